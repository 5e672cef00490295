"""Assembling an engine from its :class:`~pagedllm.config.EngineConfig`.

Each part needs the ones before it: the model (loaded, or given, and checked against the
config's dtype and device); the KV budget in bytes (configured, or what the memory
profile leaves on CUDA); the pool in blocks (:func:`~pagedllm.kv.capacity.pool_blocks`);
``max_model_len`` in tokens (never more than one normal-priority request can ever hold);
the block manager; this rank's worker (cache, swap space, runner); the other ranks'
caches; CUDA graphs; the scheduler. :class:`~pagedllm.engine.llm_engine.LLMEngine`
holds what :func:`build_engine` returns and only steps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from pagedllm.attention.selector import attention_backend_for
from pagedllm.config import (
    BLOCK_SIZE_AUTO,
    EngineConfig,
    KVAllocation,
    PreemptionMode,
    same_device,
)
from pagedllm.cpu.allocator import keep_freed_memory
from pagedllm.engine.block_size_choice import (
    CANDIDATES,
    RequestLengthLog,
    choose_block_size,
    read_lengths,
)
from pagedllm.engine.cuda_graphs import DecodeGraphs, capture_sizes
from pagedllm.engine.draft_worker import DraftWorker, draft_block_bytes, load_draft
from pagedllm.engine.memory_profile import profile_memory
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.model_worker import ModelWorker, layer_groups_for, make_kv_cache
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.tensor_parallel.executor import TensorParallelExecutor
from pagedllm.engine.tensor_parallel.worker import WorkerSetup, shared_settings
from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.block_pool import num_reserved_blocks
from pagedllm.kv.capacity import (
    draft_scratch_blocks,
    full_blocks_wanted,
    grouped_worst_case_blocks,
    longest_sequence,
    pool_blocks,
    recent_blocks,
    split_by_age,
    swap_split,
)
from pagedllm.kv.layer_groups import KVLayerGroups
from pagedllm.kv_storage.compact_blocks import TileLayout
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.kv_tiers.build import make_tiered_cache
from pagedllm.models.batch_invariance import variant_products
from pagedllm.models.decoder import CausalDecoder
from pagedllm.models.loader import LoadedModel, load_model_for
from pagedllm.models.weight_bytes import describe_weight_bytes
from pagedllm.spec_decode.config import SpeculativeMethod
from pagedllm.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class EngineParts:
    """What an engine holds. Sizes are this rank's (rank 0 holds the most KV heads)."""

    loaded: LoadedModel
    tokenizer: Tokenizer | None  # compact JSON as ``disable_any_whitespace`` asks
    kv_budget: int  # bytes for the pool
    block_bytes: int  # bytes of one block, every layer
    num_blocks: int  # blocks sequences may hold (a window's null block not counted)
    max_model_len: int  # tokens one sequence may reach
    block_manager: BlockManager
    worker: ModelWorker
    scheduler: Scheduler
    drafter: DraftWorker | None  # draft_model speculation's model and K/V


def start_executor(
    config: EngineConfig, loaded: LoadedModel | None
) -> TensorParallelExecutor | None:
    """Start the other tensor-parallel ranks (None with one rank); the caller must
    ``shutdown()`` the executor if the engine then fails to build."""
    if config.tensor_parallel_size == 1:
        return None
    if loaded is not None:
        raise ValueError("a preloaded model cannot be split over tensor-parallel ranks")
    if config.device.type == "cuda":
        raise ValueError(
            "tensor parallelism runs on the CPU (gloo) only for now; use "
            "tensor_parallel_size=1 on CUDA"
        )
    return TensorParallelExecutor(config)


