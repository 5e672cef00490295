"""Read-ahead of swapped sequences: the evicted parked blocks of the sequences that
resume next are copied back into free cached pool blocks beside a step, so their
swap-in finds them in place. It must change which copies wait, never tokens."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_engine_swap import make_llm, token_ids, workload
from test_kv_swap_space import full_block, make_cache

from pagedllm import SamplingParams
from pagedllm.kv_storage.block_copies import BlockCopies
from pagedllm.kv_storage.swap_space import SwapSpace
from pagedllm.server.metrics import ServerMetrics


def seeded(params: list[SamplingParams]) -> list[SamplingParams]:
    """The same requests sampled at temperature 0.8, each with its own seed."""
    return [
        SamplingParams(n=p.n, temperature=0.8, seed=i, max_tokens=p.max_tokens, ignore_eos=True)
        for i, p in enumerate(params)
    ]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_read_ahead_keeps_every_token_and_saves_swap_in_copies(tiny_model, sampling):
    prompts, params = workload()
    if sampling == "seeded":
        params = seeded(params)
    roomy = make_llm(tiny_model, 2048, max_num_batched_tokens=2048)
    expected = token_ids(roomy.generate(prompts, params, use_tqdm=False))
    # a small token budget: swapped sequences wait behind prefill chunks with blocks free
    tight = dict(preemption_mode="swap", swap_blocks=64, max_num_batched_tokens=24)
    runs = {}
    for read_ahead in (False, True):
        llm = make_llm(tiny_model, 32, max_num_seqs=24, swap_read_ahead=read_ahead, **tight)
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        runs[read_ahead] = stats = llm.llm_engine.get_stats()
        assert stats.num_preemptions_swap > 0
        assert stats.num_blocks_used == 0 and stats.swap.used_blocks == 0
    off, on = runs[False], runs[True]
    assert off.read_ahead is None and off.swap.read_ahead_blocks == 0
    ahead = on.read_ahead
    assert ahead.blocks == on.swap.read_ahead_blocks > 0
    assert 0 < ahead.used_blocks <= ahead.blocks and ahead.resumes > 0
    assert ahead.lead_seconds > 0
    # each block found in place is one the swap-in did not copy
    assert on.swap.bytes_swapped_in < off.swap.bytes_swapped_in
    metrics = ServerMetrics("tiny")
    metrics.record_step(on)
    metrics.record_step(on)  # counters follow totals, not calls
    sample = metrics.registry.get_sample_value
    name = "pagedllm:swap_read_ahead_blocks_total"
    assert sample(name, {"model_name": "tiny", "outcome": "copied"}) == ahead.blocks
    assert sample(name, {"model_name": "tiny", "outcome": "used"}) == ahead.used_blocks
    resumes = sample("pagedllm:swap_read_ahead_resumes_total", {"model_name": "tiny"})
    assert resumes == ahead.resumes


def test_no_read_ahead_without_prefix_caching(tiny_model):
    prompts, params = workload(24, seed=4)
    llm = make_llm(
        tiny_model,
        32,
        preemption_mode="swap",
        swap_blocks=64,
        max_num_batched_tokens=24,
        max_num_seqs=24,
        enable_prefix_caching=False,
    )
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    assert stats.num_preemptions_swap > 0
    assert stats.read_ahead is None and stats.swap.read_ahead_blocks == 0


def test_the_copy_runs_beside_the_caller_and_the_next_moves_wait_for_it(monkeypatch):
    cache = make_cache()
    swap = SwapSpace(cache, num_blocks=3)
    parked = swap.park(num_blocks=2)
    swap.copy_out([(0, parked[0]), (1, parked[1])])
    wanted = [full_block(cache, 0), full_block(cache, 1)]
    cache.tensor.zero_()
    copied_on = []
    copy_in_full = SwapSpace._copy_in_full

    def slow_copy(self, pairs):
        copied_on.append(threading.get_ident())
        time.sleep(0.3)
        copy_in_full(self, pairs)

    monkeypatch.setattr(SwapSpace, "_copy_in_full", slow_copy)
    # a step's moves start the copy last; the next step's moves wait for it first
    BlockCopies([], [], [], read_ahead=[(parked[0], 3), (parked[1], 2)]).apply(cache, swap)
    assert torch.count_nonzero(cache.tensor) == 0  # still copying
    BlockCopies([], [], [(3, 4)]).apply(cache, swap)  # copy-on-write reads block 3
    assert torch.equal(full_block(cache, 4), wanted[0])
    assert copied_on and copied_on[0] != threading.get_ident()
    assert torch.equal(full_block(cache, 3), wanted[0])
    assert torch.equal(full_block(cache, 2), wanted[1])
    stats = swap.stats()
    assert stats.read_ahead_blocks == 2 and stats.read_ahead_wait_seconds > 0.1
    swap.finish_read_ahead()  # nothing left to wait for


def test_only_full_blocks_are_read_ahead():
    cache = make_cache()
    swap = SwapSpace(cache, num_blocks=2, num_compact_blocks=2)
    compact_swap = swap.park(num_blocks=0, num_compact=1)[0]
    with pytest.raises(ValueError, match="only full blocks"):
        swap.start_read_ahead([(compact_swap, cache.compact_offset)])
    full_swap = swap.park(num_blocks=1)[0]
    with pytest.raises(ValueError, match="only full blocks"):
        swap.start_read_ahead([(full_swap, cache.compact_offset + 1)])
