"""Engine figures after each step, and the periodic log line built from them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from pagedllm.engine.scheduler import ReadAheadStats, Scheduler
from pagedllm.kv.block_manager import AllocationTimes
from pagedllm.kv_storage.swap_space import SwapStats
from pagedllm.kv_tiers.tiered_cache import TierStats
from pagedllm.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger("pagedllm")


@dataclass
class StepTimes:
    """Cumulative seconds spent in each part of ``LLMEngine.step``."""

    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    postprocess: float = 0.0
    steps: int = 0

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.postprocess

    @property
    def overhead_fraction(self) -> float:
        """Share of step time outside the model forward pass."""
        return 0.0 if self.total == 0 else 1.0 - self.forward / self.total


@dataclass
class TokenCounters:
    """The engine's own counts: tokens since start-up, and figures of the steps.

    ``prompt_tokens_total``: vLLM's, each request's whole prompt once, when its first
    token comes; ``generation_tokens_total``: tokens recorded in outputs;
    ``last_batched_tokens``: the last step's; ``max_concurrent_seqs``: the most
    sequences one step ran."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    last_batched_tokens: int = 0
    max_concurrent_seqs: int = 0


@dataclass
class EngineStats:
    """A snapshot. Blocks are KV pool blocks; tokens are counted since start-up.

    ``prefix_cache_queries``/``hits``: prompt tokens looked up in / found in the prefix
    cache (vLLM's counters); ``num_blocks_shared``: blocks held by more than one sequence;
    ``num_blocks_evictable``: cached blocks nobody holds (counted in ``num_blocks_free``);
    ``block_table_lookups``/``hits``: token slots, as
    :class:`~pagedllm.kv.block_manager.BlockManagerStats` counts them;
    ``num_preemptions_swap``: the preemptions (of ``num_preemptions_total``) that
    swapped, the rest recomputed.
    """

    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    num_preemptions_total: int
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_free: int
    num_blocks_reserved: int
    peak_blocks_used: int
    kv_cache_usage: float
    internal_fragmentation_slots: int
    slots_saved_by_sharing: int
    num_blocks_shared: int
    num_blocks_cached: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_batched_tokens: int
    max_concurrent_seqs: int
    step_times: StepTimes = field(default_factory=StepTimes)
    num_blocks_evictable: int = 0
    block_table_lookups: int = 0
    block_table_hits: int = 0
    allocation: AllocationTimes = AllocationTimes(0, 0.0)
    num_preemptions_swap: int = 0
    num_swapped: int = 0
    swap: SwapStats | None = None
    spec_decode: SpecDecodeStats | None = None
    tiers: TierStats | None = None  # the prefix cache's lower tiers, when configured
    read_ahead: ReadAheadStats | None = None  # swapped sequences' read-ahead, when on

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


def gather_stats(
    scheduler: Scheduler,
    counters: TokenCounters,
    step_times: StepTimes,
    swap: SwapStats | None,
    spec_decode: SpecDecodeStats | None,
) -> EngineStats:
    """A snapshot of the scheduler's queues and pool with the engine's counters."""
    bm = scheduler.block_manager.stats()
    pool = bm.pool
    return EngineStats(
        # requests, as vLLM counts them (an n > 1 request runs several sequences)
        num_running=len({seq.request_id for seq in scheduler.running}),
        num_waiting=len({seq.request_id for seq in scheduler.waiting}),
        num_preempted_waiting=scheduler.num_preempted_waiting,
        num_preemptions_total=scheduler.num_preemptions,
        num_blocks_total=pool.num_blocks,
        num_blocks_used=pool.used,
        num_blocks_free=pool.free,
        num_blocks_reserved=pool.reserved,
        peak_blocks_used=pool.peak_used,
        kv_cache_usage=pool.usage,
        internal_fragmentation_slots=bm.fragmentation.internal_fragmentation_slots,
        slots_saved_by_sharing=bm.fragmentation.slots_saved_by_sharing,
        num_blocks_shared=pool.shared,
        num_blocks_cached=pool.cached,
        prefix_cache_queries=bm.prefix_cache_queries,
        prefix_cache_hits=bm.prefix_cache_hits,
        prompt_tokens_total=counters.prompt_tokens_total,
        generation_tokens_total=counters.generation_tokens_total,
        num_batched_tokens=counters.last_batched_tokens,
        max_concurrent_seqs=counters.max_concurrent_seqs,
        step_times=step_times,
        num_blocks_evictable=pool.evictable,
        block_table_lookups=bm.block_table_lookups,
        block_table_hits=bm.block_table_hits,
        allocation=scheduler.block_manager.allocation_times(),
        num_preemptions_swap=0 if swap is None else swap.swap_outs,
        num_swapped=len(scheduler.swapped),
        swap=swap,
        spec_decode=spec_decode,
        tiers=None if scheduler.tiers is None else scheduler.tiers.stats(),
        read_ahead=replace(scheduler.read_ahead_stats) if scheduler.read_ahead else None,
    )


