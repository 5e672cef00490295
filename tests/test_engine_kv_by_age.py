"""The engine with ``kv_cache_dtype="int4"`` on a tiny random model: blocks wholly behind
each sequence's recent window are re-encoded into compact 4-bit blocks (a prompt's
shared blocks once for all its samples, a cached prefix not again), the compact K/V
are the encoded K/V of those positions, attention through the C++ kernel equals the
reference over every block decoded, preemption (recompute, and swap that parks compact
blocks compact) and prefix caching keep working, and every block is free again at the
end. Quality on the real model at long context: ``benchmarks/kv_by_age.py``."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.kv_storage.compact_blocks import TileLayout, decode_tiles
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.plan.capacity import PLANNED_KV_DTYPES, ByAge, Workload, by_age_capacity
from pagedllm.plan.model_shape import resolve_model

BLOCK_SIZE = 16


def make_engine(loaded, recent_tokens: int, **overrides) -> LLMEngine:
    settings = dict(
        dtype="float32",
        kv_cache_dtype="int4",
        kv_recent_tokens=recent_tokens,
        block_size=BLOCK_SIZE,
        kv_cache_memory="8MiB",
        max_num_seqs=8,
        max_num_batched_tokens=64,
        log_stats_interval=0,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), loaded)


def prompt(length: int, seed: int = 0) -> dict:
    return {"prompt_token_ids": [(31 * i + 7 * seed) % 480 + 3 for i in range(length)]}


def run(engine: LLMEngine, prompts, params) -> list[list[list[int]]]:
    """Every request to the end; the progress counts (compact entries included) are
    checked after each step."""
    return run_all(engine, prompts, [params] * len(prompts))


class EncodeCounter:
    """Counts the full blocks ``cache`` re-encodes, wrapping its method."""

    def __init__(self, cache: KVCache, monkeypatch) -> None:
        self.pairs: list[tuple[int, int]] = []
        encode = cache.encode_blocks

        def counted(pairs):
            self.pairs.extend(pairs)
            encode(pairs)

        monkeypatch.setattr(cache, "encode_blocks", counted)


def test_defaults_keep_128_recent_tokens_and_a_quarter_of_the_bytes_full_size(tiny_model):
    config = EngineConfig(dtype="float32", kv_cache_dtype="int4", log_stats_interval=0)
    assert config.block_size == 16 and config.kv_recent_tokens == 128
    engine = LLMEngine(config, tiny_model)
    pool = engine.block_manager.pool
    assert pool.num_compact_blocks > 3 * pool.num_blocks  # a quarter of the bytes at most
    assert engine.kv_cache.compact_offset == pool.compact_offset


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"kv_allocation": "contiguous"}, "kv_allocation"),
        (
            {"speculative_config": {"method": "draft_model", "model": "x"}},
            "speculative_config",
        ),
        ({"kv_recent_tokens": -1}, "kv_recent_tokens"),
        ({"block_size": 8}, "block_size"),
    ],
)
def test_int4_refuses_what_it_does_not_run_with(overrides, named):
    with pytest.raises(ValueError, match=named):
        EngineConfig(dtype="float32", kv_cache_dtype="int4", **overrides)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_recent_window_without_int4_is_refused(kv_cache_dtype):
    """A window size other than the default would be ignored: refused instead."""
    EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_recent_tokens=EngineConfig.kv_recent_tokens)
    with pytest.raises(ValueError, match="kv_recent_tokens=16 .* int4"):
        EngineConfig(kv_cache_dtype=kv_cache_dtype, kv_recent_tokens=16)


def error_bounds(tile: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codec's bound for one tile: per token, the L2 error of a key (half a step
    per rotated channel; the rotation keeps L2 norms) and the largest error of a value
    element (half a step), each widened by the bfloat16 rounding of the zero point."""
    layout = TileLayout(BLOCK_SIZE, head_dim)

    def floats(offset: int, count: int) -> torch.Tensor:
        return tile[offset : offset + 2 * count].contiguous().view(torch.bfloat16).float()

    key_scale = floats(layout.key_scale_offset, head_dim)
    key_zero = floats(layout.key_zero_offset, head_dim)
    value_scale = floats(layout.value_scale_offset, BLOCK_SIZE)
    value_zero = floats(layout.value_zero_offset, BLOCK_SIZE)
    key_bound = (key_scale / 2 + key_zero.abs() / 256).norm() + 1e-4
    return key_bound, value_scale / 2 + value_zero.abs() / 256 + 1e-4


