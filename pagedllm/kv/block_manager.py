"""The scheduler's view of KV memory: block tables keyed by sequence id over one pool.

Each step the scheduler asks, for every sequence it runs, whether the tokens it will
compute fit (:meth:`BlockManager.can_append`) and then reserves their slots
(:meth:`BlockManager.append_slots`); a finished or preempted sequence returns its blocks
with :meth:`BlockManager.free`. Every call costs O(tokens appended) or O(blocks of that
sequence), never O(blocks in the pool).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.kv.block_pool import BlockPool, BlockPoolStats
from pagedllm.kv.block_table import AppendResult, BlockTable
from pagedllm.kv.fragmentation import FragmentationStats

SeqId = int | str


@dataclass(frozen=True)
class BlockManagerStats:
    """Monitoring figures: pool counters and the fragmentation of the live tables."""

    num_seqs: int
    pool: BlockPoolStats
    fragmentation: FragmentationStats


class BlockManager:
    """Owns one :class:`BlockPool` and the :class:`BlockTable` of every live sequence."""

    def __init__(self, num_blocks: int, block_size: int, reserved_fraction: float = 0.05) -> None:
        self.pool = BlockPool(num_blocks, block_size, reserved_fraction)
        self.block_size = block_size
        self._tables: dict[SeqId, BlockTable] = {}

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._tables

    def num_blocks_needed(self, seq_id: SeqId, num_new_tokens: int) -> int:
        """Free blocks an append of ``num_new_tokens`` to ``seq_id`` would take (new or unknown
        sequence: blocks for its first tokens)."""
        table = self._tables.get(seq_id)
        if table is None:
            return -(-num_new_tokens // self.block_size)
        return table.num_blocks_needed(num_new_tokens)

    def can_append(self, seq_id: SeqId, num_new_tokens: int, high_priority: bool = False) -> bool:
        """Whether :meth:`append_slots` with the same arguments would succeed now."""
        needed = self.num_blocks_needed(seq_id, num_new_tokens)
        return self.pool.can_allocate(needed, high_priority)

    def append_slots(
        self, seq_id: SeqId, num_new_tokens: int, high_priority: bool = False
    ) -> AppendResult:
        """Reserve slots for the ``num_new_tokens`` tokens ``seq_id`` computes next.

        Creates the sequence on first use. All-or-nothing: raises
        :class:`~pagedllm.kv.block_pool.OutOfBlocksError` and changes nothing when the
        blocks are not available to this priority.
        """
        table = self._tables.get(seq_id)
        if table is None:
            table = BlockTable(self.pool)
        result = table.append_slots(num_new_tokens, high_priority)
        self._tables[seq_id] = table
        return result

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` sharing all its blocks."""
        if child_id in self._tables:
            raise ValueError(f"sequence {child_id!r} already exists")
        self._tables[child_id] = self._tables[parent_id].fork()

    def free(self, seq_id: SeqId) -> None:
        """Release every block of ``seq_id`` and forget it (finish or preemption)."""
        self._tables.pop(seq_id).free()

    def block_table(self, seq_id: SeqId) -> list[int]:
        """A copy of the physical block ids of ``seq_id``, in logical order."""
        return list(self._tables[seq_id].block_ids)

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens ``seq_id`` has slots for."""
        return self._tables[seq_id].num_tokens

    def fragmentation(self) -> FragmentationStats:
        """Seed 004's figures for the live tables in O(number of sequences).

        Relies on the tables' invariants: every referenced block belongs to a table and only
        a table's last block can be partly filled (all holders of a block agree on its fill).
        """
        block_size = self.block_size
        partial_fill: dict[int, int] = {}
        unshared_blocks = 0
        for table in self._tables.values():
            unshared_blocks += len(table.block_ids)
            fill = table.num_tokens % block_size
            if fill:
                last = table.block_ids[-1]
                partial_fill[last] = max(partial_fill.get(last, 0), fill)
        unique_blocks = self.pool.num_used
        allocated = unique_blocks * block_size
        live = allocated - sum(block_size - fill for fill in partial_fill.values())
        return FragmentationStats(
            unique_blocks=unique_blocks,
            allocated_slots=allocated,
            live_tokens=live,
            internal_fragmentation_slots=allocated - live,
            slots_saved_by_sharing=unshared_blocks * block_size - allocated,
        )

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_seqs=len(self._tables),
            pool=self.pool.stats(),
            fragmentation=self.fragmentation(),
        )
