"""Sampled block lifetimes: how long cached blocks live, rest and wait to be reused.

A :class:`BlockLifetimes` listens to a pool (:mod:`pagedllm.kv.block_events`) and
follows a random sample of the blocks allocated (``sample_rate`` of them, chosen at
allocation), reporting three durations in seconds, as vLLM's ``--kv-cache-metrics`` do:

- lifetime: from the block's allocation to its eviction from the prefix cache;
- idle before eviction: from its last access to its eviction;
- reuse gap: between two accesses of a cached block.

An access is the block's allocation, or a reference taken or dropped while it holds a
content key (a prefix-cache hit, a fork, a sequence finishing with it). A block that
is freed without ever being cached and is allocated again simply starts a new life;
only evicted blocks report a lifetime.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.prefix_hash import BlockKey

Observe = Callable[[float], None]


class BlockLifetimes:
    """Follows sampled blocks of ``pool``; call ``observe_*`` with seconds."""

    def __init__(
        self,
        pool: BlockPool,
        sample_rate: float,
        observe_lifetime: Observe,
        observe_idle: Observe,
        observe_reuse_gap: Observe,
        clock: Callable[[], float] = time.monotonic,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if not 0.0 < sample_rate <= 1.0:
            raise ValueError(f"the block sample rate must be in (0, 1], got {sample_rate}")
        self._pool = pool
        self._sample_rate = sample_rate
        self._observe_lifetime = observe_lifetime
        self._observe_idle = observe_idle
        self._observe_reuse_gap = observe_reuse_gap
        self._clock = clock
        self._rng = rng
        self._born: dict[int, float] = {}  # sampled block -> allocation time
        self._last_access: dict[int, float] = {}

    def blocks_taken(self, block_ids: Sequence[int]) -> None:
        now = self._clock()
        for block_id in block_ids:
            if self._rng() < self._sample_rate:
                self._born[block_id] = self._last_access[block_id] = now
            elif block_id in self._born:
                del self._born[block_id], self._last_access[block_id]

    def blocks_referenced(self, block_ids: Sequence[int]) -> None:
        self._accessed(block_ids, reused=True)

    def blocks_released(self, block_ids: Sequence[int], by_window: bool) -> None:
        self._accessed(block_ids, reused=False)

    def _accessed(self, block_ids: Sequence[int], reused: bool) -> None:
        now = None
        for block_id in block_ids:
            last = self._last_access.get(block_id)
            if last is None or self._pool.block_key(block_id) is None:
                continue
            now = self._clock() if now is None else now
            if reused:
                self._observe_reuse_gap(now - last)
            self._last_access[block_id] = now

    def block_stored(self, block_id: int, key: BlockKey) -> None:
        pass

    def block_removed(self, block_id: int, key: BlockKey) -> None:
        born = self._born.pop(block_id, None)
        if born is None:
            return
        now = self._clock()
        self._observe_lifetime(now - born)
        self._observe_idle(now - self._last_access.pop(block_id))

    def cache_cleared(self, block_ids: Sequence[int]) -> None:
        """A reset is not an eviction: the cleared blocks stop being followed."""
        for block_id in block_ids:
            if self._born.pop(block_id, None) is not None:
                del self._last_access[block_id]
