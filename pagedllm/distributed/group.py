"""The collectives a tensor-parallel decoder runs, over one torch.distributed group.

Every rank calls them in the same order with tensors of the same shapes (the step's
batch is the same on every rank); that is what keeps the ranks in step. Each call's
wall time is added to ``seconds`` by kind (on rank 0 it includes waiting for the
slowest rank to arrive): what tensor parallelism costs, for the benchmark.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.distributed.shm_all_reduce import SharedMemoryAllReduce


def join_default_group(init_method: str, rank: int, world_size: int, timeout_s: float) -> None:
    """Join the default process group (gloo) as ``rank`` of ``world_size``.

    ``torch.distributed.nn`` is imported first: its functions take the default group as
    a default argument, read when the module is imported. Imported later (transformers
    imports it while a model loads), they would hold the group past
    ``destroy_process_group``, whose gloo threads then outlive it and may release a
    finished collective's tensors while the interpreter exits: an abort at exit."""
    import torch.distributed.nn  # noqa: F401

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


@dataclass
class TensorParallelGroup:
    """Rank ``rank`` of ``world_size`` in the default process group (gloo on the CPU);
    rank 0 schedules, samples and answers, the others follow it. ``shared``: the
    shared-memory all-reduce of ranks on one machine, once set up."""

    rank: int
    world_size: int
    seconds: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    shared: SharedMemoryAllReduce | None = None

    def use_shared_memory(self, slot_bytes: int, timeout_s: float | None) -> None:
        """Collective: all-reduce tensors of up to ``slot_bytes`` through shared memory
        when every rank is on this machine (else gloo goes on doing them)."""
        self.shared = SharedMemoryAllReduce.create(
            self.rank, self.world_size, slot_bytes, timeout_s
        )

    def _timed(self, kind: str, start: float) -> None:
        self.seconds[kind] += time.perf_counter() - start
        self.calls[kind] += 1

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` over the ranks, in place (after a row-parallel product)."""
        start = time.perf_counter()
        if self.shared is not None and self.shared.fits(x):
            self.shared.all_reduce(x)
        else:
            dist.all_reduce(x)
        self._timed("all_reduce", start)

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's ``x`` ``[rows, width]`` side by side ``[rows, world * width]`` on
        rank 0 (``None`` elsewhere): the vocabulary shards' logits, for the rows that
        sample only."""
        start = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        self._timed("gather", start)
        return torch.cat(parts, dim=1) if parts is not None else None

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's ``obj`` (picklable), on every rank: a step's plan or a command."""
        start = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        self._timed("broadcast", start)
        return box[0]

    def all_agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (each learns it)."""
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())
