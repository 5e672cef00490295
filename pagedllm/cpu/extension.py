"""Builds (once) and calls the C++ kernels in ``paged_attention.cpp`` and
``streaming_linear.cpp``.

The first call compiles the kernels and their torch bindings (``bindings.cpp``) with
g++, the files in parallel (about 7 s of compiler time for the bindings and 4 s for
the kernels), into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``); later processes load the cached library in a fraction
of a second unless a source changed. The kernels run on torch's own OpenMP thread pool
with ``torch.get_num_threads()`` threads, so they never compete with torch's threads.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch.utils import cpp_extension

SOURCES = [
    str(Path(__file__).with_name(name))
    for name in ("bindings.cpp", "paged_attention.cpp", "streaming_linear.cpp")
]
FLAGS = ["-O3", "-march=native", "-fopenmp"]


@functools.cache
def ops() -> Any:
    """The ``torch.ops.pagedllm_cpu`` namespace, compiling the extension if needed."""
    cpp_extension.load(
        name="pagedllm_cpu",
        sources=SOURCES,
        extra_cflags=FLAGS,
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )
    return torch.ops.pagedllm_cpu


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> None:
    """Writes into ``out`` ``[num_tokens, Hq, D]`` the causal attention of every query row.

    ``q``/``out`` contiguous float32 (or bfloat16 over a bfloat16 cache); caches
    ``[num_blocks, num_kv_heads, block_size, row]`` (any strides with the row contiguous)
    of float32, bfloat16 or float16 (``row`` = ``D``), or of int8 / float8_e4m3fn /
    float8_e5m2 with ``row`` = ``D`` codes + a 2-byte bfloat16 scale
    (:mod:`pagedllm.kv.kv_quant`), decoded in the kernel; ``block_tables``, ``seq_lens``,
    ``query_start_loc`` contiguous int32 with the meaning of
    :class:`~pagedllm.attention.metadata.AttentionMetadata`. Every block a sequence uses
    is checked to lie inside the cache.
    """
    ops().paged_attention(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores token ``i`` of ``k``, ``v`` ``[num_tokens, Hkv, D]`` at flat slot
    ``slot_mapping[i]`` (int64, ``block * block_size + offset``); slot ``-1`` is skipped."""
    ops().write_kv(k_cache, v_cache, k, v, slot_mapping)


@functools.cache
def streaming_linear_available() -> bool:
    """Whether the build has :func:`streaming_linear` (it needs a CPU with AVX-512)."""
    return bool(ops().streaming_linear_available())


def streaming_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` for contiguous ``x`` ``[M, K]`` and ``weight`` ``[N, K]``,
    both float32 or both bfloat16 (``bias`` ``[N]`` any float dtype), reading each weight
    row from memory once: the fast path for few rows. Float32 accumulation; a row's result
    does not depend on the other rows of ``x``."""
    return ops().streaming_linear(x, weight, bias)
