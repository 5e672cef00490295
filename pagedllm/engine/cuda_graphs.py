"""CUDA graphs of decode-only steps, captured once at start-up, replayed every step.

A decode step of a large batch launches a few hundred small kernels; replaying a
captured graph launches them in one call. A graph replays exactly the kernels, launch
grids and memory addresses it was captured with, so each captured batch size has
static input buffers, and the attention metadata is shaped for the longest sequence
the engine allows (``max_model_len``) whatever the live batch holds.

Only the decoder runs in the graph; the LM head runs eagerly on the live rows, so no
captured size pays for a vocabulary-wide product over padding rows.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv.capacity import cdiv

logger = logging.getLogger("pagedllm")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8, up to ``max_num_seqs``
    (capped at 512), and ``max_num_seqs`` itself."""
    limit = min(max_num_seqs, 512)
    sizes = {size for size in (1, 2, 4) if size <= limit}
    sizes.update(range(8, limit + 1, 8))
    sizes.add(limit)
    return sorted(sizes)


class DecodeGraphs:
    """Captured decode steps of ``model`` for every batch size in ``sizes``.

    A live batch of ``b`` sequences runs in the graph of the smallest captured size
    ``>= b``. Rows past ``b`` are padding: their slot is ``-1`` (nothing is written) and
    they attend over one token of block 0; their outputs are dropped. Invariants of the
    static buffers: the block table has ``ceil(max_model_len / block_size)`` columns,
    ``max_seq_len`` is ``max_model_len``, ``query_start_loc`` is ``0, 1, ..., size``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        max_model_len: int,
        block_size: int,
        sizes: list[int],
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn = attn
        self.max_model_len = max_model_len
        self.sizes = sorted(sizes)
        largest = self.sizes[-1]
        max_blocks = cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        start = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # the largest first: the others reuse its pool
            self._forward(size)  # compiles and warms every kernel outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size)
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize(device)
        logger.info(
            "Captured CUDA graphs for %d decode batch sizes (1 to %d) in %.1f s",
            len(self.sizes),
            largest,
            time.monotonic() - start,
        )

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )

    def _forward(self, size: int) -> torch.Tensor:
        metadata = self._metadata(size)
        return self.model(self.input_ids[:size], self.positions[:size], self.attn, metadata)

    def can_run(self, metadata: AttentionMetadata, num_samples: int) -> bool:
        """Whether a batch is decode-only, every row samples, and a graph fits it."""
        return (
            metadata.max_query_len == 1
            and num_samples == metadata.num_seqs
            and metadata.num_seqs <= self.sizes[-1]
            and metadata.max_seq_len <= self.max_model_len
        )

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Float32 logits ``[num_seqs, vocab]`` of a batch :meth:`can_run` accepted."""
        live = metadata.num_seqs
        size = self.sizes[bisect.bisect_left(self.sizes, live)]
        self.input_ids[:live].copy_(input_ids)
        self.positions[:live].copy_(positions)
        self.slot_mapping[:live].copy_(metadata.slot_mapping)
        self.slot_mapping[live:size].fill_(-1)
        width = metadata.block_tables.shape[1]
        self.block_tables[:live, :width].copy_(metadata.block_tables)
        self.block_tables[live:size, 0].fill_(0)
        self.seq_lens[:live].copy_(metadata.seq_lens)
        self.seq_lens[live:size].fill_(1)
        graph, hidden = self._graphs[size]
        graph.replay()
        return self.model.compute_logits(hidden[:live])
