"""``dtype="auto"``: bfloat16 on a CPU with bfloat16 instructions, float32 on others; an
engine refuses a model loaded in another dtype than its own."""

from __future__ import annotations

import pytest
import torch

from pagedllm import EngineConfig, LLMEngine
from pagedllm.cpu import cpuinfo


@pytest.mark.parametrize(
    ("flags", "native"),
    [({"avx512f", "avx512_bf16"}, True), ({"amx_tile", "amx_bf16"}, True),
     ({"avx512f", "avx2"}, False), (set(), False)],
)  # fmt: skip
def test_bfloat16_instructions_are_read_from_the_flags(monkeypatch, flags, native):
    monkeypatch.setattr(cpuinfo, "cpu_flags", lambda: frozenset(flags))
    assert cpuinfo.multiplies_bfloat16() is native


@pytest.mark.parametrize(("native", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_is_bfloat16_where_the_cpu_multiplies_it(monkeypatch, native, dtype):
    monkeypatch.setattr("pagedllm.config.multiplies_bfloat16", lambda: native)
    assert EngineConfig(device="cpu").dtype == dtype
    assert EngineConfig(device="cpu", dtype="float32").dtype == torch.float32
    assert EngineConfig(device="cpu", dtype="bfloat16").dtype == torch.bfloat16


def test_an_engine_refuses_a_model_loaded_in_another_dtype(tiny_model):
    config = EngineConfig(device="cpu", dtype="bfloat16", log_stats_interval=0)
    with pytest.raises(ValueError, match="loaded in torch.float32 but the engine's dtype is"):
        LLMEngine(config, tiny_model)
