"""Where this process sits among the tensor-parallel ranks, and how they meet.

Three ways to start ``tensor_parallel_size = N`` ranks:

- one machine (``nnodes = 1``): the engine's process is rank 0 and starts ranks
  ``1 .. N-1`` itself; they meet on 127.0.0.1 at ``master_port`` (default: a free port);
- several machines: the same command on each, with ``--nnodes``, ``--node-rank``,
  ``--master-addr`` (node 0's address) and ``--master-port``; node ``r`` runs ranks
  ``r * N / nnodes ..``: its first in the command's own process, the rest as children.
  Node 0's first rank is the engine; the other nodes run only their share of each step;
- torchrun: every process torchrun starts is one rank (``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR``, ``MASTER_PORT`` in its environment); rank 0 is the engine.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from pagedllm.config import EngineConfig

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Placement:
    """This process's rank of ``world_size``, the ranks it starts as child processes
    (``children``), and the rendezvous address every rank connects to."""

    rank: int
    world_size: int
    children: tuple[int, ...]
    init_method: str

    @property
    def ranks_here(self) -> int:
        """Ranks this process runs or starts (they share this machine's cores)."""
        return 1 + len(self.children)


def placement(config: EngineConfig, env: Mapping[str, str] = os.environ) -> Placement:
    """Where this process sits, from the config, or from torchrun's environment when it
    is there (then ``WORLD_SIZE`` must equal ``tensor_parallel_size``)."""
    world = config.tensor_parallel_size
    if all(name in env for name in TORCHRUN_VARIABLES):
        if int(env["WORLD_SIZE"]) != world:
            raise ValueError(
                f"torchrun started {env['WORLD_SIZE']} processes, but tensor_parallel_size "
                f"is {world}; start one process per rank"
            )
        # env:// meets at torchrun's own store (its agent already holds MASTER_PORT)
        return Placement(int(env["RANK"]), world, (), "env://")
    per_node = world // config.nnodes
    first = config.node_rank * per_node
    port = config.master_port if config.master_port is not None else free_port()
    address = f"tcp://{config.master_addr}:{port}"
    return Placement(first, world, tuple(range(first + 1, first + per_node)), address)


def free_port() -> int:
    """A TCP port nobody listens on now, on 127.0.0.1."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def threads_per_rank(ranks_here: int, env: Mapping[str, str] = os.environ) -> int:
    """Compute threads for each rank on this machine: ``OMP_NUM_THREADS`` when set,
    else this process's cores shared evenly among its ranks."""
    if "OMP_NUM_THREADS" in env:
        return max(1, int(env["OMP_NUM_THREADS"]))
    return max(1, len(os.sched_getaffinity(0)) // ranks_here)
