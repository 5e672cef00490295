"""Speculative decoding through the whole engine: greedy tokens identical to decoding
without guesses (through forks, copy-on-write, prefix caching, preemption by recompute
and swap, stops, penalties and logprobs), sampling distributed as the model's, every
block back in the pool, and the rollback of rejected guesses."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from test_engine_swap import workload
from tiny_checkpoints import run_outputs, tiny_engine

from pagedllm import LLM
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.sequence import TokenSequence
from pagedllm.engine.speculation import PerSequence

FIXED = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_draft_length": False}


class OracleGuesses(PerSequence):
    """Guesses the true continuation (from a run without guesses), corrupted at a random
    depth half of the time, so that steps keep all, some or none of their guesses."""

    def __init__(self, continuations: dict[tuple[str, int], list[int]], seed: int = 0):
        self.continuations = continuations
        self.rng = random.Random(seed)

    def propose(self, seq: TokenSequence, limit: int) -> list[int]:
        full = self.continuations[(seq.request_id, seq.index)]
        guess = list(full[seq.num_tokens : seq.num_tokens + limit])
        if guess and self.rng.random() < 0.5:
            depth = self.rng.randrange(len(guess))
            guess[depth] = (guess[depth] + 1) % 500
        return guess

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        pass


def run_stepwise(engine, prompts, params) -> dict[str, object]:
    """Run to completion, checking every sequence's progress against the block manager
    around each step; returns the final outputs by request id."""
    for i, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, param)
    done = {}
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        engine.scheduler.check_progress(plan)
        if plan.is_empty:
            continue
        for out in engine.run_plan(plan):
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_progress()
    assert engine.block_manager.pool.num_used == 0
    return done


def continuations(prompts, outputs) -> dict[tuple[str, int], list[int]]:
    return {
        (rid, sample.index): list(prompts[int(rid)]["prompt_token_ids"]) + list(sample.token_ids)
        for rid, out in outputs.items()
        for sample in out.outputs
    }


def samples(outputs) -> dict[str, list[list[int]]]:
    return {rid: [s.token_ids for s in out.outputs] for rid, out in outputs.items()}


POOLS = pytest.mark.parametrize(
    ("num_blocks", "settings"),
    [
        (2048, {}),
        (32, {"preemption_mode": "recompute"}),
        (32, {"preemption_mode": "swap", "swap_blocks": 64}),
    ],
    ids=["roomy", "recompute", "swap"],
)
"""A roomy pool, and pools of 32 blocks that preempt by recompute and by swap."""


@POOLS
def test_greedy_tokens_are_those_without_guesses(tiny_model, num_blocks, settings):
    prompts, params = workload(count=24)
    common = dict(max_model_len=100, max_num_batched_tokens=64, **settings)
    expected = run_stepwise(tiny_engine(tiny_model, num_blocks, **common), prompts, params)
    engine = tiny_engine(tiny_model, num_blocks, speculative_config=FIXED, **common)
    engine.speculator.proposer = OracleGuesses(continuations(prompts, expected))
    got = run_stepwise(engine, prompts, params)
    assert samples(got) == samples(expected)
    spec = engine.get_stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert spec.accepted_per_position[0] >= spec.accepted_per_position[-1] > 0
    assert engine.speculator.num_blocks_rolled_back > 0  # rejected guesses gave blocks back
    if num_blocks == 32:
        assert engine.get_stats().num_preemptions_total > 0
    if engine.swap_space is not None:
        assert engine.swap_space.stats().used_blocks == 0


def test_stops_penalties_bias_and_logprobs_see_the_guesses(tiny_model):
    """Each verified row is processed as a one-token step with its history: stop ids
    and max_tokens end the sequence inside a guess, min_tokens bans stops, penalties
    and bias apply, and logprobs are the model's."""
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 500) for _ in range(12)]} for _ in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, presence_penalty=1.5,
                       frequency_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=30, logit_bias={7: 3.0, 9: -2.0}),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=30, min_tokens=10, ignore_eos=True),
    ]  # fmt: skip
    expected = run_stepwise(tiny_engine(tiny_model, 256), prompts, params)
    # a stop id the unspeculated run meets mid-output, and min_tokens that delays it
    stop_at = expected["0"].outputs[0].token_ids[12]
    params[0] = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3, stop_token_ids=[stop_at]
    )
    params[5] = SamplingParams(
        temperature=0.0, max_tokens=30, min_tokens=14, ignore_eos=True, stop_token_ids=[stop_at]
    )
    expected = run_stepwise(tiny_engine(tiny_model, 256), prompts, params)
    engine = tiny_engine(tiny_model, 256, speculative_config=FIXED)
    engine.speculator.proposer = OracleGuesses(continuations(prompts, expected), seed=1)
    got = run_stepwise(engine, prompts, params)
    assert samples(got) == samples(expected)
    assert got["0"].outputs[0].finish_reason == "stop"
    mine, theirs = got["0"].outputs[0].logprobs, expected["0"].outputs[0].logprobs
    assert [[t for t, _ in step.top] for step in mine] == [[t for t, _ in s.top] for s in theirs]
    np.testing.assert_allclose(
        [step.logprob for step in mine], [step.logprob for step in theirs], atol=1e-5
    )
    assert engine.get_stats().spec_decode.num_accepted_tokens > 0


