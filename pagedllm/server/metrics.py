"""Prometheus collectors for ``GET /metrics``, with vLLM's names where vLLM has one.

Each app gets its own ``CollectorRegistry``, so several servers can live in one
process (tests). Every collector carries a ``model_name`` label, as vLLM's do.
Gauges and token counters follow ``EngineStats`` after each step; per-request
histograms are fed by the loop thread as outputs arrive. All times in seconds.

Meanings:
- ``vllm:kv_cache_usage_perc``: fraction (0..1) of KV pool blocks in use.
- ``vllm:num_requests_waiting`` counts sequences waiting for blocks, including
  preempted ones; ``pagedllm:num_requests_preempted`` counts only the preempted.
- ``vllm:prefix_cache_queries``/``vllm:prefix_cache_hits``: prompt tokens looked up in
  and found in the prefix cache.
- ``pagedllm:kv_internal_fragmentation_slots``: allocated but unwritten slots in the
  last blocks of live sequences.
- ``vllm:time_per_output_token_seconds``: each interval between two steps that gave
  a request new tokens (inter-token latency; a step adds at most one token per
  sequence).
- ``vllm:spec_decode_num_drafts``, ``..._num_draft_tokens``, ``..._num_accepted_tokens``
  and ``..._num_accepted_tokens_per_pos`` (label ``position``, 0-based): speculative
  decoding's verified guesses (:mod:`pagedllm.spec_decode.stats`), when it is on.
- ``pagedllm:kv_blocks_shared``/``_cached``/``_evictable``: blocks held by more than one
  sequence / findable in the prefix cache / cached and held by nobody (counted free).
- ``pagedllm:kv_block_table_lookups``/``_hits``: token slots reserved or supplied by a
  prefix hit, and those whose block was in the sequence's table already (the
  block-table hit rate is their ratio; docs/dashboard.md).
- ``pagedllm:kv_allocations``/``pagedllm:kv_allocation_seconds``: calls of the block
  manager's slot allocation and the seconds they took (mean latency = their ratio).
- ``pagedllm:num_preemptions_by_mode`` (label ``mode``: ``recompute``, ``swap``).
- ``vllm:kv_block_lifetime_seconds``, ``vllm:kv_block_idle_before_evict_seconds``,
  ``vllm:kv_block_reuse_gap_seconds``: sampled block lifetimes
  (:mod:`pagedllm.kv.block_lifetimes`), only with ``--kv-cache-metrics``.
- ``pagedllm:kv_tier_blocks`` (label ``tier``: ``host``, ``disk``): blocks the prefix
  cache's lower tiers hold; ``pagedllm:kv_tier_hits`` (same label): blocks restored
  into the pool from each; ``pagedllm:kv_tier_bytes`` (label ``move``: ``spill``,
  ``fill``, ``demote``, ``load``): bytes moved; ``pagedllm:kv_tier_prefetch_lead_seconds``
  / ``pagedllm:kv_tier_prefetch_wait_seconds``: summed over loaded blocks, how long each
  was ready before a request used it, and over requests that asked for loads, how long
  they waited for them (means: divide by the disk hits and
  ``pagedllm:kv_tier_requests_waited``). Only with ``kv_tier_memory`` or ``kv_cache_dir``.
- ``pagedllm:swap_read_ahead_blocks`` (label ``outcome``: ``copied``, ``used``): parked
  blocks copied back ahead of their sequence's swap-in, and those the swap-in found
  in place; ``pagedllm:swap_read_ahead_resumes``: swap-ins that had blocks read ahead;
  ``pagedllm:swap_read_ahead_lead_seconds``: summed over them, from the first
  read-ahead to the swap-in; ``pagedllm:swap_read_ahead_wait_seconds``: steps' waits
  for a read-ahead copy still running (0 when each ended within its step). Only with
  swap preemption and ``swap_read_ahead``.
- ``pagedllm:num_requests_failed``: requests the engine failed alone (an error inside
  the step for that request); ``pagedllm:engine_step_failures``: steps that raised for
  no single request and so failed every request in flight. Both stay 0 in health.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.scheduler import ReadAheadStats
from pagedllm.engine.stats import EngineStats
from pagedllm.kv.block_lifetimes import BlockLifetimes
from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv_storage.swap_space import SwapStats
from pagedllm.kv_tiers.tiered_cache import TierStats

LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
"""Histogram bucket bounds in seconds: from a fast decode step to a long CPU request."""

BLOCK_LIFETIME_BUCKETS = (
    0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
    1800.0, 3600.0, 7200.0,
)  # fmt: skip
"""Bounds in seconds for block lifetimes: from a block evicted at once to hours."""


class ServerMetrics:
    """The server's collectors and the bookkeeping that feeds them.

    ``request_*`` and ``record_step`` are called only by the engine loop thread;
    prometheus-client makes reading them from the HTTP thread safe.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, label, buckets=LATENCY_BUCKETS, registry=self.registry
            ).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Sequences running on the engine.")
        self.waiting = gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.")
        self.preempted = gauge(
            "pagedllm:num_requests_preempted", "Preempted sequences waiting to be resumed."
        )
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.")
        self.blocks_used = gauge("pagedllm:kv_blocks_used", "KV cache blocks in use.")
        self.blocks_free = gauge("pagedllm:kv_blocks_free", "KV cache blocks free.")
        self.blocks_total = gauge("pagedllm:kv_blocks_total", "KV cache blocks in the pool.")
        self.fragmentation = gauge(
            "pagedllm:kv_internal_fragmentation_slots", "Allocated, unwritten KV slots."
        )
        self.blocks_shared = gauge(
            "pagedllm:kv_blocks_shared", "KV cache blocks held by more than one sequence."
        )
        self.blocks_cached = gauge(
            "pagedllm:kv_blocks_cached", "KV cache blocks in the prefix cache."
        )
        self.blocks_evictable = gauge(
            "pagedllm:kv_blocks_evictable", "Cached KV blocks nobody holds (counted free)."
        )
        self.swapped = gauge("pagedllm:num_requests_swapped", "Sequences swapped out.")
        self.table_lookups = counter(
            "pagedllm:kv_block_table_lookups", "Token slots looked up through block tables."
        )
        self.table_hits = counter(
            "pagedllm:kv_block_table_hits", "Token slots found in a block the table held."
        )
        self.allocations = counter("pagedllm:kv_allocations", "Slot allocations of the KV pool.")
        self.allocation_seconds = counter(
            "pagedllm:kv_allocation_seconds", "Seconds spent in slot allocations."
        )
        self._preemptions_by_mode = Counter(
            "pagedllm:num_preemptions_by_mode",
            "Preemptions since start-up, by what was done with the blocks.",
            ["model_name", "mode"],
            registry=self.registry,
        )
        self.preemptions = counter("vllm:num_preemptions", "Preemptions since start-up.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.aborted = counter(
            "pagedllm:num_requests_aborted", "Requests aborted (client gone or shutdown)."
        )
        self.failed = counter(
            "pagedllm:num_requests_failed", "Requests the engine failed alone, by an error."
        )
        self.step_failures = counter(
            "pagedllm:engine_step_failures", "Engine steps that failed every request in flight."
        )
        self._success = Counter(
            "vllm:request_success",
            "Requests finished, by the finish reason of their first sequence.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        self.spec_drafts = counter(
            "vllm:spec_decode_num_drafts", "Sequences' guesses verified (one per step each)."
        )
        self.spec_draft_tokens = counter(
            "vllm:spec_decode_num_draft_tokens", "Guessed tokens verified."
        )
        self.spec_accepted_tokens = counter(
            "vllm:spec_decode_num_accepted_tokens", "Guessed tokens the model kept."
        )
        self._spec_per_position = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Guessed tokens kept, by their position in the guess (0-based).",
            ["model_name", "position"],
            registry=self.registry,
        )
        self._last_spec_per_position: list[int] = []
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token.")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Inter-token latency.")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.")
        self._last_totals = dict.fromkeys(
            (
                "preemptions",
                "prompt",
                "generation",
                "prefix_queries",
                "prefix_hits",
                "spec_drafts",
                "spec_draft_tokens",
                "spec_accepted_tokens",
                "table_lookups",
                "table_hits",
                "allocations",
                "preemptions_recompute",
                "preemptions_swap",
            ),
            0,
        )
        self._last_allocation_seconds = 0.0
        self._last_token_time: dict[str, float | None] = {}
        self._tiers: _TierCollectors | None = None
        self._read_ahead: _ReadAheadCollectors | None = None

    def _tier_collectors(self) -> _TierCollectors:
        if self._tiers is None:
            self._tiers = _TierCollectors(self.registry, self._model_name)
        return self._tiers

    def record_step(self, stats: EngineStats) -> None:
        """Follow the engine's gauges and cumulative counters."""
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.preempted.set(stats.num_preempted_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.blocks_used.set(stats.num_blocks_used)
        self.blocks_free.set(stats.num_blocks_free)
        self.blocks_total.set(stats.num_blocks_total)
        self.fragmentation.set(stats.internal_fragmentation_slots)
        self.blocks_shared.set(stats.num_blocks_shared)
        self.blocks_cached.set(stats.num_blocks_cached)
        self.blocks_evictable.set(stats.num_blocks_evictable)
        self.swapped.set(stats.num_swapped)
        self._advance(self.table_lookups, "table_lookups", stats.block_table_lookups)
        self._advance(self.table_hits, "table_hits", stats.block_table_hits)
        self._advance(self.allocations, "allocations", stats.allocation.calls)
        self.allocation_seconds.inc(
            max(0.0, stats.allocation.seconds - self._last_allocation_seconds)
        )
        self._last_allocation_seconds = stats.allocation.seconds
        swaps = stats.num_preemptions_swap
        for mode, total in (
            ("recompute", stats.num_preemptions_total - swaps),
            ("swap", swaps),
        ):
            by_mode = self._preemptions_by_mode.labels(self._model_name, mode)
            self._advance(by_mode, f"preemptions_{mode}", total)
        self._advance(self.prefix_queries, "prefix_queries", stats.prefix_cache_queries)
        self._advance(self.prefix_hits, "prefix_hits", stats.prefix_cache_hits)
        self._advance(self.preemptions, "preemptions", stats.num_preemptions_total)
        self._advance(self.prompt_tokens, "prompt", stats.prompt_tokens_total)
        self._advance(self.generation_tokens, "generation", stats.generation_tokens_total)
        if stats.tiers is not None:
            self._tier_collectors().record(stats.tiers)
        if stats.read_ahead is not None and stats.swap is not None:
            if self._read_ahead is None:
                self._read_ahead = _ReadAheadCollectors(self.registry, self._model_name)
            self._read_ahead.record(stats.read_ahead, stats.swap)
        spec = stats.spec_decode
        if spec is not None:
            self._advance(self.spec_drafts, "spec_drafts", spec.num_drafts)
            self._advance(self.spec_draft_tokens, "spec_draft_tokens", spec.num_draft_tokens)
            self._advance(
                self.spec_accepted_tokens, "spec_accepted_tokens", spec.num_accepted_tokens
            )
            last = self._last_spec_per_position or [0] * len(spec.accepted_per_position)
            for position, (total, before) in enumerate(
                zip(spec.accepted_per_position, last, strict=True)
            ):
                self._spec_per_position.labels(self._model_name, str(position)).inc(total - before)
            self._last_spec_per_position = list(spec.accepted_per_position)

    def follow_block_lifetimes(self, pool: BlockPool, sample_rate: float) -> None:
        """Add vLLM's sampled block-lifetime histograms, fed by a listener on ``pool``
        (call before the engine loop starts)."""

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, ["model_name"], buckets=BLOCK_LIFETIME_BUCKETS, registry=self.registry
            ).labels(self._model_name)

        lifetime = histogram(
            "vllm:kv_block_lifetime_seconds", "Sampled KV block lifetime, allocation to eviction."
        )
        idle = histogram(
            "vllm:kv_block_idle_before_evict_seconds",
            "Sampled idle time of a KV block, last access to eviction.",
        )
        reuse = histogram(
            "vllm:kv_block_reuse_gap_seconds", "Sampled time between accesses of a cached block."
        )
        pool.add_listener(
            BlockLifetimes(pool, sample_rate, lifetime.observe, idle.observe, reuse.observe)
        )

    def _advance(self, counter: Counter, key: str, total: int) -> None:
        counter.inc(max(0, total - self._last_totals[key]))
        self._last_totals[key] = total

    def request_added(self, request_id: str) -> None:
        self._last_token_time[request_id] = None

    def request_progressed(self, output: RequestOutput, now: float) -> None:
        """Observe latencies for a request that got tokens or finished at ``now``."""
        request_id = output.request_id
        new_tokens = any(o.delta_token_ids for o in output.outputs)
        previous = self._last_token_time.get(request_id)
        if new_tokens:
            if previous is None:
                ttft = output.metrics.time_to_first_token
                if ttft is not None:
                    self.ttft.observe(ttft)
            else:
                self.tpot.observe(now - previous)
            self._last_token_time[request_id] = now
        if output.finished:
            self._last_token_time.pop(request_id, None)
            latency = output.metrics.e2e_latency
            if latency is not None:
                self.e2e.observe(latency)
            reason = output.outputs[0].finish_reason or "abort"
            self._success.labels(self._model_name, reason).inc()

    def request_aborted(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.aborted.inc()

    def request_failed(self, request_id: str) -> None:
        self._last_token_time.pop(request_id, None)
        self.failed.inc()

    def step_failed(self) -> None:
        self.step_failures.inc()


class _TierCollectors:
    """The lower tiers' collectors (made on the first step that has tiers)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def labelled(kind: type, name: str, doc: str, label: str) -> Counter | Gauge:
            return kind(name, doc, ["model_name", label], registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        self._model_name = model_name
        self.blocks = labelled(
            Gauge, "pagedllm:kv_tier_blocks", "Blocks a lower tier holds.", "tier"
        )
        self.hits = labelled(
            Counter, "pagedllm:kv_tier_hits", "Blocks restored into the pool, by tier.", "tier"
        )
        self.bytes = labelled(
            Counter, "pagedllm:kv_tier_bytes", "Bytes moved between pool and tiers.", "move"
        )
        self.lead = counter(
            "pagedllm:kv_tier_prefetch_lead_seconds",
            "Seconds loaded blocks were ready before a request used them (summed).",
        )
        self.wait = counter(
            "pagedllm:kv_tier_prefetch_wait_seconds",
            "Seconds requests waited in the queue for their loads (summed).",
        )
        self.waited = counter(
            "pagedllm:kv_tier_requests_waited", "Requests that asked for loads from disk."
        )
        self._last: dict[str, float] = {}

    def record(self, tiers: TierStats) -> None:
        name = self._model_name
        self.blocks.labels(name, "host").set(tiers.host_blocks)
        self.blocks.labels(name, "disk").set(tiers.disk_entries)
        totals = {
            ("hits", "host"): tiers.host_hits,
            ("hits", "disk"): tiers.disk_hits,
            ("bytes", "spill"): tiers.bytes_spilled,
            ("bytes", "fill"): tiers.bytes_filled,
            ("bytes", "demote"): tiers.bytes_demoted,
            ("bytes", "load"): tiers.bytes_loaded,
        }
        for (kind, label), total in totals.items():
            self._inc(getattr(self, kind).labels(name, label), f"{kind}.{label}", total)
        self._inc(self.lead, "lead", tiers.prefetch_lead_s)
        self._inc(self.wait, "wait", tiers.prefetch_wait_s)
        self._inc(self.waited, "waited", tiers.requests_waited)

    def _inc(self, counter: Counter, key: str, total: float) -> None:
        counter.inc(max(0.0, total - self._last.get(key, 0)))
        self._last[key] = total


class _ReadAheadCollectors:
    """The swap read-ahead's counters (made on the first step that reads ahead)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        blocks = Counter(
            "pagedllm:swap_read_ahead_blocks",
            "Parked blocks copied back ahead of their swap-in, and those it used.",
            ["model_name", "outcome"],
            registry=registry,
        )
        self._counters = {
            "copied": blocks.labels(model_name, "copied"),
            "used": blocks.labels(model_name, "used"),
            "resumes": counter(
                "pagedllm:swap_read_ahead_resumes", "Swap-ins that had blocks read ahead."
            ),
            "lead": counter(
                "pagedllm:swap_read_ahead_lead_seconds",
                "Seconds from a sequence's first read-ahead to its swap-in (summed).",
            ),
            "wait": counter(
                "pagedllm:swap_read_ahead_wait_seconds",
                "Seconds steps waited for a read-ahead copy to end (summed).",
            ),
        }
        self._last: dict[str, float] = {}

    def record(self, read_ahead: ReadAheadStats, swap: SwapStats) -> None:
        totals = {
            "copied": read_ahead.blocks,
            "used": read_ahead.used_blocks,
            "resumes": read_ahead.resumes,
            "lead": read_ahead.lead_seconds,
            "wait": swap.read_ahead_wait_seconds,
        }
        for key, total in totals.items():
            self._counters[key].inc(max(0.0, total - self._last.get(key, 0)))
            self._last[key] = total
