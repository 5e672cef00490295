"""One capacity module, one answer: over random configurations the engine's pool and
admission, beam search's admission and the planner agree with
:mod:`pagedllm.kv.capacity` (the same pool from the same budget, the same worst case for
the same request), a request exactly at the pool's edge is admitted and one block more
is refused, and requests run at that edge never need more.

The engines run *KV twins* of the planner's presets: each preset's KV heads, head size
and architecture in 2 layers of a tiny hidden size (the pool's bytes stay small), with
Mistral's 4,096-token sliding window scaled down to 24 tokens. Engines are cheap to build
over a loaded model with forced kernels, so each example builds its own.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.beam_search_runner import BeamSearchRunner
from pagedllm.kv.capacity import (
    block_bytes,
    blocks_for_tokens,
    cdiv,
    grouped_worst_case_blocks,
    max_window_blocks,
    pool_blocks,
    request_worst_case_blocks,
)
from pagedllm.kv.layer_groups import group_layers
from pagedllm.kv_storage.kv_quant import resolve_kv_format
from pagedllm.models.config import ModelConfig
from pagedllm.models.loader import load_model
from pagedllm.models.presets import PRESETS
from pagedllm.plan.capacity import (
    KV_DTYPES,
    Workload,
    blocks_per_rank,
    dtype_capacity,
    max_seqs_contiguous,
    max_seqs_paged,
)
from pagedllm.plan.capacity import block_bytes as planner_block_bytes
from pagedllm.request_errors import InvalidRequestError

LAYERS = 2
WINDOW = 24
MAX_N = 8
MAX_MODEL_LEN = 96
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
PLANNER_DTYPE = {  # kv_cache_dtype -> the planner's KV dtype (the model runs in float32)
    "auto": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "int8": "int8",
    "fp8_e4m3": "fp8",
}
FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def twin_config(name: str) -> dict:
    """``config.json`` of preset ``name``'s KV twin."""
    raw = PRESETS[name].hf_config
    twin = dict(
        raw,
        num_hidden_layers=LAYERS,
        hidden_size=64,
        num_attention_heads=raw["num_key_value_heads"],
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if raw["model_type"] == "mistral":
        twin["sliding_window"] = WINDOW
    return twin


@pytest.fixture(scope="module")
def twins(tmp_path_factory) -> dict:
    """Preset name -> the loaded KV twin (dummy weights, float32)."""
    loaded = {}
    for name in PRESETS:
        folder = tmp_path_factory.mktemp(name)
        (folder / "config.json").write_text(json.dumps(twin_config(name)))
        loaded[name] = load_model(
            str(folder), torch.float32, load_format="dummy", linear_kernel="dense"
        )
    assert loaded["mistral-7b"].config.kv_window == WINDOW
    return loaded


def float32_block_bytes(loaded, block_size: int) -> int:
    mc = loaded.config
    row_bytes = resolve_kv_format("auto", torch.float32).row_bytes(mc.head_dim)
    return block_bytes(LAYERS, block_size, mc.num_kv_heads, row_bytes)


def build_engine(loaded, budget: int, **settings_) -> LLMEngine:
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        kv_cache_memory=budget,
        max_n=MAX_N,
        max_num_seqs=MAX_N,
        attention_kernel="paged",
        linear_kernel="dense",
        log_stats_interval=0,
        **settings_,
    )
    return LLMEngine(config, loaded)


def expected_worst_case(engine: LLMEngine, prompt_len: int, max_tokens: int, n: int) -> int:
    """The request's worst case from the engine's settings, derived here independently."""
    config = engine.config
    contiguous = config.kv_allocation == "contiguous"
    return request_worst_case_blocks(
        prompt_len,
        max_tokens,
        n,
        config.block_size,
        upfront_tokens=engine.max_model_len if contiguous else None,
        window=None if contiguous else engine.model_config.kv_window,
        step_tokens=config.max_num_batched_tokens,
    )


def admits(engine: LLMEngine, prompt_len: int, max_tokens: int, n: int, priority: int) -> bool:
    """Whether ``add_request`` takes the request (aborted at once if so)."""
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    try:
        engine.add_request("probe", [7] * prompt_len, params, priority=priority)
    except InvalidRequestError as refused:
        assert refused.param == ("n" if n > 1 else "max_tokens")
        return False
    engine.abort_request("probe")
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.pool.num_used == 0
    return True


