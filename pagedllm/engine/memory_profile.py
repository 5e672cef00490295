"""Sizing the KV pool on a GPU from what a profiling step leaves free.

The method: with the weights loaded, run one forward pass of the largest step the
scheduler can plan (``max_num_batched_tokens`` tokens over up to ``max_num_seqs``
sequences, each sampling) and read the allocator's peak; everything the device holds
outside torch's allocator (the CUDA context, library workspaces) is measured too. The
KV pool gets what is left of ``gpu_memory_utilization`` of the device's memory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv.capacity import cdiv
from pagedllm.kv_storage.kv_cache import KVCache

logger = logging.getLogger("pagedllm")

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryProfile:
    """Bytes of one device: its total, the engine's share, and where that share goes.

    ``kv_budget = total * utilization - weights - peak_activations - non_torch``, never
    negative.
    """

    total: int
    utilization: float
    weights: int
    peak_activations: int
    non_torch: int

    @property
    def kv_budget(self) -> int:
        used = self.weights + self.peak_activations + self.non_torch
        return max(0, int(self.total * self.utilization) - used)

    def log(self) -> None:
        logger.info(
            "GPU memory: %.2f GiB x %.2f utilization = %.2f GiB; weights %.2f GiB, peak "
            "activations %.2f GiB, outside torch %.2f GiB; KV pool budget %.2f GiB",
            self.total / GiB,
            self.utilization,
            self.total * self.utilization / GiB,
            self.weights / GiB,
            self.peak_activations / GiB,
            self.non_torch / GiB,
            self.kv_budget / GiB,
        )


def profiling_batch(
    max_num_batched_tokens: int, max_num_seqs: int, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
    """Input ids, positions and metadata of the largest step (whole prompts laid out in
    consecutive blocks from block 0), and how many blocks its cache needs."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    lengths = [max_num_batched_tokens // num_seqs] * num_seqs
    for i in range(max_num_batched_tokens % num_seqs):
        lengths[i] += 1
    blocks_per_seq = [cdiv(n, block_size) for n in lengths]
    max_blocks = max(blocks_per_seq)
    tables = torch.full((num_seqs, max_blocks), -1, dtype=torch.int32)
    slots: list[int] = []
    positions: list[int] = []
    first = 0
    for row, (n, used) in enumerate(zip(lengths, blocks_per_seq, strict=True)):
        tables[row, :used] = torch.arange(first, first + used, dtype=torch.int32)
        slots.extend(first * block_size + i for i in range(n))
        positions.extend(range(n))
        first += used
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    starts = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(seq_lens, 0, out=starts[1:])
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=seq_lens.to(device),
        query_start_loc=starts.to(device),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
    )
    input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64, device=device)
    position_ids = torch.tensor(positions, dtype=torch.int64, device=device)
    return input_ids, position_ids, metadata, first


@torch.inference_mode()
def profile_memory(
    model: torch.nn.Module,
    make_attention: Callable[[KVCache], AttentionBackend],
    make_cache: Callable[[int], KVCache],
    max_num_batched_tokens: int,
    max_num_seqs: int,
    block_size: int,
    utilization: float,
    device: torch.device,
) -> MemoryProfile:
    """Run the largest step once on a scratch cache of ``make_cache(num_blocks)`` and
    measure; the scratch cache is freed before returning."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    weights = torch.cuda.memory_allocated(device)
    input_ids, positions, metadata, num_blocks = profiling_batch(
        max_num_batched_tokens, max_num_seqs, block_size, device
    )
    cache = make_cache(num_blocks)
    scratch = cache.nbytes
    torch.cuda.reset_peak_memory_stats(device)
    sample_rows = metadata.query_start_loc[1:] - 1
    hidden = model(input_ids, positions, make_attention(cache), metadata, sample_rows)
    logits = model.compute_logits(hidden)
    logits.log_softmax(dim=-1)  # the sampler's largest temporary
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - scratch
    del cache, hidden, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    return MemoryProfile(total, utilization, weights, max(0, peak), non_torch)
