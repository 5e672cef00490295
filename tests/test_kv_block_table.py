"""BlockTable: on-demand growth, slot mapping, fork, copy-on-write."""

import pytest

from pagedllm.kv.block_pool import BlockPool, OutOfBlocksError
from pagedllm.kv.block_table import BlockTable


def make_pool(num_blocks=8, block_size=4):
    return BlockPool(num_blocks, block_size, reserved_fraction=0.0)


def forked_pair(pool, num_tokens):
    """A parent table of ``num_tokens`` tokens and a child forked from it."""
    parent = BlockTable(pool)
    parent.append_slots(num_tokens)
    return parent, parent.fork()


def test_append_allocates_only_when_the_last_block_is_full():
    pool = make_pool()
    table = BlockTable(pool)
    result = table.append_slots(6)
    assert table.block_ids == [0, 1] and table.num_tokens == 6
    assert result.slots == [0, 1, 2, 3, 4, 5] and result.copies == []
    assert table.num_blocks_needed(2) == 0
    assert table.append_slots(2).slots == [6, 7]
    assert table.block_ids == [0, 1]
    assert table.num_blocks_needed(1) == 1
    assert table.append_slots(1).slots == [8]
    assert table.block_ids == [0, 1, 2]


def test_slots_follow_scattered_blocks():
    pool = make_pool()
    pool.allocate(3)
    pool.free([1])  # free queue: 3 4 5 6 7 1
    table = BlockTable(pool)
    assert table.append_slots(5).slots == [12, 13, 14, 15, 16]
    assert table.block_ids == [3, 4]


def test_zero_tokens_allocates_nothing():
    table = BlockTable(make_pool())
    assert table.append_slots(0).slots == []
    assert table.block_ids == []
    with pytest.raises(ValueError):
        table.append_slots(-1)


def test_fork_shares_every_block():
    pool = make_pool()
    parent, child = forked_pair(pool, 6)
    assert child.block_ids == [0, 1] and child.num_tokens == 6
    assert [pool.ref_count(b) for b in (0, 1)] == [2, 2]
    assert pool.num_free == 6


def test_copy_on_write_of_a_shared_partial_block():
    pool = make_pool()
    parent, child = forked_pair(pool, 6)
    assert child.num_blocks_needed(1) == 1
    result = child.append_slots(1)
    assert result.copies == [(1, 2)]
    assert result.slots == [2 * 4 + 2]
    assert child.block_ids == [0, 2] and parent.block_ids == [0, 1]
    assert [pool.ref_count(b) for b in (0, 1, 2)] == [2, 1, 1]
    # The parent is now the sole holder of block 1 and writes in place.
    assert parent.append_slots(1).copies == []
    assert parent.block_ids == [0, 1]


def test_appending_nothing_to_a_shared_block_copies_nothing():
    pool = make_pool()
    parent, child = forked_pair(pool, 6)
    assert child.num_blocks_needed(0) == 0
    assert child.append_slots(0).copies == []
    assert child.block_ids == parent.block_ids == [0, 1]


def test_shared_full_block_is_not_copied():
    pool = make_pool()
    parent, child = forked_pair(pool, 4)
    result = child.append_slots(2)
    assert result.copies == [] and result.slots == [4, 5]
    assert child.block_ids == [0, 1] and pool.ref_count(0) == 2


def test_copy_and_growth_in_one_append():
    pool = make_pool()
    parent, child = forked_pair(pool, 3)
    result = child.append_slots(3)
    assert result.copies == [(0, 1)]
    assert child.block_ids == [1, 2]
    assert result.slots == [7, 8, 9]


def test_failed_append_changes_nothing():
    pool = make_pool(num_blocks=3)
    parent, child = forked_pair(pool, 6)
    before = (child.block_ids[:], child.num_tokens, pool.free_block_ids(), pool.stats())
    with pytest.raises(OutOfBlocksError):
        child.append_slots(4)  # copy of block 1 + one more block, only one free
    after = (child.block_ids[:], child.num_tokens, pool.free_block_ids(), pool.stats())
    assert after == before
    assert [pool.ref_count(b) for b in (0, 1, 2)] == [2, 2, 0]


def test_free_releases_last_block_first():
    pool = make_pool(num_blocks=4)
    table = BlockTable(pool)
    table.append_slots(9)
    table.free()
    assert table.block_ids == [] and table.num_tokens == 0
    assert pool.free_block_ids() == [3, 2, 1, 0]


def test_adopted_blocks_must_match_token_count():
    pool = make_pool()
    with pytest.raises(ValueError):
        BlockTable(pool, [0], num_tokens=5)


def test_preallocate_holds_blocks_ahead_and_appends_use_them():
    pool = make_pool()
    table = BlockTable(pool)
    table.preallocate(10)
    assert table.block_ids == [0, 1, 2] and table.num_tokens == 0
    assert table.num_blocks_needed(10) == 0
    assert table.append_slots(5).slots == [0, 1, 2, 3, 4]
    assert table.block_ids == [0, 1, 2]
    assert table.append_slots(7).slots == [5, 6, 7, 8, 9, 10, 11]
    assert table.block_ids == [0, 1, 2]
    assert table.append_slots(1).slots == [12]
    assert table.block_ids == [0, 1, 2, 3]


def test_fork_of_a_preallocated_table_copies_every_shared_block_it_writes():
    pool = make_pool()
    parent = BlockTable(pool)
    parent.preallocate(12)
    parent.append_slots(2)
    child = parent.fork()
    assert child.num_blocks_needed(3) == 2
    result = child.append_slots(3)
    assert result.copies == [(0, 3), (1, 4)]
    assert child.block_ids == [3, 4, 2]
    assert [pool.ref_count(b) for b in range(5)] == [1, 1, 2, 1, 1]


def test_failed_reserve_changes_nothing():
    pool = make_pool(num_blocks=2)
    table = BlockTable(pool)
    with pytest.raises(OutOfBlocksError):
        table.preallocate(9)
    assert table.block_ids == [] and pool.num_free == 2