def beam_admits(engine: LLMEngine, prompt_len: int, max_tokens: int, width: int) -> bool:
    runner = BeamSearchRunner(engine)
    try:
        runner.add([7] * prompt_len, BeamSearchParams(width, max_tokens, ignore_eos=True))
    except ValueError as refused:
        assert "KV blocks" in str(refused)
        return False
    return True


def request_at(engine: LLMEngine, target: int) -> tuple[int, int, int] | None:
    """A request ``(prompt_len, max_tokens, n)`` whose worst case is exactly ``target``
    blocks, if any fits ``max_model_len``: the worst case grows with ``max_tokens``."""
    limit = engine.max_model_len
    for n in range(1, MAX_N + 1):
        for prompt_len in range(1, limit):
            low, high = 1, limit - prompt_len
            if expected_worst_case(engine, prompt_len, high, n) < target:
                continue
            while low < high:
                middle = (low + high) // 2
                if expected_worst_case(engine, prompt_len, middle, n) < target:
                    low = middle + 1
                else:
                    high = middle
            if expected_worst_case(engine, prompt_len, low, n) == target:
                return prompt_len, low, n
    return None


# ---- the arithmetic alone -------------------------------------------------------------


@given(st.integers(-(10**6), 10**6), st.integers(1, 10**4))
def test_cdiv_is_exact_ceil_division(a, b):
    assert cdiv(a, b) == math.ceil(a / b) == (a + b - 1) // b


@given(st.integers(0, 10**5), st.sampled_from([1, 2, 4, 8, 16, 32]))
def test_a_sequence_wastes_less_than_a_block(num_tokens, block_size):
    blocks = blocks_for_tokens(num_tokens, block_size)
    assert 0 <= blocks * block_size - num_tokens < block_size


@given(
    prompt_len=st.integers(1, 300),
    max_tokens=st.integers(1, 300),
    n=st.integers(1, 8),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    upfront=st.one_of(st.none(), st.integers(1, 700)),
    window=st.one_of(st.none(), st.integers(1, 100)),
    step_tokens=st.integers(1, 64),
)
def test_the_worst_case_bounds(prompt_len, max_tokens, n, block_size, upfront, window, step_tokens):
    if upfront is not None and window is not None:
        with pytest.raises(ValueError, match="on-demand"):
            request_worst_case_blocks(
                prompt_len, max_tokens, n, block_size, upfront_tokens=upfront, window=window
            )
        return
    worst = request_worst_case_blocks(
        prompt_len,
        max_tokens,
        n,
        block_size,
        upfront_tokens=upfront,
        window=window,
        step_tokens=step_tokens,
    )
    longest = blocks_for_tokens(prompt_len + max_tokens, block_size)
    shared = prompt_len // block_size
    if window is None:
        assert worst >= longest + (n - 1) * (longest - shared)
        if upfront is not None:
            assert worst >= blocks_for_tokens(upfront, block_size)
    else:
        assert worst <= n * max_window_blocks(window, step_tokens, block_size)
    more = request_worst_case_blocks(
        prompt_len,
        max_tokens + 1,
        n + 1,
        block_size,
        upfront_tokens=upfront,
        window=window,
        step_tokens=step_tokens,
    )
    assert more >= worst


@given(
    name=st.sampled_from(sorted(PRESETS)),
    block_size=st.sampled_from([1, 2, 4, 8, 16, 32]),
    kv_dtype=st.sampled_from(sorted(KV_DTYPES)),
    budget=st.integers(0, 10**11),
)
def test_the_planner_sizes_preset_pools_as_the_engine_does(name, block_size, kv_dtype, budget):
    """Whole presets at any budget: the planner's block bytes and pool are the engine's
    (``bytes_per_block`` of the cache format, then :func:`pool_blocks`)."""
    model = ModelConfig.from_hf_dict(PRESETS[name].hf_config)
    row_bytes = resolve_kv_format(KV_DTYPES[kv_dtype].cache_format, torch.float32).row_bytes(
        model.head_dim
    )
    per_block = block_bytes(model.num_layers, block_size, model.num_kv_heads, row_bytes)
    assert planner_block_bytes(model, block_size, KV_DTYPES[kv_dtype]) == per_block
    groups = group_layers(model.sliding_windows, model.num_layers)  # as the engine groups
    group_block = block_bytes(groups.num_slots, block_size, model.num_kv_heads, row_bytes)
    sliding = any(window is not None for window in groups.windows)
    paged = pool_blocks(budget, group_block, sliding)
    assert blocks_per_rank(model, 1, budget, block_size, kv_dtype) == paged
    row = dtype_capacity(model, block_size, budget, Workload(100, 1000), KV_DTYPES[kv_dtype])
    assert row.num_blocks == paged
    contiguous = pool_blocks(budget, per_block)  # no null block
    assert row.contiguous_seqs == max_seqs_contiguous(contiguous, block_size, 1000)


