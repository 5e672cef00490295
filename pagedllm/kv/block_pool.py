"""The physical blocks of the KV cache: who may take them, who holds them.

A pool of ``num_blocks`` blocks (ids ``0 .. num_blocks - 1``), each holding the K/V of
``block_size`` tokens. Invariants:

- every block is either in the free queue (ref count 0) or referenced (ref count > 0),
  never both;
- allocation is all-or-nothing: a request that cannot be met raises
  :class:`OutOfBlocksError` and changes nothing;
- the last ``num_reserved`` free blocks (seed 000's two-level allocation) go only to
  high-priority requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedllm.kv.free_queue import FreeBlockQueue

MAX_BLOCK_SIZE = 256


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
        raise ValueError(f"block_size must be a power of two from 1 to 256, got {block_size!r}")
    return block_size


@dataclass(frozen=True)
class BlockPoolStats:
    """A snapshot of the pool's counters; all counts are in blocks."""

    num_blocks: int
    used: int
    free: int
    reserved: int
    peak_used: int
    num_allocations: int
    num_frees: int

    @property
    def usage(self) -> float:
        """Fraction of all blocks referenced now (0.0 .. 1.0)."""
        return self.used / self.num_blocks


class BlockPool:
    """Allocates blocks from a free queue and counts references to them."""

    def __init__(self, num_blocks: int, block_size: int, reserved_fraction: float = 0.05) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if not 0.0 <= reserved_fraction < 1.0:
            raise ValueError(f"reserved_fraction must be in [0, 1), got {reserved_fraction}")
        self.num_blocks = num_blocks
        self.block_size = validate_block_size(block_size)
        self.num_reserved = int(num_blocks * reserved_fraction)
        self._free_queue = FreeBlockQueue(num_blocks)
        self._ref_counts = [0] * num_blocks
        self._peak_used = 0
        self._num_allocations = 0
        self._num_frees = 0

    @property
    def num_free(self) -> int:
        """Blocks in the free queue."""
        return len(self._free_queue)

    @property
    def num_used(self) -> int:
        """Blocks with a reference count above zero."""
        return self.num_blocks - len(self._free_queue)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free_block_ids(self) -> list[int]:
        """The free queue from head (allocated next) to tail; O(num_blocks), for inspection."""
        return list(self._free_queue)

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
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        self._num_allocations += num_blocks
        self._peak_used = max(self._peak_used, self.num_used)
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block; every block must already be referenced."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is free and cannot gain a reference")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block, in order.

        A block whose count reaches zero goes to the tail of the free queue.
        Freeing a block that is already free raises ValueError.
        """
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise ValueError(f"block {block_id} is already free")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free_queue.append(block_id)
                self._num_frees += 1

    def stats(self) -> BlockPoolStats:
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            used=self.num_used,
            free=self.num_free,
            reserved=self.num_reserved,
            peak_used=self._peak_used,
            num_allocations=self._num_allocations,
            num_frees=self._num_frees,
        )
