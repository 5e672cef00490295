"""The swap space alone (pagedllm.kv_storage.swap_space), over a small KV cache with
compact blocks: each kind of block parks in its own partition and comes back bit for
bit, a parked full block behind the window comes back compact with the bits the pool's
own re-encoding gives, kinds never mix, and its two partitions are sized as the pool's
bytes are split."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kv.block_pool import OutOfBlocksError
from pagedllm.kv.capacity import swap_split
from pagedllm.kv_storage.block_copies import BlockCopies
from pagedllm.kv_storage.compact_blocks import TileLayout, encode_tiles
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_storage.swap_space import SwapSpace

LAYERS, FULL, BLOCK_SIZE, HEADS, HEAD_DIM, COMPACT = 2, 5, 16, 2, 32, 6


def make_cache() -> KVCache:
    """Random bytes in every full and compact block (the last full one: the null block)."""
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(
        LAYERS,
        FULL + 1,
        BLOCK_SIZE,
        HEADS,
        HEAD_DIM,
        torch.bfloat16,
        kv_cache_dtype="int4",
        num_compact_blocks=COMPACT,
    )
    cache.tensor.copy_(torch.randn(cache.tensor.shape, generator=generator))
    tiles = torch.randint(0, 256, cache.compact.tensor.shape, generator=generator)
    cache.compact.tensor.copy_(tiles.to(torch.uint8))
    return cache


def full_block(cache: KVCache, block_id: int) -> torch.Tensor:
    return cache.tensor[:, :, block_id].clone()


def compact_block(cache: KVCache, block_id: int) -> torch.Tensor:
    return cache.compact.tensor[:, block_id - cache.compact_offset].clone()


@pytest.mark.parametrize("on_file", [False, True])
def test_both_kinds_round_trip_bit_for_bit_in_their_own_partitions(on_file, tmp_path):
    cache = make_cache()
    path = tmp_path / "swap.bin" if on_file else None
    swap = SwapSpace(cache, num_blocks=3, path=path, num_compact_blocks=4)
    offset = cache.compact_offset
    table = [offset + 4, offset + 1, 2, 0]  # compact entries first, as in a block table
    kept = [compact_block(cache, b) for b in table[:2]] + [full_block(cache, b) for b in table[2:]]
    parked = swap.park(num_blocks=2, num_compact=2)
    assert [swap.is_compact(s) for s in parked] == [True, True, False, False]
    swap.copy_out(list(zip(table, parked, strict=True)))
    assert swap.stats().compact_used == 2 and swap.stats().used_blocks == 2
    # the pool reuses the blocks meanwhile
    cache.tensor.zero_()
    cache.compact.tensor.zero_()
    back = [offset + 0, offset + 5, 4, 1]
    swap.unpark(parked)
    swap.copy_in(list(zip(parked, back, strict=True)))
    assert torch.equal(compact_block(cache, back[0]), kept[0])
    assert torch.equal(compact_block(cache, back[1]), kept[1])
    assert torch.equal(full_block(cache, back[2]), kept[2])
    assert torch.equal(full_block(cache, back[3]), kept[3])
    tile_bytes = LAYERS * HEADS * TileLayout(BLOCK_SIZE, HEAD_DIM).tile_bytes
    full_bytes = LAYERS * 2 * HEADS * BLOCK_SIZE * HEAD_DIM * 2
    stats = swap.stats()
    assert stats.bytes_swapped_out == stats.bytes_swapped_in == 2 * tile_bytes + 2 * full_bytes
    assert stats.used_blocks == stats.compact_used == 0
    if on_file:
        assert path.stat().st_size == 3 * full_bytes + 4 * tile_bytes


def test_a_parked_full_block_comes_back_compact_as_the_pool_would_encode_it():
    cache = make_cache()
    swap = SwapSpace(cache, num_blocks=2, num_compact_blocks=1)
    offset = cache.compact_offset
    (parked,) = swap.park(1)
    swap.copy_out([(3, parked)])
    cache.encode_blocks([(3, offset + 2)])  # the pool's own re-encoding of block 3
    swap.copy_in([(parked, offset + 5)])
    assert torch.equal(compact_block(cache, offset + 5), compact_block(cache, offset + 2))


def test_a_plan_parks_a_compact_block_before_an_encode_reuses_it():
    """A compact block a swap-out frees may be the target of a re-encoding in the same
    plan; a full block a re-encoding frees may be the target of a swap-in."""
    cache = make_cache()
    swap = SwapSpace(cache, num_blocks=2, num_compact_blocks=2)
    offset = cache.compact_offset
    kept, full = compact_block(cache, offset + 1), full_block(cache, 2)
    (parked,) = swap.park(num_blocks=0, num_compact=1)
    BlockCopies([(offset + 1, parked)], [], [], encodes=[(2, offset + 1)]).apply(cache, swap)
    swap.unpark([parked])
    swap.copy_in([(parked, offset + 3)])
    assert torch.equal(compact_block(cache, offset + 3), kept)
    (parked,) = swap.park(num_blocks=1)
    swap.copy_out([(2, parked)])
    cache.tensor[:, :, 2] = 0
    swap.unpark([parked])
    BlockCopies([], [(parked, 2)], [], encodes=[(2, offset + 0)]).apply(cache, swap)
    assert torch.equal(full_block(cache, 2), full)
    zeros = torch.zeros(LAYERS, HEADS, BLOCK_SIZE, HEAD_DIM)
    assert torch.equal(compact_block(cache, offset + 0), encode_tiles(zeros, zeros))


def test_kinds_never_mix():
    cache = make_cache()
    swap = SwapSpace(cache, num_blocks=2, num_compact_blocks=2)
    offset = cache.compact_offset
    compact, full = swap.park(num_blocks=1, num_compact=1)
    with pytest.raises(ValueError, match="its own kind"):
        swap.copy_out([(offset, full)])
    with pytest.raises(ValueError, match="its own kind"):
        swap.copy_out([(0, compact)])
    with pytest.raises(ValueError, match="comes back compact"):
        swap.copy_in([(compact, 1)])


def test_parking_is_all_or_nothing_over_both_kinds():
    swap = SwapSpace(make_cache(), num_blocks=2, num_compact_blocks=1)
    assert swap.can_hold(2, 1) and not swap.can_hold(2, 2) and not swap.can_hold(3, 0)
    with pytest.raises(OutOfBlocksError):
        swap.park(num_blocks=1, num_compact=2)
    assert swap.stats().used_blocks == swap.stats().compact_used == 0
    swap.free(swap.park(num_blocks=2, num_compact=1))
    assert swap.stats().used_blocks == swap.stats().compact_used == 0


def test_compact_swap_blocks_need_a_cache_with_compact_blocks():
    cache = KVCache(LAYERS, FULL, BLOCK_SIZE, HEADS, HEAD_DIM, torch.float32)
    with pytest.raises(ValueError, match="compact"):
        SwapSpace(cache, num_blocks=2, num_compact_blocks=1)


def test_the_swap_space_splits_its_bytes_as_the_pool_does():
    # a pool of 10 full blocks of 1,000 bytes and 300 compact ones of 100: a quarter full
    full, compact = swap_split(4_000, 1_000, 100, num_full=10, num_compact=300)
    assert (full, compact) == (1, 30)
    assert swap_split(4_000, 1_000, 100, num_full=10, num_compact=0) == (4, 0)
    # what the full-size share leaves over goes to compact blocks
    assert swap_split(5_999, 1_000, 100, num_full=10, num_compact=300) == (1, 49)
