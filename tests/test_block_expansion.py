"""GGUF block weights beside an expanded copy (pagedllm/models/block_expansion.py): each
call goes to the blocks below ``min_rows`` rows and to the copy from there on, bit for
bit the form's own product; the copy is made only within the budget and where measured
faster; the layer stack runs both forms as the Python layers do."""

from __future__ import annotations

import logging

import pytest
import torch
from test_layer_stack import assert_stack_equals_layers

from pagedllm import user_cache
from pagedllm.cpu.extension import avx512_kernels_available, quant_x16_supports
from pagedllm.cpu.kernel_choice import KernelChoice
from pagedllm.engine.llm import LLM
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.models import block_expansion
from pagedllm.models.batch_invariance import variant_products
from pagedllm.models.block_expansion import ROW_BUCKETS, ExpandedBlocks, crossover
from pagedllm.models.interleaved_weight import InterleavedWeight
from pagedllm.models.linear import PackedWeight, linear, prepare_weight
from pagedllm.models.loader import load_model
from pagedllm.models.quantized_weight import Q, QuantizedWeight, int8_per_channel
from pagedllm.models.weight_bytes import weight_bytes_by_format

pytestmark = pytest.mark.skipif(
    not avx512_kernels_available(), reason="the block and packed kernels need AVX-512"
)


def expanded_from(min_rows: int):
    """Fake timings: the copy 2x faster from ``min_rows`` rows on, 2x slower below."""

    def timings(*args):
        return {
            "blocks": dict.fromkeys(ROW_BUCKETS, 1.0),
            "expanded": {rows: 0.5 if rows >= min_rows else 2.0 for rows in ROW_BUCKETS},
        }

    return timings


@pytest.fixture
def fresh_timings(monkeypatch, tmp_path):
    """A timing cache of this test's own, so that fake timings are not read back from
    another test's."""
    monkeypatch.setattr(user_cache, "cache_dir", lambda: tmp_path)


def q8_weight(out_features: int = 96, in_features: int = 128) -> QuantizedWeight:
    return int8_per_channel(torch.randn(out_features, in_features, generator=torch.manual_seed(0)))


def test_crossover_switches_where_the_copy_always_wins():
    blocks = dict.fromkeys(ROW_BUCKETS, 1.0)
    copy = {rows: 0.5 if rows >= 24 else 2.0 for rows in ROW_BUCKETS}
    assert crossover({"blocks": blocks, "expanded": copy}) == 24
    assert crossover({"blocks": blocks, "expanded": {**copy, 16: 0.9}}) == 16
    assert crossover({"blocks": blocks, "expanded": {**copy, 16: 0.9, 48: 0.98}}) == 64
    assert crossover({"blocks": blocks, "expanded": {**copy, 512: 0.95}}) is None  # not worth it
    assert crossover({"blocks": blocks, "expanded": dict.fromkeys(ROW_BUCKETS, 0.1)}) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_call_runs_one_form_bit_for_bit(dtype):
    source = q8_weight()
    blocks = source
    if dtype == torch.bfloat16 and quant_x16_supports(int(Q.Q8_0)):
        blocks = InterleavedWeight.interleave(source)
    copy = PackedWeight.pack(source.dequantized().to(dtype))
    weight = ExpandedBlocks(blocks, copy, min_rows=4)
    x = torch.randn(9, 128, dtype=dtype)
    for rows in (1, 3, 4, 9):
        expected = linear(x[:rows], blocks if rows < 4 else copy)
        assert torch.equal(linear(x[:rows], weight), expected)
    assert torch.equal(weight.rows(torch.tensor([5, 2])), source.rows(torch.tensor([5, 2])))


