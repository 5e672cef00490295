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
    key_bit_order,
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
    layout = TileLayout(block_size, head_dim)
    key_step = (rotated.amax(-2, keepdim=True) - rotated.amin(-2, keepdim=True)) / layout.key_levels
    slack = rotated.abs().amax(-2, keepdim=True) / 128  # bfloat16 zero and scale
    assert ((rotated_back - rotated).abs() <= key_step / 2 + slack).all()
    # the rotation is orthonormal: the error's norm per token carries over
    assert torch.allclose(
        (decoded_keys - keys).norm(dim=-1), (rotated_back - rotated).norm(dim=-1), atol=1e-4
    )
    value_step = (
        values.amax(-1, keepdim=True) - values.amin(-1, keepdim=True)
    ) / layout.value_levels
    value_slack = values.abs().amax(-1, keepdim=True) / 128
    assert ((decoded_values - values).abs() <= value_step / 2 + value_slack).all()


@pytest.mark.parametrize(("block_size", "top"), [(16, 0xFF), (32, 0xFF), (64, 0x77)])
def test_byte_j_holds_dimension_j_low_and_j_plus_half_high(block_size, top):
    head_dim = 16
    values = torch.zeros(block_size, head_dim)
    values[:, 1] = 1.0  # dimension 1 is the row's largest: the top code; the others 0
    values[:, 9] = 1.0  # dimension 9 = 1 + 16 / 2 shares byte 1, in its high nibble
    tiles = encode_tiles(torch.zeros(block_size, head_dim), values)
    layout = TileLayout(block_size, head_dim)
    row = tiles[layout.value_codes_offset : layout.value_codes_offset + head_dim // 2]
    assert row.tolist() == [0, top, 0, 0, 0, 0, 0, 0]


def test_keys_take_a_fifth_bit_from_64_tokens_on():
    assert [TileLayout(b, 64).key_bits for b in (16, 32, 64, 128)] == [4, 4, 5, 5]
    assert [TileLayout(b, 64).value_levels for b in (16, 64)] == [15, 7]


def test_a_key_codes_fifth_bit_is_bit_3_of_a_value_nibble_in_transposed_order():
    block_size, head_dim = 64, 64  # W = N = 8 dwords per row, H = 1
    rotated = torch.zeros(block_size, head_dim)
    rotated[1:, 4] = 31.0  # channel 4: codes 0 (token 0) and 31 = 16 + 15 (the others)
    rotated[1:, 36] = 16.0  # channel 36 = 4 + 64 / 2: codes 0 and 31 (byte 4, high)
    tiles = encode_tiles(rotated, torch.zeros(block_size, head_dim), keys_rotated=True)
    layout = TileLayout(block_size, head_dim)
    key_rows = tiles[: layout.codes_bytes].view(block_size, head_dim // 2)
    value_rows = tiles[layout.value_codes_offset : layout.key_scale_offset].view(block_size, 32)
    assert key_rows[0].tolist() == [0] * 32 and key_rows[1].tolist() == [0] * 4 + [0xFF] + [0] * 27
    # in its 16-token group, token t's byte 4 is dword t * 8 + 1 = (r H + h) 16 + s N + m
    # with r = t // 2, s = t % 2, m = 1; it moves to dword 16 + 8 s + r: token 2 + s of
    # the group, byte 4 (t // 2)
    fifth = (value_rows & 0x88).nonzero().tolist()
    expected = [[16 * (t // 16) + 2 + t % 2, 4 * (t % 16 // 2)] for t in range(1, block_size)]
    assert sorted(fifth) == sorted(expected)
    assert (value_rows[value_rows != 0] == 0x88).all()
    keys, _ = decode_tiles(tiles, block_size, head_dim, unrotate=False)
    assert keys[1:, 4].tolist() == pytest.approx([31.0] * 63, rel=1e-2)
    assert keys[1:, 36].tolist() == pytest.approx([16.0] * 63, rel=1e-2)
    assert keys[0, 4].item() == 0.0


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_the_fifth_bits_order_is_its_own_inverse_and_moves_whole_dwords(head_dim):
    rows = torch.randint(0, 256, (2, 32, head_dim // 2), dtype=torch.uint8)
    moved = key_bit_order(rows)
    assert torch.equal(key_bit_order(moved), rows)
    assert not torch.equal(moved, rows)
    dwords = rows.view(torch.int32)
    assert sorted(moved.view(torch.int32).flatten().tolist()) == sorted(dwords.flatten().tolist())


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
