"""The planner's arithmetic against the seeds' worked examples and published model sizes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.kv.capacity import blocks_for_tokens, pool_blocks, request_worst_case_blocks
from pagedllm.kv.fragmentation import fragmentation_stats
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.models.config import ModelConfig
from pagedllm.models.partition import PartitionError
from pagedllm.models.presets import PRESETS
from pagedllm.plan.capacity import (
    KV_DTYPES,
    WEIGHT_BYTES,
    Workload,
    block_bytes,
    block_elements_per_layer,
    blocks_per_rank,
    dtype_capacity,
    hidden_size_estimate,
    kv_bytes_per_token,
    layer_groups,
    max_seqs_contiguous,
    max_seqs_paged,
    memory_budget,
)
from pagedllm.plan.layout import SHARED_OWNER, paged_layout
from pagedllm.plan.model_shape import count_parameters, rank_parameters, resolve_model
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
        per_block = bytes_per_block(
            config.num_layers,
            16,
            config.num_kv_heads,
            config.head_dim,
            KV_DTYPES[name].torch_dtype,
        )
        assert row.num_blocks == pool_blocks(budget, per_block) - null_blocks
        assert row.contiguous_seqs == pool_blocks(budget, per_block) // blocks_for_tokens(1000, 16)
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
    assert request_worst_case_blocks(0, 32768, 1, 16, window=4096) == 257
    assert request_worst_case_blocks(0, 1000, 1, 16, window=4096) == 63
    assert max_seqs_paged(1000, 16, 32768, windows=(4096,)) == 3
    assert max_seqs_paged(1000, 16, 32768) == 0
    # the prefix's 10 full blocks are shared; each sequence's own blocks, at most 257 of
    # them, run from block 10 to its last: 253 blocks at 4,200 tokens, the window's 257
    # at 8,192
    assert max_seqs_paged(257 + 253 * 2, 16, 4200, 160, (4096,)) == 3
    assert max_seqs_paged(257 * 3, 16, 8192, 160, (4096,)) == 3
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
    with pytest.raises(ValueError, match="one token of its own"):
        Workload(avg_len=32, max_model_len=4096, prefix_len=32)


def test_kv_dtypes_use_the_torch_element_sizes():
    assert [KV_DTYPES[n].element_bytes for n in KV_DTYPES] == [4, 2, 2, 1, 1]
    assert KV_DTYPES["fp8"].torch_dtype == torch.float8_e4m3fn


def test_quantized_weights_count_their_block_scales():
    # the engine holds Q4_0 as 18-byte blocks of 32 weights, Q4_K as 144 bytes per 256
    assert memory_budget([3200], "int4", 0.0, kv_bytes=1).weight_bytes == 1800
    assert memory_budget([3200], "int8", 0.0, kv_bytes=1).weight_bytes == 3400
    assert memory_budget([2560], "q4_k", 0.0, kv_bytes=1).weight_bytes == 1440


# Tensor parallelism: per-device figures, checked against counts made here from the shapes.


def llama_like_parameters(
    config: ModelConfig, q_heads: int, kv_heads: int, intermediate: int, vocab_rows: int
) -> int:
    """Parameters of a Llama-like decoder's share holding ``q_heads`` query heads,
    ``kv_heads`` KV heads, ``intermediate`` MLP features and ``vocab_rows`` vocabulary rows:
    q/k/v rows and o columns of those heads (q/k/v biases when the model has them),
    gate/up rows and down columns of those features, those rows of the embedding (and of
    the LM head unless tied), and the two norms of each layer and the final norm whole."""
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = hidden * head_dim * (2 * q_heads + 2 * kv_heads)
    biases = head_dim * (q_heads + 2 * kv_heads) if config.attention_bias else 0
    layer = attention + biases + 3 * hidden * intermediate + 2 * hidden
    vocab = vocab_rows * hidden * (1 if config.tie_word_embeddings else 2)
    return config.num_layers * layer + vocab + hidden


def smollm2_variant(**hf_fields) -> ModelConfig:
    """SmolLM2-135M's shape (9 query heads, 3 KV heads, tied embeddings) with some fields
    changed."""
    return ModelConfig.from_hf_dict({**PRESETS["smollm2-135m"].hf_config, **hf_fields})


ONE_KV_HEAD = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 1}


# Gemma 3's layers have four norms and q/k norms, and its one KV head does not split
LLAMA_LIKE = sorted(n for n in PRESETS if PRESETS[n].hf_config["model_type"] != "gemma3_text")


@pytest.mark.parametrize("name", LLAMA_LIKE)
def test_the_shape_count_matches_the_published_sizes_on_one_device(name):
    config = resolve_model(name).config
    whole = llama_like_parameters(
        config, config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
    )
    assert rank_parameters(config, 1) == (whole,) == (PRESETS[name].num_parameters,)


@pytest.mark.parametrize("name", sorted(set(LLAMA_LIKE) - {"smollm2-135m"}))
def test_two_devices_each_hold_half_of_every_split_tensor_and_every_norm(name):
    config = resolve_model(name).config
    half = llama_like_parameters(
        config,
        config.num_heads // 2,
        config.num_kv_heads // 2,
        config.intermediate_size // 2,
        config.vocab_size // 2,
    )
    assert rank_parameters(config, 2) == (half, half)
    assert 2 * half > PRESETS[name].num_parameters  # norms are on both devices
    budget = memory_budget(rank_parameters(config, 2), "bfloat16", 0.1, kv_bytes=1)
    assert (budget.device_parameters, budget.weight_bytes) == (half, 2 * half)
    assert budget.weight_bytes_all_devices == 4 * half


def test_three_kv_heads_over_two_devices_split_two_and_one_with_short_last_shards():
    """9 query heads in 3 groups: 6 + 3; 1,537 MLP features: 769 + 768; 1,001 vocabulary
    rows (embedding and LM head): 501 + 500."""
    config = smollm2_variant(vocab_size=1001, intermediate_size=1537, tie_word_embeddings=False)
    first = llama_like_parameters(config, 6, 2, 769, 501)
    second = llama_like_parameters(config, 3, 1, 768, 500)
    assert rank_parameters(config, 2) == (first, second)
    budget = memory_budget((first, second), "q4_k", 0.0, total_bytes=10**9)
    assert budget.weight_bytes == math.ceil(first * WEIGHT_BYTES["q4_k"])
    assert budget.weight_bytes_all_devices == budget.weight_bytes + math.ceil(
        second * WEIGHT_BYTES["q4_k"]
    )
    assert budget.kv_bytes == 10**9 - budget.weight_bytes


def test_one_kv_head_is_replicated_on_both_devices():
    config = smollm2_variant(**ONE_KV_HEAD)
    share = llama_like_parameters(config, 4, 1, config.intermediate_size // 2, 49152 // 2)
    assert rank_parameters(config, 2) == (share, share)


@pytest.mark.parametrize(
    ("config", "device_kv_heads", "null_blocks"),
    [
        (resolve_model("llama-3-8b").config, 4, 0),
        (resolve_model("smollm2-135m").config, 2, 0),
        (smollm2_variant(**ONE_KV_HEAD), 1, 0),
        (resolve_model("mistral-7b").config, 4, 1),
    ],
    ids=["8-kv-heads", "3-kv-heads", "1-kv-head", "sliding"],
)
@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
def test_blocks_per_device_are_the_engine_pool_of_the_rank_with_most_kv_heads(
    config, device_kv_heads, null_blocks, kv_dtype
):
    budget = 10**9 + 12345
    layers, head_dim = config.num_layers, config.head_dim
    cache_format = KV_DTYPES[kv_dtype].cache_format
    engine_blocks = pool_blocks(
        budget, bytes_per_block(layers, 16, device_kv_heads, head_dim, torch.float32, cache_format)
    )
    assert blocks_per_rank(config, 2, budget, 16, kv_dtype) == engine_blocks - null_blocks
    workload = Workload(100, 1000, prefix_len=40)
    row = dtype_capacity(config, 16, budget, workload, KV_DTYPES[kv_dtype], 2)
    element_bytes = KV_DTYPES[kv_dtype].element_bytes
    assert row.num_blocks == engine_blocks - null_blocks
    assert row.num_tokens == 16 * row.num_blocks
    assert row.kv_bytes_per_token == 2 * layers * device_kv_heads * head_dim * element_bytes
    assert row.block_bytes_per_layer == 2 * 16 * device_kv_heads * head_dim * element_bytes
    assert row.block_bytes == bytes_per_block(
        layers, 16, device_kv_heads, head_dim, torch.float32, cache_format
    )
    window = config.kv_window
    assert row.paged_seqs == max_seqs_paged(row.num_blocks, 16, 100, windows=(window,))
    assert row.paged_seqs_with_prefix == max_seqs_paged(row.num_blocks, 16, 100, 40, (window,))
    assert row.contiguous_seqs == engine_blocks // blocks_for_tokens(1000, 16)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_one_device_keeps_the_whole_model_pool(name):
    """A block holds one KV layer group's layers (every layer but for Gemma 3)."""
    config = resolve_model(name).config
    budget = 3 * 10**9 + 1
    groups = layer_groups(config)
    per_block = bytes_per_block(
        groups.num_slots, 16, config.num_kv_heads, config.head_dim, torch.float32
    )
    engine_blocks = pool_blocks(budget, per_block)
    null_blocks = any(window is not None for window in groups.windows)
    assert blocks_per_rank(config, 1, budget, 16) == engine_blocks - null_blocks
    workload = Workload(100, 1000)
    row = dtype_capacity(config, 16, budget, workload, KV_DTYPES["float32"], 1)
    assert row == dtype_capacity(config, 16, budget, workload, KV_DTYPES["float32"])