class StatsLogger:
    """Logs throughput and pool state at most once every ``interval`` seconds."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._last_time = time.monotonic()
        self._last_prompt = 0
        self._last_generation = 0
        self._last_spec: SpecDecodeStats | None = None

    def due(self) -> bool:
        """Whether a line is due: build the stats snapshot only then."""
        return self.interval > 0 and time.monotonic() - self._last_time >= self.interval

    def log(self, stats: EngineStats) -> None:
        now = time.monotonic()
        elapsed = now - self._last_time
        prompt_rate = (stats.prompt_tokens_total - self._last_prompt) / elapsed
        generation_rate = (stats.generation_tokens_total - self._last_generation) / elapsed
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, Preempted: %d (total %d), "
            "KV cache usage: %.1f%% (%d/%d blocks), Internal fragmentation: %d slots, "
            "Shared blocks: %d, Prefix cache hit rate: %.1f%%",
            prompt_rate,
            generation_rate,
            stats.num_running,
            stats.num_waiting,
            stats.num_preempted_waiting,
            stats.num_preemptions_total,
            100.0 * stats.kv_cache_usage,
            stats.num_blocks_used,
            stats.num_blocks_total,
            stats.internal_fragmentation_slots,
            stats.num_blocks_shared,
            100.0 * stats.prefix_cache_hit_rate,
        )
        if stats.spec_decode is not None:
            self._log_spec_decode(stats.spec_decode, elapsed)
        if stats.tiers is not None:
            _log_tiers(stats.tiers)
        self._last_time = now
        self._last_prompt = stats.prompt_tokens_total
        self._last_generation = stats.generation_tokens_total

    def _log_spec_decode(self, spec: SpecDecodeStats, elapsed: float) -> None:
        """vLLM's speculative decoding line, over the interval since the last one."""
        last = self._last_spec or SpecDecodeStats(spec.max_tokens)
        drafts = spec.num_drafts - last.num_drafts
        drafted = spec.num_draft_tokens - last.num_draft_tokens
        accepted = spec.num_accepted_tokens - last.num_accepted_tokens
        per_position = [
            (now - before) / drafts if drafts else 0.0
            for now, before in zip(
                spec.accepted_per_position, last.accepted_per_position, strict=True
            )
        ]
        logger.info(
            "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: "
            "%.2f tokens/s, Drafted throughput: %.2f tokens/s, Accepted: %d tokens, "
            "Drafted: %d tokens, Per-position acceptance rate: %s, Avg Draft acceptance "
            "rate: %.1f%%",
            1.0 + (accepted / drafts if drafts else 0.0),
            accepted / elapsed,
            drafted / elapsed,
            accepted,
            drafted,
            ", ".join(f"{rate:.3f}" for rate in per_position),
            100.0 * accepted / drafted if drafted else 0.0,
        )
        self._last_spec = spec


def _log_tiers(tiers: TierStats) -> None:
    """The lower tiers' line: what each holds and has restored since start-up."""
    mean_lead = tiers.prefetch_lead_s / tiers.disk_hits if tiers.disk_hits else 0.0
    mean_wait = tiers.prefetch_wait_s / tiers.requests_waited if tiers.requests_waited else 0.0
    logger.info(
        "KV tiers: host %d/%d blocks, disk %d/%d blocks; restored %d blocks from host, %d "
        "from disk; spilled %d, demoted %d; loads ready %.3f s before use, requests waited "
        "%.3f s for them (means)",
        tiers.host_blocks,
        tiers.host_slots,
        tiers.disk_entries,
        tiers.disk_capacity_entries,
        tiers.host_hits,
        tiers.disk_hits,
        tiers.spilled_blocks,
        tiers.demoted_blocks,
        mean_lead,
        mean_wait,
    )
