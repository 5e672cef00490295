"""The physical blocks of the KV cache: who may take them, who holds them.

A pool of ``num_blocks`` blocks (ids ``0 .. num_blocks - 1``), each holding the K/V of
``block_size`` tokens. Invariants:

- every block is either in the free queue (ref count 0) or referenced (ref count > 0),
  never both;
- allocation is all-or-nothing: a request that cannot be met raises
  :class:`OutOfBlocksError` and changes nothing;
- the last ``num_reserved`` free blocks go only to high-priority requests (a two-level
  allocation that keeps room for urgent requests).

Prefix caching: a full block may carry a :class:`~pagedllm.kv.prefix_hash.BlockKey`
(its content identity). Such a block stays findable by its key while referenced and, once
free, while it waits in the free queue (evictable, least recently freed first); it is
evicted (forgets its key) when allocation takes it from the head of the queue.

Compact blocks (``kv_cache_dtype="int4"``): a second partition of ids,
``compact_offset .. compact_offset + num_compact_blocks - 1`` (after the full blocks and
the null block), with a free queue of its own and no reserve. Ref counts, content keys
and listeners treat both kinds alike; :meth:`allocate` takes full blocks,
:meth:`allocate_compact` compact ones, and every count named without "compact" is of
full blocks. A full block whose K/V were re-encoded while others still read it has a
*twin*, the compact block that took its place (:meth:`add_twin`); until the full block
is free, each of its references also holds one on its twin, so the twin outlives every
reader that has not switched to it yet: ``ref(twin) = ref(full) + its own holders``.

Listeners (:class:`~pagedllm.kv.block_events.PoolListener`, added with
:meth:`BlockPool.add_listener`) hear every change after it is made; the pool never
walks its blocks for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.kv.block_events import PoolListener
from pagedllm.kv.free_queue import FreeBlockQueue
from pagedllm.kv.prefix_hash import BlockKey

MAX_BLOCK_SIZE = 256


def num_reserved_blocks(num_blocks: int, reserved_fraction: float) -> int:
    """Blocks of a pool that only high-priority requests may take: the fraction of
    ``num_blocks``, rounded down."""
    return int(num_blocks * reserved_fraction)


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks for an allocation; nothing was changed."""

    def __init__(self, requested: int, available: int) -> None:
        super().__init__(f"requested {requested} blocks, {available} available")
        self.requested = requested
        self.available = available


def validate_block_size(block_size: int) -> int:
    """Return ``block_size`` if it is a power of two from 1 to 256 tokens, else raise."""
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or not 1 <= block_size <= MAX_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block_size must be a power of two from 1 to {MAX_BLOCK_SIZE}, got {block_size!r}"
        )
    return block_size


@dataclass(frozen=True)
class BlockPoolStats:
    """A snapshot of the pool's counters; all counts are in blocks.

    ``free`` includes ``evictable`` (cached blocks nobody references); ``shared`` blocks have
    more than one reference; ``num_*`` are cumulative since the pool was made.
    """

    num_blocks: int
    used: int
    free: int
    reserved: int
    peak_used: int
    shared: int
    cached: int
    evictable: int
    num_allocations: int
    num_frees: int
    num_evictions: int
    num_compact_blocks: int = 0
    compact_used: int = 0

    @property
    def usage(self) -> float:
        """Fraction of all blocks referenced now (0.0 .. 1.0)."""
        return self.used / self.num_blocks


