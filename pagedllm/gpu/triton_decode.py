"""Paged decode attention, flash-decoding style: one query token per sequence.

Pass 1, grid ``(num_seqs, num_kv_heads, num_splits)``: each program takes one split (a
range of ``split_tokens`` positions) of one sequence for one kv head, walks it tile by
tile through the block table, scores all query heads of the kv head's group at once
(K/V are read once per group) and keeps an online softmax; it writes the partial
``(max, sum, acc)`` of every head, in log2 units. Pass 2, grid ``(num_seqs,
num_q_heads)``, merges the splits. Splits starting at or past a sequence's length do
nothing, so a sequence of length 0 (padding) yields zeros.

The launcher derives every size from tensor shapes and the host int ``max_seq_len``, and
never synchronises with the device, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from pagedllm.gpu.compact_tiles import CompactOperands, compact_args
from pagedllm.gpu.kernel_dtypes import dot_dtype, dot_precision, triton_dtype
from pagedllm.gpu.kv_codes import kernel_format
from pagedllm.gpu.paged_tiles import LOG2_E, attend_tile, tile_offsets
from pagedllm.kv_storage.kv_quant import KVFormat

# The window passed to the kernels when a layer has none: longer than any sequence.
NO_WINDOW = 2**30


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    tiles_ptr,
    compact_offset,
    rotated_ptr,
    scale_log2,
    window,
    softcap,
    split_tokens,
    stride_q_tok,
    stride_q_head,
    stride_bt,
    stride_blk,
    stride_head,
    stride_tok,
    stride_cblk,
    stride_chead,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr,
    COMPACT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_tokens
    if start >= seq_len:
        return
    end = tl.minimum(start + split_tokens, seq_len)
    lowest = tl.maximum(seq_len - window, 0)  # the first position the query sees
    # tiles wholly before the window are skipped; a split wholly before it stores -inf
    first_tile = tl.maximum(start, lowest // TILE_N * TILE_N)

    group = tl.arange(0, GROUP_PAD)
    head_ok = group < GROUP
    heads = kv_head * GROUP + group
    dims = tl.arange(0, HEAD_DIM)
    q_rows = q_ptr + seq.to(tl.int64) * stride_q_tok + heads * stride_q_head
    q = tl.load(q_rows[:, None] + dims[None, :], mask=head_ok[:, None], other=0.0)
    q = q.to(DOT_DTYPE)
    rotated = q
    if COMPACT:  # the rotated query has q's strides
        rotated_rows = rotated_ptr + seq.to(tl.int64) * stride_q_tok + heads * stride_q_head
        rotated = tl.load(rotated_rows[:, None] + dims[None, :], mask=head_ok[:, None], other=0.0)
        rotated = rotated.to(DOT_DTYPE)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt

    # finite: a tile wholly outside a row's window then adds nothing instead of NaN
    row_max = tl.full([GROUP_PAD], -1e30, tl.float32)
    row_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for first in range(first_tile, end, TILE_N):
        offsets, valid = tile_offsets(
            table, first, end, kv_head, stride_blk, stride_head, stride_tok, TILE_N, BLOCK_SIZE,
            lowest,
        )  # fmt: skip
        row_max, row_sum, acc = attend_tile(
            row_max, row_sum, acc, q, rotated, valid[None, :], table + first // BLOCK_SIZE,
            k_cache_ptr, v_cache_ptr, offsets, valid, tiles_ptr, compact_offset, kv_head,
            stride_cblk, stride_chead, scale_log2, softcap,
            HEAD_DIM, BLOCK_SIZE, KV_FORMAT, DOT_DTYPE, PRECISION, SOFTCAP, COMPACT,
        )  # fmt: skip

    part = (seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * num_splits + split
    tl.store(part_max_ptr + part, row_max, mask=head_ok)
    tl.store(part_sum_ptr + part, row_sum, mask=head_ok)
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=head_ok[:, None])


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    seq_lens_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    split_tokens,
    num_splits,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    splits = tl.arange(0, SPLITS_PAD)
    used = splits < (seq_len + split_tokens - 1) // split_tokens
    part = (seq * tl.num_programs(1) + head).to(tl.int64) * num_splits + splits
    split_max = tl.load(part_max_ptr + part, mask=used, other=float("-inf"))
    split_sum = tl.load(part_sum_ptr + part, mask=used, other=0.0)
    # finite even when no split is used (an empty sequence), so that weights are 0, not NaN
    top = tl.maximum(tl.max(split_max, axis=0), -1e30)
    weight = tl.exp2(split_max - top)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=used[:, None])
    merged = tl.sum(acc * weight[:, None], axis=0)
    # the split holding the maximum adds at least exp2(0) = 1, so total >= 1 unless empty
    total = tl.maximum(tl.sum(weight * split_sum, axis=0), 1.0)
    merged = merged / total
    out = out_ptr + seq.to(tl.int64) * stride_o_tok + head * stride_o_head + dims
    tl.store(out, merged.to(out_ptr.dtype.element_ty))


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """Pass-1 programs worth launching: enough to fill every multiprocessor a few times
    over on a GPU; one under the interpreter, which runs programs one after another."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 1
    return 4 * _multiprocessors(device.index if device.index is not None else 0)


