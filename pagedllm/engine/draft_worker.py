"""The draft model of ``draft_model`` speculation, with its K/V cache.

The draft's cache is indexed by the target pool's block ids: block ``b`` of the draft
cache holds the draft's K/V of the tokens that block ``b`` of the pool holds for the
target. One allocation (the block manager's) then serves both models, and every block
move of a step (swap out, swap in, copy on write) is applied to both caches, so a
block's draft K/V travel with its target K/V. The pool's block bytes count both
(:func:`draft_block_bytes`).

Past the pool's blocks the draft cache has ``num_scratch_blocks`` blocks of its own:
guessed positions that fall beyond a sequence's last pool block are written there
while the draft runs, and forgotten after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.config import EngineConfig, resolve_dtype
from pagedllm.engine.draft_head import DraftHead
from pagedllm.engine.model_runner import ModelInput
from pagedllm.engine.model_worker import make_runner, make_swap_space
from pagedllm.kv.capacity import draft_scratch_blocks
from pagedllm.kv_storage.block_copies import BlockCopies
from pagedllm.kv_storage.kv_cache import KVCache, bytes_per_block
from pagedllm.models.loader import LoadedModel, load_model
from pagedllm.models.weight_bytes import describe_weight_bytes
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.draft_vocab import check_same_vocabulary

logger = logging.getLogger("pagedllm")


def load_draft(config: EngineConfig, target: LoadedModel) -> LoadedModel:
    """The ``draft_model`` checkpoint of ``config.speculative_config``, loaded with its
    own quantization, dtype and activation rounding; ValueError naming the difference
    when its vocabulary is not the target's."""
    spec = config.speculative_config
    draft = load_model(
        spec.model,
        resolve_dtype(spec.dtype or "auto", config.device),
        device=config.device,
        quantization=spec.quantization or "auto",
        linear_kernel=config.linear_kernel,
        activation_quantization=spec.activation_quantization or "none",
    )
    check_same_vocabulary(target, draft)
    logger.info(
        "Draft model %s (%s, %s): weights %s",
        draft.source.name,
        draft.config.architecture,
        str(draft.model.dtype).removeprefix("torch."),
        describe_weight_bytes(draft.model),
    )
    return draft


def draft_block_bytes(draft: LoadedModel, block_size: int) -> int:
    """Bytes of one block of the draft's K/V, every draft layer (in the draft's dtype)."""
    mc = draft.model.layer_config
    return bytes_per_block(
        mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, draft.model.dtype
    )


def scratch_blocks_per_sequence(spec: SpeculativeConfig, block_size: int) -> int:
    """Blocks one sequence's guessed positions may need past its last pool block, and a
    copy of that block when it is shared."""
    return draft_scratch_blocks(spec.num_speculative_tokens, block_size, max_num_seqs=1)


@dataclass
class DraftPass:
    """One forward pass of the draft: sequence ``i`` writes ``query_lens[i]`` tokens
    (``token_ids``, ``positions`` and cache ``slots``, sequences concatenated) and reads
    its K/V through ``tables[i]`` (block ids) up to ``seq_lens[i]`` tokens; the logits
    come back for ``sample_rows`` (indexes into the concatenated tokens), the rows of
    sequences ``sample_seq_ids``."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    tables: list[list[int]]
    seq_lens: list[int]
    query_lens: list[int]
    sample_rows: list[int]
    sample_seq_ids: list[int]


class DraftWorker:
    """The draft model over a cache of ``num_pool_blocks`` blocks (the target pool's
    ids) plus ``num_scratch_blocks``, with ``swap_blocks`` blocks of swap space mirroring
    the target's (none when 0)."""

    def __init__(
        self,
        config: EngineConfig,
        draft: LoadedModel,
        num_pool_blocks: int,
        num_scratch_blocks: int,
        max_model_len: int,
        swap_blocks: int,
    ) -> None:
        model = draft.model
        mc = model.layer_config
        self.num_pool_blocks = num_pool_blocks
        self.num_scratch_blocks = num_scratch_blocks
        self.kv_cache = KVCache(
            mc.num_layers,
            num_pool_blocks + num_scratch_blocks,
            config.block_size,
            mc.num_kv_heads,
            mc.head_dim,
            model.dtype,
            device=config.device,
        )
        self.runner = make_runner(config, model, self.kv_cache, max_model_len)
        self.swap_space = make_swap_space(config, self.kv_cache, swap_blocks, ".draft")
        size = config.speculative_config.draft_vocab_size
        self.head = None
        if size is not None:
            vocab = model.config.vocab_size
            self.head = DraftHead(model.lm_head, size, vocab, model.finish_logits, model.dtype)

    @property
    def scratch_block_ids(self) -> range:
        return range(self.num_pool_blocks, self.num_pool_blocks + self.num_scratch_blocks)

    def apply(self, copies: BlockCopies) -> None:
        """A step's block moves, on the draft's cache and swap space."""
        copies.apply(self.kv_cache, self.swap_space)

    def forward(self, step: DraftPass) -> torch.Tensor:
        """Float32 logits ``[len(step.sample_rows), vocab]`` of one draft pass."""
        width = max(len(table) for table in step.tables)
        tables = np.full((len(step.tables), width), -1, dtype=np.int32)
        for row, table in enumerate(step.tables):
            tables[row, : len(table)] = table
        query_start_loc = np.zeros(len(step.query_lens) + 1, dtype=np.int32)
        np.cumsum(step.query_lens, out=query_start_loc[1:])
        to_device = self.runner.to_device
        metadata = AttentionMetadata(
            slot_mapping=to_device(torch.tensor(step.slots, dtype=torch.int64)),
            block_tables=to_device(torch.from_numpy(tables)),
            seq_lens=to_device(torch.tensor(step.seq_lens, dtype=torch.int32)),
            query_start_loc=to_device(torch.from_numpy(query_start_loc)),
            max_query_len=max(step.query_lens),
            max_seq_len=max(step.seq_lens),
        )
        batch = ModelInput(
            to_device(torch.tensor(step.token_ids, dtype=torch.int64)),
            to_device(torch.tensor(step.positions, dtype=torch.int64)),
            metadata,
            to_device(torch.tensor(step.sample_rows, dtype=torch.int64)),
            to_device(torch.zeros(0, dtype=torch.int64)),
            [],
        )
        if self.head is None:
            return self.runner.forward(batch).logits
        head, seq_ids = self.head, step.sample_seq_ids
        return self.runner.forward(batch, lambda hidden: head.logits(hidden, seq_ids)).logits