class BlockPool:
    """Allocates blocks from a free queue and counts references to them."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        reserved_fraction: float = 0.05,
        num_compact_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if not 0.0 <= reserved_fraction < 1.0:
            raise ValueError(f"reserved_fraction must be in [0, 1), got {reserved_fraction}")
        self.num_blocks = num_blocks
        self.block_size = validate_block_size(block_size)
        self.num_reserved = num_reserved_blocks(num_blocks, reserved_fraction)
        self._free_queue = FreeBlockQueue(num_blocks)
        self.num_compact_blocks = num_compact_blocks
        self.compact_offset = num_blocks + 1
        self._compact_queue = FreeBlockQueue(num_compact_blocks)  # ids less the offset
        num_ids = self.compact_offset + num_compact_blocks
        self._ref_counts = [0] * num_ids
        self._block_keys: list[BlockKey | None] = [None] * num_ids
        self._twins: dict[int, int] = {}
        self._cached_blocks: dict[bytes, int] = {}
        self._num_evictable = 0
        self._num_shared = 0
        self._peak_used = 0
        self._num_allocations = 0
        self._num_frees = 0
        self._num_evictions = 0
        self._listeners: tuple[PoolListener, ...] = ()

    def add_listener(self, listener: PoolListener) -> None:
        """Tell ``listener`` about every change from now on."""
        self._listeners = (*self._listeners, listener)

    def remove_listener(self, listener: PoolListener) -> None:
        self._listeners = tuple(known for known in self._listeners if known is not listener)

    @property
    def num_free(self) -> int:
        """Blocks in the free queue."""
        return len(self._free_queue)

    @property
    def num_used(self) -> int:
        """Blocks with a reference count above zero."""
        return self.num_blocks - len(self._free_queue)

    @property
    def null_block(self) -> int:
        """The id block tables hold for a released entry: ``num_blocks``, one past the
        last block, never allocated (see :mod:`pagedllm.kv.block_table`)."""
        return self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_compact(self, block_id: int) -> bool:
        return block_id >= self.compact_offset

    @property
    def num_compact_free(self) -> int:
        """Compact blocks in their free queue (evictable ones included)."""
        return len(self._compact_queue)

    @property
    def num_compact_used(self) -> int:
        """Compact blocks with a reference count above zero."""
        return self.num_compact_blocks - len(self._compact_queue)

    def twin(self, block_id: int) -> int | None:
        """The compact block that took the place of full block ``block_id``, while some
        reader of ``block_id`` has not switched to it."""
        return self._twins.get(block_id)

    def free_block_ids(self) -> list[int]:
        """The free queue from head (allocated next) to tail; O(num_blocks), for inspection."""
        return list(self._free_queue)

    def compact_free_block_ids(self) -> list[int]:
        """The compact free queue from head to tail; O(num_compact_blocks)."""
        return [self.compact_offset + queued for queued in self._compact_queue]

    def reserved_block_ids(self) -> list[int]:
        """The free blocks only high-priority requests may take now: the last
        ``num_reserved`` of the free queue (fewer when fewer are free); O(num_reserved)."""
        return self._free_queue.tail(self.num_reserved)

    def num_available(self, high_priority: bool = False) -> int:
        """Blocks an allocation of this priority may take now."""
        if high_priority:
            return len(self._free_queue)
        return max(0, len(self._free_queue) - self.num_reserved)

    def can_allocate(self, num_blocks: int, high_priority: bool = False) -> bool:
        return num_blocks <= self.num_available(high_priority)

    def allocate(self, num_blocks: int, high_priority: bool = False) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref count 1.

        Raises :class:`OutOfBlocksError` (changing nothing) when fewer are available.
        """
        available = self.num_available(high_priority)
        if num_blocks > available:
            raise OutOfBlocksError(num_blocks, available)
        block_ids = [self._free_queue.popleft() for _ in range(num_blocks)]
        return self._take(block_ids)

    def allocate_compact(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` compact blocks (all or nothing, like :meth:`allocate`)."""
        if num_blocks > len(self._compact_queue):
            raise OutOfBlocksError(num_blocks, len(self._compact_queue))
        offset = self.compact_offset
        return self._take([offset + self._compact_queue.popleft() for _ in range(num_blocks)])

    def _take(self, block_ids: list[int]) -> list[int]:
        """Blocks just taken from a free queue get their first reference."""
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
            if self._block_keys[block_id] is not None:
                self._evict(block_id)
        self._num_allocations += len(block_ids)
        self._peak_used = max(self._peak_used, self.num_used)
        if block_ids:
            for listener in self._listeners:
                listener.blocks_taken(block_ids)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block.

        A block must be referenced already, or be cached: a free cached block (a prefix-cache
        hit) leaves the free queue from wherever it is. Callers check the priority's
        allowance (:meth:`can_allocate`) for such blocks first, as they leave the free pool.
        """
        listeners = self._listeners
        if listeners:
            block_ids = list(block_ids)
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                if self._block_keys[block_id] is None:
                    raise ValueError(f"block {block_id} is free and cannot gain a reference")
                self._queue_of(block_id).remove(self._queued_id(block_id))
                self._num_evictable -= 1
                self._peak_used = max(self._peak_used, self.num_used)
            elif count == 1:
                self._num_shared += 1
            self._ref_counts[block_id] = count + 1
            twin = self._twins.get(block_id)
            if twin is not None:
                self.incref([twin])
        if listeners and block_ids:
            for listener in listeners:
                listener.blocks_referenced(block_ids)

    def free(self, block_ids: Iterable[int], by_window: bool = False) -> None:
        """Drop one reference from each block, in order.

        A block whose count reaches zero goes to the tail of the free queue.
        Freeing a block that is already free raises ValueError. ``by_window``: the
        references are dropped because a sliding window moved past the blocks (told to
        listeners; nothing else differs).
        """
        listeners = self._listeners
        if listeners:
            block_ids = list(block_ids)
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise ValueError(f"block {block_id} is already free")
            self._ref_counts[block_id] = count - 1
            if count == 2:
                self._num_shared -= 1
            elif count == 1:
                self._queue_of(block_id).append(self._queued_id(block_id))
                self._num_frees += 1
                if self._block_keys[block_id] is not None:
                    self._num_evictable += 1
            twin = self._twins.get(block_id)
            if twin is not None:
                if count == 1:
                    del self._twins[block_id]
                self.free([twin])
        if listeners and block_ids:
            for listener in listeners:
                listener.blocks_released(block_ids, by_window)

    def _queue_of(self, block_id: int) -> FreeBlockQueue:
        return self._compact_queue if block_id >= self.compact_offset else self._free_queue

    def _queued_id(self, block_id: int) -> int:
        """``block_id`` as its free queue numbers it."""
        return block_id - self.compact_offset if block_id >= self.compact_offset else block_id

    def add_twin(self, block_id: int, twin: int) -> None:
        """Make the compact block ``twin`` (just allocated by the caller, who holds
        ``block_id`` and re-encodes its K/V into ``twin``) ``block_id``'s twin.
        ``block_id``'s content key moves to ``twin`` (a later prefix hit finds the
        compact copy). When others hold ``block_id`` too, ``twin`` gains one reference
        per reference of ``block_id``. The caller then drops its reference to
        ``block_id`` and keeps its own on ``twin``."""
        if not self.is_compact(twin) or self.is_compact(block_id) or block_id in self._twins:
            raise ValueError(f"block {twin} cannot become the twin of block {block_id}")
        key = self._block_keys[block_id]
        if key is not None:
            self._block_keys[block_id] = None
            del self._cached_blocks[key.digest]
            for listener in self._listeners:
                listener.block_removed(block_id, key)
            self.cache_block(twin, key)
        references = self._ref_counts[block_id]
        if references > 1:  # others read block_id after the caller's switch
            self.incref([twin] * references)
            self._twins[block_id] = twin

    def block_key(self, block_id: int) -> BlockKey | None:
        """The content identity ``block_id`` is cached under, if any."""
        return self._block_keys[block_id]

    def cache_block(self, block_id: int, key: BlockKey) -> bool:
        """Make the referenced, full block ``block_id`` findable by ``key``.

        Returns False (and leaves the block uncached) when another block already holds the
        same content; caching a block again under its own key is a no-op.
        """
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only referenced blocks are cached")
        current = self._block_keys[block_id]
        if current is not None:
            if current != key:
                raise ValueError(f"block {block_id} is already cached with other content")
            return True
        if key.digest in self._cached_blocks:
            return False
        self._block_keys[block_id] = key
        self._cached_blocks[key.digest] = block_id
        for listener in self._listeners:
            listener.block_stored(block_id, key)
        return True

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """``(digest, block_id)`` of every cached block, referenced or evictable."""
        return list(self._cached_blocks.items())

    def lookup(self, key: BlockKey) -> int | None:
        """The cached block whose content is exactly ``key``, referenced or evictable."""
        block_id = self._cached_blocks.get(key.digest)
        if block_id is None or self._block_keys[block_id] != key:
            return None
        return block_id

    def _evict(self, block_id: int) -> None:
        """Forget the key of a block that allocation just took from the free queue."""
        key = self._block_keys[block_id]
        del self._cached_blocks[key.digest]
        self._block_keys[block_id] = None
        self._num_evictable -= 1
        self._num_evictions += 1
        for listener in self._listeners:
            listener.block_removed(block_id, key)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key, if no cached block is referenced (else change
        nothing and return False). The blocks stay free; nothing is evicted by
        allocation later. Listeners hear ``cache_cleared``."""
        if len(self._cached_blocks) != self._num_evictable:
            return False
        block_ids = list(self._cached_blocks.values())
        for block_id in block_ids:
            self._block_keys[block_id] = None
        self._cached_blocks.clear()
        self._num_evictable = 0
        for listener in self._listeners:
            listener.cache_cleared(block_ids)
        return True

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            used=self.num_used,
            free=self.num_free,
            reserved=self.num_reserved,
            peak_used=self._peak_used,
            shared=self._num_shared,
            cached=len(self._cached_blocks),
            evictable=self._num_evictable,
            num_allocations=self._num_allocations,
            num_frees=self._num_frees,
            num_evictions=self._num_evictions,
            num_compact_blocks=self.num_compact_blocks,
            compact_used=self.num_compact_used,
        )
