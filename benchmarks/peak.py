"""The multiply-add peak of this CPU's vector units, in GFLOP/s (JSON lines), to read the
other benchmarks' rates against: per instruction the kernels use (``avx2_fma``,
``avx512_fma``, ``avx512_bf16_dot``; whichever the CPU has) and per thread count, from
one thread to torch's. Chains of one instruction on registers (``peak.cpp``), so the
figure is the arithmetic units' alone: no memory, no other instruction. AMX tiles are
not measured.

    python benchmarks/peak.py [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from pagedllm.bench.machine import machine_record
from pagedllm.cpu.build import load_library

# The instruction each kernel of ``packed_linear`` multiplies a dtype with, best first.
INSTRUCTIONS = {
    torch.float32: ("avx512_fma", "avx2_fma"),
    torch.bfloat16: ("avx512_bf16_dot", "avx512_fma", "avx2_fma"),
}


@functools.cache
def _ops() -> object:
    source = Path(__file__).with_name("peak.cpp")
    load_library("pagedllm_peak", [str(source)], ["-O2", "-march=native", "-fopenmp"])
    return torch.ops.pagedllm_peak


def instructions() -> list[str]:
    """The multiply-add instructions this CPU has, of those ``peak.cpp`` times."""
    return list(_ops().instructions())


def peak_gflops(instruction: str, threads: int) -> float:
    """GFLOP/s of ``threads`` threads issuing nothing but ``instruction``."""
    return _ops().multiply_add_peak(instruction, threads)


def dtype_peak(dtype: torch.dtype, threads: int) -> tuple[str, float] | None:
    """The instruction ``packed_linear`` multiplies ``dtype`` with and its peak, or None
    when the CPU has none of them."""
    available = instructions()
    name = next((i for i in INSTRUCTIONS.get(dtype, ()) if i in available), None)
    return (name, peak_gflops(name, threads)) if name else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    print(json.dumps(machine_record()), flush=True)
    for instruction in instructions():
        for threads in range(1, args.threads + 1):
            record = {
                "record": "peak",
                "instruction": instruction,
                "threads": threads,
                "gflop_per_s": round(peak_gflops(instruction, threads), 1),
            }
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
