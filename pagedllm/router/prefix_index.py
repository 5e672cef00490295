"""What one replica's prefix cache holds, followed from its block events.

A replica's ``/kv_events`` stream (:mod:`pagedllm.kv.block_events`) says which blocks
it stored and removed, by content key. :class:`PrefixIndex` keeps that set of keys;
:func:`prompt_block_hashes` computes the keys a prompt's blocks would have on that
replica (its block size and extra keys, from ``/kv_cache_config``), so that the
router knows, before sending a request, how many of its prompt tokens a replica would
not compute. Exact by construction: the same hash function, the same inputs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedllm.kv.prefix_hash import iter_block_keys


def prompt_block_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...]
) -> list[str]:
    """Hex keys of the prompt's blocks a prefix-cache hit can cover: the full blocks of
    all tokens but the last (the engine always computes the last one)."""
    cacheable = token_ids[: max(0, len(token_ids) - 1)]
    return [key.digest.hex() for key in iter_block_keys(cacheable, block_size, extra_keys)]


class PrefixIndex:
    """The block keys one replica has cached, as its events last said."""

    def __init__(self) -> None:
        self._stored: set[str] = set()

    def __len__(self) -> int:
        return len(self._stored)

    def apply(self, events: Iterable[dict]) -> None:
        """Follow a batch of vLLM-shaped block events, in order."""
        for event in events:
            kind = event["type"]
            if kind == "BlockStored":
                self._stored.update(event["block_hashes"])
            elif kind == "BlockRemoved":
                self._stored.difference_update(event["block_hashes"])
            elif kind == "AllBlocksCleared":
                self._stored.clear()
            else:
                raise ValueError(f"unknown block event {kind!r}")

    def clear(self) -> None:
        """Forget everything (the replica restarted or its stream broke)."""
        self._stored.clear()

    def matched_blocks(self, block_hashes: Sequence[str]) -> int:
        """Leading blocks of a prompt's chain that are cached here."""
        count = 0
        for block_hash in block_hashes:
            if block_hash not in self._stored:
                break
            count += 1
        return count
