"""The engine over 8-bit KV caches on a tiny random model: requests finish under a pool
small enough to preempt, parallel samples share their prompt blocks (copy-on-write),
and every block is free again at the end. Agreement with a full-precision cache is
measured on the real model by ``benchmarks/kv_quant_quality.py``: this random model is
chaotic enough that even a bfloat16 cache changes its greedy tokens within 24 steps."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedllm.bench.tiny_llama import write_tiny_llama
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.models.loader import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    return load_model(str(folder))


def make_engine(loaded, kv_cache_dtype: str, preemption_mode: str = "recompute") -> LLMEngine:
    mc = loaded.config
    block_bytes = bytes_per_block(
        mc.num_layers, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim, torch.float32, kv_cache_dtype
    )
    config = EngineConfig(
        device=str(loaded.model.device),
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=NUM_BLOCKS * block_bytes,
        preemption_mode=preemption_mode,
        swap_space=4 * NUM_BLOCKS * block_bytes,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        log_stats_interval=0,
    )
    return LLMEngine(config, loaded)


def requests():
    prompts = [
        {"prompt_token_ids": [(7 * i + j) % 500 + 2 for j in range(9 + 3 * i)]} for i in range(8)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    forked = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    return prompts, [greedy if i % 2 else forked for i in range(len(prompts))]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quantized_cache_serves_forks_and_frees_every_block(tiny_model, kv_cache_dtype):
    engine = make_engine(tiny_model, kv_cache_dtype, "swap")
    assert engine.num_blocks == NUM_BLOCKS
    assert engine.kv_cache.format.name == kv_cache_dtype
    prompts, params = requests()
    outputs = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
    for out, sampling in zip(outputs, params, strict=True):
        assert len(out.outputs) == sampling.n
        assert all(len(sample.token_ids) == 16 for sample in out.outputs)
    assert engine.get_stats().num_blocks_used == 0
    assert engine.get_stats().num_preemptions_total > 0
    assert engine.swap_space.stats().used_blocks == 0


def test_swapping_quantized_blocks_keeps_their_scales(tiny_model):
    """Swapped-out blocks come back with their scales: the same tokens as recomputing."""
    prompts, params = requests()
    outputs = {}
    for mode in ("recompute", "swap"):
        engine = make_engine(tiny_model, "int8", mode)
        results = LLM.from_engine(engine).generate(prompts, params, use_tqdm=False)
        outputs[mode] = [[s.token_ids for s in out.outputs] for out in results]
    assert engine.swap_space.stats().swap_outs > 0
    assert outputs["swap"] == outputs["recompute"]
