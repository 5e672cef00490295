"""Where a workload's tokens land: contiguous reservation against paged blocks.

A simulation for pictures and counts, not the engine's allocator: sequences grow in
step, so on-demand allocation hands out blocks round-robin and a sequence's blocks end
up scattered through the pool, as in a running engine. Units: tokens and block ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.kv.capacity import blocks_for_tokens

SHARED_OWNER = -1


@dataclass(frozen=True)
class BlockUse:
    """Physical block ``block_id`` holds ``filled`` of its slots for ``owner`` (a sequence
    index, or :data:`SHARED_OWNER` for a prefix block every sequence reads)."""

    block_id: int
    owner: int
    filled: int


def paged_layout(
    lengths: Sequence[int], block_size: int, prefix_len: int = 0, window: int | None = None
) -> list[BlockUse]:
    """Blocks of sequences of ``lengths`` tokens allocated on demand, in block id order.

    The first ``prefix_len`` tokens of every sequence are shared: their full blocks come
    first and are held once; the rest of each sequence takes private blocks, one per
    sequence per round while it still grows. Invariant: sequence ``i`` reads
    ``ceil(lengths[i] / block_size)`` blocks; only the last block of each holder is
    partly empty. With a ``window`` (every layer sliding over that many tokens) a
    sequence keeps only the blocks its last token's window reads; the others were
    released (a shared block goes when no sequence keeps it).
    """
    if any(length < prefix_len for length in lengths):
        raise ValueError(f"every sequence must hold the {prefix_len}-token shared prefix")
    first_held = [
        0 if window is None else max(0, length - window) // block_size for length in lengths
    ]
    num_shared = prefix_len // block_size
    kept_shared = range(min(first_held, default=0), num_shared)
    blocks = [BlockUse(i, SHARED_OWNER, block_size) for i in range(len(kept_shared))]
    shared_tokens = num_shared * block_size
    private = [blocks_for_tokens(length, block_size) - num_shared for length in lengths]
    for round_index in range(max(private, default=0)):
        for owner, length in enumerate(lengths):
            logical = num_shared + round_index
            if round_index < private[owner] and logical >= first_held[owner]:
                start = shared_tokens + round_index * block_size
                filled = min(block_size, length - start)
                blocks.append(BlockUse(len(blocks), owner, filled))
    return blocks
