"""``benchmarks/peak.py``: the multiply-add instructions it times are the CPU's, an
instruction the CPU lacks is refused by name, and each dtype maps to the instruction
``packed_linear`` multiplies it with."""

import sys
from pathlib import Path

import pytest
import torch

from pagedllm.cpu.cpuinfo import cpu_flags

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
peak = pytest.importorskip("peak")

FLAG_OF = {"avx2_fma": "fma", "avx512_fma": "avx512f", "avx512_bf16_dot": "avx512_bf16"}


@pytest.fixture(scope="module")
def available() -> list[str]:
    try:
        return peak.instructions()
    except (RuntimeError, OSError) as error:  # no C++ compiler: the engine's fallback case
        pytest.skip(f"peak.cpp does not build here: {error}")


def test_times_exactly_the_instructions_the_cpu_has(available):
    assert sorted(available) == sorted(i for i, flag in FLAG_OF.items() if flag in cpu_flags())


def test_one_thread_times_a_positive_rate(available):
    if not available:
        pytest.skip("no multiply-add instruction peak.cpp knows on this CPU")
    assert peak.peak_gflops(available[0], 1) > 0


def test_refuses_an_instruction_by_name_and_lists_the_cpus(available):
    with pytest.raises(ValueError, match="no multiply-add instruction amx_tile") as caught:
        peak.peak_gflops("amx_tile", 1)
    assert all(name in str(caught.value) for name in available)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        peak.peak_gflops(available[0] if available else "avx2_fma", 0)


def test_each_dtype_maps_to_the_instruction_packed_linear_uses(available):
    found = peak.dtype_peak(torch.bfloat16, 1)
    if "avx512_bf16_dot" in available:
        assert found[0] == "avx512_bf16_dot"
    elif available:
        assert found[0] in ("avx512_fma", "avx2_fma")
    else:
        assert found is None
    assert peak.dtype_peak(torch.float16, 1) is None
