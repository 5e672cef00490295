"""The engine on a tiny random checkpoint: stress under a pool that holds only a few
requests, bad input, aborts and the start-up memory checks."""

from __future__ import annotations

import random

import pytest
from tiny_checkpoints import tiny_engine

from pagedllm import LLM, SamplingParams


def make_llm(loaded, num_blocks: int, **overrides) -> LLM:
    settings = dict(max_num_batched_tokens=96)
    settings.update(overrides)
    return LLM.from_engine(tiny_engine(loaded, num_blocks, **settings))


def random_requests(count: int, seed: int = 0, max_len: int = 80):
    """Greedy requests of random prompt and output lengths, each at most ``max_len``."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(count):
        prompt_len = rng.randint(1, max_len // 2)
        prompts.append({"prompt_token_ids": [rng.randrange(2, 512) for _ in range(prompt_len)]})
        max_tokens = rng.randint(1, max_len // 2)
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return prompts, params


def test_stress_small_pool_equals_unconstrained_run(tiny_model):
    prompts, params = random_requests(200)
    roomy = make_llm(tiny_model, num_blocks=4096, max_num_seqs=256, max_num_batched_tokens=4096)
    expected = roomy.generate(prompts, params, use_tqdm=False)
    # 24 blocks of 4 tokens: about three of these requests at a time
    cramped = make_llm(tiny_model, num_blocks=24, max_model_len=80, max_num_batched_tokens=64)
    got = cramped.generate(prompts, params, use_tqdm=False)
    stats = cramped.llm_engine.get_stats()
    assert stats.num_preemptions_total > 0
    assert stats.peak_blocks_used <= 24
    assert stats.num_blocks_used == 0 and stats.num_blocks_free == 24
    assert not cramped.llm_engine.has_unfinished_requests()
    for want, have, p in zip(expected, got, params, strict=True):
        assert have.finished and len(have.outputs[0].token_ids) == p.max_tokens
        assert have.outputs[0].token_ids == want.outputs[0].token_ids


def test_contiguous_mode_runs_fewer_sequences_with_same_outputs(tiny_model):
    prompts, params = random_requests(24, seed=1, max_len=160)
    paged = make_llm(tiny_model, num_blocks=160, max_model_len=160, reserved_fraction=0.0)
    contiguous = make_llm(
        tiny_model,
        num_blocks=160,
        max_model_len=160,
        reserved_fraction=0.0,
        kv_allocation="contiguous",
    )
    paged_out = paged.generate(prompts, params, use_tqdm=False)
    contiguous_out = contiguous.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in paged_out] == [
        o.outputs[0].token_ids for o in contiguous_out
    ]
    assert contiguous.llm_engine.get_stats().max_concurrent_seqs == 4  # 160 / 40 blocks each
    assert paged.llm_engine.get_stats().max_concurrent_seqs > 4


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_token_ids": list(range(2, 200))}, {}, "max_model_len"),
        ({"prompt_token_ids": [5] * 100}, {"max_tokens": 100}, "beyond max_model_len"),
        ({"prompt_token_ids": []}, {}, "empty"),
        ({"prompt_token_ids": [100000]}, {}, "token ids"),
        ({"prompt_token_ids": [5]}, {"max_tokens": 0}, "max_tokens"),
        ({"prompt_token_ids": [5]}, {"temperature": -1.0}, "temperature"),
        ({"prompt_token_ids": [5]}, {"top_p": 0.0}, "top_p"),
        ({"prompt_token_ids": [5]}, {"top_p": 1.5}, "top_p"),
        ({"wrong": 1}, {}, "prompt"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(tiny_model, prompt, params, message):
    llm = make_llm(tiny_model, num_blocks=60, max_model_len=150)
    engine = llm.llm_engine
    engine.add_request("ok", {"prompt_token_ids": [3, 4, 5]}, SamplingParams(max_tokens=5))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams(**params))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[-1].request_id == "ok" and outputs[-1].finished
    assert len(outputs[-1].outputs[0].token_ids) == 5


def test_abort_frees_blocks_and_is_harmless_when_repeated(tiny_model):
    llm = make_llm(tiny_model, num_blocks=60, max_model_len=150)
    engine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": list(range(2, 40))}, SamplingParams(max_tokens=50))
    engine.add_request("b", {"prompt_token_ids": list(range(2, 20))}, SamplingParams(max_tokens=3))
    engine.step()
    assert engine.get_stats().num_blocks_used > 0
    engine.abort_request("a")
    engine.abort_request("a")
    engine.abort_request("never-seen")
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(o.request_id for o in engine.step() if o.finished)
    assert finished == ["b"]
    engine.abort_request("b")
    assert engine.get_stats().num_blocks_used == 0


def test_refuses_to_start_when_one_full_request_cannot_fit(tiny_model):
    with pytest.raises(ValueError, match="largest max_model_len that fits is 76"):
        make_llm(tiny_model, num_blocks=20, max_model_len=400)


def test_high_priority_request_may_use_the_reserve(tiny_model):
    # 40 blocks, 20 of them reserved: normal requests share the other 20
    llm = make_llm(tiny_model, num_blocks=40, max_model_len=80, reserved_fraction=0.5)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=5)
    engine.add_request("normal-a", {"prompt_token_ids": list(range(2, 72))}, params)
    engine.step()  # 70 tokens: 18 blocks; 2 left below the reserve
    # distinct tokens, so that no prefix-cache hit shrinks what they need
    engine.add_request("normal-b", {"prompt_token_ids": list(range(100, 140))}, params)
    engine.add_request("urgent", {"prompt_token_ids": list(range(200, 240))}, params, priority=-1)
    engine.step()
    running = {seq.request_id for seq in engine.scheduler.running}
    waiting = [seq.request_id for seq in engine.scheduler.waiting]
    assert running == {"normal-a", "urgent"} and waiting == ["normal-b"]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_blocks_used == 0


def test_refuses_a_model_loaded_on_another_device(tiny_model):
    """A model already loaded elsewhere (here: shapes only, on the meta device) is refused
    by name rather than failing at the first step on mixed devices."""
    from pagedllm.models.loader import load_model

    elsewhere = load_model(str(tiny_model.source), device="meta")
    with pytest.raises(ValueError, match="loaded on meta but the engine's device is cpu"):
        tiny_engine(elsewhere, num_blocks=16, device="cpu")
