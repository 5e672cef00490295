"""BlockManager: the scheduler-facing calls, keyed by sequence id."""

import pytest

from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.fragmentation import fragmentation_stats


def test_append_creates_the_sequence_and_grows_it():
    manager = BlockManager(8, 4, reserved_fraction=0.0)
    assert manager.num_blocks_needed("a", 5) == 2
    assert manager.allocate_slots("a", 5).slots == [0, 1, 2, 3, 4]
    assert manager.allocate_slots("b", 2).slots == [8, 9]
    assert manager.allocate_slots("a", 4).slots == [5, 6, 7, 12]
    assert manager.block_table("a") == [0, 1, 3]
    assert manager.num_tokens("a") == 9 and "a" in manager and "c" not in manager


def test_fork_then_copy_on_write_then_free():
    manager = BlockManager(8, 4, reserved_fraction=0.0)
    manager.allocate_slots(0, 6)
    manager.fork(0, 1)
    assert manager.block_table(1) == [0, 1]
    assert manager.pool.ref_count(1) == 2
    assert manager.num_blocks_needed(1, 1) == 1
    result = manager.allocate_slots(1, 1)
    assert result.copies == [(1, 2)] and result.slots == [10]
    manager.free(0)
    assert manager.pool.free_block_ids() == [3, 4, 5, 6, 7, 1]
    assert manager.pool.ref_count(0) == 1
    manager.free(1)
    assert manager.pool.free_block_ids() == [3, 4, 5, 6, 7, 1, 2, 0]
    with pytest.raises(KeyError):
        manager.free(1)
    manager.allocate_slots(2, 1)
    with pytest.raises(ValueError, match="exists"):
        manager.fork(2, 2)


def test_failed_first_append_registers_nothing():
    manager = BlockManager(2, 4, reserved_fraction=0.0)
    assert not manager.can_append("a", 9)
    assert manager.allocate_slots("a", 9) is None
    assert "a" not in manager and manager.pool.num_free == 2


def test_reserve_only_for_high_priority():
    manager = BlockManager(20, 4, reserved_fraction=0.1)  # 2 reserved
    manager.allocate_slots("low", 18 * 4)
    assert not manager.can_append("low", 1)
    assert not manager.can_append("vip", 1)
    assert manager.can_append("vip", 8, high_priority=True)
    assert manager.allocate_slots("vip", 8, high_priority=True).slots[0] == 18 * 4


def test_stats_match_the_pure_fragmentation_count():
    manager = BlockManager(16, 4, reserved_fraction=0.0)
    manager.allocate_slots("a", 10)
    manager.fork("a", "b")
    manager.allocate_slots("b", 3)
    manager.allocate_slots("c", 1)
    stats = manager.stats()
    tables = [manager.block_table(s) for s in ("a", "b", "c")]
    lengths = [manager.num_tokens(s) for s in ("a", "b", "c")]
    assert stats.fragmentation == fragmentation_stats(tables, lengths, 4)
    assert stats.num_seqs == 3 and stats.pool.used == 6
    assert stats.fragmentation.slots_saved_by_sharing == (3 + 4 + 1 - 6) * 4


def test_check_progress_relates_committed_reserved_and_hashed_counts():
    manager = BlockManager(8, 4, reserved_fraction=0.0)
    prompt = [1, 2, 3, 4, 5]
    manager.allocate_slots("a", 5, prefix=manager.find_cached_prefix(prompt))
    manager.check_progress("a", 0, num_scheduled_tokens=5)  # inside the step
    with pytest.raises(AssertionError, match=r"reserved 5 != committed 0 \+ scheduled 0"):
        manager.check_progress("a", 0)
    manager.commit_tokens("a", prompt)
    manager.check_progress("a", 5)  # one block hashed (and cached), one token pending
    with pytest.raises(AssertionError, match="committed 5 != computed 4"):
        manager.check_progress("a", 4)
    manager.fork("a", "b")
    manager.check_progress("b", 5)
    manager._seqs["b"].hasher.pending.clear()  # a hash chain out of step
    with pytest.raises(AssertionError, match="0 tokens pending in the hash chain, not 1"):
        manager.check_progress("b", 5)
    with pytest.raises(AssertionError, match="holds no such sequence"):
        manager.check_progress("c", 0)
