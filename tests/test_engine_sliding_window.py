"""Sliding window as a memory feature: on a model whose every layer slides (a tiny random
Mistral, window 32 tokens, blocks of 16), the blocks a sequence holds stay bounded by the
window however long it runs, and greedy tokens still equal transformers' through chunked
prefill, prefix-cache hits, forks and preemption by recompute and by swap.

Bound, with no lookahead: a step computing ``n`` tokens from position ``p`` holds the
blocks of positions ``p - W + 1 .. p + n - 1``, at most ``ceil((W + n + B - 2) / B)``
(:func:`~pagedllm.kv.capacity.max_window_blocks`); 3 blocks while decoding, which is
``ceil(W / B) + 1``, and what the planner counts."""

from __future__ import annotations

import math

import pytest
from tiny_checkpoints import tiny_engine
from transformers_oracle import reference_greedy, write_random_checkpoint

from pagedllm import SamplingParams
from pagedllm.kv.capacity import max_window_blocks, request_worst_case_blocks
from pagedllm.models.loader import load_model

WINDOW = 32
BLOCK = 16
DECODE_BOUND = math.ceil(WINDOW / BLOCK) + 1


def chunk_bound(num_tokens: int) -> int:
    """Blocks a step computing ``num_tokens`` tokens of one sequence may hold."""
    return max_window_blocks(WINDOW, num_tokens, BLOCK)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """``(loaded model, transformers reference)`` of a 2-layer Mistral, window 32."""
    folder = tmp_path_factory.mktemp("mistral-window")
    reference = write_random_checkpoint(
        folder, "mistral", sliding_window=WINDOW, max_position_embeddings=512
    )
    return load_model(str(folder)), reference


def prompt(length: int, seed: int) -> list[int]:
    return [(seed * 37 + i * 11) % 250 + 3 for i in range(length)]


def run(engine, prompts, params):
    """Token ids of every sample by prompt index, and the most blocks any scheduled
    sequence held right after each step was planned, as ``(held, tokens run)`` pairs."""
    scheduler = engine.scheduler
    manager = engine.block_manager
    plan_step = scheduler.schedule
    seen: list[tuple[int, int]] = []

    def schedule():
        plan = plan_step()
        seen.extend((manager.num_held_blocks(i.seq.seq_id), i.num_tokens) for i in plan.scheduled)
        return plan

    scheduler.schedule = schedule
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params[i])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = [o.token_ids for o in out.outputs]
    assert engine.block_manager.pool.num_used == 0
    return [done[i] for i in range(len(prompts))], seen


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n, ignore_eos=True)


def assert_bounded(seen: list[tuple[int, int]]) -> None:
    for held, num_tokens in seen:
        assert held <= chunk_bound(num_tokens)
    assert max(held for held, n in seen if n == 1) == DECODE_BOUND


def test_a_long_sequence_holds_at_most_the_window(mistral):
    loaded, reference = mistral
    ids = prompt(20, 0)
    engine = tiny_engine(loaded, 64, block_size=BLOCK)
    assert engine.block_manager.sliding_window == WINDOW
    (tokens,), seen = run(engine, [ids], [greedy(200)])
    assert tokens == [reference_greedy(reference, ids, 200)]
    assert_bounded(seen)
    # 220 tokens would hold 14 blocks; the pool never had more than 3 in use
    planned = request_worst_case_blocks(0, 220, 1, BLOCK, window=WINDOW)
    assert engine.get_stats().peak_blocks_used == DECODE_BOUND == planned


def test_chunked_prefill_reads_the_window_before_each_chunk(mistral):
    loaded, reference = mistral
    ids = prompt(100, 1)
    engine = tiny_engine(
        loaded, 64, block_size=BLOCK, max_num_batched_tokens=16, max_num_seqs=8
    )
    (tokens,), seen = run(engine, [ids], [greedy(40)])
    assert tokens == [reference_greedy(reference, ids, 40)]
    assert_bounded(seen)
    assert max(held for held, _ in seen) <= chunk_bound(16)


