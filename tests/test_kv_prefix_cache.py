"""Automatic prefix caching in the block manager: hashes, hits, eviction, isolation."""

import hashlib
import struct

import pytest

from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.prefix_hash import BlockKey


def make_manager(num_blocks=8, block_size=4, **kwargs):
    return BlockManager(num_blocks, block_size, reserved_fraction=0.0, **kwargs)


def run_prompt(manager, seq_id, prompt, extra_keys=()):
    """Admit ``prompt`` on its cached prefix, compute the rest, commit it; return the hit."""
    prefix = manager.find_cached_prefix(prompt, extra_keys)
    manager.allocate_slots(seq_id, len(prompt) - prefix.num_tokens, prefix=prefix)
    manager.commit_tokens(seq_id, prompt[prefix.num_tokens :])
    return prefix


def state(manager):
    pool = manager.pool
    blocks = range(pool.num_blocks)
    refs = [pool.ref_count(b) for b in blocks]
    keys = [pool.block_key(b) for b in blocks]
    return refs, keys, pool.free_block_ids(), manager.stats()


def expected_chain(token_ids, block_size, extra_keys):
    """SHA-256 digests of the full blocks, written out from the documented encoding."""
    parent, digests = bytes(32), []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        data = parent + struct.pack(f"<I{block_size}q", block_size, *block)
        for key in extra_keys:
            data += struct.pack("<I", len(key.encode())) + key.encode()
        parent = hashlib.sha256(data).digest()
        digests.append(parent)
    return digests


def test_block_hashes_equal_an_independently_computed_chain():
    manager = make_manager()
    extra = ("smollm2-135m", "salt-1")
    prompt = [7, 300, 2, 65_000, 9, 9, 1, 0, 5, 6]
    run_prompt(manager, "a", prompt, extra)
    table = manager.block_table("a")
    assert [manager.pool.block_key(b).digest for b in table[:2]] == expected_chain(prompt, 4, extra)
    assert manager.pool.block_key(table[2]) is None  # partly filled: not cached
    # A sequence started on a hit continues the same chain.
    longer = prompt[:8] + [11, 12, 13, 14, 15]
    assert run_prompt(manager, "b", longer, extra).num_tokens == 8
    table = manager.block_table("b")
    digests = [manager.pool.block_key(b).digest for b in table[:3]]
    assert digests == expected_chain(longer, 4, extra)