def test_sampled_tokens_follow_the_models_distribution(tiny_model):
    """10,240 samples of one prompt (top-k 4): the first token is sampled plainly, the
    next ones verify guesses (the likeliest token, then a fixed one). The second token's
    counts, per first token, must fit the model's own distribution after it."""
    prompt = [3, 14, 15, 92, 65]
    params = SamplingParams(n=128, temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    # the model's top-4 distributions after the prompt and after each first token
    probe = tiny_engine(tiny_model, 512, max_n=128)
    after: dict[int, dict[int, float]] = {}
    first_ids = _top(probe, prompt, 4)
    for token in first_ids:
        after[token] = _top(probe, prompt + [token], 4)
    engine = tiny_engine(
        tiny_model, 4096, max_n=128, max_num_seqs=256, max_num_batched_tokens=2048,
        speculative_config=FIXED,
    )  # fmt: skip
    guesses = {t: [max(after[t], key=after[t].get), 1] for t in first_ids}
    engine.speculator.proposer = FixedGuesses(len(prompt), guesses)
    outputs = run_outputs(engine, [prompt] * 80, params)
    pairs = [s.token_ids[:2] for out in outputs.values() for s in out.outputs]
    assert len(pairs) == 10_240
    assert second_tokens_p_value(pairs, after) > 1e-4
    spec = engine.get_stats().spec_decode
    assert spec.num_drafts >= 10_000 and 0 < spec.acceptance_rate < 1


def second_tokens_p_value(pairs: list[list[int]], after: dict[int, dict[int, float]]) -> float:
    """Chi-square p-value of the second tokens of ``pairs`` (first, second) against
    ``after[first]``, the model's distribution after each first token."""
    statistic, dof = 0.0, 0
    for token, dist in after.items():
        seconds = [b for a, b in pairs if a == token]
        counts = np.array([seconds.count(t) for t in dist])
        assert sum(counts) == len(seconds), "a second token outside the distribution"
        expected = np.array(list(dist.values())) * len(seconds)
        statistic += float(((counts - expected) ** 2 / expected).sum())
        dof += len(dist) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


class FixedGuesses(PerSequence):
    """Guesses by the sequence's first output token, once per sequence."""

    def __init__(self, prompt_len: int, by_first: dict[int, list[int]]):
        self.prompt_len, self.by_first = prompt_len, by_first

    def propose(self, seq: TokenSequence, limit: int) -> list[int]:
        if seq.num_tokens != self.prompt_len + 1:
            return []
        return self.by_first[seq.all_token_ids[-1]][:limit]

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        pass


def _top(engine, prompt: list[int], k: int) -> dict[int, float]:
    """The model's next-token distribution after ``prompt`` restricted to its top ``k``
    (what top-k sampling at temperature 1 draws from), from its logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=k)
    out = run_outputs(engine, [prompt], params)["0"].outputs[0].logprobs[0]
    weights = {token: float(np.exp(logprob)) for token, logprob in out.top}
    total = sum(weights.values())
    return {token: w / total for token, w in weights.items()}


def test_beam_search_is_refused_with_speculation(tiny_model):
    llm = LLM.from_engine(tiny_engine(tiny_model, 64, speculative_config=FIXED))
    with pytest.raises(ValueError, match="beam search does not run with speculative"):
        llm.beam_search([{"prompt_token_ids": [1, 2, 3]}], BeamSearchParams(2, max_tokens=4))


def test_ngram_on_the_default_model_repeats_a_passage_exactly(default_model):
    """The input-grounded case: asked to repeat a passage, the model copies it, and
    prompt lookup guesses the copy; greedy tokens equal decoding without guesses."""
    tokenizer = default_model.tokenizer
    passage = (
        "PagedAttention stores the KV cache in fixed-size blocks drawn from one pool. "
        "Each sequence keeps a block table that maps its logical blocks to physical "
        "blocks, so memory is allocated on demand and shared by reference count."
    )
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=60)

    def run(**settings):
        from pagedllm import EngineConfig, LLMEngine

        config = EngineConfig(dtype="float32", kv_cache_memory="64MiB", log_stats_interval=0,
                              **settings)  # fmt: skip
        engine = LLMEngine(config, default_model)
        return engine, run_outputs(engine, [prompt], params)["0"].outputs[0].token_ids

    _, expected = run()
    engine, got = run(speculative_config=dict(FIXED))
    assert got == expected
    spec = engine.get_stats().spec_decode
    assert spec.acceptance_rate > 0.5, spec
    assert spec.mean_acceptance_length > 2.0, spec


class JsonRequests:
    """Chat requests asking the default model for JSON matching the first ``count`` test
    schemas, each constrained to its schema; ``params(temperature)`` gives their
    (seeded) sampling params, ``engine(**settings)`` a float32 engine over the model."""

    def __init__(self, model, count: int, max_tokens: int) -> None:
        from test_structured_outputs import SCHEMAS

        self.model, self.max_tokens = model, max_tokens
        self.schemas = SCHEMAS[:count]
        self.prompts = [
            {"prompt_token_ids": model.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"Reply with JSON matching this schema: {s}"}],
                add_generation_prompt=True)}
            for s in self.schemas
        ]  # fmt: skip

    def params(self, temperature: float) -> list[SamplingParams]:
        from pagedllm.structured_output import StructuredOutputsParams

        made = [
            SamplingParams(temperature=temperature, seed=i, max_tokens=self.max_tokens,
                           structured_outputs=StructuredOutputsParams(json=s))
            for i, s in enumerate(self.schemas)
        ]  # fmt: skip
        for p in made:  # each request compiles its grammar (as LLM and the server do)
            p.check_for_model(self.model.config.vocab_size, self.model.tokenizer)
        return made

    def engine(self, **settings):
        from pagedllm import EngineConfig, LLMEngine

        config = EngineConfig(dtype="float32", kv_cache_memory="64MiB", log_stats_interval=0,
                              **settings)  # fmt: skip
        return LLMEngine(config, self.model)

    def assert_valid(self, outputs) -> None:
        """Each request's text parses as JSON and matches its schema."""
        import jsonschema

        for i, schema in enumerate(self.schemas):
            jsonschema.validate(json.loads(outputs[str(i)].outputs[0].text), schema)


def test_structured_outputs_cut_guesses_at_the_grammar(default_model):
    """Guesses for a constrained sequence stop where the grammar refuses a token; the
    verified rows are masked as one-token steps would be: greedy JSON is the JSON
    without guesses, and sampled JSON still validates."""
    requests = JsonRequests(default_model, 8, max_tokens=80)
    prompts, params, engine = requests.prompts, requests.params, requests.engine
    expected = run_stepwise(engine(), prompts, params(0.0))
    guessing = engine(speculative_config=FIXED)
    guessing.speculator.proposer = OracleGuesses(continuations(prompts, expected), seed=3)
    assert samples(run_stepwise(guessing, prompts, params(0.0))) == samples(expected)
    assert guessing.get_stats().spec_decode.num_accepted_tokens > 0
    requests.assert_valid(run_stepwise(guessing, prompts, params(1.0)))


def test_speculation_says_at_start_where_products_are_not_batch_invariant(
    tiny_model, default_model, caplog
):
    """torch's own GEMM (linear_kernel="dense") blocks by batch size, so greedy output may
    move with speculation, and the start-up log says so. The packed kernels and the
    default model's Q4_1 and Q8_0 blocks in float32 (both paths of the block kernels add
    a row's products in one order) keep every row's sums whatever the batch: nothing is
    said."""
    import logging

    from pagedllm import EngineConfig, LLMEngine
    from pagedllm.models.loader import load_model

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    dense = load_model(tiny_model.source, torch.float32, linear_kernel="dense")
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        tiny_engine(dense, 256, speculative_config=spec)
    warned = [r.getMessage() for r in caplog.records if "batch invariant" in r.getMessage()]
    assert len(warned) == 1
    assert "because torch's products on cpu is not batch invariant" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        tiny_engine(tiny_model, 256, speculative_config=spec)
        config = EngineConfig(dtype="float32", kv_cache_memory="64MiB", speculative_config=spec)
        LLMEngine(config, default_model)
    assert "batch invariant" not in caplog.text


@pytest.fixture(scope="module")
def q4_k_model(tmp_path_factory):
    """The tiny Llama as a GGUF file of Q4_K blocks, loaded with bfloat16 activations."""
    from test_models_gguf import QType, write_gguf
    from transformers import LlamaForCausalLM

    from pagedllm.bench.tiny_llama import write_tiny_llama
    from pagedllm.models.loader import load_model

    folder = tmp_path_factory.mktemp("q4-k")
    hf_model = LlamaForCausalLM.from_pretrained(write_tiny_llama(folder / "hf")).eval()
    return load_model(write_gguf(folder / "tiny.gguf", hf_model, QType.Q4_K), torch.bfloat16)


def test_q4_k_blocks_give_the_tokens_and_logprobs_of_decoding_without_guesses(q4_k_model):
    """No interleaved kernel takes Q4_K, so its blocks run row by row: a decode step's 3
    rows in registers, a verification's 15 in panels. Both add a row's products in one
    order, so greedy tokens and their logprobs are those without guesses, to the bit."""
    from pagedllm.models.batch_invariance import variant_products

    assert variant_products(q4_k_model.model) == []
    rng = random.Random(7)
    prompts = [{"prompt_token_ids": [rng.randrange(2, 500) for _ in range(10)]} for _ in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)] * 3
    expected = run_stepwise(tiny_engine(q4_k_model, 256, dtype="bfloat16"), prompts, params)
    engine = tiny_engine(q4_k_model, 256, dtype="bfloat16", speculative_config=FIXED)
    engine.speculator.proposer = OracleGuesses(continuations(prompts, expected), seed=2)
    got = run_stepwise(engine, prompts, params)
    assert samples(got) == samples(expected)
    for rid, out in expected.items():
        mine, theirs = got[rid].outputs[0].logprobs, out.outputs[0].logprobs
        assert [(s.logprob, s.top) for s in mine] == [(s.logprob, s.top) for s in theirs]
    assert engine.get_stats().spec_decode.num_accepted_tokens > 0