def test_chunks_through_sdpa_gather_only_the_window(mistral):
    """Chunks of 32 rows attend through SDPA over K/V gathered from the first block the
    window reaches; the blocks before it are back in the pool (null table entries)."""
    loaded, reference = mistral
    ids = prompt(100, 4)
    engine = tiny_engine(
        loaded, 64, block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=8,
        attention_kernel="sdpa",
    )  # fmt: skip
    assert engine.runner.attn.sdpa_min_rows == 16
    (tokens,), seen = run(engine, [ids], [greedy(40)])
    assert tokens == [reference_greedy(reference, ids, 40)]
    assert_bounded(seen)


def test_a_prefix_cache_hit_needs_only_the_window(mistral):
    loaded, reference = mistral
    ids = prompt(100, 2)
    expected = [reference_greedy(reference, ids, 24)]
    engine = tiny_engine(loaded, 64, block_size=BLOCK)
    assert run(engine, [ids], [greedy(24)])[0] == [expected]
    # the first run released its early blocks: they wait in the cache as evictable
    stats = engine.block_manager.stats()
    assert stats.pool.evictable == stats.pool.cached > 0
    tokens, seen = run(engine, [ids], [greedy(24)])
    assert tokens == [expected]
    assert engine.get_stats().prefix_cache_hits == 96  # 6 whole blocks, last token computed
    assert max(held for held, _ in seen) <= chunk_bound(4)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_pool_keeps_the_tokens(mistral, mode):
    loaded, reference = mistral
    prompts = [prompt(10 + 9 * i, 10 + i) for i in range(6)]
    params = [greedy(90, n=2 if i % 3 == 0 else 1) for i in range(6)]
    expected = [[reference_greedy(reference, p, 90)] * params[i].n for i, p in enumerate(prompts)]
    swap = dict(swap_blocks=64) if mode == "swap" else {}
    engine = tiny_engine(
        loaded, 12, block_size=BLOCK, preemption_mode=mode, max_num_batched_tokens=32,
        max_num_seqs=8, **swap,
    )
    tokens, seen = run(engine, prompts, params)
    assert tokens == expected
    assert_bounded(seen)
    stats = engine.get_stats()
    assert stats.num_preemptions_total > 0
    if mode == "swap":
        assert stats.swap.swap_outs > 0 and stats.swap.swap_ins == stats.swap.swap_outs
        assert stats.swap.used_blocks == 0


def test_a_model_with_a_global_layer_keeps_every_block_in_that_layers_group(tmp_path):
    """Qwen2 with windows on its upper layer only: the lower layer's group reads and
    keeps everything, the upper layer's group its window (KV layer groups; more in
    tests/test_engine_layer_groups.py)."""
    write_random_checkpoint(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    engine = tiny_engine(load_model(str(tmp_path)), 64, block_size=BLOCK)
    assert engine.block_manager.sliding_window is None
    assert engine.block_manager.windows == (None, 16)
    _, seen = run(engine, [prompt(20, 3)], [greedy(60)])
    window_blocks = max_window_blocks(16, 1, BLOCK)
    assert max(held for held, _ in seen) == math.ceil(80 / BLOCK) + window_blocks


def test_evicted_blocks_come_back_from_the_host_tier_inside_the_window(mistral):
    """Every layer slides: a request that comes back takes its evicted blocks from
    host memory, copying in only those inside the window of its first computed token."""
    loaded, reference = mistral
    prompts = [prompt(90, seed) for seed in range(3)]
    flood = [prompt(90, seed) for seed in range(10, 16)]
    expected = [[reference_greedy(reference, p, 8)] for p in prompts]
    engine = tiny_engine(loaded, 24, block_size=BLOCK, kv_tier_memory=1 << 20)
    assert run(engine, prompts, [greedy(8)] * 3)[0] == expected
    run(engine, flood, [greedy(8)] * 6)  # the pool evicts the prompts' blocks
    assert run(engine, prompts, [greedy(8)] * 3)[0] == expected
    stats = engine.get_stats().tiers
    assert stats.spilled_blocks > 0 and stats.host_hits > 0