def build_engine(
    config: EngineConfig,
    loaded: LoadedModel | None = None,
    executor: TensorParallelExecutor | None = None,
) -> EngineParts:
    """Every part of an engine for ``config``; ``loaded``: a model already loaded for it
    (one rank only); ``executor``: the other ranks, from :func:`start_executor`."""
    torch.manual_seed(config.seed)
    keep_freed_memory()
    loaded = _load(config, loaded, executor)
    model = loaded.model
    if config.block_size == BLOCK_SIZE_AUTO:
        config.block_size = _auto_block_size(config, loaded)
    kv_budget = config.kv_cache_memory
    if kv_budget is None:
        kv_budget = _profiled_kv_budget(config, model)
    # With every layer sliding, blocks out of the window go back to the pool, and the
    # cache keeps one block more than the pool for the tables' null entries; with layers
    # of several kinds, each kind's group of layers keeps its own tables (and sliding
    # groups give blocks back).
    contiguous = config.kv_allocation is KVAllocation.CONTIGUOUS
    groups = layer_groups_for(config, model)
    window = groups.windows[0] if groups.num_groups == 1 else None
    slides = any(w is not None for w in groups.windows)
    if groups.num_groups > 1:
        _check_layer_groups(config, groups)
    draft = _load_draft(config, loaded, window)
    if config.speculative_config is not None:
        _warn_if_batch_variant(model)
    block_bytes = _block_bytes(config, model, groups.num_slots)
    pool_budget, num_scratch = kv_budget, 0
    if draft is not None:  # the draft's K/V ride in the same blocks, scratch beside them
        draft_bytes = draft_block_bytes(draft, config.block_size)
        num_scratch = _draft_scratch_blocks(config)
        pool_budget -= num_scratch * draft_bytes
        block_bytes += draft_bytes
        logger.info(
            "Draft K/V: %d of each block's %d bytes, in the pool's blocks; %d scratch "
            "blocks for guessed positions (%d bytes)",
            draft_bytes,
            block_bytes,
            num_scratch,
            num_scratch * draft_bytes,
        )
    num_compact = 0
    if config.kv_cache_dtype.by_age:
        num_blocks, num_compact = _split_by_age(config, model, pool_budget, block_bytes, window)
    else:
        num_blocks = pool_blocks(pool_budget, block_bytes, slides)
    model_limit = loaded.config.max_position_embeddings
    max_model_len = _max_model_len(
        config, model_limit, num_blocks, kv_budget, num_compact, groups.windows
    )
    block_manager = BlockManager(
        num_blocks,
        config.block_size,
        config.reserved_fraction,
        enable_prefix_caching=config.enable_prefix_caching,
        upfront_tokens=max_model_len if contiguous else None,
        sliding_window=window,
        num_compact_blocks=num_compact,
        recent_tokens=config.kv_recent_tokens if num_compact else None,
        group_windows=groups.windows if groups.num_groups > 1 else None,
    )
    _log_pool(block_manager, max_model_len, config.max_num_batched_tokens)
    if groups.num_groups > 1:
        logger.info("%s", groups.describe())
    # the cache keeps a null block past the pool's for a window's released entries, and
    # to start the ids of compact blocks after it
    cache_blocks = num_blocks + (slides or num_compact > 0)
    swap_blocks, swap_compact = _swap_blocks(config, model, block_bytes, num_blocks, num_compact)
    worker = ModelWorker(
        config,
        model,
        cache_blocks,
        max_model_len,
        swap_blocks,
        num_compact_blocks=num_compact,
        swap_compact_blocks=swap_compact,
    )
    drafter = None
    if draft is not None:
        drafter = DraftWorker(config, draft, cache_blocks, num_scratch, max_model_len, swap_blocks)
    if executor is not None:
        largest = None
        if not config.disable_custom_all_reduce:  # the embedding's rows, in float32 at most
            largest = config.max_num_batched_tokens * loaded.config.hidden_size * 4
        settings = shared_settings(config)
        setup = WorkerSetup(
            settings, cache_blocks, max_model_len, swap_blocks, largest, num_compact, swap_compact
        )
        executor.start_ranks(setup)
    _capture_graphs(config, model, worker.runner, max_model_len)
    tiers = make_tiered_cache(config, loaded.source, worker.kv_cache, max_model_len)
    if tiers is not None:
        worker.tiers = tiers
        block_manager.pool.add_listener(tiers)
    scheduler = Scheduler(
        block_manager,
        config.max_num_seqs,
        config.max_num_batched_tokens,
        cache_key=f"{loaded.source}:{config.dtype}",
        swap_space=worker.swap_space,
        preemption_mode=config.preemption_mode,
        tiers=tiers,
        prefetch_on_arrival=config.kv_tier_prefetch,
        read_ahead=config.swap_read_ahead,
    )
    tokenizer = loaded.tokenizer
    if tokenizer is not None:
        tokenizer = tokenizer.with_compact_json(config.disable_any_whitespace)
    return EngineParts(
        loaded,
        tokenizer,
        kv_budget,
        block_bytes,
        num_blocks,
        max_model_len,
        block_manager,
        worker,
        scheduler,
        drafter,
    )


