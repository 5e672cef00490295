"""What the pool tells its listeners: the events, their order, the flags the dashboard
derives, vLLM-shaped block events, the block-table hit count and sampled lifetimes."""

from pagedllm.kv.block_events import parents_first
from pagedllm.kv.block_lifetimes import BlockLifetimes
from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.prefix_hash import BlockKey
from pagedllm.server.dashboard.recorder import WINDOW_RELEASED, PoolRecorder


class EventLog:
    """Every callback, in order, as (name, arguments)."""

    def __init__(self):
        self.events = []

    def blocks_taken(self, block_ids):
        self.events.append(("taken", list(block_ids)))

    def blocks_referenced(self, block_ids):
        self.events.append(("referenced", list(block_ids)))

    def blocks_released(self, block_ids, by_window):
        self.events.append(("released", list(block_ids), by_window))

    def block_stored(self, block_id, key):
        self.events.append(("stored", block_id, key.token_ids))

    def block_removed(self, block_id, key):
        self.events.append(("removed", block_id, key.token_ids))

    def cache_cleared(self, block_ids):
        self.events.append(("cleared", sorted(block_ids)))


def run_prompt(manager, seq_id, prompt):
    prefix = manager.find_cached_prefix(prompt)
    manager.allocate_slots(seq_id, len(prompt) - prefix.num_tokens, prefix=prefix)
    manager.commit_tokens(seq_id, prompt[prefix.num_tokens :])
    return prefix


