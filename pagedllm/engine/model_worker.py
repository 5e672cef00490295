"""What one rank holds and does each step: the model (or its tensor-parallel slice), its
KV cache, its swap space, the prefix cache's lower tiers and the runner over them.

The engine's own process holds one; under tensor parallelism every other rank holds one
too, with the same block ids, slots and copies, each over its own heads.
"""

from __future__ import annotations

from pagedllm.attention.attention_choice import sdpa_min_rows
from pagedllm.attention.selector import attention_backend_for
from pagedllm.config import EngineConfig, KVAllocation
from pagedllm.engine.model_runner import ModelInput, ModelOutput, ModelRunner
from pagedllm.kv.layer_groups import KVLayerGroups, group_layers, single_group
from pagedllm.kv_storage.block_copies import BlockCopies
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_storage.swap_space import SwapSpace
from pagedllm.kv_tiers.tiered_cache import TieredCache
from pagedllm.models.decoder import CausalDecoder
from pagedllm.models.layer_stack import LayerStack


def layer_groups_for(config: EngineConfig, model: CausalDecoder) -> KVLayerGroups:
    """The KV layer groups of ``model`` under ``config``
    (:mod:`pagedllm.kv.layer_groups`): one per kind of layer with ``kv_layer_groups``
    and paged allocation; else one group of every layer, sliding only when every layer
    slides (over the largest window)."""
    mc = model.layer_config
    if config.kv_allocation is KVAllocation.CONTIGUOUS:
        return single_group(mc.num_layers)
    if config.kv_layer_groups:
        return group_layers(mc.sliding_windows, mc.num_layers)
    return single_group(mc.num_layers, mc.kv_window)


def make_kv_cache(
    config: EngineConfig,
    model: CausalDecoder,
    num_blocks: int,
    num_compact_blocks: int = 0,
    groups: KVLayerGroups | None = None,
) -> KVCache:
    """A cache of ``num_blocks`` full-size blocks and ``num_compact_blocks`` compact ones
    for ``model``'s layers (its own KV heads), a block holding one layer group's layers
    (:func:`layer_groups_for`)."""
    mc = model.layer_config
    groups = groups or layer_groups_for(config, model)
    return KVCache(
        groups.num_slots,
        num_blocks,
        config.block_size,
        mc.num_kv_heads,
        mc.head_dim,
        config.dtype,
        device=config.device,
        kv_cache_dtype=config.full_block_dtype,
        num_compact_blocks=num_compact_blocks,
        layer_slots=groups.layer_slot if groups.num_groups > 1 else None,
    )


def make_runner(
    config: EngineConfig,
    model: CausalDecoder,
    kv_cache: KVCache,
    max_model_len: int,
    groups: KVLayerGroups | None = None,
) -> ModelRunner:
    """A runner of ``model`` over ``kv_cache`` (whose blocks hold ``groups``' layers;
    None: one group of every layer): attention kernels chosen for the cache and, on the
    CPU unless ``enforce_eager``, the C++ layer stack."""
    on_cpu = kv_cache.tensor.device.type == "cpu"
    min_rows = None
    if on_cpu:
        heads = model.layer_config.num_heads
        min_rows = sdpa_min_rows(config.attention_kernel, kv_cache, model.dtype, heads)
    groups = groups or single_group(model.layer_config.num_layers)
    runner = ModelRunner(
        model,
        attention_backend_for(kv_cache, min_rows),
        config.block_size,
        max_model_len,
        config.device,
        groups.layer_group if groups.num_groups > 1 else (),
    )
    if not config.enforce_eager and on_cpu:
        runner.layer_stack = LayerStack.build(model, runner.attn, groups.layer_group)
    return runner


def make_swap_space(
    config: EngineConfig,
    kv_cache: KVCache,
    num_blocks: int,
    suffix: str = "",
    num_compact_blocks: int = 0,
) -> SwapSpace | None:
    """``num_blocks`` full-size and ``num_compact_blocks`` compact blocks of swap space
    for ``kv_cache`` (None when no full-size one), in memory or in the file
    ``swap_path`` + ``suffix``."""
    if not num_blocks:
        return None
    path = None if config.swap_path is None else f"{config.swap_path}{suffix}"
    return SwapSpace(kv_cache, num_blocks, path, num_compact_blocks)


class ModelWorker:
    """``model`` over a cache of ``num_cache_blocks`` full-size blocks and
    ``num_compact_blocks`` compact ones, with ``swap_blocks`` full-size and
    ``swap_compact_blocks`` compact blocks of swap space (none when ``swap_blocks`` is
    0; a ``swap_path`` gets ``rank`` appended past rank 0)."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalDecoder,
        num_cache_blocks: int,
        max_model_len: int,
        swap_blocks: int,
        rank: int = 0,
        num_compact_blocks: int = 0,
        swap_compact_blocks: int = 0,
    ) -> None:
        self.model = model
        groups = layer_groups_for(config, model)
        self.kv_cache = make_kv_cache(config, model, num_cache_blocks, num_compact_blocks, groups)
        self.runner = make_runner(config, model, self.kv_cache, max_model_len, groups)
        suffix = f".rank{rank}" if rank else ""
        self.swap_space = make_swap_space(
            config, self.kv_cache, swap_blocks, suffix, swap_compact_blocks
        )
        self.tiers: TieredCache | None = None  # the engine's rank sets them (one rank)

    def execute(self, copies: BlockCopies, batch: ModelInput) -> ModelOutput:
        """Apply the step's block moves, then run its batch."""
        copies.apply(self.kv_cache, self.swap_space, self.tiers)
        return self.runner.forward(batch)
