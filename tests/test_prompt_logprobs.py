"""Prompt logprobs (``SamplingParams.prompt_logprobs``) against transformers' log-softmax
over the same prompt: through chunked prefill, a warm prefix cache, preemption by
recompute and n > 1."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import run_outputs, tiny_engine

from pagedllm import SamplingParams
from pagedllm.bench.tiny_llama import write_tiny_llama
from pagedllm.models.loader import load_model

# Both sides run float32; the paged kernel and the packed products sum in other orders
# (about 1e-6 relative per product), far below the 1e-2 a wrong row or token would move.
LOGPROB_TOLERANCE = 1e-4
TOP = 3
PROMPTS = [[7], [5, 17, 200, 3, 64, 9], [(13 * i + 11) % 500 + 2 for i in range(45)]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-logprobs"))
    return folder, load_model(str(folder))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """transformers' float32 log-softmax of every prompt position, prompt by prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint[0], torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].log_softmax(-1) for ids in PROMPTS]


def assert_matches_reference(prompt_logprobs, ids, ref: torch.Tensor) -> None:
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for position, entry in enumerate(prompt_logprobs[1:]):
        row = ref[position]
        token = ids[position + 1]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=LOGPROB_TOLERANCE)
        assert entry.rank == int((row > row[token]).sum()) + 1
        top_logprobs, top_ids = row.topk(TOP)
        assert [tid for tid, _ in entry.top] == top_ids.tolist()
        for (_, logprob), expected in zip(entry.top, top_logprobs.tolist(), strict=True):
            assert logprob == pytest.approx(expected, abs=LOGPROB_TOLERANCE)


def params(**overrides) -> SamplingParams:
    settings = dict(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=TOP)
    settings.update(overrides)
    return SamplingParams(**settings)


def test_equal_to_transformers_through_chunked_prefill(checkpoint, reference):
    # 8 tokens per step: the 45-token prompt is scored over six chunks
    engine = tiny_engine(checkpoint[1], num_blocks=256, max_num_batched_tokens=8, max_num_seqs=4)
    outputs = run_outputs(engine, PROMPTS, params())
    for index, ids in enumerate(PROMPTS):
        assert_matches_reference(outputs[str(index)].prompt_logprobs, ids, reference[index])


def test_without_the_field_there_are_none(checkpoint):
    engine = tiny_engine(checkpoint[1], num_blocks=256)
    outputs = run_outputs(engine, PROMPTS, params(prompt_logprobs=None))
    assert all(output.prompt_logprobs is None for output in outputs.values())


def test_a_cached_prompt_is_scored_in_full_and_still_fills_the_cache(checkpoint, reference):
    engine = tiny_engine(checkpoint[1], num_blocks=256)
    long_prompt = [PROMPTS[2]]
    run_outputs(engine, long_prompt, params(prompt_logprobs=None))  # warms the cache
    hits = engine.get_stats().prefix_cache_hits
    scored = run_outputs(engine, long_prompt, params())["0"]
    assert engine.get_stats().prefix_cache_hits == hits  # computed, not read from cache
    assert_matches_reference(scored.prompt_logprobs, PROMPTS[2], reference[2])
    run_outputs(engine, long_prompt, params(prompt_logprobs=None))
    assert engine.get_stats().prefix_cache_hits > hits  # the cache still serves others


def test_preemption_by_recompute_scores_each_position_once(checkpoint, reference):
    # 20 blocks of 4 tokens, 8 tokens a step: sequences are preempted mid-prefill and
    # mid-decode and recomputed (their earlier positions from the prefix cache)
    engine = tiny_engine(
        checkpoint[1],
        num_blocks=20,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        preemption_mode="recompute",
    )
    prompts = PROMPTS[1:] * 3
    outputs = run_outputs(engine, prompts, params(max_tokens=24))
    assert engine.get_stats().num_preemptions_total > 0
    for index, ids in enumerate(prompts):
        ref = reference[1 + index % 2]
        assert_matches_reference(outputs[str(index)].prompt_logprobs, ids, ref)


def test_parallel_samples_share_one_scoring(checkpoint, reference):
    engine = tiny_engine(checkpoint[1], num_blocks=256)
    output = run_outputs(engine, [PROMPTS[1]], params(n=3, temperature=1.0, seed=5))["0"]
    assert len(output.outputs) == 3
    assert_matches_reference(output.prompt_logprobs, PROMPTS[1], reference[1])


def test_refuses_negative_and_oversized_counts(checkpoint):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    engine = tiny_engine(checkpoint[1], num_blocks=64)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.add_request("x", {"prompt_token_ids": [3, 4]}, params(prompt_logprobs=10_000))
