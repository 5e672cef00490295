"""One sequence's map from logical blocks to physical blocks.

Logical block ``j`` holds the sequence's tokens ``j * block_size .. (j + 1) * block_size - 1``
and lives in physical block ``block_ids[j]``. ``num_tokens`` counts the tokens that have
slots: reserved, not computed. A step reserves its tokens' slots before the forward pass
writes them, so inside a step it runs ahead of the block manager's committed count, the
source of the sequence's progress, and equals it between steps
(:meth:`~pagedllm.kv.block_manager.BlockManager.check_progress`). Invariants:

- a table of ``num_tokens`` tokens holds exactly ``ceil(num_tokens / block_size)`` blocks
  (more only after :meth:`BlockTable.preallocate`), each with one reference owned by this table;
- blocks before the one holding token ``num_tokens`` are full and never written again;
- a block is written in place only while this table is its sole holder: a shared block
  about to be written is first copied (copy-on-write);
- with a sliding window, the first :attr:`BlockTable.num_null` entries are *null*: their
  blocks were released (or never allocated) because no later query sees their tokens.
  A null entry holds :attr:`BlockPool.null_block`, an id the pool never hands out; the
  KV cache keeps a physical block there that is never written, so a kernel that reads
  it under a mask reads zeros, never another sequence's K/V. Null entries always form a
  prefix of the table and hold no reference.
- with compact blocks (``kv_cache_dtype="int4"``), the entries before
  :attr:`BlockTable.compact_end` are null or compact: :meth:`BlockTable.compact`
  re-encodes full blocks once they fall wholly behind the recent window, and a compact
  block is never written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.capacity import cdiv


@dataclass
class AppendResult:
    """What the KV cache must do before the new tokens' K/V are written.

    ``copies``: ``(src_block, dst_block)`` pairs to copy first (copy-on-write).
    ``slots``: flat cache slot of each new token, ``block_id * block_size + offset``.
    ``first_changed``: the first logical block whose entry the append changed (a copy,
    a release, a new block, a re-encoded one); the table's length when no entry
    changed. Entries before it are as they were. ``encodes``: ``(full_block,
    compact_block)`` pairs whose K/V the cache re-encodes before any move but a swap-out
    (:meth:`BlockTable.compact`). ``more_groups``: with layer groups
    (:mod:`pagedllm.kv.layer_groups`), the same append in the tables of groups 1, 2, ...
    (this result is group 0's; its ``copies`` include theirs).
    """

    slots: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    first_changed: int = 0
    encodes: list[tuple[int, int]] = field(default_factory=list)
    more_groups: list[AppendResult] = field(default_factory=list)


class BlockTable:
    """Logical -> physical blocks of one sequence, growing one block at a time."""

    def __init__(
        self,
        pool: BlockPool,
        block_ids: list[int] | None = None,
        num_tokens: int = 0,
        num_null: int = 0,
    ):
        """Adopt ``block_ids`` holding ``num_tokens``: the first ``num_null`` are null
        entries, the caller hands over the references of the others; the compact ones
        among them come first (a prefix hit's) and count toward :attr:`compact_end`."""
        self._pool = pool
        self._block_size = pool.block_size
        self._block_ids: list[int] = [] if block_ids is None else block_ids
        if len(self._block_ids) < cdiv(num_tokens, self._block_size):
            raise ValueError(f"{len(self._block_ids)} blocks cannot hold {num_tokens} tokens")
        if any(b != pool.null_block for b in self._block_ids[:num_null]):
            raise ValueError(f"the first {num_null} entries must be null")
        self.num_tokens = num_tokens
        self.num_null = num_null
        self.compact_end = num_null
        while self.compact_end < len(self._block_ids) and pool.is_compact(
            self._block_ids[self.compact_end]
        ):
            self.compact_end += 1

    @property
    def block_ids(self) -> list[int]:
        """The physical block of each logical block (null entries included); read-only
        for callers."""
        return self._block_ids

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks this table references: every entry after the null ones."""
        return self._block_ids[self.num_null :]

    def _growth(self, num_tokens: int, live_from: int = 0) -> int:
        """Blocks to allocate so the table can hold ``num_tokens`` tokens, entries before
        logical block ``live_from`` being null."""
        end = cdiv(num_tokens, self._block_size)
        return max(0, end - max(len(self._block_ids), live_from))

    def _shared_write_targets(self, num_new_tokens: int, live_from: int = 0) -> list[int]:
        """Logical indexes of held blocks the next write lands in that others also hold
        (none before ``live_from``: those are released, not written).

        Without reservations that is at most the partly filled last block (after a fork).
        """
        if num_new_tokens == 0:
            return []
        first = max(self.num_tokens // self._block_size, self.num_null, live_from)
        end = min(len(self._block_ids), cdiv(self.num_tokens + num_new_tokens, self._block_size))
        ref_count = self._pool.ref_count
        return [i for i in range(first, end) if ref_count(self._block_ids[i]) > 1]

    def num_blocks_needed(self, num_new_tokens: int, live_from: int = 0) -> int:
        """Blocks an append of ``num_new_tokens`` tokens would allocate, copies included
        (``live_from`` as in :meth:`append_slots`)."""
        growth = self._growth(self.num_tokens + num_new_tokens, live_from)
        return growth + len(self._shared_write_targets(num_new_tokens, live_from))

    def append_slots(
        self, num_new_tokens: int, high_priority: bool = False, live_from: int = 0
    ) -> AppendResult:
        """Make room for ``num_new_tokens`` more tokens and return where they go.

        Logical blocks before ``live_from`` are null afterwards (a sliding window: no
        later query reads their K/V): held ones are released, new ones never allocated,
        and their tokens' slots are ``-1``. All-or-nothing: raises
        :class:`OutOfBlocksError` and changes nothing when the pool cannot supply the
        blocks.
        """
        if num_new_tokens == 1 and live_from <= self.num_null:
            # a decode step's token, written in place into a held block: nothing to
            # allocate, copy or release (the general path below returns the same)
            logical, offset = divmod(self.num_tokens, self._block_size)
            if self.num_null <= logical < len(self._block_ids):
                block_id = self._block_ids[logical]
                if self._pool.ref_count(block_id) == 1:
                    self.num_tokens += 1
                    slot = block_id * self._block_size + offset
                    return AppendResult([slot], first_changed=len(self._block_ids))
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        targets = self._shared_write_targets(num_new_tokens, live_from)
        end = self.num_tokens + num_new_tokens
        growth = self._growth(end, live_from)
        num_needed = growth + len(targets)
        new_blocks = self._pool.allocate(num_needed, high_priority) if num_needed else []
        result = AppendResult(first_changed=targets[0] if targets else len(self._block_ids))
        for index, dst in zip(targets, new_blocks[: len(targets)], strict=True):
            src = self._block_ids[index]
            self._block_ids[index] = dst
            self._pool.free([src])
            result.copies.append((src, dst))
        released = self.release_before(live_from)
        if released:  # it starts at the first held entry, before any copy target
            result.first_changed = released.start
        num_new_null = max(0, min(live_from, cdiv(end, self._block_size)) - len(self._block_ids))
        self._block_ids.extend([self._pool.null_block] * num_new_null)
        self.num_null += num_new_null
        self._block_ids.extend(new_blocks[len(targets) :])
        result.slots = self._slots(self.num_tokens, end)
        self.num_tokens = end
        return result

    def release_before(self, live_from: int) -> range:
        """Release the held blocks of logical blocks before ``live_from`` (oldest first)
        and make their entries null; returns the logical blocks released."""
        end = min(live_from, len(self._block_ids))
        released = range(self.num_null, end)
        if released:
            self._pool.free(self._block_ids[released.start : released.stop], by_window=True)
            self._block_ids[released.start : released.stop] = [self._pool.null_block] * len(
                released
            )
            self.num_null = end
        return released

    def compact(self, end: int) -> tuple[list[tuple[int, int]], int]:
        """Replace the held full blocks of logical blocks before ``end`` (full of
        committed tokens, wholly behind the recent window) by compact ones, oldest
        first. A full block another table re-encoded already is taken from its twin;
        the others get a compact block each and a ``(full, compact)`` pair for the
        cache to encode. Stops early, without error, when the compact blocks run out
        (the rest stays full until a later call). Returns the pairs and the first
        logical block whose entry changed (the table's length when none did)."""
        pool = self._pool
        pairs: list[tuple[int, int]] = []
        first_changed = len(self._block_ids)
        for index in range(max(self.compact_end, self.num_null), min(end, len(self._block_ids))):
            block_id = self._block_ids[index]
            if not pool.is_compact(block_id):
                twin = pool.twin(block_id)
                if twin is not None:
                    pool.incref([twin])
                elif pool.num_compact_free:
                    (twin,) = pool.allocate_compact(1)
                    pool.add_twin(block_id, twin)
                    pairs.append((block_id, twin))
                else:
                    break
                pool.free([block_id])
                self._block_ids[index] = twin
                first_changed = min(first_changed, index)
            self.compact_end = index + 1
        return pairs, first_changed

    def append_compact(self, num_blocks: int) -> list[int]:
        """Append ``num_blocks`` compact blocks for whole blocks of restored tokens (a
        swap-in copies their compact K/V in, or encodes their parked full ones) after
        entries that are all null or compact and full of tokens, and return those
        tokens' slots. All-or-nothing: raises :class:`OutOfBlocksError` and changes
        nothing when the compact blocks are not free."""
        length = len(self._block_ids)
        if self.compact_end != length or self.num_tokens != length * self._block_size:
            raise ValueError("restored compact blocks follow whole compact entries only")
        start = self.num_tokens
        self._block_ids.extend(self._pool.allocate_compact(num_blocks))
        self.num_tokens = len(self._block_ids) * self._block_size
        self.compact_end = len(self._block_ids)
        return self._slots(start, self.num_tokens)

    def truncate(self, num_tokens: int, min_blocks: int = 0) -> int:
        """Drop the slots of tokens ``num_tokens ..`` (reserved, never to be kept) and
        release the blocks wholly past them, last first, keeping at least
        ``min_blocks`` entries (an up-front reservation). Returns the blocks released.
        Their K/V were never committed, so none of them is cached."""
        if not self.num_null * self._block_size <= num_tokens <= self.num_tokens:
            raise ValueError(f"cannot truncate a table of {self.num_tokens} tokens to {num_tokens}")
        keep = max(cdiv(num_tokens, self._block_size), min_blocks, self.num_null, self.compact_end)
        released = self._block_ids[keep:]
        self._pool.free(reversed(released))
        del self._block_ids[keep:]
        self.num_tokens = num_tokens
        return len(released)

    def preallocate(self, num_tokens: int, high_priority: bool = False) -> None:
        """Hold blocks for ``num_tokens`` tokens in advance (contiguous-reservation baseline).

        All-or-nothing like :meth:`append_slots`; the token count does not change.
        """
        self._block_ids.extend(self._pool.allocate(self._growth(num_tokens), high_priority))

    def _slots(self, start: int, end: int) -> list[int]:
        """Flat cache slots of token positions ``start .. end - 1`` (``-1`` in null
        entries)."""
        block_size = self._block_size
        slots: list[int] = []
        position = start
        while position < end:
            offset = position % block_size
            run = min(block_size - offset, end - position)
            logical = position // block_size
            if logical < self.num_null:
                slots.extend([-1] * run)
            else:
                first = self._block_ids[logical] * block_size + offset
                slots.extend(range(first, first + run))
            position += run
        return slots

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one (ref count + 1, nothing allocated)."""
        self._pool.incref(self.held_block_ids)
        return BlockTable(self._pool, list(self._block_ids), self.num_tokens, self.num_null)

    def free(self) -> None:
        """Release every held block, last logical block first, and empty the table.

        Releasing the tail first puts a sequence's later blocks ahead of its earlier ones
        in the free queue, so the prefix cache evicts the end of a chain before its start.
        """
        self._pool.free(reversed(self.held_block_ids))
        self._block_ids = []
        self.num_tokens = 0
        self.num_null = 0
        self.compact_end = 0
