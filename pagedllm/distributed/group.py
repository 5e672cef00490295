"""The collectives a tensor-parallel decoder runs, over one torch.distributed group.

Every rank calls them in the same order with tensors of the same shapes (the step's
batch is the same on every rank); that is what keeps the ranks in step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TensorParallelGroup:
    """Rank ``rank`` of ``world_size`` in the default process group (gloo on the CPU,
    NCCL on CUDA); rank 0 schedules, samples and answers, the others follow it."""

    rank: int
    world_size: int

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place (after a row-parallel product)."""
        dist.all_reduce(x)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` ``[rows, width]`` side by side ``[rows, world * width]`` on
        rank 0 (``None`` elsewhere): the vocabulary shards' logits, for the rows that
        sample only."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=1) if parts is not None else None

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` (picklable), on every rank: a step's plan or a command."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
