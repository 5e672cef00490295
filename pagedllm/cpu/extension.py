"""Builds (once) and calls the C++ kernels in ``paged_attention.cpp``,
``paged_attention_compact.cpp``, ``packed_linear.cpp``, ``elementwise.cpp``,
``quant_linear.cpp``, ``quant_linear_bf16.cpp``, ``quant_x16.cpp``,
``quant_x16_int8.cpp`` and ``layer_stack.cpp``, and registers the suffix tree of
``suffix_tree.cpp``.

The first call compiles the kernels and their torch bindings (``bindings.cpp``) with
g++, the files in parallel (about 7 s of compiler time for the bindings and 4 s for
the kernels), into torch's extension cache (:mod:`pagedllm.cpu.build` says where);
later processes load the cached library in a fraction of a second unless a source
changed. The library is built for this CPU (``-march=native``). The kernels run
on torch's own OpenMP thread pool with ``torch.get_num_threads()`` threads, so they never
compete with torch's threads.

Building needs a C++ compiler with OpenMP (g++). Without one the engine still runs, on
torch's operators (much slower), after one warning.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

from pagedllm.cpu.build import build_failure_reason, load_library

SOURCES = [
    str(Path(__file__).with_name(name))
    for name in (
        "bindings.cpp",
        "paged_attention.cpp",
        "paged_attention_compact.cpp",
        "packed_linear.cpp",
        "elementwise.cpp",
        "argmax.cpp",
        "quant_linear.cpp",
        "quant_linear_bf16.cpp",
        "quant_x16.cpp",
        "quant_x16_int8.cpp",
        "layer_stack.cpp",
        "suffix_tree.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in (
        "kernels.h",
        "bfloat16.h",
        "quant_blocks.h",
        "quant_codes.h",
        "quant_panel.h",
        "tensor_ops.h",
        "vector_math.h",
        "kv_rows.h",
    )
]
FLAGS = ["-O3", "-march=native", "-fopenmp"]

logger = logging.getLogger("pagedllm")


def headers_flag() -> str:
    """A define naming the headers' contents: torch rebuilds the extension when a source
    or a flag changes, not when a header does, so a changed header changes the flags."""
    digest = hashlib.sha1(b"".join(path.read_bytes() for path in HEADERS)).hexdigest()[:10]
    return f"-DPAGEDLLM_HEADERS_{digest}"


def sources_digest() -> str:
    """Ten hex digits naming the C++ sources' and headers' contents: the kernels' version."""
    paths = [*map(Path, SOURCES), *HEADERS]
    return hashlib.sha1(b"".join(path.read_bytes() for path in paths)).hexdigest()[:10]


@functools.cache
def ops() -> Any | None:
    """The ``torch.ops.pagedllm_cpu`` namespace, compiling the extension if needed; None,
    after one warning, when it cannot be built."""
    try:
        load_library("pagedllm_cpu", SOURCES, [*FLAGS, headers_flag()], ["-fopenmp"])
    except Exception as error:  # no compiler, no OpenMP, a failed build: run without
        reason = build_failure_reason(error)
        logger.warning(
            "The C++ CPU kernels could not be built (%s); running torch's operators "
            "instead, several times slower. Install a C++ compiler with OpenMP (g++) to "
            "build them.",
            reason,
        )
        return None
    return torch.ops.pagedllm_cpu


def kernels_built() -> bool:
    """Whether the C++ kernels are available (building them on first use)."""
    return ops() is not None


def paged_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> None:
    """Writes into ``out`` ``[num_tokens, Hq, D]`` the causal attention of every query row.

    ``sliding_window`` ``W`` > 0: a query at position ``p`` sees keys ``p - W + 1 .. p``
    only. ``logit_softcap`` ``c`` > 0: each score ``s`` (already scaled) becomes
    ``c * tanh(s / c)`` before the softmax. 0 turns either off.

    ``q``/``out`` contiguous float32 (or bfloat16 over a bfloat16 cache); caches
    ``[num_blocks, num_kv_heads, block_size, row]`` (any strides with the row contiguous)
    of float32, bfloat16 or float16 (``row`` = ``D``), or of int8 / float8_e4m3fn /
    float8_e5m2 with ``row`` = ``D`` codes + a 2-byte bfloat16 scale
    (:mod:`pagedllm.kv_storage.kv_quant`), decoded in the kernel; ``block_tables``, ``seq_lens``,
    ``query_start_loc`` contiguous int32 with the meaning of
    :class:`~pagedllm.attention.metadata.AttentionMetadata`. Every block a sequence uses
    is checked to lie inside the cache.
    """
    ops().paged_attention(
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
        sliding_window, logit_softcap,
    )  # fmt: skip


