"""What the block pool tells its listeners, and the block events tools read.

A :class:`PoolListener` attached to a :class:`~pagedllm.kv.block_pool.BlockPool` hears
every change of a block's state as it happens, in the thread that changes the pool:
references taken and dropped, content keys stored and removed. Listeners are how the
dashboard, the kv-events stream and the block-lifetime metrics follow the pool without
ever scanning it; a pool without listeners pays one empty-tuple test per call.

:func:`block_stored`, :func:`block_removed` and :func:`all_blocks_cleared` build the
events in vLLM's shape (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``), as
plain dicts ready for JSON; block hashes are the content keys' SHA-256 digests in hex.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from pagedllm.kv.prefix_hash import BlockKey


class PoolListener(Protocol):
    """Callbacks made after the pool has changed; each may read the pool's new state."""

    def blocks_taken(self, block_ids: Sequence[int]) -> None:
        """Each block left the free queue with one reference (an allocation)."""

    def blocks_referenced(self, block_ids: Sequence[int]) -> None:
        """Each block gained one reference (a prefix-cache hit, a fork)."""

    def blocks_released(self, block_ids: Sequence[int], by_window: bool) -> None:
        """Each block lost one reference; ``by_window``: because a sliding window
        moved past it."""

    def block_stored(self, block_id: int, key: BlockKey) -> None:
        """``block_id`` became findable in the prefix cache under ``key``."""

    def block_removed(self, block_id: int, key: BlockKey) -> None:
        """``block_id`` was evicted: the cache forgot ``key``."""

    def cache_cleared(self, block_ids: Sequence[int]) -> None:
        """The prefix cache was emptied; ``block_ids`` lost their keys."""


def block_stored(key: BlockKey, block_size: int, medium: str) -> dict:
    """vLLM's ``BlockStored`` for one block (its tokens, its parent's hash)."""
    parent = key.parent_digest
    return {
        "type": "BlockStored",
        "block_hashes": [key.digest.hex()],
        "parent_block_hash": None if parent is None else parent.hex(),
        "token_ids": list(key.token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
    }


def block_removed(key: BlockKey, medium: str) -> dict:
    """vLLM's ``BlockRemoved`` for one block."""
    return {"type": "BlockRemoved", "block_hashes": [key.digest.hex()], "medium": medium}


def all_blocks_cleared() -> dict:
    """vLLM's ``AllBlocksCleared``: every stored block is gone."""
    return {"type": "AllBlocksCleared"}


def parents_first(keys: Iterable[BlockKey]) -> list[BlockKey]:
    """``keys`` ordered so that every block comes after its parent when the parent is
    among them (a chain's blocks in chain order), for a reader building a tree."""
    keys = list(keys)
    present = {key.digest for key in keys}
    children: dict[bytes, list[BlockKey]] = {}
    roots = []
    for key in keys:
        parent = key.parent_digest
        if parent is None or parent not in present:
            roots.append(key)
        else:
            children.setdefault(parent, []).append(key)
    ordered, stack = [], roots[::-1]
    while stack:
        key = stack.pop()
        ordered.append(key)
        stack.extend(reversed(children.get(key.digest, ())))
    return ordered
