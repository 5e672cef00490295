"""The host-memory tier: evicted cached blocks kept beside the pool, least recently
used out first.

``num_slots`` slots shaped like the pool's blocks, laid out block-major
(``[num_slots, num_layers, 2, num_kv_heads, block_size, row]``) so that one block, every
layer's K and V, is one contiguous run of bytes: what the disk tier stores as an
entry, and what a GPU pool copies to and from pinned host memory in one transfer.

A slot is free, *ready* (holds the block of a digest, findable, in LRU order) or
*loading* (reserved for a digest whose bytes a background reader is writing; neither
findable nor evictable until :meth:`HostTier.loaded`). A ready slot is not evicted while
it is pinned (a fill of the plan being made reads it) or held (a queued request waits
for it). The bookkeeping is the
scheduler's, the bytes the executor's: every method here but :meth:`HostTier.block`
touches only the bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


class HostTier:
    """``num_slots`` block-sized slots of host memory for blocks shaped like ``shape``
    (one pool block: ``[num_layers, 2, num_kv_heads, block_size, row]``) of ``dtype``;
    pinned when ``pin`` (a GPU pool's tier)."""

    def __init__(
        self, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.tensor = torch.empty((num_slots, *shape), dtype=dtype, pin_memory=pin)
        self.block_bytes = self.tensor[0].numel() * self.tensor.element_size()
        self._ready: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._loading: dict[bytes, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()
        self._held: dict[int, int] = {}  # slot -> requests waiting for its block

    def __len__(self) -> int:
        """Ready blocks."""
        return len(self._ready)

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    def __contains__(self, digest: bytes) -> bool:
        """Whether ``digest``'s block is here, ready or on its way."""
        return digest in self._ready or digest in self._loading

    def find(self, digest: bytes) -> int | None:
        """The slot of ``digest``'s ready block (now the most recently used), or None."""
        slot = self._ready.get(digest)
        if slot is not None:
            self._ready.move_to_end(digest)
        return slot

    def is_loading(self, digest: bytes) -> bool:
        return digest in self._loading

    def loading_slot(self, digest: bytes) -> int | None:
        return self._loading.get(digest)

    def loading_digests(self) -> list[bytes]:
        return list(self._loading)

    def pin(self, slots: list[int]) -> None:
        """Keep ``slots`` from being evicted until :meth:`unpin` (a fill planned from
        them while the same plan may still evict)."""
        self._pinned.update(slots)

    def unpin(self, slots: list[int]) -> None:
        self._pinned.difference_update(slots)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def hold(self, slot: int) -> None:
        """Keep ``slot`` from eviction while a queued request waits for its block (one
        hold per request; :meth:`release` each)."""
        self._held[slot] = self._held.get(slot, 0) + 1

    def release(self, slot: int) -> None:
        count = self._held.pop(slot) - 1
        if count:
            self._held[slot] = count

    def reserve(self, digest: bytes, loading: bool = False) -> tuple[int, bytes | None] | None:
        """A slot for ``digest``'s block: a free one, or the least recently used ready
        one that is not pinned (its digest returned as the victim, forgotten here); None
        when every slot is pinned or loading. The slot is ready for ``digest`` at once
        (its bytes arrive before anything reads them: a plan's moves run in order), or
        loading with ``loading``."""
        victim = None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((d for d, s in self._ready.items() if self._evictable(s)), None)
            if victim is None:
                return None
            slot = self._ready.pop(victim)
        if loading:
            self._loading[digest] = slot
        else:
            self._ready[digest] = slot
        return slot, victim

    def _evictable(self, slot: int) -> bool:
        return slot not in self._pinned and slot not in self._held

    def loaded(self, digest: bytes, ok: bool) -> None:
        """The background read for ``digest`` ended: its block is ready (most recently
        used), or, when ``ok`` is false, its slot is free again."""
        slot = self._loading.pop(digest)
        if ok:
            self._ready[digest] = slot
        else:
            self._free.append(slot)

    def clear(self) -> None:
        """Forget every ready block (their slots free again); loading ones stay
        reserved until :meth:`loaded`. Nothing may be pinned."""
        if self._pinned:
            raise RuntimeError("a host tier is cleared between plans, with nothing pinned")
        self._free.extend(self._ready.values())
        self._ready.clear()
        self._held.clear()

    def ready_items(self) -> list[tuple[bytes, int]]:
        """``(digest, slot)`` of every ready block, least recently used first."""
        return list(self._ready.items())

    def block(self, slot: int) -> torch.Tensor:
        """The bytes of ``slot`` (a view shaped like one pool block)."""
        return self.tensor[slot]
