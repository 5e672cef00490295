"""What this CPU is: its model name and instruction-set flags, read from ``/proc/cpuinfo``
(Linux), else from the platform's processor string (with no flags); and how busy its
cores are (``/proc/stat``)."""

from __future__ import annotations

import contextlib
import functools
import os
import platform

NUMBERS = (("family", "cpu family"), ("model", "model"), ("stepping", "stepping"))
"""How :func:`cpu_model` labels the ``/proc/cpuinfo`` fields that tell CPU generations
apart."""


@functools.cache
def cpuinfo_fields() -> dict[str, str]:
    """The first processor's ``name: value`` lines of ``/proc/cpuinfo``; empty where there
    is no such file."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if not line.strip():
                break
            name, _, value = line.partition(":")
            fields.setdefault(name.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's model name with its family, model and stepping numbers, e.g. ``"AMD EPYC
    (family 26, model 2, stepping 1)"``: under a hypervisor the name alone can be as
    generic as ``"AMD EPYC"`` for two generations whose kernels run 2x apart."""
    fields = cpuinfo_fields()
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    numbers = [(label, fields.get(field)) for label, field in NUMBERS]
    if not all(value for _, value in numbers):
        return name
    return f"{name} ({', '.join(f'{label} {value}' for label, value in numbers)})"


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags as Linux names them (``avx512f``, ``amx_bf16``)."""
    return frozenset(cpuinfo_fields().get("flags", "").split())


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process (and the hypervisor, as steal) has kept the cores busy
    since boot, from ``/proc/stat``; ``None`` where there is no such file."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(t) for t in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def multiplies_bfloat16() -> bool:
    """Whether the CPU has bfloat16 dot-product instructions (``avx512_bf16`` or
    ``amx_bf16``): bfloat16 products there run at float32's throughput or better while
    reading half the bytes."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


DEFAULT_CACHE_BYTES = 32 << 20
"""The last-level cache assumed where sysfs does not tell it."""


@functools.cache
def last_level_cache_bytes() -> int:
    """Bytes of the first CPU's largest (last-level) cache, from sysfs; else
    :data:`DEFAULT_CACHE_BYTES`."""
    sizes = []
    for index in range(8):
        with contextlib.suppress(OSError, ValueError):
            with open(f"/sys/devices/system/cpu/cpu0/cache/index{index}/size") as size:
                text = size.read().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            sizes.append(int(text.rstrip("KMG")) * units.get(text[-1], 1))
    return max(sizes, default=DEFAULT_CACHE_BYTES)
