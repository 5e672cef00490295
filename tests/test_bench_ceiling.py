"""The throughput ceiling counts the matrix products a Llama decoder really runs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm.bench import ceiling
from pagedllm.bench.ceiling import (
    cached_prompt_tokens,
    matmul_flops_per_token,
    workload_attention_flops,
    workload_matmul_flops,
)
from pagedllm.bench.workload import BenchRequest
from pagedllm.cpu.onednn import reorderable

CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # not hidden / heads: the count must use it
    "vocab_size": 200,
}


def test_flops_per_token_equal_torchs_count_of_a_forward_pass():
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager")).eval()
    tokens = 5
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.arange(tokens)[None])
    counts = counter.get_flop_counts()["Global"]
    projections = sum(n for op, n in counts.items() if "mm" in str(op) and "bmm" not in str(op))
    per_token, head_row = matmul_flops_per_token(CONFIG)
    assert projections == tokens * (per_token + head_row)  # HF computes every row's logits


def test_workload_counts_each_output_tokens_head_row_and_feeds_back_all_but_the_last():
    per_token, head_row = matmul_flops_per_token(CONFIG)
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([5], 1)]
    through_layers = (3 + 4 - 1) + (1 + 1 - 1)
    expected = through_layers * per_token + 5 * head_row
    assert workload_matmul_flops(CONFIG, requests) == expected


def test_a_cached_prompt_prefix_is_its_longest_start_shared_with_an_earlier_prompt():
    requests = [
        BenchRequest([1, 2, 3, 4], 2),
        BenchRequest([1, 2, 3, 9], 2),  # three tokens of the first
        BenchRequest([1, 2, 3, 4], 2),  # all of it, but the last token is computed again
        BenchRequest([1, 7], 2),
        BenchRequest([8], 2),
    ]
    assert cached_prompt_tokens(requests) == [0, 3, 3, 1, 0]


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), max_size=8))
def test_cached_prefixes_equal_a_comparison_with_every_earlier_prompt(prompts):
    requests = [BenchRequest(p, 1) for p in prompts]
    expected = []
    for i, prompt in enumerate(prompts):
        shared = 0
        for earlier in prompts[:i]:
            n = 0
            while n < min(len(prompt), len(earlier)) and prompt[n] == earlier[n]:
                n += 1
            shared = max(shared, n)
        expected.append(min(shared, len(prompt) - 1))
    assert cached_prompt_tokens(requests) == expected


def seen_pairs_by_hand(requests, cached):
    """(query position, position seen) pairs, one position at a time."""
    pairs = 0
    for request, first in zip(requests, cached, strict=True):
        for p in range(first, len(request.prompt_token_ids) + request.output_len - 1):
            pairs += p + 1
    return pairs


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_attention_counts_every_computed_position_against_all_it_sees(prefix_caching):
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([5], 1), BenchRequest([1, 2, 6], 3)]
    cached = [0, 0, 2] if prefix_caching else [0, 0, 0]
    per_pair = CONFIG["num_hidden_layers"] * CONFIG["num_attention_heads"] * 4 * CONFIG["head_dim"]
    expected = seen_pairs_by_hand(requests, cached) * per_pair
    assert workload_attention_flops(CONFIG, requests, prefix_caching) == expected
    per_token, head_row = matmul_flops_per_token(CONFIG)
    through_layers = (3 + 4 - 1) + (1 + 1 - 1) + (3 + 3 - 1) - sum(cached)
    expected_matmul = through_layers * per_token + 8 * head_row
    assert workload_matmul_flops(CONFIG, requests, prefix_caching) == expected_matmul


def test_attention_count_refuses_a_sliding_window():
    with pytest.raises(ValueError, match="sliding window"):
        workload_attention_flops({**CONFIG, "sliding_window": 4}, [BenchRequest([1], 1)])


def test_ceiling_rests_on_the_faster_gemm(monkeypatch):
    rates = {"dense": 1e11, "packed": 4e11}
    monkeypatch.setattr(ceiling, "gemm_rates", lambda dtype: rates)
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([5], 1)]
    record = ceiling.ceiling_record(CONFIG, requests, "float32")
    flops = workload_matmul_flops(CONFIG, requests)
    attention = workload_attention_flops(CONFIG, requests)
    assert record["gemm_gflop_per_s"] == 400.0
    assert record["gflop_per_s_by_gemm"] == {"dense": 100.0, "packed": 400.0}
    assert record["max_output_tokens_per_s"] == 5 / (flops / 4e11)
    assert record["max_output_tokens_per_s_with_attention"] == 5 / ((flops + attention) / 4e11)
    assert record["attention_tflop"] == attention / 1e12 > 0


def test_gemm_rates_time_every_gemm_the_build_has():
    from pagedllm.cpu.extension import avx512_kernels_available

    rates = ceiling.gemm_rates(torch.float32)
    expected = {"dense"} | ({"packed"} if avx512_kernels_available() else set())
    expected |= {"onednn"} if reorderable(torch.empty(1, 1)) else set()
    assert set(rates) == expected
    assert all(rate > 0 for rate in rates.values())


workloads = st.lists(
    st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 12)).map(
        lambda t: BenchRequest(*t)
    ),
    min_size=1,
    max_size=12,
)


@given(
    workloads,
    st.booleans(),
    st.integers(1, 64),
    st.integers(1, 6),
)
def test_scheduled_steps_compute_what_the_workload_computes(
    requests, prefix_caching, budget, max_seqs
):
    """Whatever the step budget: every computed position once, one LM-head row per
    output token, every attention pair once, no step over budget."""
    steps = ceiling.scheduled_steps(requests, prefix_caching, budget, max_seqs)
    positions = ceiling.computed_positions(requests, prefix_caching)
    assert sum(s.tokens for s in steps) == sum(end - first for first, end in positions)
    assert sum(s.sampled for s in steps) == sum(r.output_len for r in requests)
    per_pair = CONFIG["num_hidden_layers"] * CONFIG["num_attention_heads"] * 4 * CONFIG["head_dim"]
    pairs = workload_attention_flops(CONFIG, requests, prefix_caching) / per_pair
    assert sum(s.attention_pairs for s in steps) == pairs
    assert all(0 < s.tokens <= max(budget, max_seqs) for s in steps)
    assert all(s.positions_read <= s.attention_pairs for s in steps)


def test_roofline_is_the_larger_of_products_and_bytes_step_by_step():
    """One request decoding alone streams the weights every step: with a slow copy the
    bound is the bytes, with a slow GEMM the products; never above either alone."""
    requests = [BenchRequest([1] * 8, 5)]
    weights = 10**6
    memory_bound = ceiling.roofline_record(CONFIG, requests, "float32", weights, rates=(1e15, 1e9))
    steps = memory_bound["steps"]
    assert steps == 5  # the prompt, then one step per further output token
    assert memory_bound["gb_moved"]["weights"] == pytest.approx(steps * weights / 1e9)
    assert memory_bound["max_output_tokens_per_s"] == pytest.approx(
        5 / memory_bound["memory_seconds"], rel=1e-3
    )
    compute_bound = ceiling.roofline_record(CONFIG, requests, "float32", weights, rates=(1e6, 1e15))
    assert compute_bound["max_output_tokens_per_s"] == pytest.approx(
        5 / compute_bound["compute_seconds"], rel=1e-3
    )


def test_a_shared_prefix_is_read_once_per_step():
    prefix = list(range(16))
    shared = [BenchRequest(prefix + [20 + i], 2) for i in range(4)]
    steps = ceiling.scheduled_steps(shared, True, 1024, 8)
    assert [(s.tokens, s.sampled) for s in steps] == [(17 + 3, 4), (4, 4)]
    assert steps[0].positions_read == 16 + 4 * 1  # the prefix once, each its own token
    assert steps[1].positions_read == 16 + 4 * 2
    alone = ceiling.scheduled_steps(shared, False, 1024, 8)
    assert alone[1].positions_read == 4 * 18
