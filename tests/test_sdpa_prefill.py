"""Long prefill chunks through torch's SDPA (pagedllm.attention.sdpa_prefill) next to the
paged kernel: mixed batches against the gather-and-dense reference, the paged rows'
bits untouched by the split, the measured crossover (pagedllm.attention.attention_choice)
with fake and real timings, refusals, and the engine's greedy tokens against
transformers float32 with every long chunk through SDPA."""

from __future__ import annotations

import logging

import pytest
import torch
from paged_cases import build_case
from transformers_oracle import engine_greedy, reference_greedy, write_random_checkpoint

from pagedllm import EngineConfig, user_cache
from pagedllm.attention import attention_choice
from pagedllm.attention.attention_choice import ROW_BUCKETS, crossover, sdpa_min_rows
from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.attention.reference import reference_paged_attention
from pagedllm.config_flags import add_config_flags, config_from_flags
from pagedllm.cpu import kernel_choice
from pagedllm.cpu.extension import kernels_built
from pagedllm.kv_storage.kv_cache import KVCache

# Read at collection, before conftest swaps in a timer that keeps every chunk paged.
REAL_TIME_PREFILL = attention_choice.time_prefill
pytestmark = pytest.mark.skipif(not kernels_built(), reason="needs the C++ paged kernel")

HQ, HKV, D, BLOCK = 6, 2, 64, 16
# decode rows, a short chunk (paged), long chunks (SDPA) after a context and from 0
SEQ_LENS = [300, 41, 90, 200, 37]
QUERY_LENS = [1, 9, 40, 200, 1]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def cache_of(case, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVCache:
    """A one-layer KVCache holding ``case``'s blocks."""
    cache = KVCache(1, case.k_cache.shape[0], BLOCK, HKV, D, dtype, kv_cache_dtype=kv_cache_dtype)
    if kv_cache_dtype == "auto":
        cache.key(0).copy_(case.k_cache)
        cache.value(0).copy_(case.v_cache)
    return cache


def attend(backend: PagedAttentionBackend, case, options: AttentionOptions) -> torch.Tensor:
    """The backend's output for ``case``'s queries; nothing new is written (slots -1)."""
    new_kv = torch.zeros(case.q.shape[0], HKV, D, dtype=case.q.dtype)
    return backend.forward(0, case.q, new_kv, new_kv, case.metadata, options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 50])
def test_long_chunks_through_sdpa_match_the_reference_and_leave_paged_rows_alone(dtype, window):
    case = build_case(SEQ_LENS, QUERY_LENS, BLOCK, HQ, HKV, D, dtype, seed=3)
    options = AttentionOptions(scale=D**-0.5, sliding_window=window)
    cache = cache_of(case, dtype)
    split = PagedAttentionBackend(cache, sdpa_min_rows=16)
    assert split.routes_to_sdpa(case.metadata)
    out = attend(split, case, options)
    paged = attend(PagedAttentionBackend(cache), case, options)
    reference = reference_paged_attention(
        case.q.float(), case.k_cache.float(), case.v_cache.float(), case.metadata,
        options.scale, window,
    )  # fmt: skip
    assert (out.float() - reference).abs().max() <= TOLERANCE[dtype]
    starts = case.metadata.query_start_loc.tolist()
    sdpa_rows = torch.zeros(case.q.shape[0], dtype=torch.bool)
    for i, rows in enumerate(QUERY_LENS):
        sdpa_rows[starts[i] : starts[i + 1]] = rows >= 16
    assert torch.equal(out[~sdpa_rows], paged[~sdpa_rows])  # same kernel, same bits
    assert not torch.equal(out[sdpa_rows], paged[sdpa_rows])  # another kernel ran them


def test_a_step_of_only_long_chunks_or_only_short_rows():
    case = build_case([120, 64], [120, 20], BLOCK, HQ, HKV, D, torch.float32, seed=4)
    options = AttentionOptions(scale=D**-0.5)
    cache = cache_of(case, torch.float32)
    reference = reference_paged_attention(
        case.q, case.k_cache, case.v_cache, case.metadata, options.scale
    )
    out = attend(PagedAttentionBackend(cache, sdpa_min_rows=16), case, options)
    assert (out - reference).abs().max() <= TOLERANCE[torch.float32]
    short = PagedAttentionBackend(cache, sdpa_min_rows=256)
    assert not short.routes_to_sdpa(case.metadata)
    paged = attend(PagedAttentionBackend(cache), case, options)
    assert torch.equal(attend(short, case, options), paged)


def test_soft_capped_layers_run_every_row_paged():
    case = build_case(SEQ_LENS, QUERY_LENS, BLOCK, HQ, HKV, D, torch.float32, seed=5)
    options = AttentionOptions(scale=D**-0.5, logit_softcap=30.0)
    cache = cache_of(case, torch.float32)
    out = attend(PagedAttentionBackend(cache, sdpa_min_rows=16), case, options)
    assert torch.equal(out, attend(PagedAttentionBackend(cache), case, options))


