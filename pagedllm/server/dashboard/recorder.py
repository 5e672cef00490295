"""What changed in the pool since the last look: the dashboard's and the kv-events
stream's :class:`~pagedllm.kv.block_events.PoolListener`.

Attached to the pool only while someone watches; every callback is O(blocks named) and
runs in the engine loop thread, as do :meth:`PoolRecorder.take_changed` and
:meth:`PoolRecorder.take_kv_events`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.kv.block_events import all_blocks_cleared, block_removed, block_stored
from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.prefix_hash import BlockKey

WINDOW_RELEASED = 1
"""Flag bit of a block whose last reference a sliding window dropped, not taken since."""


class PoolRecorder:
    """Collects changed block ids (for the dashboard) and, when ``kv_events`` is on,
    vLLM-shaped block events (for tools). ``medium``: where the pool lives, ``"CPU"``
    or ``"GPU"``."""

    def __init__(self, pool: BlockPool, medium: str) -> None:
        self._pool = pool
        self.medium = medium
        self.kv_events = False
        self._changed: set[int] = set()
        self._window_released: set[int] = set()
        self._events: list[dict] = []

    def flags(self, block_id: int) -> int:
        """The flag bits of ``block_id`` (:data:`WINDOW_RELEASED`)."""
        return WINDOW_RELEASED if block_id in self._window_released else 0

    @property
    def has_changes(self) -> bool:
        return bool(self._changed)

    def take_changed(self) -> set[int]:
        """Block ids whose state changed since the last call."""
        changed, self._changed = self._changed, set()
        return changed

    def take_kv_events(self) -> list[dict]:
        """Block events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def blocks_taken(self, block_ids: Sequence[int]) -> None:
        self._changed.update(block_ids)
        self._window_released.difference_update(block_ids)

    def blocks_referenced(self, block_ids: Sequence[int]) -> None:
        self._changed.update(block_ids)
        self._window_released.difference_update(block_ids)

    def blocks_released(self, block_ids: Sequence[int], by_window: bool) -> None:
        self._changed.update(block_ids)
        if by_window:
            ref_count = self._pool.ref_count
            self._window_released.update(b for b in block_ids if ref_count(b) == 0)

    def block_stored(self, block_id: int, key: BlockKey) -> None:
        self._changed.add(block_id)
        if self.kv_events:
            self._events.append(block_stored(key, self._pool.block_size, self.medium))

    def block_removed(self, block_id: int, key: BlockKey) -> None:
        self._changed.add(block_id)
        if self.kv_events:
            self._events.append(block_removed(key, self.medium))

    def cache_cleared(self, block_ids: Sequence[int]) -> None:
        self._changed.update(block_ids)
        if self.kv_events:
            self._events.append(all_blocks_cleared())
