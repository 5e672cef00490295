"""Sharing blocks in the engine: automatic prefix caching and n > 1 parallel sampling
must change memory, never tokens."""

from __future__ import annotations

import random

import pytest
from tiny_checkpoints import tiny_engine

from pagedllm import LLM, LLMEngine, SamplingParams
from pagedllm.engine.sequence import SequenceStatus


def make_engine(loaded, num_blocks: int, **overrides) -> LLMEngine:
    settings = dict(max_model_len=300, max_num_batched_tokens=128)
    settings.update(overrides)
    return tiny_engine(loaded, num_blocks, **settings)


def shared_prefix_requests(count: int = 64, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(2, 512) for _ in range(201)]
    prompts, params = [], []
    for _ in range(count):
        suffix = [rng.randrange(2, 512) for _ in range(rng.randint(1, 30))]
        prompts.append({"prompt_token_ids": system + suffix})
        params.append(
            SamplingParams(temperature=0.0, max_tokens=rng.randint(4, 16), ignore_eos=True)
        )
    order = list(range(count))
    rng.shuffle(order)
    return [prompts[i] for i in order], [params[i] for i in order]


def test_prefix_caching_on_equals_off_with_evictions(tiny_model):
    prompts, params = shared_prefix_requests()
    cold = LLM.from_engine(make_engine(tiny_model, 200, enable_prefix_caching=False))
    cached_engine = make_engine(tiny_model, 200)
    cached = LLM.from_engine(cached_engine)
    expected = cold.generate(prompts, params, use_tqdm=False)
    # a different prompt first, so its blocks are cached and later evicted
    cached.generate({"prompt_token_ids": list(range(5, 305 - 20))}, SamplingParams(max_tokens=4))
    got = cached.generate(prompts, params, use_tqdm=False)
    for want, have in zip(expected, got, strict=True):
        assert have.outputs[0].token_ids == want.outputs[0].token_ids
    stats = cached_engine.get_stats()
    pool = cached_engine.block_manager.pool.stats()
    assert stats.prefix_cache_hits >= 60 * 200  # nearly every request reuses the 200-token prefix
    assert pool.num_evictions > 0
    assert stats.num_blocks_used == 0  # everything is free or merely cached
    assert cold.llm_engine.get_stats().prefix_cache_hits == 0


def test_cache_salt_prevents_sharing(tiny_model):
    engine = make_engine(tiny_model, 200)
    prompt = {"prompt_token_ids": list(range(2, 120))}
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm = LLM.from_engine(engine)
    llm.generate(prompt, params, use_tqdm=False)
    hits_before = engine.get_stats().prefix_cache_hits
    engine.add_request("salted", prompt, params, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().prefix_cache_hits == hits_before
    engine.add_request("same-salt", prompt, params, cache_salt="tenant-b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().prefix_cache_hits > hits_before


def test_parallel_sampling_equals_separate_seeded_requests_and_shares_the_prompt(tiny_model):
    prompt = {"prompt_token_ids": list(range(2, 103))}  # 101 tokens: 25 full blocks + 1
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    engine = make_engine(tiny_model, 200, enable_prefix_caching=False)
    engine.add_request("n4", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
        stats = engine.get_stats()
        if len(engine.scheduler.running) == 4:
            # every full prompt block is held by all four samples, stored once
            assert stats.num_blocks_shared >= 25
    final = outputs[-1]
    assert final.finished and len(final.outputs) == 4
    peak_shared = engine.get_stats().peak_blocks_used
    separate = LLM.from_engine(make_engine(tiny_model, 200, enable_prefix_caching=False))
    for index, sample in enumerate(final.outputs):
        alone = separate.generate(
            prompt,
            SamplingParams(temperature=1.0, seed=7 + index, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )
        assert sample.token_ids == alone[0].outputs[0].token_ids
    assert len({tuple(o.token_ids) for o in final.outputs}) > 1
    # four unshared copies would need 4 x 29 blocks; sharing keeps the prompt once
    assert peak_shared <= 26 + 4 * 4
    assert engine.get_stats().num_blocks_used == 0


def test_abort_before_the_samples_fork_finishes_every_sample(tiny_model):
    """Samples 2 and 3 wait, unscheduled, to be forked from the first after its
    prefill; an abort before then ends all three through the scheduler."""
    engine = make_engine(tiny_model, 200)
    engine.add_request(
        "n3", {"prompt_token_ids": list(range(2, 50))}, SamplingParams(n=3, max_tokens=50)
    )
    sequences = [out.seq for out in engine._requests["n3"].sequences]
    engine.abort_request("n3")
    assert [seq.status for seq in sequences] == [SequenceStatus.FINISHED_ABORTED] * 3
    assert not engine.has_unfinished_requests()
    with pytest.raises(ValueError, match="not a sample waiting unscheduled"):
        engine.scheduler.finish_unscheduled(sequences[0], SequenceStatus.FINISHED_ABORTED)


def test_abort_of_parallel_request_frees_all_samples(tiny_model):
    engine = make_engine(tiny_model, 200)
    engine.add_request(
        "n3", {"prompt_token_ids": list(range(2, 50))}, SamplingParams(n=3, max_tokens=50)
    )
    engine.step()
    engine.step()
    assert len(engine.scheduler.running) == 3
    engine.abort_request("n3")
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().num_blocks_used == 0
