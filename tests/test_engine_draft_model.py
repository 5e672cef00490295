"""``draft_model`` speculation through the engine: greedy tokens identical to decoding
without guesses (n > 1, copy-on-write, prefix caching, preemption by recompute and by
swap), sampled tokens distributed as the target's, the draft's K/V carried across steps
rather than recomputed, every block back in the pool, and drafts that cannot serve
refused at start."""

from __future__ import annotations

import json

import pytest
import torch
from test_engine_speculation import (
    POOLS,
    JsonRequests,
    _top,
    run_stepwise,
    samples,
    second_tokens_p_value,
)
from test_engine_swap import workload
from tiny_checkpoints import run_outputs, tiny_engine

from pagedllm.bench.tiny_llama import write_tiny_llama
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.kv_storage.kv_cache import bytes_per_block

BLOCK_SIZE = 4
MAX_NUM_SEQS = 64


def draft_config(folder, k: int = 3, **extra) -> dict:
    return {
        "method": "draft_model",
        "model": str(folder),
        "num_speculative_tokens": k,
        "adaptive_draft_length": False,
        **extra,
    }


def draft_engine(target, num_blocks: int, spec: dict, swap_blocks: int = 0, **overrides):
    """An engine over ``target`` whose pool holds exactly ``num_blocks`` blocks of both
    models' K/V (the draft: ``target``'s shape in ``spec``'s dtype), and ``swap_blocks``
    of swap space."""
    mc = target.config
    dtype = getattr(torch, spec["dtype"])
    shape = mc.num_layers, BLOCK_SIZE, mc.num_kv_heads, mc.head_dim
    target_bytes = bytes_per_block(*shape, torch.float32)
    draft_bytes = bytes_per_block(*shape, dtype)
    scratch = MAX_NUM_SEQS * (-(-spec["num_speculative_tokens"] // BLOCK_SIZE) + 1)
    engine = tiny_engine(
        target,
        num_blocks,
        speculative_config=spec,
        kv_cache_memory=num_blocks * (target_bytes + draft_bytes) + scratch * draft_bytes,
        swap_space=swap_blocks * (target_bytes + draft_bytes),
        max_num_seqs=MAX_NUM_SEQS,
        **overrides,
    )
    assert engine.num_blocks == num_blocks
    return engine


@POOLS
def test_greedy_tokens_are_those_without_guesses(tiny_model, num_blocks, settings):
    """The draft is the target's checkpoint in bfloat16: it agrees most of the time and
    not always, so steps keep all, some or none of their guesses."""
    prompts, params = workload(count=24)
    common = dict(max_model_len=100, max_num_batched_tokens=64, **settings)
    expected = run_stepwise(tiny_engine(tiny_model, num_blocks, **common), prompts, params)
    spec = draft_config(tiny_model.source, dtype="bfloat16")
    engine = draft_engine(tiny_model, num_blocks, spec, **common)
    got = run_stepwise(engine, prompts, params)
    assert samples(got) == samples(expected)
    stats = engine.get_stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.speculator.num_blocks_rolled_back > 0
    if num_blocks == 32:
        assert engine.get_stats().num_preemptions_total > 0
    if engine.swap_space is not None:
        assert engine.swap_space.stats().used_blocks == 0


def test_the_draft_runs_each_token_about_once(tiny_model):
    """After its first pass over the prompt, the draft only catches up the tokens the
    target kept past what it had fed: one sequence of 40 prompt and 120 output tokens
    runs fewer than prompt + 2 x output tokens through the draft (recomputing its
    history every step would run thousands)."""
    prompt = [(7 * i) % 500 + 2 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    expected = run_outputs(tiny_engine(tiny_model, 256), [prompt], params)
    engine = draft_engine(tiny_model, 256, draft_config(tiny_model.source, dtype="bfloat16"))
    got = run_outputs(engine, [prompt], params)
    assert got["0"].outputs[0].token_ids == expected["0"].outputs[0].token_ids
    drafts = engine.speculator.proposer
    assert len(prompt) + 120 <= drafts.num_tokens_run < len(prompt) + 2 * 120
    stats = engine.get_stats().spec_decode
    assert stats.mean_acceptance_length > 2.0, stats


def test_sampled_tokens_follow_the_targets_distribution(tiny_model, tmp_path):
    """10,240 samples (top-k 4) with a draft of the target's weights scaled by 3/4 (its
    distributions overlap the target's without matching them), whose sampled guesses
    the target keeps or rejects: the second token's counts, per first token, must fit
    the target's own distribution after it (so the residual ``max(p - q, 0)`` is drawn
    right)."""
    other = write_tiny_llama(tmp_path / "other", initializer_range=0.15)
    prompt = [3, 14, 15, 92, 65]
    params = SamplingParams(n=128, temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    probe = tiny_engine(tiny_model, 512, max_n=128)
    after = {token: _top(probe, prompt + [token], 4) for token in _top(probe, prompt, 4)}
    engine = draft_engine(
        tiny_model,
        4096,
        draft_config(other, k=2, dtype="float32"),
        max_n=128,
        max_num_batched_tokens=2048,
    )
    outputs = run_outputs(engine, [prompt] * 80, params)
    pairs = [s.token_ids[:2] for out in outputs.values() for s in out.outputs]
    assert len(pairs) == 10_240
    assert second_tokens_p_value(pairs, after) > 1e-4
    stats = engine.get_stats().spec_decode
    assert stats.num_drafts >= 10_000 and 0 < stats.acceptance_rate < 1


def test_a_draft_with_another_vocabulary_is_refused(tiny_model, tmp_path):
    other = write_tiny_llama(tmp_path / "wide", vocab_size=600)
    with pytest.raises(ValueError, match="vocabulary of 600 tokens, the target .* 512"):
        draft_engine(tiny_model, 64, draft_config(other, dtype="float32"))


def test_a_draft_that_is_not_there_is_refused(tiny_model, tmp_path):
    with pytest.raises(ValueError, match="neither a .gguf file nor a folder"):
        draft_engine(tiny_model, 64, draft_config(tmp_path / "missing", dtype="float32"))


def test_the_default_model_drafts_for_itself_expanded(expanded_default_model):
    """The quantized self-draft: the target is the default model expanded to float32,
    the draft its own Q4_1 blocks multiplied with int8 activations. Greedy chat answers
    are the target's, and most guesses are kept."""
    from pagedllm import EngineConfig, LLMEngine

    tokenizer = expanded_default_model.tokenizer
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        for text in ("What is a block table?", "Name three colours.")
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40)

    def run(**settings):
        config = EngineConfig(dtype="float32", quantization="none", kv_cache_memory="64MiB",
                              log_stats_interval=0, **settings)  # fmt: skip
        engine = LLMEngine(config, expanded_default_model)
        return engine, run_outputs(engine, prompts, params)

    _, expected = run()
    spec = {"method": "draft_model", "model": "default", "num_speculative_tokens": 4,
            "activation_quantization": "int8", "adaptive_draft_length": False}  # fmt: skip
    engine, got = run(speculative_config=spec)
    assert samples(got) == samples(expected)
    stats = engine.get_stats().spec_decode
    assert stats.acceptance_rate > 0.6, stats


def test_the_planner_counts_the_drafts_share_of_each_block(tiny_model, capsys):
    """``pagedllm plan --draft-model``: the pool the planner sizes for a KV budget, with
    the draft's K/V in every block and its scratch blocks taken first, is the pool the
    engine allocates for that budget."""
    from pagedllm.cli import main

    folder = str(tiny_model.source)
    budget = 3_000_000
    spec = draft_config(tiny_model.source, k=3, dtype="bfloat16")
    engine = tiny_engine(
        tiny_model, 1, speculative_config=spec, kv_cache_memory=budget, max_num_seqs=64
    )
    argv = ["plan", folder, "--kv-cache-memory", str(budget), "--kv-dtype", "float32",
            "--block-size", str(BLOCK_SIZE), "--draft-model", folder, "--draft-kv-dtype",
            "bfloat16", "--num-speculative-tokens", "3", "--max-num-seqs", "64"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_dtypes"][0]["num_blocks"] == engine.num_blocks
    draft = plan["draft"]
    assert engine.block_bytes == plan["kv_dtypes"][0]["block_bytes"]
    assert draft["scratch_bytes"] == engine.drafter.kv_cache.nbytes - (
        engine.drafter.num_pool_blocks * draft["block_bytes"]
    )
    assert main(argv) == 0
    assert "its bfloat16 K/V add" in capsys.readouterr().out


def test_structured_outputs_with_a_draft(default_model):
    """A constrained sequence's drafted guesses are cut where the grammar refuses a
    token: greedy JSON is the JSON without guesses, and sampled JSON (guesses drawn
    from the draft, rejection against its distributions) still validates."""
    requests = JsonRequests(default_model, 6, max_tokens=60)
    prompts, params, engine = requests.prompts, requests.params, requests.engine
    expected = run_stepwise(engine(), prompts, params(0.0))
    spec = {"method": "draft_model", "model": "default", "dtype": "bfloat16",
            "num_speculative_tokens": 4, "adaptive_draft_length": False}  # fmt: skip
    drafting = engine(speculative_config=spec)
    assert samples(run_stepwise(drafting, prompts, params(0.0))) == samples(expected)
    assert drafting.get_stats().spec_decode.num_accepted_tokens > 0
    requests.assert_valid(run_stepwise(drafting, prompts, params(1.0)))
