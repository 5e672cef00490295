"""Compact 4-bit K/V blocks (pagedllm.kv_storage.compact_blocks): the tile's layout and
size, round trips within the codec's bound, the nibble order a kernel relies on, and
re-encoding full blocks of every layer into compact ones at their ids."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kv_storage.compact_blocks import (
    CompactKVCache,
    TileLayout,
    decode_tiles,
    encode_tiles,
)
from pagedllm.kv_storage.int4_codec import hadamard
from pagedllm.kv_storage.kv_cache import KVCache


def test_a_tile_of_64_tokens_and_dims_is_3_56x_smaller_than_bfloat16():
    layout = TileLayout(64, 64)
    assert layout.tile_bytes == 4608
    assert 2 * 64 * 64 * 2 / layout.tile_bytes == pytest.approx(3.556, abs=1e-3)
    assert TileLayout(16, 64).tile_bytes == 1344  # 3.05x
    sections = [
        0,
        layout.value_codes_offset,
        layout.key_scale_offset,
        layout.key_zero_offset,
        layout.value_scale_offset,
        layout.value_zero_offset,
        layout.tile_bytes,
    ]
    assert sections == sorted(sections) and all(offset % 2 == 0 for offset in sections)


def test_head_dims_the_rotation_cannot_take_are_refused():
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        TileLayout(16, 80)


@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (64, 64), (32, 128)])
def test_round_trips_stay_within_half_a_step(block_size, head_dim):
    torch.manual_seed(0)
    keys = torch.randn(3, 2, block_size, head_dim) * torch.linspace(0.1, 8, head_dim)
    values = torch.randn(3, 2, block_size, head_dim)
    tiles = encode_tiles(keys, values)
    decoded_keys, decoded_values = decode_tiles(tiles, block_size, head_dim)
    rotated_back, _ = decode_tiles(tiles, block_size, head_dim, unrotate=False)
    rotated = keys @ hadamard(head_dim)
    # keys per channel over the block's tokens, in the rotated space
    key_step = (rotated.amax(-2, keepdim=True) - rotated.amin(-2, keepdim=True)) / 15
    slack = rotated.abs().amax(-2, keepdim=True) / 128  # bfloat16 zero and scale
    assert ((rotated_back - rotated).abs() <= key_step / 2 + slack).all()
    # the rotation is orthonormal: the error's norm per token carries over
    assert torch.allclose(
        (decoded_keys - keys).norm(dim=-1), (rotated_back - rotated).norm(dim=-1), atol=1e-4
    )
    value_step = (values.amax(-1, keepdim=True) - values.amin(-1, keepdim=True)) / 15
    value_slack = values.abs().amax(-1, keepdim=True) / 128
    assert ((decoded_values - values).abs() <= value_step / 2 + value_slack).all()


def test_byte_j_holds_dimension_j_low_and_j_plus_half_high():
    block_size, head_dim = 16, 16
    values = torch.zeros(block_size, head_dim)
    values[:, 1] = 1.0  # dimension 1 is the row's largest: code 15; the others 0
    values[:, 9] = 1.0  # dimension 9 = 1 + 16 / 2 shares byte 1, in its high nibble
    tiles = encode_tiles(torch.zeros(block_size, head_dim), values)
    layout = TileLayout(block_size, head_dim)
    row = tiles[layout.value_codes_offset : layout.value_codes_offset + head_dim // 2]
    assert row.tolist() == [0, 0xFF, 0, 0, 0, 0, 0, 0]


def test_a_cache_re_encodes_full_blocks_of_every_layer_at_compact_ids():
    torch.manual_seed(1)
    cache = KVCache(3, 5, 16, 2, 64, torch.bfloat16, kv_cache_dtype="int4", num_compact_blocks=4)
    assert isinstance(cache.compact, CompactKVCache) and cache.compact_offset == 5
    cache.tensor.copy_(torch.randn(cache.tensor.shape))
    cache.encode_blocks([(3, 5 + 2), (0, 5 + 0)])
    for layer in range(3):
        for full, compact in ((3, 2), (0, 0)):
            keys, values = cache.key(layer)[full].float(), cache.value(layer)[full].float()
            want = encode_tiles(keys, values)
            assert torch.equal(cache.compact.tiles(layer)[compact], want)
        assert not cache.compact.tiles(layer)[1].any()  # untouched
    assert cache.nbytes == cache.tensor.numel() * 2 + 3 * 4 * 2 * TileLayout(16, 64).tile_bytes
