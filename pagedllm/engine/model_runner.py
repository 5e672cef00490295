"""Turns a scheduler plan into one flattened forward pass and the logits to sample.

The batch is every scheduled token of every sequence, concatenated in plan order,
with no padding. Only rows that end a sequence's known tokens are projected to the
vocabulary: a prefill chunk that stops short of the prompt's end samples nothing. A
sequence running guessed tokens (speculative decoding) has them after its known token,
and each of their rows is projected too: ``1 + guesses`` rows, in order.
Rows of prompt positions whose logprobs a request asked for (``prompt_logprobs``) come
back as final hidden states, from the same pass, for the engine to score.

The batch is built on the host; on a CUDA device it travels in one pinned,
asynchronous copy per tensor, and decode-only batches replay a captured CUDA graph
when one was captured for their size (:mod:`pagedllm.engine.cuda_graphs`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.engine.block_table_rows import BlockTableRows
from pagedllm.engine.cuda_graphs import DecodeGraphs
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.sequence import TokenSequence
from pagedllm.kv.capacity import cdiv
from pagedllm.models.layer_stack import LayerStack


@dataclass
class ModelInput:
    """One flattened batch: token ids and positions ``[T]``, attention metadata, the
    rows that sample (per sequence whose known tokens end in this batch, its last known
    token's row, then one per guessed token), and the
    rows of prompt positions owed logprobs, sequence by sequence (``prompt_spans``:
    each sequence with its positions, in ``prompt_rows`` order)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: torch.Tensor
    prompt_rows: torch.Tensor
    prompt_spans: list[tuple[TokenSequence, range]]


@dataclass
class ModelOutput:
    """Float32 logits ``[len(sample_rows), vocab]`` and the final hidden states
    ``[len(prompt_rows), hidden_size]`` of the prompt positions owed logprobs."""

    logits: torch.Tensor
    prompt_hidden: torch.Tensor


class ModelRunner:
    """Runs ``model`` over a plan; K/V go through ``attn`` into the paged cache.

    ``device`` is where the model, the cache and the batch tensors live. ``graphs``,
    when given, replays decode-only batches it has captured. The runner never reads the
    block manager: every sequence's block table arrives as deltas in the plans, one per
    KV layer group (``layer_groups``: each layer's, empty for one group of every layer;
    :mod:`pagedllm.kv.layer_groups`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        block_size: int,
        max_model_len: int,
        device: torch.device | str = "cpu",
        layer_groups: tuple[int, ...] = (),
    ):
        self.model = model
        self.attn = attn
        self.block_size = block_size
        columns = cdiv(max_model_len, block_size)
        self.layer_groups = layer_groups
        num_groups = 1 + max(layer_groups, default=0)
        self.group_tables = [BlockTableRows(columns) for _ in range(num_groups)]
        self.device = torch.device(device)
        self.graphs: DecodeGraphs | None = None
        self.layer_stack: LayerStack | None = None

    def build_batch(self, plan: SchedulerOutput) -> ModelInput:
        """The plan as one batch; applies its block-table deltas to the runner's
        persistent tables first."""
        for tables in self.group_tables:
            tables.release(plan.released)
        tables = self.group_tables[0]
        more_tables = self.group_tables[1:]
        more_slots: list[list[int]] = [[] for _ in more_tables]
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        seq_ids: list[int] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[TokenSequence, range]] = []
        for item in plan.scheduled:
            seq = item.seq
            if item.new_block_ids:
                tables.update(seq.seq_id, item.table_start, item.new_block_ids)
            if more_tables:  # KV layer groups
                for group_tables, group_slots, delta in zip(
                    more_tables, more_slots, item.more_groups, strict=True
                ):
                    if delta.new_block_ids:
                        group_tables.update(seq.seq_id, delta.table_start, delta.new_block_ids)
                    group_slots.extend(delta.slots)
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
            owed = seq.prompt_logprob_positions(item.num_tokens)
            if owed:
                first_row = len(token_ids) - start
                prompt_rows.extend(range(first_row + owed.start, first_row + owed.stop))
                prompt_spans.append((seq, owed))
            if item.num_tokens == 1:
                token_ids.append(seq.all_token_ids[start])
                positions.append(start)
            else:
                token_ids.extend(seq.all_token_ids[start : start + item.num_known_tokens])
                token_ids.extend(item.draft_token_ids)
                positions.extend(range(start, end))
            slots.extend(item.slots)
            seq_lens.append(end)
            query_lens.append(item.num_tokens)
            seq_ids.append(seq.seq_id)
        query_start_loc = np.zeros(len(plan.scheduled) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        max_seq_len = max(seq_lens)
        width = cdiv(max_seq_len, self.block_size)
        metadata = AttentionMetadata(
            slot_mapping=self.to_device(torch.tensor(slots, dtype=torch.int64)),
            block_tables=self.to_device(torch.from_numpy(tables.gather(seq_ids, width))),
            seq_lens=self.to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            query_start_loc=self.to_device(torch.from_numpy(query_start_loc)),
            max_query_len=max(query_lens),
            max_seq_len=max_seq_len,
        )
        metadata.more_groups = tuple(
            dataclasses.replace(
                metadata,
                slot_mapping=self.to_device(torch.tensor(group_slots, dtype=torch.int64)),
                block_tables=self.to_device(torch.from_numpy(group_tables.gather(seq_ids, width))),
            )
            for group_tables, group_slots in zip(more_tables, more_slots, strict=True)
        )
        if more_tables:
            metadata.layer_groups = self.layer_groups
        sample_rows = [
            int(query_start_loc[row + 1]) - 1 - guess
            for row, item in enumerate(plan.scheduled)
            if item.will_sample
            for guess in range(len(item.draft_token_ids), -1, -1)
        ]
        return ModelInput(
            self.to_device(torch.tensor(token_ids, dtype=torch.int64)),
            self.to_device(torch.tensor(positions, dtype=torch.int64)),
            metadata,
            self.to_device(torch.tensor(sample_rows, dtype=torch.int64)),
            self.to_device(torch.tensor(prompt_rows, dtype=torch.int64)),
            prompt_spans,
        )

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` itself on the CPU; elsewhere a copy made from pinned memory without
        waiting (the step's kernels are queued behind it on the same stream)."""
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def forward(
        self,
        batch: ModelInput,
        logits_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> ModelOutput:
        """The sampling rows' logits (the model's, or ``logits_of`` their final hidden
        states) and the owed prompt rows' hidden states."""
        num_samples, metadata = len(batch.sample_rows), batch.metadata
        if not len(batch.prompt_rows):
            graphs = self.graphs if logits_of is None else None
            if graphs is not None and graphs.can_run(metadata, num_samples):
                logits = graphs.run(batch.input_ids, batch.positions, metadata)
                return ModelOutput(logits, logits.new_empty(0))
            rows = batch.sample_rows
        else:
            rows = torch.cat([batch.sample_rows, batch.prompt_rows])
        stack = self.layer_stack
        if stack is not None and stack.attn.routes_to_sdpa(metadata):
            stack = None  # the C++ stack runs the paged kernel only
        hidden = self.model(batch.input_ids, batch.positions, self.attn, metadata, rows, stack)
        logits = (logits_of or self.model.compute_logits)(hidden[:num_samples])
        return ModelOutput(logits, hidden[num_samples:])