@given(
    num_blocks=st.integers(0, 400),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    prefix_len=st.integers(0, 200),
    output_len=st.integers(1, 200),
    windows=st.one_of(
        st.tuples(st.one_of(st.none(), st.integers(1, 100))),  # one table
        st.lists(st.one_of(st.none(), st.integers(1, 100)), min_size=2, max_size=4).map(tuple),
    ),
)
def test_the_planners_sequences_are_the_largest_request_that_fits(
    num_blocks, block_size, prefix_len, output_len, windows
):
    """``max_seqs_paged`` is the most samples of one request that fit, decoding, over one
    table or a table per KV layer group."""
    fits = max_seqs_paged(num_blocks, block_size, prefix_len + output_len, prefix_len, windows)

    def worst(n: int) -> int:
        return grouped_worst_case_blocks(prefix_len, output_len, n, block_size, windows)

    assert fits == 0 or worst(fits) <= num_blocks
    assert worst(fits + 1) > num_blocks


# ---- the engine, beam search and the planner over random configurations -------------------


@FAST
@given(data=st.data())
def test_engine_beam_search_and_planner_agree(twins, data):
    draw = data.draw
    name = draw(st.sampled_from(sorted(PRESETS)), label="preset")
    loaded = twins[name]
    model = loaded.config
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]), label="block_size")
    kv_cache_dtype = draw(st.sampled_from(KV_CACHE_DTYPES), label="kv_cache_dtype")
    contiguous = draw(st.booleans(), label="contiguous")
    max_model_len = draw(st.integers(2, MAX_MODEL_LEN), label="max_model_len")
    reserved_fraction = draw(st.sampled_from([0.0, 0.1, 0.3]), label="reserved_fraction")
    least = blocks_for_tokens(max_model_len, block_size)
    num_blocks = draw(st.integers(least, least + 40), label="num_blocks")
    if num_blocks - int(num_blocks * reserved_fraction) < least:
        reserved_fraction = 0.0
    null_block = model.kv_window is not None and not contiguous
    row_bytes = resolve_kv_format(kv_cache_dtype, torch.float32).row_bytes(model.head_dim)
    per_block = block_bytes(LAYERS, block_size, model.num_kv_heads, row_bytes)
    budget = (num_blocks + null_block) * per_block + draw(st.integers(0, per_block - 1))
    engine = build_engine(
        loaded,
        budget,
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        kv_allocation="contiguous" if contiguous else "paged",
        max_model_len=max_model_len,
        reserved_fraction=reserved_fraction,
        max_num_batched_tokens=draw(st.sampled_from([8, 16, 64]), label="step tokens"),
    )

    # the same pool from the same budget
    assert engine.block_bytes == per_block
    assert engine.num_blocks == pool_blocks(budget, per_block, null_block) == num_blocks
    assert engine.kv_cache.num_blocks == num_blocks + null_block
    planner_dtype = PLANNER_DTYPE.get(kv_cache_dtype)
    if planner_dtype is not None:
        kv_dtype = KV_DTYPES[planner_dtype]
        assert planner_block_bytes(model, block_size, kv_dtype) == per_block
        workload = Workload(max_model_len, max_model_len)
        row = dtype_capacity(model, block_size, budget, workload, kv_dtype)
        if contiguous:  # every sequence reserves max_model_len slots
            sequence = engine.worst_case_blocks(1, 1, 1)
            assert row.contiguous_seqs == engine.capacity_blocks(-1) // sequence
        else:
            assert row.num_blocks == engine.num_blocks

    # the same worst case for the same request, and admission by it
    prompt_len = draw(st.integers(1, max_model_len - 1), label="prompt_len")
    max_tokens = draw(st.integers(1, max_model_len - prompt_len), label="max_tokens")
    n = draw(st.integers(1, MAX_N), label="n")
    priority = draw(st.sampled_from([0, -1]), label="priority")
    worst = expected_worst_case(engine, prompt_len, max_tokens, n)
    assert engine.worst_case_blocks(prompt_len, max_tokens, n) == worst
    capacity = engine.capacity_blocks(priority)
    assert capacity == num_blocks - (0 if priority < 0 else int(num_blocks * reserved_fraction))
    assert admits(engine, prompt_len, max_tokens, n, priority) == (worst <= capacity)
    normal = engine.capacity_blocks()
    assert beam_admits(engine, prompt_len, max_tokens, n) == (worst <= normal)
    if not contiguous and model.kv_window is None:
        seqs = max_seqs_paged(normal, block_size, prompt_len + max_tokens, prompt_len)
        assert (seqs >= n) == (worst <= normal)

    # exactly at the edge: admitted; one block beyond: refused
    edge = request_at(engine, normal)
    if edge is not None:
        assert engine.worst_case_blocks(*edge) == normal
        assert admits(engine, *edge, priority=0)
        assert beam_admits(engine, *edge)
    beyond = request_at(engine, normal + 1)
    if beyond is not None:
        assert not admits(engine, *beyond, priority=0)
        assert not beam_admits(engine, *beyond)


