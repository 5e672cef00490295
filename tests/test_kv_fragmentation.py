"""Fragmentation accounting against a worked example (lengths 10 and 7, block size 4)."""

import pytest

from pagedllm.kv.fragmentation import fragmentation_stats


def test_seed_004_worked_example():
    stats = fragmentation_stats([[5, 1, 6], [5, 3]], [10, 7], 4)
    assert stats.unique_blocks == 4
    assert stats.allocated_slots == 16
    assert stats.live_tokens == 13
    assert stats.internal_fragmentation_slots == 3
    assert stats.slots_saved_by_sharing == 4


def test_padding_rows_as_in_a_block_table_tensor():
    padded = fragmentation_stats([[5, 1, 6], [5, 3, -1]], [10, 7], 4)
    assert padded == fragmentation_stats([[5, 1, 6], [5, 3]], [10, 7], 4)


def test_shared_partial_block_counts_its_fullest_holder():
    # Two forks of a 6-token sequence share a half-filled block 1.
    stats = fragmentation_stats([[0, 1], [0, 1]], [6, 6], 4)
    assert (stats.unique_blocks, stats.live_tokens) == (2, 6)
    assert stats.internal_fragmentation_slots == 2
    assert stats.slots_saved_by_sharing == 8


def test_without_sharing_waste_is_below_one_block_per_sequence():
    lengths = [1, 4, 5, 16, 17]
    tables, next_block = [], 0
    for length in lengths:
        count = -(-length // 4)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    stats = fragmentation_stats(tables, lengths, 4)
    assert stats.live_tokens == sum(lengths)
    assert stats.internal_fragmentation_slots == 3 + 0 + 3 + 0 + 3
    assert stats.slots_saved_by_sharing == 0


def test_empty_and_invalid_inputs():
    assert fragmentation_stats([], [], 16).allocated_slots == 0
    with pytest.raises(ValueError):
        fragmentation_stats([[0]], [5], 4)
    with pytest.raises(ValueError):
        fragmentation_stats([[0, -1]], [5], 4)
    with pytest.raises(ValueError):
        fragmentation_stats([[0]], [1, 2], 4)
