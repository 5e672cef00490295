"""Compact 4-bit K/V tiles (``kv_cache_dtype="int4"``) read by the attention kernels.

A block-table entry ``e >= compact_offset`` names compact block ``e - compact_offset``,
whose tile for one kv head (:mod:`pagedllm.kv_storage.compact_blocks`, ``B`` = block
size, ``D`` = head dim) holds, from its first byte: key nibbles ``[B, D/2]``, value
nibbles ``[B, D/2]`` (byte ``j`` of a row: dimension ``j`` in its low nibble, ``j + D/2``
in its high one), then bfloat16 key scales and zeros ``[D]`` each (per channel) and value
scales and zeros ``[B]`` each (per token). A code is its nibble (0..15); from
``FIFTH_KEY_BIT_TOKENS`` tokens on, a value code (0..7) is its nibble's low 3 bits and a
key code (0..31) its nibble plus 16 times its fifth bit, bit 3 of a value nibble at the
place :func:`~pagedllm.kv_storage.compact_blocks.key_bit_order` moves it to. A code
``c`` means ``zero + c * scale``. Keys are
stored rotated (``k @ H``, :func:`~pagedllm.kv_storage.int4_codec.hadamard`), so they are
scored against the query rotated alike: ``(q @ H) . (k @ H) = q . k``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedllm.kv_storage.compact_blocks import FIFTH_KEY_BIT_TOKENS, TileLayout


@dataclass(frozen=True)
class CompactOperands:
    """What the kernels need to read one layer's compact blocks."""

    tiles: torch.Tensor
    """``[num_compact_blocks, num_kv_heads, tile_bytes]`` uint8: the layer's tiles
    (:meth:`~pagedllm.kv_storage.compact_blocks.CompactKVCache.tiles`)."""
    offset: int
    """Table entries from this one on are compact (the cache's ``compact_offset``)."""
    rotated_q: torch.Tensor
    """``q.float() @ hadamard(head_dim)``: float32, ``q``'s shape and strides."""


@triton.jit
def compact_tile_ptr(tiles_ptr, entry, compact_offset, kv_head, stride_cblk, stride_chead):
    """The first byte of kv head ``kv_head``'s tile of table entry ``entry`` (compact)."""
    block = (entry - compact_offset).to(tl.int64)
    return tiles_ptr + block * stride_cblk + kv_head * stride_chead


