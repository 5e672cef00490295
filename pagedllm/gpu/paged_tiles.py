"""Loading K/V tiles through a block table, shared by the attention kernels.

A tile is ``TILE_N`` consecutive token positions of one sequence and one kv head; it may
span several blocks (``TILE_N >= BLOCK_SIZE``, both powers of two), so each position
looks up its own physical block. Offsets are int64: a layer's pool can exceed 2**31
elements. Over a table that mixes full-size and compact blocks (``kv_cache_dtype="int4"``)
a tile is one block, of either kind (:func:`attend_tile`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.gpu.compact_tiles import compact_tile_ptr, load_compact_tile
from pagedllm.gpu.kv_codes import FLOAT, decode_codes, load_row_scales

LOG2_E = 1.4426950408889634
"""log2(e): the host's factor from natural-log to log2 score units."""
KERNEL_LOG2_E = tl.constexpr(LOG2_E)
"""The same factor inside kernels (which read module globals only as constexpr)."""


@triton.jit
def tile_offsets(
    block_table_row_ptr,
    first_token,
    limit,
    kv_head,
    stride_blk,
    stride_head,
    stride_tok,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    floor=0,
):
    """Element offsets of the rows of positions ``first_token ..`` (``[TILE_N]`` int64)
    and which of them lie in ``[floor, limit)`` (the others are never read)."""
    tokens = first_token + tl.arange(0, TILE_N)
    valid = (tokens < limit) & (tokens >= floor)
    blocks = tl.load(block_table_row_ptr + tokens // BLOCK_SIZE, mask=valid, other=0)
    offsets = (
        blocks.to(tl.int64) * stride_blk
        + kv_head * stride_head
        + (tokens % BLOCK_SIZE).to(tl.int64) * stride_tok
    )
    return offsets, valid


@triton.jit
def soft_cap(scores, cap):
    """``cap * tanh(scores / cap)``, as ``1 - 2 / (exp(2x) + 1)`` (exact at both ends in
    float32: large ``x`` gives 1, very negative ``x`` gives -1)."""
    return cap * (1.0 - 2.0 / (tl.exp(2.0 * scores / cap) + 1.0))


@triton.jit
def load_keys(
    cache_ptr,
    offsets,
    valid,
    HEAD_DIM: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """K rows ``[TILE_N, HEAD_DIM]`` in ``DOT_DTYPE``, unscaled: quantized rows hold
    their codes' values, to be multiplied by :func:`load_scales` after the dot product."""
    dims = tl.arange(0, HEAD_DIM)
    raw = tl.load(cache_ptr + offsets[:, None] + dims[None, :], mask=valid[:, None], other=0)
    if KV_FORMAT == FLOAT:
        return raw.to(DOT_DTYPE)
    else:
        return decode_codes(raw, KV_FORMAT, DOT_DTYPE)


@triton.jit
def load_scales(cache_ptr, offsets, valid, HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr):
    """float32 factor of each quantized row of :func:`load_keys`."""
    return load_row_scales(cache_ptr + offsets, valid, HEAD_DIM, KV_FORMAT)


@triton.jit
def load_values(
    cache_ptr,
    offsets,
    valid,
    HEAD_DIM: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """V rows ``[TILE_N, HEAD_DIM]`` in ``DOT_DTYPE``, scales applied (in float32)."""
    if KV_FORMAT == FLOAT:
        return load_keys(cache_ptr, offsets, valid, HEAD_DIM, KV_FORMAT, DOT_DTYPE)
    else:
        codes = load_keys(cache_ptr, offsets, valid, HEAD_DIM, KV_FORMAT, tl.float32)
        scales = load_scales(cache_ptr, offsets, valid, HEAD_DIM, KV_FORMAT)
        return (codes * scales[:, None]).to(DOT_DTYPE)


@triton.jit
def tile_scores(
    q,
    k_cache_ptr,
    offsets,
    valid,
    scale_log2,
    softcap,
    HEAD_DIM: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Scores of the query rows ``q`` against one tile of keys, in log2 units (scaled,
    soft-capped when ``SOFTCAP``), before any mask."""
    k = load_keys(k_cache_ptr, offsets, valid, HEAD_DIM, KV_FORMAT, DOT_DTYPE)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if KV_FORMAT != FLOAT:
        scores = scores * load_scales(k_cache_ptr, offsets, valid, HEAD_DIM, KV_FORMAT)[None, :]
    return log2_scores(scores, scale_log2, softcap, SOFTCAP)


@triton.jit
def log2_scores(dots, scale_log2, softcap, SOFTCAP: tl.constexpr):
    """Dot products as scores in log2 units: scaled, soft-capped when ``SOFTCAP``."""
    if SOFTCAP:
        return soft_cap(dots * (scale_log2 / KERNEL_LOG2_E), softcap) * KERNEL_LOG2_E
    else:
        return dots * scale_log2


@triton.jit
def online_softmax_step(
    scores,
    row_max,
    row_sum,
    acc,
    v_cache_ptr,
    offsets,
    valid,
    HEAD_DIM: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Fold one tile of masked log2 ``scores`` and its values into the running
    ``(row_max, row_sum, acc)``; returns the new triple."""
    new_max, rescale, probs, row_sum = softmax_weights(scores, row_max, row_sum)
    v = load_values(v_cache_ptr, offsets, valid, HEAD_DIM, KV_FORMAT, DOT_DTYPE)
    acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), v, input_precision=PRECISION)
    return new_max, row_sum, acc


@triton.jit
def softmax_weights(scores, row_max, row_sum):
    """The online softmax over one more tile of masked log2 ``scores``: the new row
    maxima, the factor that rescales what was accumulated before, the tile's
    probabilities (relative to the new maxima) and the new row sums."""
    new_max = tl.maximum(row_max, tl.max(scores, axis=1))
    rescale = tl.exp2(row_max - new_max)
    probs = tl.exp2(scores - new_max[:, None])
    return new_max, rescale, probs, row_sum * rescale + tl.sum(probs, axis=1)


@triton.jit
def attend_tile(
    row_max,
    row_sum,
    acc,
    q,
    rotated,
    visible,
    table_entry_ptr,
    k_cache_ptr,
    v_cache_ptr,
    offsets,
    valid,
    tiles_ptr,
    compact_offset,
    kv_head,
    stride_cblk,
    stride_chead,
    scale_log2,
    softcap,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    COMPACT: tl.constexpr,
):
    """Fold one tile of positions (``offsets``, ``valid`` from :func:`tile_offsets`;
    ``visible`` ``[rows, tile]`` the rows' mask) into the running ``(row_max, row_sum,
    acc)`` of the query rows ``q``; returns the new triple.

    With ``COMPACT`` the tile is one block (``TILE_N == BLOCK_SIZE``), named by the table
    entry at ``table_entry_ptr``: a compact one (entry ``>= compact_offset``, tiles at
    ``tiles_ptr``, :mod:`pagedllm.gpu.compact_tiles`) is scored against the ``rotated``
    query rows, a full-size one as without ``COMPACT``."""
    if COMPACT:
        entry = tl.load(table_entry_ptr)
        if entry >= compact_offset:
            tile = compact_tile_ptr(
                tiles_ptr, entry, compact_offset, kv_head, stride_cblk, stride_chead
            )
            k, v = load_compact_tile(tile, valid, HEAD_DIM, BLOCK_SIZE, DOT_DTYPE)
            dots = tl.dot(rotated, tl.trans(k), input_precision=PRECISION)
            scores = log2_scores(dots, scale_log2, softcap, SOFTCAP)
        else:
            scores = tile_scores(
                q, k_cache_ptr, offsets, valid, scale_log2, softcap,
                HEAD_DIM, KV_FORMAT, DOT_DTYPE, PRECISION, SOFTCAP,
            )  # fmt: skip
            v = load_values(v_cache_ptr, offsets, valid, HEAD_DIM, KV_FORMAT, DOT_DTYPE)
        scores = tl.where(visible, scores, float("-inf"))
        new_max, rescale, probs, row_sum = softmax_weights(scores, row_max, row_sum)
        acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), v, input_precision=PRECISION)
        return new_max, row_sum, acc
    else:
        scores = tile_scores(
            q, k_cache_ptr, offsets, valid, scale_log2, softcap,
            HEAD_DIM, KV_FORMAT, DOT_DTYPE, PRECISION, SOFTCAP,
        )  # fmt: skip
        scores = tl.where(visible, scores, float("-inf"))
        return online_softmax_step(
            scores, row_max, row_sum, acc, v_cache_ptr, offsets, valid,
            HEAD_DIM, KV_FORMAT, DOT_DTYPE, PRECISION,
        )  # fmt: skip