def plan_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, tile_tokens: int, programs: int
) -> tuple[int, int]:
    """``(split_tokens, num_splits)``: splits of whole tiles that cover ``max_seq_len``
    and give about ``programs`` pass-1 programs in all (at least one split)."""
    tiles = max(1, math.ceil(max_seq_len / tile_tokens))
    wanted = min(tiles, max(1, math.ceil(programs / (num_seqs * num_kv_heads))))
    tiles_per_split = math.ceil(tiles / wanted)
    return tiles_per_split * tile_tokens, math.ceil(tiles / tiles_per_split)


def default_tile_tokens(block_size: int, fmt: KVFormat) -> int:
    """64 positions per step for float caches: the fastest of 32/64/128 on an H200
    (Llama-3-8B shape, bfloat16, block size 16; ``benchmarks/gpu_attention.py --tune``).
    32 for 8-bit caches, which ran 2-13x slower at 64 with 3 stages there."""
    return max(block_size, 32 if fmt.quantized else 64)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    fmt: KVFormat,
    *,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    compact: CompactOperands | None = None,
    split_tokens: int | None = None,
    tile_tokens: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of query row ``i`` (``q`` ``[num_seqs, num_q_heads, head_dim]``) over
    positions ``0 .. seq_lens[i] - 1`` of sequence ``i``, K/V read from one layer's caches
    ``[num_blocks, num_kv_heads, block_size, row]`` (``fmt.storage_dtype``) through
    ``block_tables`` (int32). ``max_seq_len`` bounds ``seq_lens`` (host int; under a CUDA
    graph, the bound the graph was captured with). ``sliding_window`` ``W``: the query
    sees only the last ``W`` positions; ``logit_softcap`` ``c``: scores become
    ``c * tanh(score / c)``. With ``compact``, table entries from ``compact.offset`` on
    name its compact blocks, and a tile is one block. ``split_tokens`` (a multiple of the
    tile) overrides the split plan; ``tile_tokens``, ``num_warps``, ``num_stages`` tune
    the kernel. Returns ``q``'s shape and dtype."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    tile = tile_tokens or (default_tile_tokens(block_size, fmt) if compact is None else block_size)
    if compact is not None and tile != block_size:
        raise ValueError(f"over compact blocks a tile is one block ({block_size}), not {tile}")
    if num_stages is None:
        num_stages = 2 if fmt.quantized else 3
    if tile < max(16, block_size) or tile & (tile - 1):
        raise ValueError(f"tile_tokens must be a power of two >= max(16, block_size), got {tile}")
    if split_tokens is None:
        programs = target_programs(q.device)
        split_tokens, num_splits = plan_splits(num_seqs, num_kv_heads, max_seq_len, tile, programs)
    else:
        if split_tokens % tile:
            raise ValueError(f"split_tokens {split_tokens} is not a multiple of the tile {tile}")
        num_splits = max(1, math.ceil(max_seq_len / split_tokens))
    group = num_q_heads // num_kv_heads
    operands = dot_dtype(q.dtype, fmt)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    part_acc = torch.empty(
        (num_seqs, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_max = torch.empty(
        (num_seqs, num_q_heads, num_splits), dtype=torch.float32, device=q.device
    )
    part_sum = torch.empty_like(part_max)
    tiles, compact_offset, rotated, stride_cblk, stride_chead = compact_args(compact, q, k_cache)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_acc, part_max, part_sum,
        tiles, compact_offset, rotated,
        scale * LOG2_E, sliding_window or NO_WINDOW, logit_softcap or 0.0, split_tokens,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), stride_cblk, stride_chead,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=tile,
        KV_FORMAT=kernel_format(fmt),
        DOT_DTYPE=triton_dtype(operands),
        PRECISION=dot_precision(operands),
        SOFTCAP=bool(logit_softcap),
        COMPACT=compact is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    _decode_merge_kernel[(num_seqs, num_q_heads)](
        out, seq_lens, part_acc, part_max, part_sum, split_tokens, num_splits,
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )  # fmt: skip
    return out
