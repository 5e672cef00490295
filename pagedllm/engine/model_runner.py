"""Turns a scheduler plan into one flattened forward pass and the logits to sample.

The batch is every scheduled token of every sequence, concatenated in plan order,
with no padding. Only rows that end a sequence's known tokens are projected to the
vocabulary: a prefill chunk that stops short of the prompt's end samples nothing.

The batch is built on the host; on a CUDA device it travels in one pinned,
asynchronous copy per tensor, and decode-only batches replay a captured CUDA graph
when one was captured for their size (:mod:`pagedllm.engine.cuda_graphs`).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.engine.block_table_rows import BlockTableRows
from pagedllm.engine.cuda_graphs import DecodeGraphs
from pagedllm.engine.scheduler import SchedulerOutput


class ModelRunner:
    """Runs ``model`` over a plan; K/V go through ``attn`` into the paged cache.

    ``device`` is where the model, the cache and the batch tensors live. ``graphs``,
    when given, replays decode-only batches it has captured. The runner never reads the
    block manager: every sequence's block table arrives as deltas in the plans.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        block_size: int,
        max_model_len: int,
        device: torch.device | str = "cpu",
    ):
        self.model = model
        self.attn = attn
        self.block_size = block_size
        self.block_tables = BlockTableRows(-(-max_model_len // block_size))
        self.device = torch.device(device)
        self.graphs: DecodeGraphs | None = None

    def build_batch(
        self, plan: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Input ids, positions, attention metadata and the row index of each sample.

        Applies the plan's block-table deltas to the runner's persistent tables first.
        """
        tables = self.block_tables
        tables.release(plan.released)
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        seq_ids: list[int] = []
        for item in plan.scheduled:
            seq = item.seq
            if item.new_block_ids:
                tables.update(seq.seq_id, item.table_start, item.new_block_ids)
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
            if item.num_tokens == 1:
                token_ids.append(seq.all_token_ids[start])
                positions.append(start)
            else:
                token_ids.extend(seq.all_token_ids[start:end])
                positions.extend(range(start, end))
            slots.extend(item.slots)
            seq_lens.append(end)
            query_lens.append(item.num_tokens)
            seq_ids.append(seq.seq_id)
        query_start_loc = np.zeros(len(plan.scheduled) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        max_seq_len = max(seq_lens)
        block_tables = tables.gather(seq_ids, -(-max_seq_len // self.block_size))
        metadata = AttentionMetadata(
            slot_mapping=self._to_device(torch.tensor(slots, dtype=torch.int64)),
            block_tables=self._to_device(torch.from_numpy(block_tables)),
            seq_lens=self._to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            query_start_loc=self._to_device(torch.from_numpy(query_start_loc)),
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len,
        )
        sample_rows = [
            int(query_start_loc[row + 1]) - 1
            for row, item in enumerate(plan.scheduled)
            if item.will_sample
        ]
        return (
            self._to_device(torch.tensor(token_ids, dtype=torch.int64)),
            self._to_device(torch.tensor(positions, dtype=torch.int64)),
            metadata,
            self._to_device(torch.tensor(sample_rows, dtype=torch.int64)),
        )

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` itself on the CPU; elsewhere a copy made from pinned memory without
        waiting (the step's kernels are queued behind it on the same stream)."""
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        sample_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Float32 logits ``[len(sample_rows), vocab]`` for the rows that sample."""
        if self.graphs is not None and self.graphs.can_run(metadata, len(sample_rows)):
            return self.graphs.run(input_ids, positions, metadata)
        hidden = self.model(input_ids, positions, self.attn, metadata, sample_rows)
        return self.model.compute_logits(hidden)
