"""Compact (4-bit) K/V blocks: the format blocks are re-encoded into once they fall
wholly behind a sequence's recent window (``kv_cache_dtype="int4"``).

A compact block holds ``block_size`` tokens of every layer and KV head. One *tile* is one
(layer, block, KV head), contiguous bytes in this order (``B`` = block size in tokens,
``D`` = head dim, a power of two):

====================  ========================  ======================================
section               shape, type               meaning
====================  ========================  ======================================
key codes             ``[B, D/2]`` uint8        rotated keys, 4 bits per dimension
value codes           ``[B, D/2]`` uint8        values, 4 bits per dimension
key scale, key zero   ``[D]`` bfloat16 each     per channel, over the block's B tokens
value scale, zero     ``[B]`` bfloat16 each     per token, over the D channels
====================  ========================  ======================================

``tile_bytes = B * D + 4 * D + 4 * B`` (4,608 bytes at B = D = 64, against 16,384 for
the same K/V in bfloat16: 3.56x). Byte ``j`` of a row of codes holds dimension ``j`` in
its low nibble and dimension ``j + D/2`` in its high nibble, so 16 consecutive bytes give
16 consecutive dimensions twice over (a mask and a shift). A code ``c`` (0..15) means
``zero + c * scale`` (:mod:`pagedllm.kv_storage.int4_codec`).

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


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., D]`` (uint8, 0..15) packed two per byte ``[..., D/2]``: dimension
    ``j`` low, ``j + D/2`` high."""
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed & 15, packed >> 4], dim=-1)


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
    key_codes, key_scale, key_zero = quantize_groups(rotated, dim=-2)
    value_codes, value_scale, value_zero = quantize_groups(values, dim=-1)
    sections = [
        _pack(key_codes).reshape(*lead, -1),
        _pack(value_codes).reshape(*lead, -1),
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
    key_codes = _unpack(section(0, codes).reshape(*lead, block_size, head_dim // 2))
    value_codes = _unpack(
        section(layout.value_codes_offset, codes).reshape(*lead, block_size, head_dim // 2)
    )
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
