"""BlockPool: deterministic ids, ref counts, all-or-nothing allocation, the reserve."""

import pytest

from pagedllm.kv.block_pool import BlockPool, OutOfBlocksError


def pool_state(pool: BlockPool):
    refs = [pool.ref_count(block_id) for block_id in range(pool.num_blocks)]
    return refs, pool.free_block_ids(), pool.stats()


@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 128, 256])
def test_power_of_two_block_sizes_are_accepted(block_size):
    assert BlockPool(4, block_size).block_size == block_size


@pytest.mark.parametrize("block_size", [0, 3, 12, 512, -4, 16.0, True])
def test_other_block_sizes_are_rejected(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, block_size)


def test_fresh_pool_hands_out_ids_in_order_and_freed_blocks_go_to_the_tail():
    pool = BlockPool(6, 4, reserved_fraction=0.0)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.free_block_ids() == [3, 4, 5, 1, 0]
    assert pool.allocate(4) == [3, 4, 5, 1]
    assert pool.ref_count(1) == 1 and pool.ref_count(0) == 0


def test_ref_counts_and_double_free():
    pool = BlockPool(4, 4, reserved_fraction=0.0)
    [block] = pool.allocate(1)
    pool.incref([block, block])
    assert pool.ref_count(block) == 3
    pool.free([block, block])
    assert pool.ref_count(block) == 1 and block not in pool.free_block_ids()
    pool.free([block])
    assert pool.free_block_ids()[-1] == block
    with pytest.raises(ValueError, match="already free"):
        pool.free([block])
    with pytest.raises(ValueError, match="free"):
        pool.incref([block])


def test_failed_allocation_changes_nothing():
    pool = BlockPool(5, 2, reserved_fraction=0.0)
    pool.allocate(3)
    pool.free([1])
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError) as info:
        pool.allocate(4)
    assert (info.value.requested, info.value.available) == (4, 3)
    assert isinstance(info.value, RuntimeError)
    assert pool_state(pool) == before


def test_reserve_is_only_for_high_priority():
    pool = BlockPool(40, 16)  # 5% of 40 -> 2 reserved blocks
    assert pool.num_reserved == 2
    assert pool.num_available() == 38 and pool.num_available(high_priority=True) == 40
    assert pool.can_allocate(38) and not pool.can_allocate(39)
    pool.allocate(38)
    with pytest.raises(OutOfBlocksError) as info:
        pool.allocate(1)
    assert info.value.available == 0
    assert pool.can_allocate(2, high_priority=True)
    assert pool.allocate(2, high_priority=True) == [38, 39]
    assert not pool.can_allocate(1, high_priority=True)


def test_reserved_count_is_floor_of_fraction():
    assert BlockPool(19, 16, reserved_fraction=0.05).num_reserved == 0
    assert BlockPool(100, 16, reserved_fraction=0.05).num_reserved == 5
    assert BlockPool(10, 16, reserved_fraction=0.25).num_reserved == 2
    with pytest.raises(ValueError):
        BlockPool(10, 16, reserved_fraction=1.0)


def test_counters():
    pool = BlockPool(10, 8, reserved_fraction=0.1)
    pool.allocate(4)
    pool.free([0, 1])
    pool.allocate(1)
    stats = pool.stats()
    assert (stats.num_blocks, stats.used, stats.free, stats.reserved) == (10, 3, 7, 1)
    assert (stats.peak_used, stats.num_allocations, stats.num_frees) == (4, 5, 2)
    assert stats.usage == pytest.approx(0.3)
