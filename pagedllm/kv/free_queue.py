"""The queue of free physical blocks: a doubly linked list over block ids.

Order is the allocation order: blocks leave from the head and return to the tail,
so the head holds the block that has been free the longest (least recently used,
which is what the prefix cache evicts first). Every operation is O(1), including
removal from the middle (a prefix-cache hit on a free block takes it out of the queue).
"""

from __future__ import annotations

from collections.abc import Iterator

_NOT_QUEUED = -1


class FreeBlockQueue:
    """Block ids ``0 .. num_blocks - 1``, each present at most once.

    The links live in two int lists indexed by block id; index ``num_blocks`` is a
    sentinel that closes the ring, so an empty queue needs no special case.
    A block that is not queued has both links set to ``-1``.
    """

    def __init__(self, num_blocks: int) -> None:
        """Start with every block queued in id order: ``0`` at the head."""
        self._sentinel = num_blocks
        self._next = list(range(1, num_blocks + 2))
        self._prev = list(range(-1, num_blocks))
        self._next[num_blocks] = 0
        self._prev[0] = num_blocks
        self._size = num_blocks

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block_id: int) -> bool:
        return self._next[block_id] != _NOT_QUEUED

    def __iter__(self) -> Iterator[int]:
        """Block ids from head (next to be allocated) to tail (most recently freed)."""
        block_id = self._next[self._sentinel]
        while block_id != self._sentinel:
            yield block_id
            block_id = self._next[block_id]

    def tail(self, count: int) -> list[int]:
        """The last ``count`` block ids (fewer if fewer are queued), tail first; O(count)."""
        block_ids = []
        block_id = self._prev[self._sentinel]
        while block_id != self._sentinel and len(block_ids) < count:
            block_ids.append(block_id)
            block_id = self._prev[block_id]
        return block_ids

    def popleft(self) -> int:
        """Remove and return the head block. Raises IndexError when empty."""
        if self._size == 0:
            raise IndexError("pop from an empty free block queue")
        block_id = self._next[self._sentinel]
        self.remove(block_id)
        return block_id

    def append(self, block_id: int) -> None:
        """Queue ``block_id`` at the tail. Raises ValueError if it is already queued."""
        if self._next[block_id] != _NOT_QUEUED:
            raise ValueError(f"block {block_id} is already in the free queue")
        tail = self._prev[self._sentinel]
        self._next[tail] = block_id
        self._prev[block_id] = tail
        self._next[block_id] = self._sentinel
        self._prev[self._sentinel] = block_id
        self._size += 1

    def remove(self, block_id: int) -> None:
        """Unlink ``block_id`` wherever it is. Raises ValueError if it is not queued."""
        next_id = self._next[block_id]
        if next_id == _NOT_QUEUED:
            raise ValueError(f"block {block_id} is not in the free queue")
        prev_id = self._prev[block_id]
        self._next[prev_id] = next_id
        self._prev[next_id] = prev_id
        self._next[block_id] = self._prev[block_id] = _NOT_QUEUED
        self._size -= 1
