"""Preemption by swap: a second KV tier must change where blocks wait, never tokens."""

from __future__ import annotations

import random

from tiny_checkpoints import tiny_engine

from pagedllm import LLM, SamplingParams


def make_llm(loaded, num_blocks: int, **overrides) -> LLM:
    settings = dict(max_model_len=100, max_num_batched_tokens=64)
    settings.update(overrides)
    return LLM.from_engine(tiny_engine(loaded, num_blocks, **settings))


def workload(count: int = 64, seed: int = 3):
    """Greedy requests, a third of them sharing a 40-token prefix, some with n = 2."""
    rng = random.Random(seed)
    shared = [rng.randrange(2, 512) for _ in range(40)]
    prompts, params = [], []
    for i in range(count):
        head = shared if i % 3 == 0 else []
        tail = [rng.randrange(2, 512) for _ in range(rng.randint(1, 30))]
        prompts.append({"prompt_token_ids": head + tail})
        params.append(
            SamplingParams(
                n=2 if i % 5 == 0 else 1,
                temperature=0.0,
                max_tokens=rng.randint(4, 28),
                ignore_eos=True,
            )
        )
    return prompts, params


def token_ids(outputs) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in out.outputs] for out in outputs]


def test_swap_and_recompute_give_the_unpreempted_outputs(tiny_model):
    prompts, params = workload()
    roomy = make_llm(tiny_model, 2048, max_num_batched_tokens=2048)
    expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
    assert roomy.llm_engine.get_stats().num_preemptions_total == 0

    recompute = make_llm(tiny_model, 32, preemption_mode="recompute")
    assert token_ids(recompute.generate(prompts, params, use_tqdm=False)) == expected
    assert recompute.llm_engine.get_stats().num_preemptions_total > 0

    for mode in ("swap", "auto"):
        swapping = make_llm(tiny_model, 32, preemption_mode=mode, swap_blocks=64)
        assert token_ids(swapping.generate(prompts, params, use_tqdm=False)) == expected
        stats = swapping.llm_engine.get_stats()
        assert stats.num_preemptions_total > 0
        assert stats.swap.swap_outs > 0 and stats.swap.swap_ins == stats.swap.swap_outs
        # a swap-in takes the parked blocks still cached in the pool without a copy
        assert stats.swap.bytes_swapped_out >= stats.swap.bytes_swapped_in > 0
        assert stats.swap.used_blocks == 0 and stats.num_swapped == 0
        assert stats.num_blocks_used == 0


def test_swap_space_on_a_memory_mapped_file(tiny_model, tmp_path):
    prompts, params = workload(16, seed=5)
    expected = token_ids(make_llm(tiny_model, 2048).generate(prompts, params, use_tqdm=False))
    spill = tmp_path / "kv-swap.bin"
    llm = make_llm(tiny_model, 30, preemption_mode="swap", swap_blocks=64, swap_path=str(spill))
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert llm.llm_engine.get_stats().swap.swap_outs > 0
    assert spill.stat().st_size > 0


def test_abort_of_a_swapped_request_frees_its_swap_blocks(tiny_model):
    llm = make_llm(tiny_model, 30, preemption_mode="swap", swap_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", {"prompt_token_ids": [7 + i] * 30}, params)
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0].request_id
    engine.abort_request(victim)
    assert engine.swap_space.stats().used_blocks == 0
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().num_blocks_used == 0
