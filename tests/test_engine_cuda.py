"""The engine on a CUDA device: the same tokens as on the CPU, with and without CUDA
graphs, through preemption by swap to pinned host memory. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import run_token_ids

from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [list(range(100, 140)) + [7, 8, 9], list(range(100, 140)) + [11] * 6, [5, 6, 7]]


def generate(engine: LLMEngine, params: SamplingParams) -> dict[str, list[list[int]]]:
    return run_token_ids(engine, PROMPTS, params)


def engine_on(loaded, **overrides) -> LLMEngine:
    settings = dict(
        block_size=16,
        kv_cache_memory="16MiB",
        max_num_seqs=16,
        max_num_batched_tokens=32,
        log_stats_interval=0,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(dtype="float32", **settings), loaded)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from pagedllm.bench.tiny_llama import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-cuda"))


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_cuda_tokens_equal_cpu_tokens(tiny_folder, enforce_eager):
    params = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)
    cpu = generate(engine_on(load_model(str(tiny_folder)), device="cpu"), params)
    loaded = load_model(str(tiny_folder), device="cuda")
    engine = engine_on(loaded, device="cuda", enforce_eager=enforce_eager)
    assert (engine.runner.graphs is None) == enforce_eager
    assert generate(engine, params) == cpu


def test_cuda_swap_preemption_keeps_tokens(tiny_folder):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    loaded = load_model(str(tiny_folder), device="cuda")
    roomy = generate(engine_on(loaded, device="cuda"), params)
    probe = engine_on(loaded, device="cuda", enforce_eager=True)
    block_bytes = probe.kv_cache.nbytes // probe.num_blocks
    tight = engine_on(
        loaded,
        device="cuda",
        kv_cache_memory=7 * block_bytes,
        swap_space=16 * block_bytes,
        preemption_mode="swap",
        max_num_batched_tokens=16,
        reserved_fraction=0.0,
    )
    assert generate(tight, params) == roomy
    assert tight.swap_space.tensor.is_pinned()
    assert tight.get_stats().swap.swap_outs > 0


def test_cuda_pool_sized_from_memory_profile(tiny_folder):
    loaded = load_model(str(tiny_folder), device="cuda")
    engine = engine_on(loaded, device="cuda", kv_cache_memory=None, gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    assert 0 < engine.kv_budget <= 0.5 * total
    assert engine.kv_cache.nbytes <= engine.kv_budget


def test_cuda_host_tier_is_pinned_and_keeps_tokens(tiny_folder):
    from test_engine_tiers import conversations, two_rounds
    from tiny_checkpoints import tiny_engine

    loaded = load_model(str(tiny_folder), device="cuda")
    roomy = two_rounds(tiny_engine(loaded, 1024), conversations())
    engine = tiny_engine(loaded, 40, kv_tier_memory=1 << 20)
    assert two_rounds(engine, conversations()) == roomy
    assert engine.tiers.host.tensor.is_pinned()
    stats = engine.get_stats()
    assert stats.tiers.spilled_blocks > 0 and stats.tiers.host_hits > 0


def test_cuda_swap_read_ahead_keeps_tokens(tiny_folder):
    from test_engine_swap import make_llm, token_ids, workload

    loaded = load_model(str(tiny_folder), device="cuda")
    prompts, params = workload()
    roomy = make_llm(loaded, 2048, max_num_batched_tokens=2048)
    expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
    tight = make_llm(
        loaded, 32, preemption_mode="swap", swap_blocks=64, max_num_batched_tokens=24,
        max_num_seqs=24,
    )  # fmt: skip
    assert token_ids(tight.generate(prompts, params, use_tqdm=False)) == expected
    stats = tight.llm_engine.get_stats()
    assert stats.read_ahead.used_blocks > 0 and stats.num_blocks_used == 0