def test_compact_blocks_hold_their_positions_keys_and_values_within_the_codec_bound(
    tiny_model, monkeypatch
):
    """Layer 0's K/V depend on the tokens alone: each compact block of a running
    sequence decodes to the K/V a float cache holds for the same positions, within
    the 4-bit codec's bound; the window's full-size blocks hold them exactly."""
    engine = make_engine(tiny_model, recent_tokens=8)
    counter = EncodeCounter(engine.kv_cache, monkeypatch)
    engine.add_request("0", prompt(70), SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(30):
        engine.step()
    (seq,) = engine.scheduler.running
    table = engine.block_manager.block_table(seq.seq_id)
    pool = engine.block_manager.pool
    compact = [(i, b) for i, b in enumerate(table) if pool.is_compact(b)]
    # re-encoded at the last reservation, from the tokens committed before that step
    assert len(compact) == (seq.num_computed_tokens - 1 - 8) // BLOCK_SIZE > 3
    assert [b for _, b in compact] == [c for _, c in counter.pairs]
    reference = make_engine(tiny_model, EngineConfig.kv_recent_tokens, kv_cache_dtype="auto")
    tokens = seq.all_token_ids[: seq.num_computed_tokens]
    reference.add_request("0", {"prompt_token_ids": tokens}, SamplingParams(max_tokens=2))
    (ref_seq,) = [*reference.scheduler.waiting]
    while ref_seq.num_computed_tokens < len(tokens):
        reference.step()
    ref_table = reference.block_manager.block_table(ref_seq.seq_id)
    tiles = engine.kv_cache.compact.tiles(0)
    offset = engine.kv_cache.compact_offset
    head_dim = engine.kv_cache.head_dim
    for index, block_id in compact:
        tile = tiles[block_id - offset]
        keys, values = decode_tiles(tile, BLOCK_SIZE, head_dim)
        want_keys = reference.kv_cache.key(0)[ref_table[index]].float()
        want_values = reference.kv_cache.value(0)[ref_table[index]].float()
        for head in range(tile.shape[0]):
            key_bound, value_bound = error_bounds(tile[head], head_dim)
            key_error = (keys[head] - want_keys[head]).norm(dim=-1)
            assert (key_error <= key_bound).all(), (index, head, key_error.max(), key_bound)
            value_error = (values[head] - want_values[head]).abs().amax(dim=-1)
            assert (value_error <= value_bound).all(), (index, head)
    for index in range(len(compact), seq.num_computed_tokens // BLOCK_SIZE):
        torch.testing.assert_close(
            engine.kv_cache.key(0)[table[index]], reference.kv_cache.key(0)[ref_table[index]]
        )


@pytest.mark.parametrize("recent_dtype", ["auto", "int8", "fp8_e4m3"])
def test_the_kernel_equals_the_reference_over_every_block_decoded(
    tiny_model, monkeypatch, recent_dtype
):
    """In every attention call of real engine steps (mixed tables: compact blocks, then
    full ones, the last partly filled; prefill chunks and decode steps), the C++ kernel's
    output equals the reference's over every block decoded, within the kernel's
    fixed-point tolerance (tests/test_paged_attention_compact.py); the recent window in
    the model's dtype or in 8 bits (``kv_recent_dtype``). Call by call, on the same cache
    contents: comparing two engines' tokens would compare caches whose 4-bit codes
    drift apart wherever a rounding tips one way in one and the other way in the other.
    The layers run in Python, so that every call passes here (the layer stack equals
    them: tests/test_layer_stack.py)."""
    prompts = [prompt(90 + 13 * i, seed=i) for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    engine = make_engine(tiny_model, recent_tokens=5, kv_recent_dtype=recent_dtype)
    assert engine.kv_cache.format.name == ("float32" if recent_dtype == "auto" else recent_dtype)
    assert engine.runner.attn.uses_fast_kernel
    engine.runner.layer_stack = None
    by_age = PagedAttentionBackend._by_age
    errors, compact_calls = [], 0

    def both(self: PagedAttentionBackend, layer_idx, q, keys, values, tables, *rest):
        nonlocal compact_calls
        out = by_age(self, layer_idx, q, keys, values, tables, *rest)
        compact_calls += bool((tables[0] >= self.kv_cache.compact_offset).any())
        self.uses_fast_kernel = False
        try:
            expected = by_age(self, layer_idx, q, keys, values, tables, *rest)
        finally:
            self.uses_fast_kernel = True
        errors.append(((out - expected).abs().max() / expected.abs().max()).item())
        return out

    monkeypatch.setattr(PagedAttentionBackend, "_by_age", both)
    run(engine, prompts, greedy)
    assert compact_calls > 50
    assert max(errors) < 2e-3, max(errors)  # measured 3.5e-4 to 5.4e-4; a wrong layout 1e-2+


@pytest.mark.parametrize("recent_dtype", ["auto", "int8"])
def test_shared_blocks_are_encoded_once_and_cached_ones_not_again(
    tiny_model, monkeypatch, recent_dtype
):
    engine = make_engine(tiny_model, recent_tokens=0, kv_recent_dtype=recent_dtype)
    counter = EncodeCounter(engine.kv_cache, monkeypatch)
    forked = SamplingParams(n=3, temperature=0.9, seed=1, max_tokens=20, ignore_eos=True)
    run(engine, [prompt(100)], forked)
    # the prompt's 6 full blocks once, then each sample's own (after token 100 + 20)
    shared = 100 // BLOCK_SIZE
    own = (100 + 20 - 1) // BLOCK_SIZE - shared
    assert len(counter.pairs) == shared + 3 * own
    assert len({full for full, _ in counter.pairs}) <= len(counter.pairs)
    stats = engine.block_manager.pool.stats()
    assert stats.used == 0 and stats.compact_used == 0 and stats.cached > 0
    # the same prompt again: its cached compact blocks are hits, none is encoded again
    counter.pairs.clear()
    run(engine, [prompt(100)], SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.block_manager.stats().prefix_cache_hits >= (shared - 1) * BLOCK_SIZE
    assert len(counter.pairs) <= 1


@pytest.mark.parametrize(("recent_dtype", "memory"), [("auto", "600KiB"), ("int8", "360KiB")])
def test_a_small_pool_preempts_by_recompute_and_frees_every_block(tiny_model, recent_dtype, memory):
    engine = make_engine(
        tiny_model,
        recent_tokens=16,
        kv_cache_memory=memory,
        max_num_batched_tokens=16,
        kv_recent_dtype=recent_dtype,
    )
    pool = engine.block_manager.pool
    prompts = [prompt(60 + 20 * i, seed=i) for i in range(6)]
    outputs = run(engine, prompts, SamplingParams(max_tokens=120, ignore_eos=True))
    assert all(len(tokens) == 120 for (tokens,) in outputs)
    assert engine.scheduler.num_preemptions > 0
    stats = pool.stats()
    assert stats.used == 0 and stats.compact_used == 0


@pytest.mark.parametrize(("recent_dtype", "recent_format"), [("auto", None), ("int8", "int8")])
def test_the_planner_splits_a_budget_as_the_engine_does(tiny_model, recent_dtype, recent_format):
    budget = 5 << 20
    engine = make_engine(
        tiny_model,
        recent_tokens=24,
        kv_cache_memory=budget,
        max_num_seqs=4,
        kv_recent_dtype=recent_dtype,
    )
    model = resolve_model(str(tiny_model.source))
    by_age = ByAge(24, 4, 64, torch.float32, recent_format)
    row = by_age_capacity(
        model.config, BLOCK_SIZE, budget, Workload(100, 512), PLANNED_KV_DTYPES["int4"], by_age
    )
    pool = engine.block_manager.pool
    assert (row.num_blocks, row.num_compact_blocks) == (pool.num_blocks, pool.num_compact_blocks)
    assert row.compact_block_bytes * pool.num_compact_blocks == engine.kv_cache.compact.nbytes
    assert engine.kv_cache.nbytes <= budget + row.block_bytes  # and the null block


def swap_workload(seeded: bool) -> tuple[list[dict], list[SamplingParams]]:
    """16 requests of 20-32 prompt tokens (every third on a shared 16-token prefix, every
    fourth with n = 2) and 60-120 output tokens: greedy, or sampled with a seed each.
    Prompts of at most 32 tokens are never read compact while prefilled (16 recent
    tokens), however a pool chunks them; their outputs are."""
    rng = random.Random(3)
    shared = [rng.randrange(2, 480) for _ in range(16)]
    prompts, params = [], []
    for i in range(16):
        head = shared if i % 3 == 0 else [rng.randrange(2, 480) for _ in range(4)]
        tail = [rng.randrange(2, 480) for _ in range(rng.randint(4, 16))]
        prompts.append({"prompt_token_ids": head + tail})
        sampling = dict(temperature=0.8, seed=i) if seeded else dict(temperature=0.0)
        n = 2 if i % 4 == 0 else 1
        max_tokens = rng.randint(60, 120)
        params.append(SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, **sampling))
    return prompts, params


def run_all(engine: LLMEngine, prompts, params) -> list[list[list[int]]]:
    """``run`` with a sampling parameter per request."""
    for i, (item, sampling) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), item, sampling)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
        engine.scheduler.check_progress()
    return [outputs[str(i)] for i in range(len(prompts))]


SWAP_SETTINGS = dict(max_num_seqs=8, max_num_batched_tokens=64)


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_parks_compact_blocks_and_gives_the_unpreempted_outputs(
    tiny_model, mode, prefix_caching, seeded
):
    """A pool of 16 full-size blocks (and 292 compact ones) preempts sequences that
    already hold compact blocks; each comes back with the same bits, so every output
    equals a roomy pool's, and every block is free at the end. With prefix caching off
    every parked block is copied back, and some parked full blocks come back compact
    (behind the window of the restored tokens), as the next reservation would have
    re-encoded them."""
    prompts, params = swap_workload(seeded)
    settings = dict(SWAP_SETTINGS, enable_prefix_caching=prefix_caching)
    roomy = make_engine(tiny_model, 16, kv_cache_memory="64MiB", **settings)
    expected = run_all(roomy, prompts, params)
    assert roomy.scheduler.num_preemptions == 0
    engine = make_engine(
        tiny_model, 16, kv_cache_memory="2MiB", preemption_mode=mode, swap_space="2MiB", **settings
    )
    pool, swap_space = engine.block_manager.pool, engine.swap_space
    assert (pool.num_blocks, pool.num_compact_blocks) == (16, 292)
    # the swap space splits its bytes as the pool does
    assert (swap_space.pool.num_blocks, swap_space.pool.num_compact_blocks) == (16, 292)
    assert run_all(engine, prompts, params) == expected
    stats = engine.get_stats()
    # every preemption swapped: recomputing would read the prompt's old blocks unencoded
    assert stats.num_preemptions_total == stats.num_preemptions_swap > 0
    assert stats.swap.swap_ins == stats.swap.swap_outs
    assert stats.swap.compact_swapped_out > 0  # re-encoded before they were preempted
    assert (stats.prefix_cache_hits > 0) == prefix_caching
    if not prefix_caching:
        assert stats.swap.compact_swapped_in > stats.swap.compact_swapped_out
        assert stats.swap.bytes_swapped_in == stats.swap.bytes_swapped_out
    assert stats.swap.used_blocks == stats.swap.compact_used == stats.num_swapped == 0
    assert pool.num_used == pool.num_compact_used == 0
