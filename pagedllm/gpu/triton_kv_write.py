"""Writes a step's new K/V rows into one layer's paged cache, in the cache's format."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.gpu.kv_codes import FLOAT, encode_tile, kernel_format, to_bfloat16
from pagedllm.kv_storage.kv_quant import KVFormat


@triton.jit
def _store_rows(
    src_ptr,
    cache_ptr,
    token,
    slot,
    stride_src_tok,
    stride_src_head,
    stride_blk,
    stride_head,
    stride_tok,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    MAX_CODE: tl.constexpr,
):
    """Every kv head's row of one token: ``src[token]`` -> cache slot ``slot``."""
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    head_ok = heads < NUM_KV_HEADS
    mask = head_ok[:, None]
    src = src_ptr + token * stride_src_tok + heads[:, None] * stride_src_head + dims[None, :]
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    block = (slot // BLOCK_SIZE).to(tl.int64)
    rows = cache_ptr + block * stride_blk + heads * stride_head + (slot % BLOCK_SIZE) * stride_tok
    if KV_FORMAT == FLOAT:
        if cache_ptr.dtype.element_ty == tl.bfloat16:
            stored = to_bfloat16(x)
        else:
            stored = x.to(cache_ptr.dtype.element_ty)
        tl.store(rows[:, None] + dims[None, :], stored, mask=mask)
    else:
        codes, scale_bits = encode_tile(x, KV_FORMAT, MAX_CODE)
        tl.store(rows[:, None] + dims[None, :], codes, mask=mask)
        tl.store(rows + HEAD_DIM, (scale_bits & 0xFF).to(tl.uint8), mask=head_ok)
        tl.store(rows + HEAD_DIM + 1, ((scale_bits >> 8) & 0xFF).to(tl.uint8), mask=head_ok)


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_blk,
    stride_head,
    stride_tok,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_FORMAT: tl.constexpr,
    MAX_CODE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    _store_rows(
        k_ptr, k_cache_ptr, token, slot, stride_k_tok, stride_k_head,
        stride_blk, stride_head, stride_tok,
        NUM_KV_HEADS, HEADS_PAD, HEAD_DIM, BLOCK_SIZE, KV_FORMAT, MAX_CODE,
    )  # fmt: skip
    _store_rows(
        v_ptr, v_cache_ptr, token, slot, stride_v_tok, stride_v_head,
        stride_blk, stride_head, stride_tok,
        NUM_KV_HEADS, HEADS_PAD, HEAD_DIM, BLOCK_SIZE, KV_FORMAT, MAX_CODE,
    )  # fmt: skip


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    fmt: KVFormat,
) -> None:
    """Stores token ``i`` of ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` (any
    float dtype) at slot ``slot_mapping[i]`` (int64; ``-1`` skips the token) of one
    layer's caches ``[num_blocks, num_kv_heads, block_size, row]`` in ``fmt.storage_dtype``,
    converting or quantizing exactly as :func:`~pagedllm.kv_storage.kv_quant.encode_rows` does.
    Launches one program per token; makes no host synchronisation."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("k and v must have the same shape and contiguous rows")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("the K and V caches must have the same shape and strides")
    if k_cache.dtype != fmt.storage_dtype or k_cache.shape[-1] != fmt.row_width(head_dim):
        raise ValueError(f"cache {k_cache.dtype} rows of {k_cache.shape[-1]} do not hold {fmt}")
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[2],
        KV_FORMAT=kernel_format(fmt),
        MAX_CODE=fmt.max_code,
    )  # fmt: skip
