"""Engines over tiny checkpoints and running requests through them to the end (the
checkpoints: :mod:`pagedllm.bench.tiny_llama`)."""

from __future__ import annotations

import torch


def tiny_engine(loaded, num_blocks: int, block_size: int = 4, swap_blocks: int = 0, **overrides):
    """An engine over ``loaded``, on the model's device, whose KV pool holds exactly
    ``num_blocks`` blocks (and a second tier of ``swap_blocks``); other keywords are
    :class:`EngineConfig` fields."""
    from pagedllm import EngineConfig, LLMEngine
    from pagedllm.kv_storage.kv_cache import bytes_per_block

    mc = loaded.config
    block_bytes = bytes_per_block(
        mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, torch.float32
    )
    settings = dict(
        device=str(loaded.model.device),
        dtype="float32",
        block_size=block_size,
        kv_cache_memory=num_blocks * block_bytes,
        swap_space=swap_blocks * block_bytes,
        max_num_seqs=64,
        log_stats_interval=0,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), loaded)


def run_outputs(engine, prompts: list[list[int]], params) -> dict[str, object]:
    """Each request's final ``RequestOutput`` by request id (the prompt's index), after
    running the engine dry; checks that every block is back in the pool."""
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert engine.block_manager.pool.num_used == 0
    return done


def run_token_ids(engine, prompts: list[list[int]], params) -> dict[str, list[list[int]]]:
    """Every sample's token ids by request id, as :func:`run_outputs` runs them."""
    outputs = run_outputs(engine, prompts, params)
    return {rid: [o.token_ids for o in out.outputs] for rid, out in outputs.items()}