@pytest.mark.parametrize("size", [0, 4])
def test_a_model_the_partition_refuses_has_no_per_device_figures(size):
    """SmolLM2's 3 KV heads do not split over 4 devices (4 is no multiple of 3)."""
    config = resolve_model("smollm2-135m").config
    with pytest.raises(PartitionError):
        rank_parameters(config, size)
    with pytest.raises(PartitionError):
        blocks_per_rank(config, size, 10**9, 16)


def test_gemma3_is_planned_as_the_engine_keeps_it():
    """Gemma-3-1B: 7 KV layer groups of 4 layers (one global, six sliding over 512
    tokens), so at 8k tokens a sequence holds 512 global blocks and a window per sliding
    group, each of 4 layers: about 4.8x the sequences of one table for every layer."""
    config = resolve_model("gemma-3-1b").config
    assert layer_groups(config).windows == (None,) + (512,) * 6
    workload = Workload(8192, 8192)
    row = dtype_capacity(config, 16, 4 << 30, workload, KV_DTYPES["bfloat16"])
    one_table = layer_groups(config, one_table=True)
    assert one_table.windows == (None,) and one_table.num_slots == 26
    assert row.block_bytes == 2 * 4 * 16 * 256 * 2
    assert row.contiguous_seqs == (4 << 30) // (2 * 26 * 16 * 256 * 2) // 512
    assert row.paged_seqs > 4 * row.contiguous_seqs