def test_sdpa_refuses_a_quantized_cache_or_another_dtype():
    case = build_case([40], [40], BLOCK, HQ, HKV, D, torch.float32, seed=6)
    quantized = cache_of(case, torch.float32, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="SDPA prefill cannot run here: the KV cache holds int8"):
        PagedAttentionBackend(quantized, sdpa_min_rows=16)
    with pytest.raises(ValueError, match="attention_kernel='sdpa' cannot run here"):
        sdpa_min_rows("sdpa", quantized, torch.float32, HQ)
    assert sdpa_min_rows("auto", quantized, torch.float32, HQ) is None  # paged, untimed
    bf16_cache = cache_of(case, torch.bfloat16)
    with pytest.raises(ValueError, match="the model runs in torch.float32"):
        sdpa_min_rows("sdpa", bf16_cache, torch.float32, HQ)
    with pytest.raises(ValueError, match="attention_kernel must be one of auto, paged, sdpa"):
        sdpa_min_rows("flash", bf16_cache, torch.bfloat16, HQ)


def rows_timings(sdpa_faster_from: int | None) -> dict[str, dict[int, float]]:
    """Timings where SDPA takes half the paged kernel's time from ``sdpa_faster_from``
    rows and twice below it."""
    faster = [r for r in ROW_BUCKETS if sdpa_faster_from and r >= sdpa_faster_from]
    return {
        "paged": dict.fromkeys(ROW_BUCKETS, 1.0),
        "sdpa": {r: 0.5 if r in faster else 2.0 for r in ROW_BUCKETS},
    }


def test_crossover_is_the_least_bucket_sdpa_wins_from_with_a_margin():
    assert crossover(rows_timings(None)) is None
    assert crossover(rows_timings(64)) == 64
    assert crossover(rows_timings(16)) == 16
    dip = rows_timings(16)
    dip["sdpa"][64] = 0.95  # not 10% faster at 64: only 256 rows and up go to SDPA
    assert crossover(dip) == 256


def test_auto_times_each_layout_once_and_caches_the_choice(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(user_cache, "cache_dir", lambda: tmp_path / "pagedllm")
    timed = []

    def fake(layout):
        timed.append(layout)
        return rows_timings(64)

    monkeypatch.setattr(attention_choice, "time_prefill", fake)
    case = build_case([40], [40], BLOCK, HQ, HKV, D, torch.float32, seed=7)
    cache = cache_of(case, torch.float32)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert sdpa_min_rows("auto", cache, torch.float32, HQ) == 64
        assert sdpa_min_rows("auto", cache, torch.float32, HQ) == 64
    assert timed == [(torch.float32, HQ, HKV, D, BLOCK)]
    assert "Prefill attention (timed on " in caplog.text
    assert caplog.text.count("SDPA from 64 rows") == 2
    assert sdpa_min_rows("paged", cache, torch.float32, HQ) is None
    assert sdpa_min_rows("sdpa", cache, torch.float32, HQ) == ROW_BUCKETS[0]
    assert len(timed) == 1
    assert list((tmp_path / "pagedllm").glob("attention-kernels-*.json"))


def test_real_timings_cover_every_bucket_for_both_kernels():
    timings = REAL_TIME_PREFILL((torch.bfloat16, 2, 1, 16, 16))
    assert set(timings) == {"paged", "sdpa"}
    assert all(set(t) == set(ROW_BUCKETS) and min(t.values()) > 0 for t in timings.values())


def test_engine_greedy_tokens_through_sdpa_equal_transformers(tmp_path, monkeypatch):
    reference = write_random_checkpoint(tmp_path, "llama")
    prompts = [list(range(3, 43)), [7, 9, 11] * 23, [5, 17, 200]]  # 40, 69 and 3 tokens
    expected = [reference_greedy(reference, p) for p in prompts]
    sdpa_steps = []
    routes = PagedAttentionBackend.routes_to_sdpa

    def counted(backend, metadata):
        sdpa_steps.append(routes(backend, metadata))
        return routes(backend, metadata)

    monkeypatch.setattr(PagedAttentionBackend, "routes_to_sdpa", counted)
    for chunk in (1024, 32):  # whole prompts, then chunks of 32 tokens
        ours = engine_greedy(
            tmp_path, prompts, attention_kernel="sdpa", max_num_batched_tokens=chunk,
            max_num_seqs=4,
        )
        assert ours == expected
        assert any(sdpa_steps) and not all(sdpa_steps)  # prefill through SDPA, decode paged
        sdpa_steps.clear()


def test_attention_kernel_config_and_flag(monkeypatch):
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        EngineConfig(attention_kernel="flash")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check comes first
    with pytest.raises(ValueError, match="chooses a CPU kernel; cuda runs the Triton kernel"):
        EngineConfig(device="cuda", attention_kernel="sdpa")
    import argparse

    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    args = parser.parse_args(["--device", "cpu", "--attention-kernel", "paged"])
    assert config_from_flags(args).attention_kernel == "paged"


def test_timings_under_contention_keep_every_row_paged_uncached(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(user_cache, "cache_dir", lambda: tmp_path / "pagedllm")
    monkeypatch.setattr(kernel_choice, "contended", lambda cores: True)
    monkeypatch.setattr(attention_choice, "time_prefill", lambda layout: rows_timings(16))
    case = build_case([40], [40], BLOCK, HQ, HKV, D, torch.float32, seed=8)
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert sdpa_min_rows("auto", cache_of(case, torch.float32), torch.float32, HQ) is None
    assert "cores busy while the attention kernels were timed" in caplog.text
    assert "paged for every row (timed under contention, not cached)" in caplog.text
    assert not list((tmp_path / "pagedllm").glob("attention-kernels-*.json"))
