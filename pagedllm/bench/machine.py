"""The machine a benchmark ran on, for its first JSON line: the same code can be 2x
apart on two CPUs, so every figure travels with the CPU's model and flags."""

from __future__ import annotations

import os
from pathlib import Path

KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")
"""The CPU flags that choose kernels."""


def machine_record() -> dict[str, object]:
    """CPU model, its kernel-choosing flags, cores this process may use, load average."""
    name, flags = "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    return {
        "measure": "machine",
        "cpu": name,
        "flags": [f for f in KERNEL_FLAGS if f in flags],
        "cores": len(os.sched_getaffinity(0)),
        "load_average": os.getloadavg(),
    }