@triton.jit
def _load_bfloat16(byte_ptrs, mask):
    """float32 values of the little-endian bfloat16 at ``byte_ptrs`` (0 where masked)."""
    low = tl.load(byte_ptrs, mask=mask, other=0).to(tl.int32)
    high = tl.load(byte_ptrs + 1, mask=mask, other=0).to(tl.int32)
    return (((high << 8) | low) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _load_nibbles(codes_ptr, valid, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """int32 nibbles ``[BLOCK_SIZE, HEAD_DIM]`` (0..15, 0 in rows not ``valid``) of the
    ``[BLOCK_SIZE, HEAD_DIM / 2]`` bytes at ``codes_ptr``: each byte is loaded for both of
    its dimensions."""
    HALF: tl.constexpr = HEAD_DIM // 2
    tokens = tl.arange(0, BLOCK_SIZE)
    dims = tl.arange(0, HEAD_DIM)
    packed = tl.load(
        codes_ptr + tokens[:, None] * HALF + (dims % HALF)[None, :], mask=valid[:, None], other=0
    )
    return (packed.to(tl.int32) >> (4 * (dims // HALF))[None, :]) & 15


@triton.jit
def _load_fifth_bits(values_ptr, valid, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """int32 fifth bits ``[BLOCK_SIZE, HEAD_DIM]`` of the key codes (0 in rows not
    ``valid``), from the value nibbles at ``values_ptr``: (token, dimension)'s bit lies in
    the byte its key nibble's dword moves to under ``key_bit_order``."""
    HALF: tl.constexpr = HEAD_DIM // 2
    WORDS: tl.constexpr = HEAD_DIM // 8
    N: tl.constexpr = WORDS if WORDS < 16 else 16
    H: tl.constexpr = WORDS // N
    tokens = tl.arange(0, BLOCK_SIZE)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    byte = dims % HALF
    index = (tokens % 16) * WORDS + byte // 4  # the dword in its 16-token group
    r, h = index // 16 // H, index // 16 % H
    s, m = index % 16 // N, index % 16 % N
    moved = (m * H + h) * 16 + s * N + r
    address = (tokens // 16) * (16 * HALF) + moved * 4 + byte % 4
    packed = tl.load(values_ptr + address, mask=valid[:, None], other=0).to(tl.int32)
    return (packed >> (3 + 4 * (dims // HALF))) & 1


@triton.jit
def load_compact_tile(
    tile_ptr,
    valid,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Rotated keys and values ``[BLOCK_SIZE, HEAD_DIM]`` of one tile, decoded in float32
    (``zero + code * scale``, as :func:`~pagedllm.kv_storage.compact_blocks.decode_tiles`)
    and cast to ``DOT_DTYPE``. Rows not ``valid`` are not read (values 0, keys the zero
    points): their scores must be masked."""
    # byte offsets of the sections (TileLayout's)
    CODES: tl.constexpr = BLOCK_SIZE * HEAD_DIM // 2
    KEY_SCALE: tl.constexpr = 2 * CODES
    KEY_ZERO: tl.constexpr = KEY_SCALE + 2 * HEAD_DIM
    VALUE_SCALE: tl.constexpr = KEY_ZERO + 2 * HEAD_DIM
    VALUE_ZERO: tl.constexpr = VALUE_SCALE + 2 * BLOCK_SIZE
    dims = tl.arange(0, HEAD_DIM)
    tokens = tl.arange(0, BLOCK_SIZE)
    value_nibbles = _load_nibbles(tile_ptr + CODES, valid, HEAD_DIM, BLOCK_SIZE)
    key_nibbles = _load_nibbles(tile_ptr, valid, HEAD_DIM, BLOCK_SIZE)
    if BLOCK_SIZE >= FIFTH_KEY_BIT_TOKENS:
        fifth_bits = _load_fifth_bits(tile_ptr + CODES, valid, HEAD_DIM, BLOCK_SIZE)
        key_codes = (key_nibbles | (fifth_bits << 4)).to(tl.float32)
        value_codes = (value_nibbles & 7).to(tl.float32)
    else:
        key_codes = key_nibbles.to(tl.float32)
        value_codes = value_nibbles.to(tl.float32)
    every_dim = dims < HEAD_DIM  # all true: scales and zeros per channel
    key_scale = _load_bfloat16(tile_ptr + KEY_SCALE + 2 * dims, every_dim)
    key_zero = _load_bfloat16(tile_ptr + KEY_ZERO + 2 * dims, every_dim)
    keys = key_zero[None, :] + key_codes * key_scale[None, :]
    value_scale = _load_bfloat16(tile_ptr + VALUE_SCALE + 2 * tokens, valid)
    value_zero = _load_bfloat16(tile_ptr + VALUE_ZERO + 2 * tokens, valid)
    values = value_zero[:, None] + value_codes * value_scale[:, None]
    return keys.to(DOT_DTYPE), values.to(DOT_DTYPE)


def compact_args(compact: CompactOperands | None, q: torch.Tensor, k_cache: torch.Tensor) -> tuple:
    """The kernels' compact arguments (tiles, offset, rotated query, tile strides), after
    checking them against ``q`` and ``k_cache`` (``[num_blocks, num_kv_heads,
    block_size, row]``); without compact blocks, stand-ins that a launch with
    ``COMPACT=False`` never reads."""
    if compact is None:
        return k_cache, 0, q, 0, 0
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    head_dim = q.shape[-1]
    tiles, rotated = compact.tiles, compact.rotated_q
    tile_bytes = TileLayout(block_size, head_dim).tile_bytes
    if block_size < 16:
        raise ValueError(f"compact blocks need block_size >= 16, got {block_size}")
    if tiles.dtype != torch.uint8 or tiles.shape[1:] != (num_kv_heads, tile_bytes):
        raise ValueError(
            f"compact tiles {tuple(tiles.shape)} {tiles.dtype} do not fit {num_kv_heads} kv "
            f"heads of {tile_bytes} bytes"
        )
    if tiles.stride(2) != 1:
        raise ValueError("each compact tile must be contiguous")
    if rotated.dtype != torch.float32 or rotated.shape != q.shape or rotated.stride() != q.stride():
        raise ValueError("the rotated query must be float32 with q's shape and strides")
    return tiles, compact.offset, rotated, tiles.stride(0), tiles.stride(1)
