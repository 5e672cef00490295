"""Every engine knob, its default and its validation, in one place."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pagedllm.kv.block_pool import validate_block_size
from pagedllm.kv.kv_quant import resolve_kv_format

_DTYPES = {
    "auto": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

LOAD_FORMATS = ("auto", "dummy")
"""``load_format`` values: read the checkpoint, or seeded random weights of its shape."""

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30
"""Bytes of the KV pool on the CPU when ``kv_cache_memory`` is not given."""

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
}


def parse_bytes(size: int | float | str) -> int:
    """Bytes from ``1073741824``, ``"1GiB"``, ``"512MB"`` or ``"1.5g"``."""
    if isinstance(size, (int, float)):
        return int(size)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", size)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read a memory size from {size!r} (try '2GiB' or '512MB')")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for a user's ``device`` option: ``"auto"`` is the first CUDA
    device when one is available, else the CPU; ``"cuda"`` without one is an error."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}") from err
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}, but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a user's ``dtype`` option (float32 on CPU for ``auto``)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype {dtype} is not supported; use float32, bfloat16 or float16 (CUDA only)"
            )
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class EngineConfig:
    """Engine settings. Units: tokens unless a name says blocks or bytes.

    - ``load_format``: ``"auto"`` reads the checkpoint ``model`` names; ``"dummy"`` builds
      seeded random weights of the shape ``model`` names (a preset such as
      ``"llama-3-8b"``, a config.json or a folder holding one), with no tokenizer.
    - ``device``: ``"auto"`` (CUDA when available, else the CPU), ``"cpu"``, ``"cuda[:N]"``;
      resolved to a ``torch.device``. ``dtype`` ``"auto"`` is float32 on the CPU and
      bfloat16 on CUDA.
    - ``kv_cache_memory``: bytes for the whole KV pool (all layers, K and V). ``None``:
      2 GiB on the CPU; on CUDA, what ``gpu_memory_utilization`` (a fraction of the
      device's memory) leaves after the weights and the peak activation memory of a
      profiling step, measured at start-up.
    - ``enforce_eager``: on CUDA, run every step eagerly instead of replaying the CUDA
      graphs captured at start-up for decode batches.
    - ``kv_cache_dtype``: the KV cache's element format, ``"auto"`` (the model's dtype),
      ``"bfloat16"``, ``"float16"``, or 8-bit ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int8"``
      with a scale per token and KV head (:mod:`pagedllm.kv.kv_quant`); the pool holds
      as many blocks as fit ``kv_cache_memory`` in that format, scales included.
    - ``max_model_len``: longest sequence (prompt + output) a request may reach;
      ``None`` takes the model's own limit, capped by what the pool holds.
    - ``max_num_batched_tokens``: tokens one step may run (decodes + prefill chunks).
    - ``max_n``: most samples (``n``) one request may ask for; each is a sequence with
      its own KV blocks and logits row, so this bounds what one request can claim.
    - ``reserved_fraction``: share of blocks only high-priority requests (priority < 0)
      may take, seed 000's two-level allocation.
    - ``kv_allocation``: ``"paged"`` allocates blocks as sequences grow; ``"contiguous"``
      reserves ``max_model_len`` slots per request up front (the baseline).
    - ``preemption_mode``: ``"recompute"`` drops a preempted sequence's K/V; ``"swap"``
      parks them in a second tier of ``swap_space`` bytes (host memory, or a
      memory-mapped file at ``swap_path``); ``"auto"`` swaps sequences with at least one
      full block computed and recomputes shorter ones.
    """

    model: str | None = None
    load_format: str = "auto"
    device: str | torch.device = "auto"
    dtype: str | torch.dtype = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 1024
    max_n: int = 128
    reserved_fraction: float = 0.05
    kv_allocation: str = "paged"
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: int | str = 0
    swap_path: str | None = None
    seed: int = 0
    log_stats_interval: float = 5.0

    def __post_init__(self) -> None:
        self.device = resolve_device(self.device)
        if self.dtype == "auto" and self.device.type == "cuda":
            self.dtype = "bfloat16"
        self.dtype = resolve_dtype(self.dtype)
        resolve_kv_format(self.kv_cache_dtype, self.dtype)  # raises on an unknown name
        if self.kv_cache_memory is None and self.device.type == "cpu":
            self.kv_cache_memory = DEFAULT_CPU_KV_CACHE_MEMORY
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ValueError(
                    f"kv_cache_memory must be positive, got {self.kv_cache_memory}"
                )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        self.swap_space = parse_bytes(self.swap_space)
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(
                f"preemption_mode must be 'recompute', 'swap' or 'auto', got "
                f"{self.preemption_mode!r}"
            )
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        validate_block_size(self.block_size)
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 <= self.reserved_fraction < 1.0:
            raise ValueError(f"reserved_fraction must be in [0, 1), got {self.reserved_fraction}")
        if self.kv_allocation not in ("paged", "contiguous"):
            raise ValueError(
                f"kv_allocation must be 'paged' or 'contiguous', got {self.kv_allocation!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
