"""A tensor-parallel rank other than 0: it loads its slice of the model, then runs its
share of every step rank 0 sends, until rank 0 says stop.

Per step it receives a :class:`StepWork` (the block moves and the flattened batch rank 0
built), applies the moves to its cache, runs the same forward pass over its heads, and
joins the collectives: the all-reduces of every layer and the gathers of logits (the
sampling rows', then the prompt-logprob rows' through the same
:func:`~pagedllm.engine.prompt_logprobs.prompt_logits` slices rank 0 scores). It
never samples, and holds no scheduler or block manager.

A rank started by the engine dies with it (``PR_SET_PDEATHSIG`` on Linux), ignores
SIGINT (the engine's process handles Ctrl-C and stops its ranks), and exits non-zero on
any error, which the engine's next collective sees at once.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig
from pagedllm.distributed.group import TensorParallelGroup, join_default_group
from pagedllm.engine.model_runner import ModelInput
from pagedllm.engine.model_worker import ModelWorker
from pagedllm.engine.prompt_logprobs import prompt_logits
from pagedllm.kv_storage.block_copies import BlockCopies
from pagedllm.models.loader import load_model_for

logger = logging.getLogger("pagedllm")

WAIT_FOR_STEPS_S = 365 * 24 * 3600.0
"""Seconds a rank waits for rank 0's next step: an idle engine sends none."""

PR_SET_PDEATHSIG = 1


SHARED_SETTINGS = (
    "model",
    "load_format",
    "quantization",
    "activation_quantization",
    "dtype",
    "kv_cache_dtype",
    "kv_recent_tokens",
    "kv_recent_dtype",
    "kv_layer_groups",
    "kv_allocation",
    "block_size",
    "tensor_parallel_size",
)
"""Engine settings every rank must share (each node reads its own command line)."""


@dataclass(frozen=True)
class WorkerSetup:
    """Sent once by rank 0 after it sized the pool: its :data:`SHARED_SETTINGS`, the
    cache every rank allocates (blocks, window null block included), the runner's table
    width, swap blocks, the largest all-reduce (bytes) to run through shared memory
    (``None``: gloo only), and the compact blocks of the cache and of the swap space
    (``kv_cache_dtype="int4"``)."""

    settings: dict[str, object]
    num_cache_blocks: int
    max_model_len: int
    swap_blocks: int
    all_reduce_bytes: int | None
    num_compact_blocks: int = 0
    swap_compact_blocks: int = 0


def shared_settings(config: EngineConfig) -> dict[str, object]:
    return {name: getattr(config, name) for name in SHARED_SETTINGS}