def test_a_prompts_life_in_events_from_allocation_to_eviction():
    manager = BlockManager(3, 4, reserved_fraction=0.0)
    log = EventLog()
    manager.pool.add_listener(log)
    run_prompt(manager, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert log.events == [
        ("taken", [0, 1, 2]),
        ("stored", 0, (1, 2, 3, 4)),
        ("stored", 1, (5, 6, 7, 8)),
    ]
    log.events.clear()
    manager.fork("a", "b")
    manager.free("a")
    manager.free("b")
    assert log.events == [
        ("referenced", [0, 1, 2]),
        ("released", [2, 1, 0], False),
        ("released", [2, 1, 0], False),
    ]
    log.events.clear()
    assert run_prompt(manager, "c", [1, 2, 3, 4, 0, 0]).num_tokens == 4  # a hit on block 0
    manager.allocate_slots("d", 4)  # the free queue's head is block 1, cached: evicted
    assert log.events == [
        ("referenced", [0]),
        ("taken", [2]),
        ("removed", 1, (5, 6, 7, 8)),
        ("taken", [1]),
    ]


def test_eviction_is_told_before_the_block_is_taken_again():
    pool = BlockPool(2, 1, reserved_fraction=0.0)
    log = EventLog()
    pool.add_listener(log)
    (block,) = pool.allocate(1)
    pool.cache_block(block, BlockKey(None, (7,), ()))
    pool.free([block])
    pool.allocate(2)
    assert log.events == [
        ("taken", [0]),
        ("stored", 0, (7,)),
        ("released", [0], False),
        ("removed", 0, (7,)),
        ("taken", [1, 0]),
    ]


def test_a_pool_without_listeners_keeps_none_and_a_removed_listener_hears_nothing():
    pool = BlockPool(4, 1, reserved_fraction=0.0)
    log = EventLog()
    pool.add_listener(log)
    pool.remove_listener(log)
    pool.free(iter(pool.allocate(2)))  # iterators are consumed once, listener or not
    assert log.events == [] and pool.num_free == 4


def test_reset_prefix_cache_refuses_while_a_cached_block_is_held():
    manager = BlockManager(4, 2, reserved_fraction=0.0)
    log = EventLog()
    manager.pool.add_listener(log)
    run_prompt(manager, "a", [1, 2, 3, 4, 5])
    assert manager.pool.reset_prefix_cache() is False
    assert manager.pool.stats().cached == 2
    manager.free("a")
    log.events.clear()
    assert manager.pool.reset_prefix_cache() is True
    assert log.events == [("cleared", [0, 1])]
    stats = manager.pool.stats()
    assert stats.cached == 0 and stats.evictable == 0 and stats.free == 4
    assert manager.find_cached_prefix([1, 2, 3, 4, 5]).num_tokens == 0


def test_the_recorder_flags_blocks_a_sliding_window_released_until_they_are_taken():
    manager = BlockManager(8, 2, reserved_fraction=0.0, sliding_window=3)
    recorder = PoolRecorder(manager.pool, "CPU")
    manager.pool.add_listener(recorder)
    manager.allocate_slots("a", 4)
    manager.commit_tokens("a", [1, 2, 3, 4])
    manager.allocate_slots("a", 2)
    manager.commit_tokens("a", [5, 6])  # the next query (position 6) reads 4..6
    released = [b for b in range(8) if recorder.flags(b) == WINDOW_RELEASED]
    assert released == [0, 1]  # logical blocks 0 and 1, positions 0..3
    assert manager.block_table("a")[:2] == [manager.pool.null_block] * 2
    assert {0, 1} <= recorder.take_changed()
    manager.free("a")
    head = manager.pool.free_block_ids()[:2]
    manager.allocate_slots("b", 4)
    assert all(recorder.flags(b) == 0 for b in head)


def test_the_recorder_writes_vllm_shaped_events_only_when_asked():
    pool = BlockPool(4, 2, reserved_fraction=0.0)
    recorder = PoolRecorder(pool, "CPU")
    pool.add_listener(recorder)
    first, second = pool.allocate(2)
    root = BlockKey(None, (1, 2), ())
    pool.cache_block(first, root)
    assert recorder.take_kv_events() == []
    recorder.kv_events = True
    child = BlockKey(root.digest, (3, 4), ())
    pool.cache_block(second, child)
    pool.free([first, second])
    pool.allocate(4)
    assert recorder.take_kv_events() == [
        {
            "type": "BlockStored",
            "block_hashes": [child.digest.hex()],
            "parent_block_hash": root.digest.hex(),
            "token_ids": [3, 4],
            "block_size": 2,
            "lora_id": None,
            "medium": "CPU",
        },
        {"type": "BlockRemoved", "block_hashes": [root.digest.hex()], "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [child.digest.hex()], "medium": "CPU"},
    ]
    assert recorder.take_kv_events() == []


def test_parents_come_first_whatever_the_order_given():
    root = BlockKey(None, (1,), ())
    child = BlockKey(root.digest, (2,), ())
    grandchild = BlockKey(child.digest, (3,), ())
    orphan = BlockKey(b"\x01" * 32, (4,), ())  # its parent is not among the keys
    ordered = parents_first([grandchild, orphan, child, root])
    assert ordered.index(root) < ordered.index(child) < ordered.index(grandchild)
    assert sorted(ordered, key=id) == sorted([root, child, grandchild, orphan], key=id)


def test_the_reserve_is_the_free_queues_tail():
    pool = BlockPool(10, 1, reserved_fraction=0.2)
    assert pool.reserved_block_ids() == [9, 8]
    taken = pool.allocate(8)
    assert pool.reserved_block_ids() == [9, 8]
    pool.free([taken[0]])
    assert pool.reserved_block_ids() == [taken[0], 9]
    pool.allocate(1, high_priority=True)
    assert pool.reserved_block_ids() == [taken[0], 9][:2] and pool.num_free == 2


def test_block_table_hits_count_slots_found_in_blocks_the_table_held():
    manager = BlockManager(16, 4, reserved_fraction=0.0)
    run_prompt(manager, "a", list(range(10)))  # 3 new blocks: 10 misses
    stats = manager.stats()
    assert (stats.block_table_lookups, stats.block_table_hits) == (10, 0)
    for token in (10, 11, 12):  # 2 slots left in block 2, then a new block
        manager.allocate_slots("a", 1)
        manager.commit_tokens("a", [token])
    stats = manager.stats()
    assert (stats.block_table_lookups, stats.block_table_hits) == (13, 2)
    run_prompt(manager, "b", list(range(9)))  # 8 tokens from the cache, 1 new block
    stats = manager.stats()
    assert (stats.block_table_lookups, stats.block_table_hits) == (13 + 9, 2 + 8)
    assert manager.allocation_times().calls == 5


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_sampled_lifetimes_idle_times_and_reuse_gaps():
    manager = BlockManager(2, 2, reserved_fraction=0.0)
    clock = FakeClock()
    seen = {"lifetime": [], "idle": [], "reuse": []}
    lifetimes = BlockLifetimes(
        manager.pool,
        1.0,
        seen["lifetime"].append,
        seen["idle"].append,
        seen["reuse"].append,
        clock=clock,
        rng=lambda: 0.5,
    )
    manager.pool.add_listener(lifetimes)
    run_prompt(manager, "a", [1, 2, 3])  # t=0: blocks 0 (cached) and 1
    clock.now = 1.0
    manager.free("a")
    clock.now = 3.0
    run_prompt(manager, "b", [1, 2, 9])  # a hit on block 0: reused 2 s after its release
    clock.now = 4.0
    manager.free("b")
    clock.now = 10.0
    manager.allocate_slots("c", 4)  # takes both blocks: block 0 is evicted
    assert seen == {"lifetime": [10.0], "idle": [6.0], "reuse": [2.0]}


def test_unsampled_blocks_report_nothing():
    manager = BlockManager(2, 2, reserved_fraction=0.0)
    seen = []
    observe = seen.append
    lifetimes = BlockLifetimes(manager.pool, 0.01, observe, observe, observe, rng=lambda: 0.5)
    manager.pool.add_listener(lifetimes)
    run_prompt(manager, "a", [1, 2, 3])
    manager.free("a")
    manager.allocate_slots("b", 4)
    assert seen == []