def test_hit_reuses_the_exact_blocks_and_counts_tokens():
    manager = make_manager()
    run_prompt(manager, "a", list(range(10)))
    assert manager.block_table("a") == [0, 1, 2]
    prefix = run_prompt(manager, "b", list(range(8)) + [50, 51, 52])
    assert prefix.block_ids == (0, 1) and prefix.num_tokens == 8
    assert manager.block_table("b") == [0, 1, 3]
    assert [manager.pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    stats = manager.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (10 + 11, 8)
    assert stats.prefix_cache_hit_rate == pytest.approx(8 / 21)
    assert stats.pool.shared == 2
    assert stats.fragmentation.slots_saved_by_sharing == 2 * 4


def test_the_last_prompt_token_is_always_computed():
    manager = make_manager()
    run_prompt(manager, "a", list(range(10)))
    assert manager.find_cached_prefix(list(range(8))).block_ids == (0,)
    assert manager.find_cached_prefix(list(range(9))).block_ids == (0, 1)
    assert manager.find_cached_prefix([0]).block_ids == ()
    assert manager.find_cached_prefix([]).block_ids == ()


def test_freed_blocks_stay_cached_and_a_hit_takes_them_from_the_middle_of_the_queue():
    manager = make_manager()
    run_prompt(manager, "a", list(range(10)))
    manager.free("a")
    assert manager.pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert manager.stats().pool.evictable == 2
    prefix = run_prompt(manager, "b", list(range(9)))
    assert prefix.block_ids == (0, 1)
    assert manager.block_table("b") == [0, 1, 3]
    assert manager.pool.free_block_ids() == [4, 5, 6, 7, 2]
    assert manager.stats().pool.evictable == 0


def test_eviction_order_is_least_recently_freed_first():
    manager = make_manager(num_blocks=4, block_size=2)
    run_prompt(manager, "a", [1, 2, 3, 4])
    manager.free("a")  # queue: 2 3 1 0
    run_prompt(manager, "b", [5, 6, 7, 8])
    manager.free("b")  # queue: 1 0 3 2
    assert manager.pool.free_block_ids() == [1, 0, 3, 2]
    manager.allocate_slots("c", 6, prefix=manager.find_cached_prefix([9] * 6))
    assert manager.block_table("c") == [1, 0, 3]
    assert manager.stats().pool.num_evictions == 3
    assert manager.find_cached_prefix([1, 2, 3, 4, 0]).block_ids == ()
    assert manager.find_cached_prefix([5, 6, 7, 8, 0]).block_ids == (2,)


def test_failed_allocation_after_a_partial_hit_changes_nothing():
    manager = make_manager(num_blocks=5)
    run_prompt(manager, "a", list(range(9)))  # blocks 0 1 2; 0 and 1 cached
    manager.free("a")
    run_prompt(manager, "b", [40] * 7)  # takes blocks 3 4
    prefix = manager.find_cached_prefix(list(range(8)) + [99] * 9)
    assert prefix.block_ids == (0, 1)
    assert manager.num_blocks_needed("c", 9, prefix) == 2 + 3
    assert not manager.can_append("c", 9, prefix=prefix)
    before = state(manager)
    assert manager.allocate_slots("c", 9, prefix=prefix) is None
    assert state(manager) == before and "c" not in manager
    assert manager.can_append("c", 4, prefix=prefix)


def test_hits_on_evictable_blocks_respect_the_reserve():
    manager = BlockManager(20, 4, reserved_fraction=0.1)  # 2 reserved
    run_prompt(manager, "a", list(range(9)))
    manager.free("a")
    manager.allocate_slots("filler", 4 * 17)  # free: 2 1 0, with 0 and 1 cached
    prefix = manager.find_cached_prefix(list(range(9)))
    assert prefix.block_ids == (0, 1)
    assert manager.num_blocks_needed("b", 1, prefix) == 3
    assert not manager.can_append("b", 1, prefix=prefix)
    assert manager.can_append("b", 1, high_priority=True, prefix=prefix)
    manager.free("filler")
    assert manager.can_append("b", 1, prefix=prefix)


def test_different_cache_salts_never_share():
    manager = make_manager()
    prompt = list(range(9))
    run_prompt(manager, "a", prompt, ("model", "tenant-a"))
    assert manager.find_cached_prefix(prompt, ("model", "tenant-b")).block_ids == ()
    assert manager.find_cached_prefix(prompt, ("model",)).block_ids == ()
    assert manager.find_cached_prefix(prompt, ("other-model", "tenant-a")).block_ids == ()
    assert manager.find_cached_prefix(prompt, ("model", "tenant-a")).block_ids == (0, 1)


def test_a_hit_compares_contents_not_just_digests():
    manager = make_manager()
    run_prompt(manager, "a", list(range(5)))
    real = manager.pool.block_key(0)
    forged = BlockKey(None, (9, 9, 9, 9), ())
    object.__setattr__(forged, "digest", real.digest)
    assert manager.pool.lookup(real) == 0
    assert manager.pool.lookup(forged) is None


def test_content_computed_twice_is_cached_once():
    manager = make_manager()
    for seq_id in ("a", "b"):  # both admitted before either commits: no hit
        manager.allocate_slots(seq_id, 5, prefix=manager.find_cached_prefix(list(range(5))))
    manager.commit_tokens("a", list(range(5)))
    manager.commit_tokens("b", list(range(5)))
    assert manager.pool.block_key(0) is not None and manager.pool.block_key(2) is None
    assert manager.find_cached_prefix(list(range(5))).block_ids == (0,)


def test_forks_cache_their_own_continuations():
    manager = make_manager()
    run_prompt(manager, "p", [1, 2, 3, 4, 5, 6])
    manager.fork("p", "c")
    for seq_id, tokens in (("p", [7, 8]), ("c", [70, 80])):
        manager.allocate_slots(seq_id, 2)
        manager.commit_tokens(seq_id, tokens)
    # The first writer copies the shared block; the other then owns it alone.
    assert manager.block_table("p") == [0, 2] and manager.block_table("c") == [0, 1]
    assert manager.find_cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]).block_ids == (0, 2)
    assert manager.find_cached_prefix([1, 2, 3, 4, 5, 6, 70, 80, 0]).block_ids == (0, 1)


def test_caching_off_never_hashes_or_hits():
    manager = make_manager(enable_prefix_caching=False)
    run_prompt(manager, "a", list(range(9)))
    assert manager.find_cached_prefix(list(range(9))).block_ids == ()
    stats = manager.stats()
    assert stats.pool.cached == 0 and stats.prefix_cache_queries == 0


def test_sequences_started_without_a_prefix_are_not_cached():
    manager = make_manager()
    manager.allocate_slots("a", 8)
    manager.commit_tokens("a", list(range(8)))
    assert manager.stats().pool.cached == 0


def test_misuse_is_rejected():
    manager = make_manager()
    run_prompt(manager, "a", list(range(5)))
    with pytest.raises(ValueError, match="reserved slots"):
        manager.commit_tokens("a", [5])
    prefix = manager.find_cached_prefix(list(range(5)))
    with pytest.raises(ValueError, match="exists"):
        manager.allocate_slots("a", 1, prefix=prefix)
    manager.free("a")
    manager.allocate_slots("filler", 8 * 4)  # evicts block 0
    with pytest.raises(ValueError, match="stale"):
        manager.allocate_slots("b", 1, prefix=prefix)


def test_fork_before_commit_caches_the_shared_block_once():
    manager = make_manager()
    manager.allocate_slots("p", 6, prefix=manager.find_cached_prefix([1, 2, 3, 4, 5, 6]))
    manager.fork("p", "c")  # slots reserved, K/V not yet committed
    manager.commit_tokens("p", [1, 2, 3, 4, 5, 6])
    manager.commit_tokens("c", [1, 2, 3, 4, 5, 6])
    assert manager.stats().pool.cached == 1
    assert manager.find_cached_prefix([1, 2, 3, 4, 0]).block_ids == (0,)
