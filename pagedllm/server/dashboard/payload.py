"""The dashboard feed's messages, built from the engine's own state in the engine loop
thread (docs/dashboard.md describes every field).

Blocks travel as ``[block_id, ref_count, key_prefix, flags]``: ``key_prefix`` is the
first :data:`KEY_PREFIX_CHARS` hex characters of the block's content key (None when it
is not cached); ``flags`` are :mod:`~pagedllm.server.dashboard.recorder`'s bits.
Only a snapshot visits every block (once per page connecting); a delta visits the
blocks that changed, the live block tables and the reserve.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import TokenSequence
from pagedllm.engine.stats import EngineStats
from pagedllm.kv.block_pool import BlockPool
from pagedllm.server.dashboard.recorder import PoolRecorder

KEY_PREFIX_CHARS = 16
MAX_LISTED_SEQUENCES = 256
"""Sequences listed with their tables in one message; the rest are only counted."""


def block_state(pool: BlockPool, recorder: PoolRecorder, block_id: int) -> list:
    key = pool.block_key(block_id)
    key_prefix = None if key is None else key.digest.hex()[:KEY_PREFIX_CHARS]
    return [block_id, pool.ref_count(block_id), key_prefix, recorder.flags(block_id)]


def all_blocks(pool: BlockPool, recorder: PoolRecorder) -> list[list]:
    """Every block that is not plain free (referenced, cached or flagged); O(pool)."""
    states = (block_state(pool, recorder, block_id) for block_id in range(pool.num_blocks))
    return [state for state in states if state[1] or state[2] is not None or state[3]]


def changed_blocks(pool: BlockPool, recorder: PoolRecorder, block_ids: Iterable[int]) -> list:
    return [block_state(pool, recorder, block_id) for block_id in sorted(block_ids)]


def _sequence(seq: TokenSequence, scheduler: Scheduler) -> dict:
    manager = scheduler.block_manager
    null = manager.pool.null_block
    table = manager.block_table(seq.seq_id) if seq.seq_id in manager else []
    return {
        "request_id": seq.request_id,
        "seq_id": str(seq.seq_id),
        "status": seq.status.value,
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_tokens": seq.num_tokens,
        "num_computed_tokens": seq.num_computed_tokens,
        "block_table": [-1 if block_id == null else block_id for block_id in table],
        "swap_block_ids": list(seq.swap_block_ids),
    }


def sequences(scheduler: Scheduler) -> tuple[list[dict], int]:
    """The first :data:`MAX_LISTED_SEQUENCES` live sequences (running, then swapped,
    then waiting) with their block tables, and how many more there are."""
    live = [*scheduler.running, *scheduler.swapped, *scheduler.waiting]
    listed = live[:MAX_LISTED_SEQUENCES]
    return [_sequence(seq, scheduler) for seq in listed], len(live) - len(listed)


def swap_view(scheduler: Scheduler) -> dict | None:
    """The swap space's size and the slots swapped sequences hold; None without one."""
    if scheduler.swap_space is None:
        return None
    used = [slot for seq in scheduler.swapped for slot in seq.swap_block_ids]
    return {"num_blocks": scheduler.swap_space.pool.num_blocks, "used": sorted(used)}


def stats_view(stats: EngineStats, block_size: int, slowest_allocation_s: float) -> dict:
    """Gauges and cumulative counters; the page turns counters into rates.
    ``allocated_slots``: the token slots of the blocks in use."""
    return {
        "kv_cache_usage": stats.kv_cache_usage,
        "num_blocks_used": stats.num_blocks_used,
        "num_blocks_free": stats.num_blocks_free,
        "num_blocks_shared": stats.num_blocks_shared,
        "num_blocks_cached": stats.num_blocks_cached,
        "num_blocks_evictable": stats.num_blocks_evictable,
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "block_table_lookups": stats.block_table_lookups,
        "block_table_hits": stats.block_table_hits,
        "preemptions_recompute": stats.num_preemptions_total - stats.num_preemptions_swap,
        "preemptions_swap": stats.num_preemptions_swap,
        "internal_fragmentation_slots": stats.internal_fragmentation_slots,
        "allocated_slots": stats.num_blocks_used * block_size,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_swapped": stats.num_swapped,
        "prompt_tokens_total": stats.prompt_tokens_total,
        "generation_tokens_total": stats.generation_tokens_total,
        "allocation_calls": stats.allocation.calls,
        "allocation_seconds_total": stats.allocation.seconds,
        "allocation_seconds_max": slowest_allocation_s,
    }