def paged_attention_compact(
    out: torch.Tensor,
    q: torch.Tensor,
    q_rotated: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tiles: torch.Tensor,
    num_full_blocks: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logit_softcap: float = 0.0,
) -> None:
    """:func:`paged_attention` over block tables that mix full blocks with compact 4-bit
    ones (:mod:`pagedllm.kv_storage.compact_blocks`): an entry below ``num_full_blocks``
    is a block of ``k_cache``/``v_cache`` (any format :func:`paged_attention` takes), an
    entry ``e >= num_full_blocks`` is compact block ``e - num_full_blocks``, read from
    ``tiles`` (uint8 ``[num_compact_blocks, Hkv, tile_bytes]``, contiguous:
    ``CompactKVCache.tiles(layer)``) without decoding it to memory.

    ``q``, ``q_rotated`` and ``out`` are contiguous float32 ``[num_tokens, Hq, D]`` with
    ``q_rotated = q @ hadamard(D)`` per head: compact keys are stored rotated and scored
    with it, full blocks with ``q``. ``D`` is 32, 64, 128 or 256, the block size (the
    caches' ``shape[2]``) a power of two from 16 on. The rest as in
    :func:`paged_attention`.
    """
    ops().paged_attention_compact(
        out, q, q_rotated, k_cache, v_cache, tiles, num_full_blocks, block_tables, seq_lens,
        query_start_loc, scale, sliding_window, logit_softcap,
    )  # fmt: skip


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores token ``i`` of ``k``, ``v`` ``[num_tokens, Hkv, D]`` at flat slot
    ``slot_mapping[i]`` (int64, ``block * block_size + offset``); slot ``-1`` is skipped.
    Caches are ``[num_blocks, Hkv, block_size, row]``; without the C++ kernels, torch's
    indexing writes the same rows."""
    kernels = ops()
    if kernels is not None:
        kernels.write_kv(k_cache, v_cache, k, v, slot_mapping)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // k_cache.shape[2], slots % k_cache.shape[2]
    k_cache[blocks, :, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v[keep].to(v_cache.dtype)


def write_kv_int8(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Quantizes token ``i`` of ``k``, ``v`` ``[num_tokens, Hkv, D]`` into int8 rows (codes
    and a bfloat16 scale, :func:`~pagedllm.kv_storage.kv_quant.encode_rows`' bits) and
    stores them as :func:`write_kv` does, in one pass. Needs the C++ kernels."""
    kernels = ops()
    if kernels is None:
        raise RuntimeError("write_kv_int8 needs the C++ kernels, which are not built")
    k, v = k.float().contiguous(), v.float().contiguous()
    kernels.write_kv_int8(k_cache, v_cache, k, v, slot_mapping)


@functools.cache
def avx512_kernels_available() -> bool:
    """Whether the build has :func:`packed_linear`, :func:`rms_norm`, :func:`silu_and_mul`
    and :func:`rotary` (they need a CPU with AVX-512)."""
    kernels = ops()
    return kernels is not None and bool(kernels.avx512_kernels_available())


