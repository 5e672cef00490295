"""A process that is not the engine's: it runs its node's ranks and no engine.

That is node ``r > 0`` of a multi-node launch (``--node-rank r``), or a process torchrun
started with ``RANK > 0``. Its ranks run until node 0's engine stops them.
"""

from __future__ import annotations

import logging

from pagedllm.config import EngineConfig
from pagedllm.engine.tensor_parallel.launch import placement, threads_per_rank
from pagedllm.engine.tensor_parallel.worker import run_rank, start_ranks

logger = logging.getLogger("pagedllm")


def run_ranks_unless_engine(config: EngineConfig) -> int | None:
    """``None`` when this process is rank 0 (it goes on to build the engine); otherwise
    run this process's ranks until the engine stops them, and return the exit status."""
    if config.tensor_parallel_size == 1:
        return None
    place = placement(config)
    if place.rank == 0:
        return None
    threads = threads_per_rank(place.ranks_here)
    children = start_ranks(config, place.children, place.init_method, threads)
    level = logger.getEffectiveLevel()
    try:
        run_rank(config, place.rank, place.init_method, threads, log_level=level)
    except ValueError as error:
        logger.error("rank %d: %s", place.rank, error)
        return 2
    except Exception:
        logger.exception("rank %d failed", place.rank)
        return 1
    finally:
        for child in children:
            child.join()
    return max([0, *(abs(child.exitcode or 0) for child in children)])
