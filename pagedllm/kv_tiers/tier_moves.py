"""A step's moves between the pool and the lower tiers, in the order they were planned.

The scheduler plans them while it allocates (an eviction spills, a hit found below the
pool fills), and they must run in that order: a slot demoted to disk before a spill
overwrites it, a spill read before a fill or any later write reuses its pool block.
The executor runs them after the plan's swap-outs and before its swap-ins, copies on
write and forward pass (:class:`~pagedllm.kv_storage.block_copies.BlockCopies`): every
block a plan evicts still holds what it held before the plan, and every block a fill
writes is read only by that pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class MoveKind(Enum):
    DEMOTE = "demote"  # host slot -> disk entry (the slot is about to be reused)
    SPILL = "spill"  # pool block -> host slot (the pool evicted the block)
    FILL = "fill"  # host slot -> pool block (a hit below the pool)


@dataclass(frozen=True)
class TierMove:
    """One move of one block's bytes: ``slot`` in the host tier, ``block_id`` in the pool
    (-1 for a demotion), ``digest`` the block's content key."""

    kind: MoveKind
    slot: int
    block_id: int
    digest: bytes
