"""Fragmentation accounting, counted per physical block.

Units are token slots. A physical block provides ``block_size`` slots however many
tables hold it, so a shared block is counted once; its live tokens are the most any
holder has filled it with. For example (lengths 10 and 7, block size 4, tables
``[5, 1, 6]`` and ``[5, 3]`` sharing block 5) that gives 4 unique blocks, 16 slots,
4 + 6 + 3 = 13 live tokens, 3 slots of internal fragmentation, and 20 - 16 = 4 slots
saved by sharing (without sharing each sequence holds ``ceil(len / block_size)`` blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.capacity import cdiv


@dataclass(frozen=True)
class FragmentationStats:
    """Memory held by a set of block tables, in blocks and token slots."""

    unique_blocks: int
    allocated_slots: int
    live_tokens: int
    internal_fragmentation_slots: int
    slots_saved_by_sharing: int


def fragmentation_stats(
    block_tables: Sequence[Sequence[int]],
    seq_lens: Sequence[int],
    block_size: int,
    null_block: int | None = None,
) -> FragmentationStats:
    """Count the slots ``block_tables`` hold and how many of them hold live tokens.

    ``block_tables[i]`` maps sequence ``i`` (``seq_lens[i]`` tokens) to physical blocks.
    Negative ids are padding (as in a ``[num_seqs, max_blocks]`` tensor) and are skipped;
    the first ``ceil(seq_lens[i] / block_size)`` entries must be real blocks, or
    ``null_block`` (released by a sliding window: holds nothing, counted nowhere).
    """
    if len(block_tables) != len(seq_lens):
        raise ValueError(f"{len(block_tables)} block tables for {len(seq_lens)} lengths")
    filled: dict[int, int] = {}
    unshared_blocks = 0
    for table, seq_len in zip(block_tables, seq_lens, strict=True):
        needed = cdiv(seq_len, block_size)
        if len(table) < needed or any(block_id < 0 for block_id in table[:needed]):
            raise ValueError(f"block table {list(table)} cannot hold {seq_len} tokens")
        unshared_blocks += needed - sum(block_id == null_block for block_id in table[:needed])
        for logical, block_id in enumerate(table):
            if block_id < 0 or block_id == null_block:
                continue
            tokens_here = min(block_size, max(0, seq_len - logical * block_size))
            filled[block_id] = max(filled.get(block_id, 0), tokens_here)
    allocated = len(filled) * block_size
    live = sum(filled.values())
    return FragmentationStats(
        unique_blocks=len(filled),
        allocated_slots=allocated,
        live_tokens=live,
        internal_fragmentation_slots=allocated - live,
        slots_saved_by_sharing=unshared_blocks * block_size - allocated,
    )
