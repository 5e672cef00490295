"""A step's block moves, applied to one cache (and its swap space) in the order the
scheduler's invariants need: blocks leave the pool (swap-out) before they are reused,
a compact one freed there possibly as the target of a re-encoding; full blocks are
re-encoded into compact ones next (the full block freed may take any later move); then
blocks come back (swap-in) and are copied on write. A re-encoding reads only blocks its
sequence still holds, which no swap-out writes. Under tensor parallelism every rank
applies the same moves to its own slice of the cache."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_storage.swap_space import SwapSpace


@dataclass(frozen=True)
class BlockCopies:
    """``(src, dst)`` block pairs: pool -> swap space, swap space -> pool, within the
    pool (copy-on-write), and full -> compact (re-encoded by age)."""

    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    copy_on_write: list[tuple[int, int]]
    encodes: list[tuple[int, int]] = field(default_factory=list)

    def apply(self, cache: KVCache, swap_space: SwapSpace | None) -> None:
        if swap_space is not None:
            swap_space.copy_out(self.swap_out)
        if self.encodes:
            cache.encode_blocks(self.encodes)
        if swap_space is not None:
            swap_space.copy_in(self.swap_in)
        if self.copy_on_write:
            cache.copy_blocks(self.copy_on_write)