def _load_draft(
    config: EngineConfig, target: LoadedModel, window: int | None
) -> LoadedModel | None:
    """The draft model of ``draft_model`` speculation (None for other methods or none);
    ValueError where the target slides (its released blocks would hold draft K/V the
    draft still reads)."""
    spec = config.speculative_config
    if spec is None or spec.method is not SpeculativeMethod.DRAFT_MODEL:
        return None
    if window is not None:
        raise ValueError(
            "speculative_config: method 'draft_model' does not run with a model whose "
            "every layer slides (its out-of-window blocks leave the pool); use 'ngram' or "
            "'suffix', or kv_allocation='contiguous'"
        )
    return load_draft(config, target)


def _warn_if_batch_variant(model: CausalDecoder) -> None:
    """Say so at start when speculation cannot keep greedy output token for token
    (:mod:`pagedllm.models.batch_invariance`)."""
    variant = variant_products(model)
    if variant:
        logger.warning(
            "Speculative decoding: greedy output may differ in rare tokens from decoding "
            "without it, because %s %s not batch invariant (a row's result moves by "
            "rounding with the rows that share its call)",
            " and ".join(variant),
            "is" if len(variant) == 1 else "are",
        )


def _draft_scratch_blocks(config: EngineConfig) -> int:
    """Scratch blocks of the draft's cache (:func:`~pagedllm.kv.capacity.draft_scratch_blocks`)."""
    tokens = config.speculative_config.num_speculative_tokens
    return draft_scratch_blocks(tokens, config.block_size, config.max_num_seqs)


def _auto_block_size(config: EngineConfig, loaded: LoadedModel) -> int:
    """``block_size="auto"`` resolved for ``loaded`` (see
    :mod:`pagedllm.engine.block_size_choice`), with the reason logged."""
    if config.block_size_workload is not None:
        lengths = read_lengths(Path(config.block_size_workload))
        if not lengths:
            raise ValueError(
                f"block_size_workload {config.block_size_workload!r} holds no request "
                'lengths (JSON lines {"prompt": tokens, "output": tokens})'
            )
    else:
        lengths = RequestLengthLog(str(loaded.source)).read()
    model = loaded.model
    layout = (model.dtype, model.layer_config.num_heads, model.layer_config.num_kv_heads,
              model.layer_config.head_dim)  # fmt: skip
    candidates = [b for b in CANDIDATES if b >= 16 or not config.kv_cache_dtype.by_age]
    chosen, reason = choose_block_size(layout, lengths, candidates, config.device.type == "cpu")
    logger.info("block_size auto: %d (%s)", chosen, reason)
    return chosen


def _load(
    config: EngineConfig, loaded: LoadedModel | None, executor: TensorParallelExecutor | None
) -> LoadedModel:
    """``loaded``, or the model loaded for ``config`` (this rank's slice); ValueError when
    its dtype or device is not the config's."""
    start = time.monotonic()
    loaded = loaded or load_model_for(config, executor.group if executor else None)
    model = loaded.model
    if model.dtype != config.dtype:
        raise ValueError(
            f"the model was loaded in {model.dtype} but the engine's dtype is "
            f"{config.dtype}; pass the model's dtype to EngineConfig"
        )
    if not same_device(model.device, config.device):
        raise ValueError(
            f"the model was loaded on {model.device} but the engine's device "
            f"is {config.device}; pass the model's device to EngineConfig"
        )
    logger.info(
        "Loaded %s (%s) in %.2f s; weights %s%s",
        loaded.source.name,
        loaded.config.architecture,
        time.monotonic() - start,
        describe_weight_bytes(model),
        f" on rank 0 of {config.tensor_parallel_size}" if executor else "",
    )
    return loaded