@dataclass(frozen=True)
class StepWork:
    """One step for every rank: block moves, then the batch as numpy arrays (they pickle
    as raw bytes; a torch tensor pickles through ``torch.save``, 25x slower) and its two
    host-side maxima. The prompt spans stay on rank 0: the prompt rows say how many
    logprob rows are gathered."""

    copies: BlockCopies
    arrays: dict[str, np.ndarray]
    max_query_len: int
    max_seq_len: int

    @classmethod
    def of(cls, copies: BlockCopies, batch: ModelInput) -> StepWork:
        meta = batch.metadata
        tensors = {
            "input_ids": batch.input_ids,
            "positions": batch.positions,
            "sample_rows": batch.sample_rows,
            "prompt_rows": batch.prompt_rows,
            "slot_mapping": meta.slot_mapping,
            "block_tables": meta.block_tables,
            "seq_lens": meta.seq_lens,
            "query_start_loc": meta.query_start_loc,
        }
        for group, more in enumerate(meta.more_groups, start=1):  # KV layer groups
            tensors[f"slot_mapping.{group}"] = more.slot_mapping
            tensors[f"block_tables.{group}"] = more.block_tables
        if meta.more_groups:
            tensors["layer_groups"] = torch.tensor(meta.layer_groups)
        arrays = {name: t.numpy() for name, t in tensors.items()}
        return cls(copies, arrays, meta.max_query_len, meta.max_seq_len)

    def batch(self) -> ModelInput:
        t = {name: torch.from_numpy(array) for name, array in self.arrays.items()}
        metadata = AttentionMetadata(
            t["slot_mapping"],
            t["block_tables"],
            t["seq_lens"],
            t["query_start_loc"],
            self.max_query_len,
            self.max_seq_len,
        )
        num_more = sum(name.startswith("slot_mapping.") for name in t)
        metadata.more_groups = tuple(
            dataclasses.replace(
                metadata,
                slot_mapping=t[f"slot_mapping.{group}"],
                block_tables=t[f"block_tables.{group}"],
            )
            for group in range(1, 1 + num_more)
        )
        if num_more:
            metadata.layer_groups = tuple(self.arrays["layer_groups"].tolist())
        rows = t["sample_rows"], t["prompt_rows"]
        return ModelInput(t["input_ids"], t["positions"], metadata, *rows, prompt_spans=[])


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when its parent dies, then make sure it has not
    already died (the request races with the parent's exit)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)


def run_rank(
    config: EngineConfig,
    rank: int,
    init_method: str,
    threads: int,
    parent_pid: int | None = None,
    log_level: int = logging.WARNING,
) -> None:
    """Run rank ``rank`` (> 0) of ``config.tensor_parallel_size`` until rank 0 stops it;
    ``parent_pid``: the engine process that started it, if one did."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    log_format = f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=log_level, format=log_format)
    torch.set_num_threads(threads)
    world = config.tensor_parallel_size
    join_default_group(init_method, rank, world, WAIT_FOR_STEPS_S)
    try:
        _serve(config, TensorParallelGroup(rank, world))
        dist.barrier()  # rank 0's stop reached every rank: connections close in order
    finally:
        dist.destroy_process_group()


def _serve(config: EngineConfig, group: TensorParallelGroup) -> None:
    loaded = load_model_for(config, group)
    setup = group.broadcast_object()
    if not isinstance(setup, WorkerSetup):
        return  # rank 0 failed before it sized the pool, and says stop
    differ = {
        name: (value, setup.settings[name])
        for name, value in shared_settings(config).items()
        if value != setup.settings[name]
    }
    if not group.all_agree(not differ):
        if not differ:
            raise ValueError("another rank was started with settings other than rank 0's")
        raise ValueError(
            f"rank {group.rank} was started with other settings than rank 0 "
            f"(this rank's, rank 0's): {differ}; give every node the same engine options"
        )
    if setup.all_reduce_bytes is not None:
        group.use_shared_memory(setup.all_reduce_bytes, timeout_s=None)
    worker = ModelWorker(
        config,
        loaded.model,
        setup.num_cache_blocks,
        setup.max_model_len,
        setup.swap_blocks,
        group.rank,
        setup.num_compact_blocks,
        setup.swap_compact_blocks,
    )
    compute_logits = loaded.model.compute_logits
    with torch.inference_mode():
        while isinstance(work := group.broadcast_object(), StepWork):
            output = worker.execute(work.copies, work.batch())
            for _ in prompt_logits(compute_logits, output.prompt_hidden):
                pass  # this rank's share of the gathers rank 0 scores


def start_ranks(
    config: EngineConfig, ranks: tuple[int, ...], init_method: str, threads: int
) -> list[multiprocessing.process.BaseProcess]:
    """Start ``ranks`` as child processes of this one (spawned: a fresh interpreter
    each), logging at this process's level; they die with it."""
    context = multiprocessing.get_context("spawn")
    level = logger.getEffectiveLevel()
    processes = [
        context.Process(
            target=run_rank,
            args=(config, rank, init_method, threads, os.getpid(), level),
            name=f"pagedllm-rank{rank}",
            daemon=True,
        )
        for rank in ranks
    ]
    for process in processes:
        process.start()
    return processes
