"""The planner's arithmetic against the seeds' worked examples and published model sizes."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kv.fragmentation import fragmentation_stats
from pagedllm.kv.kv_cache import num_blocks_for_budget
from pagedllm.plan.capacity import (
    KV_DTYPES,
    Workload,
    block_bytes,
    block_elements_per_layer,
    blocks_held,
    dtype_capacity,
    hidden_size_estimate,
    kv_bytes_per_token,
    max_seqs_contiguous,
    max_seqs_paged,
    memory_budget,
)
from pagedllm.plan.layout import SHARED_OWNER, paged_layout
from pagedllm.plan.model_shape import count_parameters, resolve_model
from pagedllm.plan.presets import PRESETS
from pagedllm.plan.report import binary_bytes, decimal_bytes

FP16 = KV_DTYPES["float16"]


@pytest.mark.parametrize(
    ("length", "exact", "shown"),
    [(2048, 8_589_934_592, "8.59 GB"), (8192, 34_359_738_368, "34.36 GB")],
)
def test_textbook_formula_batch_of_8_in_fp16(length, exact, shown):
    """32 layers, hidden 4096, no GQA: 8 x 2,048 tokens ~ 8.6 GB, 8 x 8,192 ~ 34 GB."""
    config = resolve_model("llama-2-7b").config
    assert (config.num_layers, config.hidden_size) == (32, 4096)
    assert config.num_kv_heads * config.head_dim == config.hidden_size
    workload = Workload(avg_len=length, max_model_len=length, batch=8)
    row = dtype_capacity(config, 16, 10**12, workload, FP16)
    assert row.batch_kv_bytes == exact == hidden_size_estimate(config, 8 * length, 2)
    assert decimal_bytes(row.batch_kv_bytes) == shown


def test_block_of_16_tokens_32_heads_128_dims():
    """131,072 elements per layer, 256 KiB at fp16."""
    config = resolve_model("llama-2-7b").config
    assert block_elements_per_layer(config, 16) == 131_072
    row = dtype_capacity(config, 16, 10**9, Workload(16, 16), FP16)
    assert row.block_bytes_per_layer == 262_144
    assert binary_bytes(row.block_bytes_per_layer) == "256 KiB"
    assert row.block_bytes == 32 * 262_144


def test_gqa_scales_the_hidden_size_formula_by_kv_heads_over_heads():
    config = resolve_model("llama-3-8b").config
    per_token = kv_bytes_per_token(config, KV_DTYPES["bfloat16"])
    assert per_token == 131_072
    assert per_token * config.num_heads == hidden_size_estimate(config, 1, 2) * config.num_kv_heads


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_counts_match_their_shapes(name):
    shape = resolve_model(name)
    assert count_parameters(shape.config) == PRESETS[name].num_parameters == shape.num_parameters


@pytest.mark.parametrize(("model", "null_blocks"), [("llama-3-8b", 0), ("mistral-7b", 1)])
def test_blocks_match_the_kv_cache_sizing_for_unquantized_dtypes(model, null_blocks):
    """The engine's pool: every block of the budget, less the null block of a model whose
    every layer slides (Mistral-7B-v0.1: 4,096 tokens)."""
    config = resolve_model(model).config
    budget = 3 * 10**9 + 12345
    for name in ("float32", "bfloat16", "float16"):
        row = dtype_capacity(config, 16, budget, Workload(100, 1000), KV_DTYPES[name])
        expected = num_blocks_for_budget(
            budget,
            config.num_layers,
            16,
            config.num_kv_heads,
            config.head_dim,
            KV_DTYPES[name].torch_dtype,
        )
        assert row.num_blocks == expected - null_blocks
        assert row.num_tokens == 16 * row.num_blocks


def test_quantized_blocks_carry_scales_and_hold_about_twice_bfloat16():
    config = resolve_model("llama-3-8b").config
    # one bfloat16 scale (2 bytes) per token, layer, K/V and KV head
    scales = 2 * config.num_layers * 16 * config.num_kv_heads * 2
    assert (
        block_bytes(config, 16, KV_DTYPES["int8"])
        == block_bytes(config, 16, KV_DTYPES["bfloat16"]) // 2 + scales
    )
    budget = 10 * 10**9
    counts = {
        name: dtype_capacity(config, 16, budget, Workload(100, 1000), KV_DTYPES[name]).num_blocks
        for name in ("float32", "bfloat16", "int8", "fp8")
    }
    assert counts["int8"] == counts["fp8"] >= 1.9 * counts["bfloat16"]
    assert counts["int8"] >= 3.8 * counts["float32"]


def test_paged_against_contiguous_and_a_shared_prefix():
    # 100 blocks of 16: 300-token sequences take 19 blocks, 2,048-token reservations 128.
    assert max_seqs_paged(100, 16, 300) == 5
    assert max_seqs_contiguous(100, 16, 2048) == 0
    assert max_seqs_contiguous(256, 16, 2048) == 2
    # A 100-token prefix shares 6 full blocks; each sequence keeps 13 private blocks.
    assert max_seqs_paged(100, 16, 300, prefix_len=100) == (100 - 6) // 13
    assert max_seqs_paged(5, 16, 300, prefix_len=100) == 0


def test_a_sliding_window_bounds_the_blocks_a_sequence_holds():
    # a 4,096-token window over blocks of 16: at most 257 blocks (4,096 + 15 positions)
    assert blocks_held(32768, 16, 4096) == (257, 0)
    assert blocks_held(1000, 16, 4096) == (63, 0)
    assert max_seqs_paged(1000, 16, 32768, window=4096) == 3
    assert max_seqs_paged(1000, 16, 32768) == 0
    # a shared prefix counts once only while it is inside every sequence's window
    assert blocks_held(4200, 16, 4096, prefix_len=160) == (257, 4)
    assert blocks_held(8192, 16, 4096, prefix_len=160) == (257, 0)
    plan = resolve_model("mistral-7b").config
    assert plan.kv_window == 4096
    row = dtype_capacity(plan, 16, 10 * 2**30, Workload(32768, 32768), KV_DTYPES["bfloat16"])
    assert row.paged_seqs == row.num_blocks // 257 > row.contiguous_seqs


def test_paged_layout_under_a_window_keeps_the_last_window():
    layout = paged_layout([40, 10], 4, prefix_len=8, window=12)
    # sequence 0 keeps blocks 7..9 (positions 28..39); sequence 1 keeps all 3, so the
    # shared prefix blocks 0 and 1 stay for it
    owners = [use.owner for use in layout]
    assert owners.count(SHARED_OWNER) == 2 and owners.count(0) == 3 and owners.count(1) == 1


def test_memory_budget_takes_weights_and_activation_reserve_first():
    params = PRESETS["llama-3-8b"].num_parameters
    budget = memory_budget([params], "bfloat16", 0.2, total_bytes=80 * 10**9)
    assert budget.weight_bytes == 2 * params
    assert budget.activation_reserve_bytes == pytest.approx(0.4 * params, abs=1)
    assert budget.kv_bytes == 80 * 10**9 - budget.weight_bytes - budget.activation_reserve_bytes
    with pytest.raises(ValueError, match="do not hold the weights"):
        memory_budget([params], "bfloat16", 0.2, total_bytes=16 * 10**9)
    with pytest.raises(ValueError, match="either"):
        memory_budget([params], "bfloat16", 0.2)


def test_paged_layout_counts_like_the_worked_example():
    """Lengths 10 and 7, block size 4, a 4-token shared prefix: 4 blocks, 13 live tokens."""
    layout = paged_layout([10, 7], 4, prefix_len=4)
    assert [use.owner for use in layout] == [SHARED_OWNER, 0, 1, 0]
    tables = [
        [use.block_id for use in layout if use.owner in (SHARED_OWNER, owner)] for owner in (0, 1)
    ]
    stats = fragmentation_stats(tables, [10, 7], 4)
    assert stats.unique_blocks == len(layout) == 4
    assert stats.live_tokens == sum(use.filled for use in layout) == 13
    assert stats.internal_fragmentation_slots == 3


def test_workload_rejects_impossible_lengths():
    with pytest.raises(ValueError):
        Workload(avg_len=5000, max_model_len=4096)
    with pytest.raises(ValueError):
        Workload(avg_len=100, max_model_len=4096, prefix_len=200)


def test_kv_dtypes_use_the_torch_element_sizes():
    assert [KV_DTYPES[n].element_bytes for n in KV_DTYPES] == [4, 2, 2, 1, 1]
    assert KV_DTYPES["fp8"].torch_dtype == torch.float8_e4m3fn


def test_quantized_weights_count_their_block_scales():
    # the engine holds Q4_0 as 18-byte blocks of 32 weights, Q4_K as 144 bytes per 256
    assert memory_budget([3200], "int4", 0.0, kv_bytes=1).weight_bytes == 1800
    assert memory_budget([3200], "int8", 0.0, kv_bytes=1).weight_bytes == 3400
    assert memory_budget([2560], "q4_k", 0.0, kv_bytes=1).weight_bytes == 1440
