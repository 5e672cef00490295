"""Rank 0's side of tensor parallelism: it starts this machine's other ranks, joins the
process group, sends every step to the ranks, and turns any failure into one clear error.

Bounded failure: the engine's process waits at most ``distributed_timeout`` seconds in
any collective (a dead rank is usually seen at once: its connections close). On failure
it kills the ranks it started and raises :class:`WorkerFailedError` naming the rank
and how it ended; every later step raises the same error. Ranks started here never
outlive the engine: they are stopped on :meth:`shutdown` (also run at interpreter exit),
and killed by the kernel if the engine's process dies (see
:func:`~pagedllm.engine.tensor_parallel.worker.die_with_parent`).
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.errors import WorkerFailedError
from pagedllm.distributed.group import TensorParallelGroup, join_default_group
from pagedllm.engine.tensor_parallel.launch import placement, threads_per_rank
from pagedllm.engine.tensor_parallel.worker import StepWork, WorkerSetup, start_ranks

logger = logging.getLogger("pagedllm")

STOP_GRACE_S = 5.0
"""Seconds a rank gets to exit after the stop command before it is killed."""


class TensorParallelExecutor:
    """Rank 0 of ``config.tensor_parallel_size``: ``group`` is what its decoder joins."""

    def __init__(self, config: EngineConfig) -> None:
        place = placement(config)
        if place.rank != 0:
            raise ValueError(f"the engine runs on rank 0, not rank {place.rank}")
        self.timeout = config.distributed_timeout
        threads = threads_per_rank(place.ranks_here)
        torch.set_num_threads(threads)
        self.processes = start_ranks(config, place.children, place.init_method, threads)
        self.failure: WorkerFailedError | None = None
        self._stopped = False
        atexit.register(self.shutdown)
        with self.guard():
            join_default_group(place.init_method, 0, place.world_size, self.timeout)
        self.group = TensorParallelGroup(0, place.world_size)
        logger.info(
            "Tensor parallelism: %d ranks over %s (gloo), %d started here, %d threads each",
            place.world_size,
            place.init_method,
            len(self.processes),
            threads,
        )

    def start_ranks(self, setup: WorkerSetup) -> None:
        """Tell every rank the pool's size and rank 0's settings; they check the settings
        and allocate their caches. Raises :class:`WorkerFailedError` if a rank refuses."""
        with self.guard():
            self.group.broadcast_object(setup)
            if not self.group.all_agree(True):
                raise WorkerFailedError(
                    "a tensor-parallel rank was started with engine options other than "
                    "rank 0's (its log names them); give every node the same options"
                )
            if setup.all_reduce_bytes is not None:
                self.group.use_shared_memory(setup.all_reduce_bytes, self.timeout)
                how = (
                    "shared memory"
                    if self.group.shared
                    else (
                        "gloo: the ranks are on several machines, or a rank could not build the "
                        "shared-memory kernel (its warning says why)"
                    )
                )
                logger.info("Tensor-parallel all-reduces run through %s", how)

    def send_step(self, work: StepWork) -> None:
        self.group.broadcast_object(work)

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Run collectives; any failure stops the ranks and becomes a
        :class:`WorkerFailedError` (raised again by every later guard)."""
        if self.failure is not None:
            raise self.failure
        try:
            yield
        except Exception as error:
            if isinstance(error, WorkerFailedError):
                self.failure = error
            else:
                self.failure = WorkerFailedError(self._describe_failure(error))
            logger.error("%s", self.failure)
            self.shutdown()
            raise self.failure from error

    def _describe_failure(self, error: Exception) -> str:
        ended = []
        for process in self.processes:
            process.join(timeout=1.0)
            code = process.exitcode
            if code is None:
                continue
            how = f"exit code {code}" if code >= 0 else f"signal {signal.Signals(-code).name}"
            rank = process.name.removeprefix("pagedllm-rank")
            ended.append(f"rank {rank} (pid {process.pid}) ended with {how}")
        if ended:
            return "tensor-parallel " + "; ".join(ended) + "; the engine has stopped"
        return (
            f"a tensor-parallel step failed or a rank did not answer within "
            f"{self.timeout:g} s (distributed_timeout): {type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}; the engine has stopped"
        )

    def shutdown(self) -> None:
        """Stop every rank (politely when they can still hear, then by force) and leave
        the process group. Idempotent; registered to run at interpreter exit."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.shutdown)
        if self.failure is None and dist.is_initialized():
            try:
                self.group.broadcast_object(None)
                dist.barrier()  # every rank took it: connections close in order
            except Exception:  # a rank died meanwhile: it is killed below
                logger.warning("a tensor-parallel rank did not take the stop command")
        if self.failure is not None:  # ranks still inside a collective never return
            for process in self.processes:
                if process.is_alive():
                    process.kill()
        _stop_processes(self.processes)
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop_processes(processes: list[multiprocessing.process.BaseProcess]) -> None:
    """Wait for the ranks to exit, then kill those that did not."""
    for process in processes:
        process.join(timeout=STOP_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()
