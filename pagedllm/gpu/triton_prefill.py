"""Paged prefill attention over a mixed batch: chunked prefills and decode rows together.

Sequence ``i`` has ``q_len`` query rows (from ``query_start_loc``), the *last* ``q_len``
positions of its ``seq_lens[i]`` tokens, whose K/V (cached prefix, earlier chunks and
this step's tokens) are all in the cache already. Grid ``(num_seqs, row tiles,
num_kv_heads)``: a program's ``BLOCK_M`` rows are (query token, head of the group) pairs
flattened token-major, so every query head of a group reads each K/V tile once. It walks
the sequence from position 0 up to the last position its rows can see, ``BLOCK_N``
positions per step, with a causal mask and an online softmax in float32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedllm.gpu.compact_tiles import CompactOperands, compact_args
from pagedllm.gpu.kernel_dtypes import dot_dtype, dot_precision, triton_dtype
from pagedllm.gpu.kv_codes import kernel_format
from pagedllm.gpu.paged_tiles import LOG2_E, attend_tile, tile_offsets
from pagedllm.gpu.triton_decode import NO_WINDOW
from pagedllm.kv_storage.kv_quant import KVFormat


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    tiles_ptr,
    compact_offset,
    rotated_ptr,
    scale_log2,
    window,
    softcap,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_bt,
    stride_blk,
    stride_head,
    stride_tok,
    stride_cblk,
    stride_chead,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    COMPACT: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + seq)

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP
    row_ok = token < q_len
    heads = kv_head * GROUP + rows % GROUP
    position = seq_len - q_len + token  # of each query row in its sequence
    dims = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + (q_start + token).to(tl.int64) * stride_q_tok + heads * stride_q_head
    q = tl.load(q_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    rotated = q
    if COMPACT:  # the rotated query has q's strides
        rotated_rows = (
            rotated_ptr + (q_start + token).to(tl.int64) * stride_q_tok + heads * stride_q_head
        )
        rotated = tl.load(rotated_rows[:, None] + dims[None, :], mask=row_ok[:, None], other=0.0)
        rotated = rotated.to(DOT_DTYPE)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    last_token = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
    end = seq_len - q_len + last_token + 1  # past the last position these rows see
    # the first position the first row sees; tiles wholly before it are skipped
    lowest = tl.maximum(seq_len - q_len + (tile * BLOCK_M) // GROUP - window + 1, 0)

    # finite: a tile wholly outside a row's window then adds nothing instead of NaN
    row_max = tl.full([BLOCK_M], -1e30, tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for first in range(lowest // BLOCK_N * BLOCK_N, end, BLOCK_N):
        offsets, valid = tile_offsets(
            table, first, end, kv_head, stride_blk, stride_head, stride_tok, BLOCK_N, BLOCK_SIZE,
            lowest,
        )  # fmt: skip
        key_position = first + tl.arange(0, BLOCK_N)
        visible = (key_position[None, :] <= position[:, None]) & valid[None, :]
        visible = visible & (key_position[None, :] > position[:, None] - window)
        row_max, row_sum, acc = attend_tile(
            row_max, row_sum, acc, q, rotated, visible, table + first // BLOCK_SIZE,
            k_cache_ptr, v_cache_ptr, offsets, valid, tiles_ptr, compact_offset, kv_head,
            stride_cblk, stride_chead, scale_log2, softcap,
            HEAD_DIM, BLOCK_SIZE, KV_FORMAT, DOT_DTYPE, PRECISION, SOFTCAP, COMPACT,
        )  # fmt: skip

    out = acc / row_sum[:, None]
    out_rows = out_ptr + (q_start + token).to(tl.int64) * stride_o_tok + heads * stride_o_head
    tl.store(
        out_rows[:, None] + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    fmt: KVFormat,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    compact: CompactOperands | None = None,
    block_m: int = 64,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention of every query row of a flattened batch (``q`` ``[num_tokens,
    num_q_heads, head_dim]``, sequence ``i`` owning rows ``query_start_loc[i] :
    query_start_loc[i + 1]``, int32) over its sequence's K/V in one layer's caches
    ``[num_blocks, num_kv_heads, block_size, row]`` read through ``block_tables``.
    ``max_query_len`` bounds the query lengths (host int). ``sliding_window`` ``W``: a
    row at position ``p`` sees positions ``p - W + 1 .. p`` only; ``logit_softcap``
    ``c``: scores become ``c * tanh(score / c)``. With ``compact``, table entries from
    ``compact.offset`` on name its compact blocks, and ``block_n`` is one block. Returns
    ``q``'s shape and dtype; makes no host synchronisation."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    block_n = block_n or (max(block_size, 32) if compact is None else block_size)
    if compact is not None and block_n != block_size:
        raise ValueError(f"over compact blocks block_n is one block ({block_size}), not {block_n}")
    if block_n < max(16, block_size) or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= max(16, block_size), got {block_n}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    operands = dot_dtype(q.dtype, fmt)
    out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    row_tiles = math.ceil(max_query_len * group / block_m)
    tiles, compact_offset, rotated, stride_cblk, stride_chead = compact_args(compact, q, k_cache)
    _prefill_kernel[(num_seqs, row_tiles, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        tiles, compact_offset, rotated,
        scale * LOG2_E, sliding_window or NO_WINDOW, logit_softcap or 0.0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_cblk, stride_chead,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        KV_FORMAT=kernel_format(fmt),
        DOT_DTYPE=triton_dtype(operands),
        PRECISION=dot_precision(operands),
        SOFTCAP=bool(logit_softcap),
        COMPACT=compact is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
