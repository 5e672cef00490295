"""The machine a benchmark ran on, for its first JSON line: the same code can be 2x
apart on two CPUs, so every figure travels with the CPU's model and flags."""

from __future__ import annotations

import os

from pagedllm.cpu.cpuinfo import cpu_flags, cpu_model
from pagedllm.cpu.kernel_choice import MATRIX_FLAGS


def machine_record() -> dict[str, object]:
    """CPU model, its flags that choose matrix kernels, cores this process may use, load
    average."""
    return {
        "measure": "machine",
        "cpu": cpu_model(),
        "flags": sorted(cpu_flags() & MATRIX_FLAGS),
        "cores": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
    }
