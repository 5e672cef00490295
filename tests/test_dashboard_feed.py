"""The engine side of the dashboard feed, in process: the pool has a listener only
while someone watches, a page joining gets a snapshot first, deltas carry exactly the
blocks that changed and never come faster than the interval, and an idle loop is told
how long it may wait before a pending change is due."""

import time

import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm import LLM, SamplingParams
from pagedllm.server.dashboard.feed import PoolFeed


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory="1MiB", block_size=4)
    return llm.llm_engine


def test_the_pool_is_followed_only_while_watched_and_deltas_name_the_changes(engine):
    pool = engine.block_manager.pool
    sent = []
    feed = PoolFeed(engine, "tiny", lambda kind, message: sent.append((kind, message)), 0.05)
    assert pool._listeners == ()
    feed.after_pass(True)
    assert sent == [] and feed.wait_timeout() is None  # nobody watches: nothing built
    feed.watch(1, 0, snapshot=True, kv_snapshot=False)
    assert len(pool._listeners) == 1
    feed.after_pass(False)
    (kind, snapshot), = sent
    assert kind == "snapshot" and snapshot["pool"]["num_blocks"] == pool.num_blocks
    engine.add_request("a", {"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=2))
    engine.step()
    feed.after_pass(True)
    assert len(sent) == 1  # not due yet: the interval has not passed
    assert 0 < feed.wait_timeout() <= 0.05
    time.sleep(0.06)
    feed.after_pass(False)
    kind, delta = sent[-1]
    assert kind == "delta"
    held = engine.block_manager.held_block_ids(engine.scheduler.running[0].seq_id)
    assert sorted(block_id for block_id, *_ in delta["blocks"]) == sorted(held)
    assert all(ref == 1 for _, ref, _, _ in delta["blocks"])
    assert delta["requests"][0]["block_table"] == held
    while engine.has_unfinished_requests():
        engine.step()
    time.sleep(0.06)
    feed.after_pass(True)
    kind, delta = sent[-1]
    assert delta["requests"] == [] and all(ref == 0 for _, ref, _, _ in delta["blocks"])
    assert feed.wait_timeout() is None  # nothing pending
    feed.watch(0, 0, snapshot=False, kv_snapshot=False)
    assert pool._listeners == ()


def test_a_kv_events_client_gets_the_cached_blocks_parents_first(engine):
    sent = []
    feed = PoolFeed(engine, "tiny", lambda kind, message: sent.append((kind, message)))
    engine.add_request("b", {"prompt_token_ids": list(range(40, 60))}, SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    feed.watch(0, 1, snapshot=False, kv_snapshot=True)
    (kind, batch), = sent
    assert kind == "kv_snapshot"
    seen = set()
    for event in batch["events"]:
        assert event["parent_block_hash"] is None or event["parent_block_hash"] in seen
        seen.add(event["block_hashes"][0])
    assert len(seen) == engine.block_manager.pool.stats().cached
    feed.watch(0, 0, snapshot=False, kv_snapshot=False)


def test_a_failing_call_in_the_engine_loop_reaches_its_caller_not_the_loop(engine):
    """The feed's and the reset's work runs in the loop thread through
    ``AsyncEngine.call``; an error there is the caller's, and the loop serves on."""
    import asyncio

    from pagedllm.server.async_engine import AsyncEngine
    from pagedllm.server.metrics import ServerMetrics

    async def scenario():
        loop = AsyncEngine(engine, ServerMetrics("tiny"), max_pending_requests=8)
        loop.start()
        try:
            with pytest.raises(ZeroDivisionError):
                await loop.call_and_wait(lambda: 1 / 0)
            assert loop.is_running
            assert await loop.call_and_wait(lambda: 42) == 42
        finally:
            await loop.stop()

    asyncio.run(scenario())
