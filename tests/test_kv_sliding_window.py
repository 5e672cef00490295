"""The block manager under a sliding window: blocks no later query reads go back to the
pool, their table entries become the null block, sharing and the prefix cache follow
the usual rules, and a prefix hit needs only the blocks inside the window."""

from __future__ import annotations

import pytest

from pagedllm.kv.block_manager import BlockManager


def manager(num_blocks: int = 16, window: int = 8, **options) -> BlockManager:
    """Blocks of 4 tokens; no reserve."""
    return BlockManager(num_blocks, 4, 0.0, sliding_window=window, **options)


def test_commit_releases_blocks_before_the_window_of_the_next_query():
    m = manager()
    m.allocate_slots("a", 13)
    assert m.commit_tokens("a", list(range(13))) == [range(0, 1)]  # next query 13 sees 6..13
    null = m.pool.null_block
    assert null == 16 and m.block_table("a")[:1] == [null]
    assert m.num_held_blocks("a") == 3 and m.pool.num_used == 3
    result = m.allocate_slots("a", 1)  # position 13 lands in held block 3
    assert result.slots == [m.block_table("a")[3] * 4 + 1]
    assert not any(m.commit_tokens("a", [0]))  # next query 14 sees 7..14: block 1 stays
    m.allocate_slots("a", 1)
    assert m.commit_tokens("a", [0]) == [range(1, 2)]  # next query 15 sees 8..15
    assert m.block_table("a")[:2] == [null, null] and m.num_held_blocks("a") == 2
    m.free("a")
    assert m.pool.num_used == 0


def test_a_decoding_sequence_holds_at_most_the_window_plus_one_block():
    m = manager(window=8)
    m.allocate_slots("a", 1)
    m.commit_tokens("a", [1])
    for position in range(1, 200):
        m.allocate_slots("a", 1)
        assert m.num_held_blocks("a") <= 8 // 4 + 1
        m.commit_tokens("a", [position % 7])
    assert m.pool.stats().peak_used == 3


def test_a_shared_block_stays_with_its_other_holder():
    m = manager()
    m.allocate_slots("a", 8)
    m.commit_tokens("a", list(range(8)))
    m.fork("a", "b")
    first = m.block_table("a")[0]
    m.allocate_slots("a", 4)
    assert m.commit_tokens("a", [9, 9, 9, 9]) == [range(0, 1)]
    assert m.pool.ref_count(first) == 1 and m.block_table("b")[0] == first
    m.allocate_slots("b", 4)
    m.commit_tokens("b", [8, 8, 8, 8])
    assert m.pool.ref_count(first) == 0 and first in m.pool.free_block_ids()


def test_released_blocks_stay_cached_and_evictable():
    m = manager()
    prompt = list(range(20))
    prefix = m.find_cached_prefix(prompt, ("model",))
    m.allocate_slots("a", 20, prefix=prefix)
    m.commit_tokens("a", prompt)  # next query 20 sees 13..20: blocks 0..2 released
    stats = m.pool.stats()
    assert stats.cached == 5 and stats.evictable == 3 and stats.used == 2


def test_a_prefix_hit_needs_only_the_blocks_inside_the_window():
    m = manager(num_blocks=8)
    prompt = list(range(24))
    m.allocate_slots("a", 24, prefix=m.find_cached_prefix(prompt))
    m.commit_tokens("a", prompt)
    m.free("a")
    # another sequence evicts the oldest free blocks: the chain's first blocks
    m.allocate_slots("x", 12)
    assert all(m.pool.block_key(b) is None for b in m.block_table("x"))
    hit = m.find_cached_prefix(prompt + [99])
    assert m.pool.lookup(hit.keys[0]) is None  # the chain from the start is broken, but
    # position 24's window (17..24) lies in blocks 4 and 5, both cached
    assert hit.num_tokens == 24 and hit.num_null_blocks == 4
    assert hit.block_ids[:4] == (m.pool.null_block,) * 4
    used = m.pool.num_used
    result = m.allocate_slots("b", 1, prefix=hit)
    assert m.pool.num_used == used + 3  # two revived cached blocks and one new block
    assert result.slots == [m.block_table("b")[6] * 4]


def test_a_swap_in_allocates_no_block_outside_the_window():
    m = manager()
    prefix = m.find_cached_prefix([1, 2, 3])
    result = m.allocate_slots("a", 21, prefix=prefix, num_restored=20)
    # the first computed token is at 20; it sees 13..20: blocks 3.. are held
    assert result.slots[:12] == [-1] * 12
    assert m.num_held_blocks("a") == 3 and m.num_null_blocks("a") == 3
    assert m.commit_tokens("a", list(range(20))) == [range(3, 3)]


def test_a_window_needs_allocation_on_demand():
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(8, 4, 0.0, upfront_tokens=16, sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(8, 4, 0.0, sliding_window=0)
