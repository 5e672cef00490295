"""All-reduce through shared memory, for tensor-parallel ranks on one machine.

gloo sums a tensor over TCP round trips on the loopback device; a decoder step runs two
all-reduces per layer, mostly of small tensors, so their latency adds up. Ranks on one
machine instead map one buffer (a file in ``/dev/shm``, unlinked once every rank has
mapped it, so nothing is left behind whatever happens): each rank copies its tensor into
its slot and publishes a counter, waits for every other rank's counter, and sums the
slots in rank order (every rank gets the same bits). See ``shm_all_reduce.cpp``.

Tensors larger than a slot, ranks on different machines, or a machine where the kernel
cannot be built fall back to gloo. While waiting, a rank checks every ``POLL_S`` that
the other ranks' processes are alive, and gives up after the group's timeout.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.cpu.build import build_failure_reason, load_library

logger = logging.getLogger("pagedllm")

SOURCE = Path(__file__).with_name("shm_all_reduce.cpp")
SHM_DIR = Path("/dev/shm")
MAX_SLOT_BYTES = 64 << 20
"""Largest tensor sent through shared memory; larger ones go through gloo."""
HEADER_BYTES = 4096
"""Room for the ranks' counters (one 64-byte cache line each) before the slots."""
POLL_S = 0.2


@functools.cache
def library() -> Any | None:
    """``torch.ops.pagedllm_shm``, built on first use; None when it cannot be built."""
    try:
        load_library("pagedllm_shm", [str(SOURCE)], ["-O3", "-march=native"])
    except Exception as error:  # no compiler: gloo does the all-reduces
        reason = build_failure_reason(error)
        logger.warning("shared-memory all-reduce unavailable (%s); using gloo", reason)
        return None
    return torch.ops.pagedllm_shm


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (an exited process not yet reaped does not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


class SharedMemoryAllReduce:
    """This rank's view of one buffer shared by ``world`` ranks of one machine;
    ``peers``: every rank's process id; ``timeout_s``: longest wait for the others
    (``None``: no limit)."""

    def __init__(
        self,
        rank: int,
        world: int,
        buffer: mmap.mmap,
        slot_bytes: int,
        peers: list[int],
        timeout_s: float | None,
    ) -> None:
        self.rank, self.world = rank, world
        self._mapping = buffer
        self.buffer = torch.frombuffer(buffer, dtype=torch.uint8)
        self.slot_bytes = slot_bytes
        self.peers = peers
        self.timeout_s = timeout_s
        self.generation = 0
        self.ops = library()

    @classmethod
    def create(
        cls, rank: int, world: int, slot_bytes: int, timeout_s: float | None
    ) -> SharedMemoryAllReduce | None:
        """Collective over the default group: the shared buffer on every rank, or
        ``None`` on every rank when one cannot have it (another machine, no kernel)."""
        slot_bytes = min(slot_bytes, MAX_SLOT_BYTES)
        here = (socket.gethostname(), os.getpid(), SHM_DIR.is_dir() and library() is not None)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, here)
        if len({host for host, _, _ in everyone}) > 1 or not all(ok for *_, ok in everyone):
            return None
        size = HEADER_BYTES + 2 * world * slot_bytes
        path = None
        if rank == 0:
            fd, path = tempfile.mkstemp(prefix="pagedllm-tp-", dir=SHM_DIR)
            os.ftruncate(fd, size)
            os.close(fd)
        box = [path]
        dist.broadcast_object_list(box, src=0)
        fd = os.open(box[0], os.O_RDWR)
        try:
            buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier()
        if rank == 0:
            os.unlink(box[0])  # the mappings keep it; nothing outlives the ranks
        peers = [pid for _, pid, _ in everyone]
        return cls(rank, world, buffer, slot_bytes, peers, timeout_s)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.nbytes <= self.slot_bytes

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum ``x`` (contiguous, at most ``slot_bytes``) over the ranks, in place."""
        self.generation += 1
        ops, gen = self.ops, self.generation
        ops.post(x, self.buffer, self.rank, self.world, gen, HEADER_BYTES, self.slot_bytes)
        start, slot = time.monotonic(), self.slot_bytes
        while not ops.reduce(x, self.buffer, self.world, gen, HEADER_BYTES, slot, POLL_S):
            for rank, pid in enumerate(self.peers):
                if not process_alive(pid):
                    raise RuntimeError(f"rank {rank} (pid {pid}) is gone")
            if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
                raise RuntimeError(
                    f"the ranks did not all reach the all-reduce within {self.timeout_s:g} s"
                )
