"""What one rank holds and does each step: the model (or its tensor-parallel slice), its
KV cache, its swap space and the runner over them.

The engine's own process holds one; under tensor parallelism every other rank holds one
too, with the same block ids, slots and copies, each over its own heads.
"""

from __future__ import annotations

from pagedllm.attention.attention_choice import sdpa_min_rows
from pagedllm.attention.selector import attention_backend_for
from pagedllm.config import EngineConfig
from pagedllm.engine.model_runner import ModelInput, ModelOutput, ModelRunner
from pagedllm.kv_storage.block_copies import BlockCopies
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_storage.swap_space import SwapSpace
from pagedllm.models.decoder import CausalDecoder
from pagedllm.models.layer_stack import LayerStack


def make_kv_cache(config: EngineConfig, model: CausalDecoder, num_blocks: int) -> KVCache:
    """A cache of ``num_blocks`` blocks for ``model``'s layers (its own KV heads)."""
    mc = model.layer_config
    return KVCache(
        mc.num_layers,
        num_blocks,
        config.block_size,
        mc.num_kv_heads,
        mc.head_dim,
        config.dtype,
        device=config.device,
        kv_cache_dtype=config.kv_cache_dtype,
    )


class ModelWorker:
    """``model`` over a cache of ``num_cache_blocks`` blocks, with ``swap_blocks`` blocks
    of swap space (none when 0; a ``swap_path`` gets ``rank`` appended past rank 0)."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalDecoder,
        num_cache_blocks: int,
        max_model_len: int,
        swap_blocks: int,
        rank: int = 0,
    ) -> None:
        self.model = model
        self.kv_cache = make_kv_cache(config, model, num_cache_blocks)
        min_rows = None
        if self.kv_cache.tensor.device.type == "cpu":
            heads = model.layer_config.num_heads
            min_rows = sdpa_min_rows(config.attention_kernel, self.kv_cache, model.dtype, heads)
        self.runner = ModelRunner(
            model,
            attention_backend_for(self.kv_cache, min_rows),
            config.block_size,
            max_model_len,
            config.device,
        )
        if not config.enforce_eager and self.kv_cache.tensor.device.type == "cpu":
            self.runner.layer_stack = LayerStack.build(model, self.runner.attn)
        self.swap_space = None
        if swap_blocks:
            path = config.swap_path
            if path is not None and rank:
                path = f"{path}.rank{rank}"
            self.swap_space = SwapSpace(self.kv_cache, swap_blocks, path)

    def execute(self, copies: BlockCopies, batch: ModelInput) -> ModelOutput:
        """Apply the step's block moves, then run its batch."""
        copies.apply(self.kv_cache, self.swap_space)
        return self.runner.forward(batch)
