"""Compact (4-bit) K/V blocks: the format blocks are re-encoded into once they fall
wholly behind a sequence's recent window (``kv_cache_dtype="int4"``).

A compact block holds ``block_size`` tokens of every layer and KV head. One *tile* is one
(layer, block, KV head), contiguous bytes in this order (``B`` = block size in tokens,
``D`` = head dim, a power of two):

====================  ========================  ======================================
section               shape, type               meaning
====================  ========================  ======================================
key nibbles           ``[B, D/2]`` uint8        rotated keys' codes (their low 4 bits)
value nibbles         ``[B, D/2]`` uint8        values' codes (with B >= 64: 3 bits,
                                                and each key code's fifth bit)
key scale, key zero   ``[D]`` bfloat16 each     per channel, over the block's B tokens
value scale, zero     ``[B]`` bfloat16 each     per token, over the D channels
====================  ========================  ======================================

``tile_bytes = B * D + 4 * D + 4 * B`` (4,608 bytes at B = D = 64, against 16,384 for
the same K/V in bfloat16: 3.56x). Four bits per element on average. Blocks of fewer than
:data:`FIFTH_KEY_BIT_TOKENS` tokens give keys and values 4 bits each (codes 0..15);
longer ones split them unevenly, keys 5 bits (codes 0..31) and values 3 (codes 0..7).
A key group over 64 tokens spans a wider range than one over 16: there, with 4 and 4
bits, keys missed pass keys at 8k tokens that bfloat16 finds, and 5 and 3 bits find
them; over 16 tokens 4 and 4 find them and 3-bit values lose keys near the end
(docs/capacity.md).

Byte ``j`` of a row of nibbles holds dimension ``j`` in its low nibble and dimension
``j + D/2`` in its high nibble, so 16 consecutive bytes give 16 consecutive dimensions
twice over (a mask and a shift). With 5-bit keys a value code is the low 3 bits of its
nibble, and a key code is its nibble plus 16 times its fifth bit, which is bit 3 of a
value nibble: laid out as the key nibbles are, then moved by :func:`key_bit_order` (the
order in which the CPU kernel's register transpose leaves the key nibbles, so that it
reads the bits with plain loads). A code ``c`` means ``zero + c * scale``
(:mod:`pagedllm.kv_storage.int4_codec`).

Keys are rotated before they are encoded: ``k @ H`` with ``H`` the orthonormal Hadamard
matrix of order D (symmetric, ``H @ H = I``), which spreads a few large channels over all
of them (perplexity at 8k tokens of a novel, default model: 20.07 unrotated, 20.06
rotated at 64-token groups; 20.02 and 19.97 at 16). Scores are unchanged when the query
is rotated alike, ``(q @ H) . (k @ H) = q . k``; decoding a key tile gives the rotated
key, and ``@ H`` turns it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.cpu.allocator import zeroed_pool
from pagedllm.kv_storage.int4_codec import hadamard, quantize_groups

FIFTH_KEY_BIT_TOKENS = 64
"""Blocks of at least this many tokens code keys in 5 bits and values in 3 (the CPU
kernel's kFifthKeyBitTokens)."""


@dataclass(frozen=True)
class TileLayout:
    """Byte offsets of a tile's sections for ``block_size`` tokens of ``head_dim``."""

    block_size: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.head_dim < 2 or self.head_dim & (self.head_dim - 1):
            raise ValueError(
                f"4-bit K/V blocks need a power-of-two head_dim (for the rotation), "
                f"got {self.head_dim}"
            )

    @property
    def key_bits(self) -> int:
        """Bits per key code: 5 from :data:`FIFTH_KEY_BIT_TOKENS` tokens on, else 4."""
        return 5 if self.block_size >= FIFTH_KEY_BIT_TOKENS else 4

    @property
    def key_levels(self) -> int:
        """The largest key code."""
        return 2**self.key_bits - 1

    @property
    def value_levels(self) -> int:
        """The largest value code (values take the bits keys leave of 8 per pair)."""
        return 2 ** (8 - self.key_bits) - 1

    @property
    def codes_bytes(self) -> int:
        """Bytes of one section of codes (keys or values): ``B * D / 2``."""
        return self.block_size * self.head_dim // 2

    @property
    def value_codes_offset(self) -> int:
        return self.codes_bytes

    @property
    def key_scale_offset(self) -> int:
        return 2 * self.codes_bytes

    @property
    def key_zero_offset(self) -> int:
        return self.key_scale_offset + 2 * self.head_dim

    @property
    def value_scale_offset(self) -> int:
        return self.key_zero_offset + 2 * self.head_dim

    @property
    def value_zero_offset(self) -> int:
        return self.value_scale_offset + 2 * self.block_size

    @property
    def tile_bytes(self) -> int:
        return self.value_zero_offset + 2 * self.block_size


def _pack(nibbles: torch.Tensor) -> torch.Tensor:
    """Nibbles ``[..., D]`` (uint8, 0..15) packed two per byte ``[..., D/2]``: dimension
    ``j`` low, ``j + D/2`` high."""
    half = nibbles.shape[-1] // 2
    return nibbles[..., :half] | (nibbles[..., half:] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def key_bit_order(rows: torch.Tensor) -> torch.Tensor:
    """Rows of bytes ``[..., B, D/2]`` (B a multiple of 16) with each 16-token group's
    dwords transposed as the CPU kernel transposes key nibbles: with ``W = D/8`` dwords
    per row, ``N = min(W, 16)`` and ``H = W / N``, the group's dword ``(r H + h) 16 + s N
    + m`` goes to ``(m H + h) 16 + s N + r``. Its own inverse."""
    *lead, block_size, row_bytes = rows.shape
    words = row_bytes // 4
    n = min(words, 16)
    dwords = rows.contiguous().view(torch.int32)
    grouped = dwords.reshape(*lead, block_size // 16, n, words // n, 16 // n, n)
    moved = grouped.transpose(-4, -1).contiguous()
    return moved.view(torch.uint8).reshape(rows.shape)


def encode_tiles(
    keys: torch.Tensor, values: torch.Tensor, keys_rotated: bool = False
) -> torch.Tensor:
    """K/V ``[..., B, D]`` (any float dtype; keys as computed, or already rotated by
    ``hadamard(D)`` with ``keys_rotated``, as an int8 cache stores them) as tiles
    ``[..., tile_bytes]`` of uint8."""
    *lead, block_size, head_dim = keys.shape
    layout = TileLayout(block_size, head_dim)
    rotated = keys.float()
    if not keys_rotated:
        rotated = rotated @ hadamard(head_dim).to(keys.device)
    key_codes, key_scale, key_zero = quantize_groups(rotated, dim=-2, levels=layout.key_levels)
    value_codes, value_scale, value_zero = quantize_groups(
        values, dim=-1, levels=layout.value_levels
    )
    value_nibbles = _pack(value_codes)
    if layout.key_bits == 5:
        value_nibbles |= key_bit_order(_pack((key_codes >> 4) << 3))
    sections = [
        _pack(key_codes & 15).reshape(*lead, -1),
        value_nibbles.reshape(*lead, -1),
        key_scale.reshape(*lead, head_dim).view(torch.uint8),
        key_zero.reshape(*lead, head_dim).view(torch.uint8),
        value_scale.reshape(*lead, block_size).view(torch.uint8),
        value_zero.reshape(*lead, block_size).view(torch.uint8),
    ]
    tiles = torch.cat(sections, dim=-1)
    assert tiles.shape[-1] == layout.tile_bytes
    return tiles


def decode_tiles(
    tiles: torch.Tensor, block_size: int, head_dim: int, unrotate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles ``[..., tile_bytes]`` back to float32 keys and values ``[..., B, D]``: the
    values the attention kernel computes with (keys rotated back unless ``unrotate`` is
    False)."""
    layout = TileLayout(block_size, head_dim)
    lead = tiles.shape[:-1]

    def section(offset: int, nbytes: int) -> torch.Tensor:
        return tiles[..., offset : offset + nbytes]

    def bf16(offset: int, count: int) -> torch.Tensor:
        return section(offset, 2 * count).contiguous().view(torch.bfloat16).float()

    codes = layout.codes_bytes
    rows = (*lead, block_size, head_dim // 2)
    key_codes = _unpack(section(0, codes).reshape(rows))
    value_bytes = section(layout.value_codes_offset, codes).reshape(rows)
    value_codes = _unpack(value_bytes) & layout.value_levels
    if layout.key_bits == 5:
        key_codes |= (_unpack(key_bit_order(value_bytes & 0x88)) >> 3) << 4
    key_scale = bf16(layout.key_scale_offset, head_dim).unsqueeze(-2)
    key_zero = bf16(layout.key_zero_offset, head_dim).unsqueeze(-2)
    value_scale = bf16(layout.value_scale_offset, block_size).unsqueeze(-1)
    value_zero = bf16(layout.value_zero_offset, block_size).unsqueeze(-1)
    keys = key_zero + key_codes.float() * key_scale
    values = value_zero + value_codes.float() * value_scale
    if unrotate:
        keys = keys @ hadamard(head_dim).to(keys.device)
    return keys, values


class CompactKVCache:
    """Preallocated compact blocks: one uint8 tensor ``[num_layers, num_blocks,
    num_kv_heads, tile_bytes]``, each (layer, block, head) tile contiguous. Holds no
    bookkeeping (the block pool's business) and is written only by
    :meth:`encode_from`."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout = TileLayout(block_size, head_dim)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_blocks, num_kv_heads, self.layout.tile_bytes)
        self.tensor = zeroed_pool(shape, torch.uint8, torch.device(device))
        self._layers = [self.tensor[i] for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def tiles(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s tiles ``[num_blocks, num_kv_heads, tile_bytes]`` (a view)."""
        return self._layers[layer_idx]

    def write(self, layer_idx: int, block_ids: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:  # fmt: skip
        """Encodes ``keys``/``values`` ``[n, num_kv_heads, B, D]`` into blocks ``block_ids``
        (compact ids, 0-based) of layer ``layer_idx``."""
        self._layers[layer_idx].index_copy_(0, block_ids, encode_tiles(keys, values))

    def read(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded float32 keys and values ``[n, num_kv_heads, B, D]`` of ``block_ids``."""
        tiles = self._layers[layer_idx].index_select(0, block_ids)
        return decode_tiles(tiles, self.block_size, self.head_dim)
