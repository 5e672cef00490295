"""What one replica's prefix cache holds, followed from its block events.

A replica's ``/kv_events`` stream (:mod:`pagedllm.kv.block_events`) says which blocks
it stored and removed, by content key. :class:`PrefixIndex` keeps that set of keys;
:func:`prompt_block_hashes` computes the keys a prompt's blocks would have on that
replica (its block size and extra keys, from ``/kv_cache_config``), so that the
router knows, before sending a request, how many of its prompt tokens a replica would
not compute. Exact by construction: the same hash function, the same inputs.

Between routing a prompt to a replica and that replica's events saying its blocks are
stored lies the prefill (and the events' way back). A second request with the same
prefix in that window would miss everywhere and be sent elsewhere, computing the
prefix twice. So the router also records what it *expects* a replica to store
(:meth:`PrefixIndex.expect`): those keys count as held for :data:`EXPECTATION_TTL_S`
seconds, or until the events name them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from pagedllm.kv.prefix_hash import iter_block_keys


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...]
) -> list[str]:
    """Hex keys of the prompt's blocks a prefix-cache hit can cover: the full blocks of
    all tokens but the last (the engine always computes the last one)."""
    cacheable = token_ids[: max(0, len(token_ids) - 1)]
    return [key.digest.hex() for key in iter_block_keys(cacheable, block_size, extra_keys)]


EXPECTATION_TTL_S = 10.0
"""Seconds a routed prompt's keys count as held before the replica's events confirm
them (longer than a long prefill)."""


class PrefixIndex:
    """The block keys one replica has cached, as its events last said, and those the
    router expects it to store soon."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._stored: set[str] = set()
        self._expected: dict[str, float] = {}  # key -> when the expectation lapses
        self._clock = clock

    def __len__(self) -> int:
        return len(self._stored)

    def apply(self, events: Iterable[dict]) -> None:
        """Follow a batch of vLLM-shaped block events, in order."""
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                self._stored.update(event["block_hashes"])
                for block_hash in event["block_hashes"]:
                    self._expected.pop(block_hash, None)
            elif kind == "BlockRemoved":
                self._stored.difference_update(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                self._stored.clear()
            else:
                raise ValueError(f"unknown block event {kind!r}")

    def clear(self) -> None:
        """Forget everything (the replica restarted or its stream broke)."""
        self._stored.clear()
        self._expected.clear()

    def expect(self, block_hashes: Sequence[str]) -> None:
        """A prompt with these keys was just routed here: count them as held for a
        while (:data:`EXPECTATION_TTL_S`)."""
        lapses = self._clock() + EXPECTATION_TTL_S
        for block_hash in block_hashes:
            if block_hash not in self._stored:
                self._expected[block_hash] = lapses

    def matched_blocks(self, block_hashes: Sequence[str]) -> int:
        """Leading blocks of a prompt's chain that are cached here (or expected)."""
        now = self._clock()
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._stored:
                lapses = self._expected.get(block_hash)
                if lapses is None or lapses < now:
                    self._expected.pop(block_hash, None)
                    break
            count += 1
        return count