def _profiled_kv_budget(config: EngineConfig, model: CausalDecoder) -> int:
    """Bytes for the KV pool on CUDA: what the memory profile of the largest step leaves
    of ``gpu_memory_utilization`` of the device."""
    profile = profile_memory(
        model,
        attention_backend_for,
        partial(make_kv_cache, config, model),
        config.max_num_batched_tokens,
        config.max_num_seqs,
        config.block_size,
        config.gpu_memory_utilization,
        config.device,
    )
    profile.log()
    return profile.kv_budget


def _check_layer_groups(config: EngineConfig, groups: KVLayerGroups) -> None:
    """Refuse what does not run over KV layer groups yet, naming the way out."""
    spec = config.speculative_config
    unsupported = {
        "kv_cache_dtype": config.kv_cache_dtype.by_age,
        # a draft's K/V ride in group 0's blocks, which a global group never releases
        "speculative_config": spec is not None
        and spec.method is SpeculativeMethod.DRAFT_MODEL
        and groups.windows[0] is not None,
    }
    refused = [name for name, bad in unsupported.items() if bad]
    if refused:
        raise ValueError(
            f"this model's layers attend in {groups.num_groups} ways and keep a block table "
            f"per kind (kv_layer_groups); not with "
            + ", ".join(f"{name}={getattr(config, name)!r}" for name in refused)
            + " for now. Set kv_layer_groups=False to keep one table for every layer"
        )


def _block_bytes(config: EngineConfig, model: CausalDecoder, num_layers: int) -> int:
    """Bytes of one block over ``num_layers`` layers (a KV layer group's slots), for this
    rank's KV heads."""
    mc = model.layer_config
    return bytes_per_block(
        num_layers,
        config.block_size,
        mc.num_kv_heads,
        mc.head_dim,
        config.dtype,
        config.full_block_dtype,
    )


def _split_by_age(
    config: EngineConfig,
    model: CausalDecoder,
    budget: int,
    block_bytes: int,
    window: int | None,
) -> tuple[int, int]:
    """Full-size and compact blocks of an int4 pool
    (:func:`~pagedllm.kv.capacity.split_by_age`): full ones for ``max_num_seqs``
    decoding sequences' recent windows and two steps of batched tokens."""
    if window is not None:
        raise ValueError(
            "kv_cache_dtype='int4' does not run with a model whose every layer slides yet"
        )
    compact_bytes = _compact_block_bytes(config, model)
    wanted = full_blocks_wanted(
        config.max_num_seqs,
        config.kv_recent_tokens,
        config.max_num_batched_tokens,
        config.block_size,
    )
    return split_by_age(budget, block_bytes, compact_bytes, wanted)


def _compact_block_bytes(config: EngineConfig, model: CausalDecoder) -> int:
    """Bytes of one compact block over every layer, for this rank's KV heads."""
    mc = model.layer_config
    return mc.num_layers * mc.num_kv_heads * TileLayout(config.block_size, mc.head_dim).tile_bytes


def _max_model_len(
    config: EngineConfig,
    model_limit: int,
    num_blocks: int,
    kv_budget: int,
    num_compact: int = 0,
    windows: tuple[int | None, ...] = (None,),
) -> int:
    """``max_model_len`` as configured, or the model's limit capped by the slots one
    normal-priority request can ever hold (the pool less the reserve, and the compact
    blocks where its full-size ones hold the recent window of a whole step; over KV
    layer groups of ``windows``, the sliding groups' windows first); ValueError when the
    configured one exceeds either, or when the pool cannot hold two tokens."""
    usable = num_blocks - num_reserved_blocks(num_blocks, config.reserved_fraction)
    step = config.max_num_batched_tokens
    if num_compact and usable >= recent_blocks(config.kv_recent_tokens, step, config.block_size):
        usable += num_compact
    fits = longest_sequence(usable, config.block_size, windows, step)
    if fits is None:  # no global group: any length fits
        fits = model_limit
    requested = config.max_model_len
    if requested is not None and requested > model_limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's limit of {model_limit} tokens"
        )
    # the fewest tokens one request must be able to hold: the configured length, or
    # without one a prompt token and an output token (fewer if the model allows fewer)
    wanted = model_limit if requested is None else requested
    least = min(model_limit, 2) if requested is None else requested
    if fits < least:
        raise ValueError(
            f"The KV cache pool ({num_blocks} blocks of {config.block_size} tokens, "
            f"{kv_budget} bytes) cannot hold one request of max_model_len="
            f"{wanted} tokens. The largest max_model_len that fits is "
            f"{fits}; lower max_model_len or raise kv_cache_memory."
        )
    return min(model_limit, fits) if requested is None else requested


