"""A step's block moves, applied to one cache (and its swap space) in the order the
scheduler's invariants need: blocks leave the pool (swap-out) before they are reused,
a compact one freed there possibly as the target of a re-encoding; full blocks are
re-encoded into compact ones next (the full block freed may take any later move); then
blocks come back (swap-in) and are copied on write. A re-encoding reads only blocks its
sequence still holds, which no swap-out writes. The moves to and from the prefix
cache's lower tiers run right after the swap-outs, in planned order
(:mod:`pagedllm.kv_tiers.tier_moves`): a block a plan evicts still holds what it held
before the plan, and a block a fill writes is new to its sequence. Read-ahead copies
(parked blocks restored ahead of their swap-in into free cached blocks no sequence of
the step touches) start last and run beside the forward pass; the next step's moves
wait for them first. Under tensor parallelism every rank applies the same moves to its
own slice of the cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_storage.swap_space import SwapSpace

if TYPE_CHECKING:
    from pagedllm.kv_tiers.tier_moves import TierMove
    from pagedllm.kv_tiers.tiered_cache import TieredCache


@dataclass(frozen=True)
class BlockCopies:
    """``(src, dst)`` block pairs: pool -> swap space, swap space -> pool, within the
    pool (copy-on-write), full -> compact (re-encoded by age), and swap space -> pool
    ahead of a swap-in (read-ahead); and the moves between the pool and the lower
    tiers."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copy_on_write: list[tuple[int, int]]
    encodes: list[tuple[int, int]] = field(default_factory=list)
    tier_moves: list[TierMove] = field(default_factory=list)
    read_ahead: list[tuple[int, int]] = field(default_factory=list)

    def apply(
        self, cache: KVCache, swap_space: SwapSpace | None, tiers: TieredCache | None = None
    ) -> None:
        """Apply the moves to ``cache`` (and ``swap_space``, ``tiers``: a cache without
        tiers, a draft model's, skips their moves; it recomputes what they restore)."""
        if swap_space is not None:
            swap_space.finish_read_ahead()
            swap_space.copy_out(self.swap_out)
        if tiers is not None and self.tier_moves:
            tiers.apply(self.tier_moves)
        if self.encodes:
            cache.encode_blocks(self.encodes)
        if swap_space is not None:
            swap_space.copy_in(self.swap_in)
        if self.copy_on_write:
            cache.copy_blocks(self.copy_on_write)
        if swap_space is not None:
            swap_space.start_read_ahead(self.read_ahead)
