"""One sequence's map from logical blocks to physical blocks.

Logical block ``j`` holds the sequence's tokens ``j * block_size .. (j + 1) * block_size - 1``
and lives in physical block ``block_ids[j]``. Invariants:

- a table of ``num_tokens`` tokens holds exactly ``ceil(num_tokens / block_size)`` blocks
  (more only after :meth:`BlockTable.preallocate`), each with one reference owned by this table;
- blocks before the one holding token ``num_tokens`` are full and never written again;
- a block is written in place only while this table is its sole holder: a shared block
  about to be written is first copied (copy-on-write).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.kv.block_pool import BlockPool


@dataclass
class AppendResult:
    """What the KV cache must do before the new tokens' K/V are written.

    ``copies``: ``(src_block, dst_block)`` pairs to copy first (copy-on-write).
    ``slots``: flat cache slot of each new token, ``block_id * block_size + offset``.
    """

    slots: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)


class BlockTable:
    """Logical -> physical blocks of one sequence, growing one block at a time."""

    def __init__(self, pool: BlockPool, block_ids: list[int] | None = None, num_tokens: int = 0):
        """Adopt ``block_ids`` (whose references the caller hands over) holding ``num_tokens``."""
        self._pool = pool
        self._block_size = pool.block_size
        self._block_ids: list[int] = [] if block_ids is None else block_ids
        if len(self._block_ids) < -(-num_tokens // self._block_size):
            raise ValueError(f"{len(self._block_ids)} blocks cannot hold {num_tokens} tokens")
        self.num_tokens = num_tokens

    @property
    def block_ids(self) -> list[int]:
        """The physical block of each logical block; read-only for callers."""
        return self._block_ids

    def _growth(self, num_tokens: int) -> int:
        """Blocks to add so the table can hold ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self._block_size) - len(self._block_ids))

    def _shared_write_targets(self, num_new_tokens: int) -> list[int]:
        """Logical indexes of held blocks the next write lands in that others also hold.

        Without reservations that is at most the partly filled last block (after a fork).
        """
        if num_new_tokens == 0:
            return []
        first = self.num_tokens // self._block_size
        end = min(len(self._block_ids), -(-(self.num_tokens + num_new_tokens) // self._block_size))
        ref_count = self._pool.ref_count
        return [i for i in range(first, end) if ref_count(self._block_ids[i]) > 1]

    def num_blocks_needed(self, num_new_tokens: int) -> int:
        """Blocks an append of ``num_new_tokens`` tokens would allocate, copies included."""
        growth = self._growth(self.num_tokens + num_new_tokens)
        return growth + len(self._shared_write_targets(num_new_tokens))

    def append_slots(self, num_new_tokens: int, high_priority: bool = False) -> AppendResult:
        """Make room for ``num_new_tokens`` more tokens and return where they go.

        All-or-nothing: raises :class:`OutOfBlocksError` and changes nothing when the pool
        cannot supply the blocks.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        targets = self._shared_write_targets(num_new_tokens)
        growth = self._growth(self.num_tokens + num_new_tokens)
        num_needed = growth + len(targets)
        new_blocks = self._pool.allocate(num_needed, high_priority) if num_needed else []
        result = AppendResult()
        for index, dst in zip(targets, new_blocks[: len(targets)], strict=True):
            src = self._block_ids[index]
            self._block_ids[index] = dst
            self._pool.free([src])
            result.copies.append((src, dst))
        self._block_ids.extend(new_blocks[len(targets) :])
        result.slots = self._slots(self.num_tokens, self.num_tokens + num_new_tokens)
        self.num_tokens += num_new_tokens
        return result

    def preallocate(self, num_tokens: int, high_priority: bool = False) -> None:
        """Hold blocks for ``num_tokens`` tokens in advance (contiguous-reservation baseline).

        All-or-nothing like :meth:`append_slots`; the token count does not change.
        """
        self._block_ids.extend(self._pool.allocate(self._growth(num_tokens), high_priority))

    def _slots(self, start: int, end: int) -> list[int]:
        """Flat cache slots of token positions ``start .. end - 1``."""
        block_size = self._block_size
        slots: list[int] = []
        position = start
        while position < end:
            offset = position % block_size
            run = min(block_size - offset, end - position)
            first = self._block_ids[position // block_size] * block_size + offset
            slots.extend(range(first, first + run))
            position += run
        return slots

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one (ref count + 1, nothing allocated)."""
        self._pool.incref(self._block_ids)
        return BlockTable(self._pool, list(self._block_ids), self.num_tokens)

    def free(self) -> None:
        """Release every block, last logical block first, and empty the table.

        Releasing the tail first puts a sequence's later blocks ahead of its earlier ones
        in the free queue, so the prefix cache evicts the end of a chain before its start.
        """
        self._pool.free(reversed(self._block_ids))
        self._block_ids = []
        self.num_tokens = 0