def _log_pool(block_manager: BlockManager, max_model_len: int, step_tokens: int) -> None:
    pool = block_manager.pool
    block_size = block_manager.block_size
    usable = pool.num_blocks - pool.num_reserved + pool.num_compact_blocks
    if block_manager.num_groups > 1:  # a block holds one group's layers
        held = grouped_worst_case_blocks(
            0, max_model_len, 1, block_size, block_manager.windows, step_tokens=step_tokens
        )
        logger.info(
            "KV cache pool: %d blocks x %d tokens of one layer group (%d reserved blocks), "
            "max_model_len %d, held in at most %d blocks over the groups; maximum "
            "concurrency at max_model_len: %.2fx",
            pool.num_blocks,
            block_size,
            pool.num_reserved,
            max_model_len,
            held,
            usable / held,
        )
        return
    if pool.num_compact_blocks:
        logger.info(
            "KV cache by age: %d full-size blocks for the newest %d tokens of each sequence "
            "and %d compact 4-bit blocks (%d tokens) for the older ones",
            pool.num_blocks,
            block_manager.recent_tokens,
            pool.num_compact_blocks,
            pool.num_compact_blocks * block_size,
        )
    logger.info(
        "KV cache pool: %d blocks x %d tokens = %d tokens (%d reserved blocks), "
        "max_model_len %d, maximum concurrency at max_model_len: %.2fx",
        pool.num_blocks,
        block_size,
        pool.num_blocks * block_size,
        pool.num_reserved,
        max_model_len,
        usable * block_size / max_model_len,
    )
    if block_manager.sliding_window is not None:
        logger.info(
            "Every layer slides over %d tokens: blocks that leave the window go back to the pool",
            block_manager.sliding_window,
        )


def _swap_blocks(
    config: EngineConfig, model: CausalDecoder, block_bytes: int, num_blocks: int, num_compact: int
) -> tuple[int, int]:
    """Full-size and compact blocks of the swap space (``swap_space`` bytes per rank,
    split as the pool's bytes are: :func:`~pagedllm.kv.capacity.swap_split`); (0, 0)
    for none."""
    if config.preemption_mode is PreemptionMode.RECOMPUTE or config.swap_space == 0:
        return 0, 0
    compact_bytes = _compact_block_bytes(config, model) if num_compact else 0
    full, compact = swap_split(
        config.swap_space, block_bytes, compact_bytes, num_blocks, num_compact
    )
    if full == 0:
        share = " in the share the pool's split gives them" if num_compact else ""
        raise ValueError(
            f"swap_space={config.swap_space} bytes holds no full-size block of {block_bytes} "
            f"bytes{share}"
        )
    if compact:
        logger.info(
            "Swap space: %d full-size blocks (%d bytes) and %d compact blocks (%d bytes), "
            "split as the pool's bytes",
            full,
            full * block_bytes,
            compact,
            compact * compact_bytes,
        )
    else:
        logger.info("Swap space: %d blocks (%d bytes)", full, full * block_bytes)
    return full, compact


def _capture_graphs(
    config: EngineConfig, model: CausalDecoder, runner: ModelRunner, max_model_len: int
) -> None:
    """On CUDA (unless ``enforce_eager``), capture the decode steps' graphs into
    ``runner`` for the batch sizes up to ``max_num_seqs``."""
    if config.device.type != "cuda" or config.enforce_eager:
        return
    if not model.supports_cuda_graphs:
        logger.info("Decode steps run eagerly: this model's layers cannot be captured")
        return
    if len(runner.group_tables) > 1:
        logger.info("Decode steps run eagerly: the graphs hold one block table per sequence")
        return
    runner.graphs = DecodeGraphs(
        model,
        runner.attn,
        max_model_len,
        config.block_size,
        capture_sizes(config.max_num_seqs),
        config.device,
    )