def fits_avx512_kernels(*tensors: torch.Tensor) -> bool:
    """Whether the AVX-512 kernels take these tensors: contiguous, on the CPU, all float32
    or all bfloat16, on a build that has the kernels."""
    dtype = tensors[0].dtype
    return (
        dtype in (torch.float32, torch.bfloat16)
        and all(t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and avx512_kernels_available()
    )


PANEL_WIDTH = 48
"""Output features per panel of a packed weight (``kPanelWidth`` in ``kernels.h``)."""


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """Float32 or bfloat16 ``weight`` ``[N, K]`` as panels
    ``[ceil(N / PANEL_WIDTH), ceil(K / S), PANEL_WIDTH, S]`` with ``S`` = 1 for float32
    and 2 for bfloat16: ``panels[p, k // S, j, k % S] = weight[p * PANEL_WIDTH + j, k]``,
    zero past ``N`` and ``K``."""
    return ops().pack_weight(weight)


def packed_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
    float_output: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias`` ``[M, out_features]`` for contiguous ``x`` ``[M, K]`` and
    ``panels = pack_weight(weight)`` of ``x``'s dtype, in that dtype, or float32 with
    ``float_output`` (a bfloat16 product's float32 sums, unrounded). Each output sums over
    k in one fixed order, so a row's result does not depend on the other rows of ``x`` or
    on ``M``."""
    return ops().packed_linear(x, panels, out_features, bias, float_output)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` for contiguous ``x`` ``[rows, dim]``,
    one pass per row; float32, or bfloat16 rounded where transformers' RMSNorm rounds, or
    float32 ``x`` under a bfloat16 ``weight``: normed unrounded, the result rounded once
    to bfloat16."""
    return ops().rms_norm(x, weight, eps)


def add_rms_norm(
    hidden: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``hidden += branch`` (contiguous float32 ``[rows, dim]``, in place), then
    :func:`rms_norm` of the sum in ``weight``'s dtype, in one pass per row; ``branch``
    has ``weight``'s dtype (float32 or bfloat16, widened exactly). The bits of
    ``hidden.add_(branch)`` followed by ``rms_norm(hidden, weight, eps)``."""
    return ops().add_rms_norm(hidden, branch, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ``[rows, width]`` for contiguous ``gate_up`` ``[rows, 2 * width]``
    (gate first), float32 or bfloat16."""
    return ops().silu_and_mul(gate_up)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` (int64 ``[rows]``) of 2-D ``x``: each row's first maximum, a NaN
    counting as the largest. Contiguous float32 rows on the CPU go to the C++ kernel
    (torch's compares one value at a time); anything else, or a build without the
    kernels, to torch."""
    fits = x.device.type == "cpu" and x.dim() == 2 and x.dtype == torch.float32
    kernels = ops() if fits and x.is_contiguous() and 0 < x.shape[1] < 2**31 else None
    return x.argmax(dim=-1) if kernels is None else kernels.argmax_rows(x)


def rotary(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split contiguous ``qkv`` ``[T, (Hq + 2 Hkv) * D]`` into new contiguous ``q``
    ``[T, Hq, D]``, ``k`` and ``v`` ``[T, Hkv, D]``, rotating q and k ("rotate half") by
    rows ``positions`` (int64 ``[T]``) of the ``cos`` / ``sin`` tables ``[max_pos, D / 2]``.
    Products and sums round one at a time, as torch's separate operators do."""
    return ops().rotary(qkv, positions, cos, sin, num_q_heads, num_kv_heads)


def rotary_to_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """:func:`rotary`'s ``q``, with its ``k`` and ``v`` written in the same pass to flat slots
    ``slot_mapping`` (int64 ``[T]``; -1 skipped) of caches of ``qkv``'s dtype, as
    :func:`write_kv` writes them."""
    return ops().rotary_to_cache(
        qkv, positions, cos, sin, num_q_heads, num_kv_heads, k_cache, v_cache, slot_mapping
    )


def quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None = None,
    float_output: bool = False,
) -> torch.Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype (float32 or bfloat16, ``[M, K]``) for ``W``
    ``[N, K]`` kept as ``weight``: uint8 ``[N, K / block values * block bytes]``, each row
    the GGUF blocks of ggml type ``ggml_type`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K,
    Q6_K), never expanded. Sums are float32; bfloat16 ``x`` is multiplied in bfloat16 pairs
    where the CPU has them (else widened), and the result rounded once, or returned
    unrounded in float32 with ``float_output``."""
    return ops().quant_linear(x, weight, ggml_type, bias, float_output)


def quant_linear_x16(
    x: torch.Tensor,
    weight: torch.Tensor,
    ggml_type: int,
    out_features: int,
    bias: torch.Tensor | None = None,
    int8_activations: bool = False,
    float_output: bool = False,
) -> torch.Tensor:
    """:func:`quant_linear` for bfloat16 ``x`` and a weight of ``out_features`` rows whose
    blocks are interleaved by groups of 16 rows (layout in ``quant_x16.cpp``; see
    :class:`~pagedllm.models.interleaved_weight.InterleavedWeight`). With
    ``int8_activations``, ``x`` is quantized to int8 per block of 32 values (scale: the
    block's largest magnitude / 127) and multiplied on the CPU's int8 quad products: equal,
    up to float32 rounding, to the product of the quantized ``x`` with the dequantized
    weight (``quant_x16_int8.cpp``)."""
    product = ops().quant_linear_x16_int8 if int8_activations else ops().quant_linear_x16
    return product(x, weight, ggml_type, out_features, bias, float_output)


@functools.cache
def quant_x16_supports(ggml_type: int, int8_activations: bool = False) -> bool:
    """Whether :func:`quant_linear_x16` runs weights of ``ggml_type`` on this CPU (with
    ``int8_activations``: the int8 kernels, which need AVX-512 VNNI)."""
    kernels = ops()
    if kernels is None:
        return False
    supports = kernels.quant_x16_int8_supports if int8_activations else kernels.quant_x16_supports
    return bool(supports(ggml_type))


def dequantize_rows(
    weight: torch.Tensor, ggml_type: int, K: int, rows: torch.Tensor
) -> torch.Tensor:
    """Float32 rows ``rows`` (int64) ``[len(rows), K]`` of a weight kept as in
    :func:`quant_linear`."""
    return ops().dequantize_rows(weight, ggml_type, K, rows)