def test_copy_made_only_where_faster_and_within_the_budget(monkeypatch, fresh_timings):
    source = q8_weight()
    copy_bytes = 96 * 128 * 4
    monkeypatch.setattr(block_expansion, "time_forms", expanded_from(16))
    choice = KernelChoice(activations=torch.float32, expansion_budget=copy_bytes + 10)
    weight = prepare_weight(source, choice)
    assert isinstance(weight, ExpandedBlocks) and weight.min_rows == 16
    assert torch.equal(weight.expanded.panels, PackedWeight.pack(source.dequantized()).panels)
    assert choice.expansion_budget == 10
    assert prepare_weight(source, choice) is source  # no budget left for a second copy
    assert choice.expansions == [(choice.expansions[0][0], 16), (choice.expansions[0][0], None)]
    assert "from 16 rows" in choice.expansion_summary()

    monkeypatch.setattr(block_expansion, "time_forms", expanded_from(10**6))  # never faster
    other = q8_weight(48)
    slower = KernelChoice(activations=torch.float32, expansion_budget=1 << 30)
    assert prepare_weight(other, slower) is other
    assert slower.expansion_budget == 1 << 30
    assert prepare_weight(other, KernelChoice(activations=torch.float32)) is other  # no budget


def test_real_timing_of_both_forms(fresh_timings, monkeypatch):
    """The real timer (cold copies of both forms) gives every bucket a positive time, and
    the choice follows from them."""
    monkeypatch.setattr(block_expansion, "MAX_COPY_BYTES", 4 << 20)
    source = q8_weight(256, 256)
    choice = KernelChoice(activations=torch.float32, expansion_budget=1 << 30)
    weight = prepare_weight(source, choice)
    (timings,) = choice.expansion_table.entries.values()
    assert set(timings) == {"blocks", "expanded"}
    assert all(set(t) == set(ROW_BUCKETS) and min(t.values()) > 0 for t in timings.values())
    min_rows = crossover(timings)
    assert (weight.min_rows if isinstance(weight, ExpandedBlocks) else None) == min_rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_stack_runs_both_forms_as_the_layers_do(monkeypatch, fresh_timings, dtype):
    """Prefill chunks of 8+ rows take the copies, decode steps the blocks: the one C++
    call per step gives the layer-by-layer results bit for bit."""
    monkeypatch.setattr(block_expansion, "time_forms", expanded_from(8))
    loaded = load_model(None, getattr(torch, dtype), weight_expansion_memory=1 << 30)
    assert loaded.model.layers[0].qkv_weight.min_rows == 8
    formats = weight_bytes_by_format(loaded.model)
    assert formats[f"{dtype} expanded copies"] > 3 * formats["Q4_1"]
    assert variant_products(loaded.model) == [
        "GGUF blocks with an expanded copy for calls of many rows"
    ]
    assert_stack_equals_layers(loaded, dtype, ExpandedBlocks)


def test_engine_default_budget_and_when_it_keeps_blocks_alone(monkeypatch, fresh_timings, caplog):
    """The engine's default budget expands the default model's blocks where faster; in
    float32 the copies hold the blocks' exact values, so greedy tokens match the blocks
    alone. Speculation and int8 activations keep the blocks alone."""
    monkeypatch.setattr(block_expansion, "time_forms", expanded_from(8))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompt = "The capital of France is a city where"
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    assert "expanded copies" in caplog.text
    model = llm.llm_engine.runner.model
    assert isinstance(model.layers[0].gate_up_weight, ExpandedBlocks)
    expanded_tokens = llm.generate([prompt], params)[0].outputs[0].token_ids
    del llm
    alone = LLM(dtype="float32", kv_cache_memory="64MiB", weight_expansion_memory=0)
    assert isinstance(alone.llm_engine.runner.model.layers[0].gate_up_weight, QuantizedWeight)
    assert alone.generate([prompt], params)[0].outputs[0].token_ids == expanded_tokens
    del alone
    speculating = LLM(
        dtype="float32",
        kv_cache_memory="64MiB",
        speculative_config={"method": "ngram", "num_speculative_tokens": 2},
    )
    assert not variant_products(speculating.llm_engine.runner.model)