# ---- requests run at the edge ----------------------------------------------------------

EDGE_CASES = {
    # mode: (preset, engine settings, prompt_len, max_tokens, n)
    "paged": ("llama-3-8b", {}, 10, 30, 3),
    # the first sequence holds 64 slots up front; the others share them and copy on write
    "contiguous": ("llama-3-8b", {"kv_allocation": "contiguous", "max_model_len": 64}, 10, 30, 3),
    # no sequence holds more than 9 blocks: 24 window tokens and 8 of a step, misaligned
    "window": ("mistral-7b", {"max_model_len": 60}, 10, 50, 3),
}


@pytest.mark.parametrize("mode", sorted(EDGE_CASES))
def test_searches_and_samples_run_in_a_pool_of_their_worst_case(twins, mode):
    """Beam search and ``n`` samples admitted into a pool of exactly their worst case run
    to the end without preemption, never holding more."""
    name, overrides, prompt_len, max_tokens, n = EDGE_CASES[mode]
    loaded = twins[name]
    per_block = float32_block_bytes(loaded, 4)
    settings_ = dict(
        block_size=4, max_num_batched_tokens=8, reserved_fraction=0.0, max_model_len=40
    )
    settings_.update(overrides)
    probe = build_engine(loaded, 64 * per_block, **settings_)
    worst = probe.worst_case_blocks(prompt_len, max_tokens, n)
    null_block = probe.block_manager.sliding_window is not None
    assert worst == {"paged": 2 + 3 * 8, "contiguous": 16 + 2 * 8, "window": 3 * 9}[mode]
    prompt = [(5 * i + 3) % 64 for i in range(prompt_len)]

    def edge_engine() -> LLMEngine:
        engine = build_engine(loaded, (worst + null_block) * per_block, **settings_)
        assert engine.capacity_blocks() == worst
        return engine

    engine = edge_engine()
    runner = BeamSearchRunner(engine)
    runner.add(prompt, BeamSearchParams(n, max_tokens, ignore_eos=True))
    results = []
    while runner.has_unfinished:
        results += runner.step()  # raises if a beam is preempted
    assert len(results[0][1].sequences) == n
    assert 0 < engine.block_manager.pool.stats().peak_used <= worst

    engine = edge_engine()
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=0)
    engine.add_request("edge", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.get_stats()
    assert stats.num_preemptions_total == 0
    assert 0 < stats.peak_blocks_used <= worst
    with pytest.raises(InvalidRequestError):
        build_engine(loaded, (worst - 1 + null_block) * per_block, **settings_).add_request(
            "beyond", prompt, params
        )


def test_beam_search_counts_the_up_front_reservation(twins):
    """Contiguous allocation: the first beam holds 128 slots (32 blocks, the whole pool)
    from its first step and the other beams copy the blocks they write, so a search of 3
    beams may need 48 blocks. Counting its beams' tokens alone (26 blocks) admitted it,
    and its first fork was preempted."""
    loaded = twins["llama-3-8b"]
    per_block = float32_block_bytes(loaded, 4)
    engine = build_engine(
        loaded,
        32 * per_block,
        block_size=4,
        kv_allocation="contiguous",
        max_model_len=128,
        reserved_fraction=0.0,
        max_num_batched_tokens=8,
    )
    assert engine.worst_case_blocks(10, 30, 3) == 32 + 2 * 8
    assert not beam_admits(engine, 10, 30, 3)
    assert beam_admits(engine, 10, 30, 1)
