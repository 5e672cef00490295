"""The decoder layers as one C++ call (pagedllm/models/layer_stack.py) against the same
layers run one by one in Python (``enforce_eager=True``): every matrix form, bit for bit."""

from __future__ import annotations

import pytest
import torch
from shared_models import default_model
from tiny_checkpoints import run_outputs, tiny_engine

from pagedllm.bench.tiny_llama import write_tiny_llama
from pagedllm.cpu.extension import avx512_kernels_available, quant_x16_supports
from pagedllm.cpu.onednn import reorderable
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.models.interleaved_weight import InterleavedWeight
from pagedllm.models.layer_stack import unsupported_reason
from pagedllm.models.linear import OneDNNWeight, PackedWeight
from pagedllm.models.loader import load_model
from pagedllm.models.quantized_weight import Q, QuantizedWeight

pytestmark = pytest.mark.skipif(
    not avx512_kernels_available(), reason="the layer stack runs the AVX-512 kernels"
)


def tiny_qwen_like(folder, dtype: torch.dtype, linear_kernel: str):
    """A tiny Llama with q/k/v biases (as Qwen2 has), in plain (oneDNN) or packed form."""
    path = write_tiny_llama(folder, seed=3, attention_bias=True)
    return load_model(str(path), dtype, linear_kernel=linear_kernel)


def prompts_with_shared_prefix() -> list[list[int]]:
    """Prompts of 5-70 tokens, three of them sharing a 40-token prefix (prefix caching)."""
    shared = [(7 * i) % 480 + 2 for i in range(40)]
    return [
        shared + [11, 12, 13],
        shared + [21, 22],
        shared + list(range(30, 60)),
        [5, 6, 7, 8, 9],
        [(3 * i) % 500 + 2 for i in range(70)],
    ]


def outputs_of(loaded, eager: bool, dtype: str, **overrides):
    """Tokens and logprobs of every request, with prompts chunked over several steps."""
    settings = dict(
        num_blocks=256, block_size=16, dtype=dtype, enforce_eager=eager,
        max_num_batched_tokens=32, max_num_seqs=4, enable_prefix_caching=True,
    )  # fmt: skip
    engine = tiny_engine(loaded, **{**settings, **overrides})
    assert (engine.runner.layer_stack is None) == eager
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    done = run_outputs(engine, prompts_with_shared_prefix(), params)
    return {
        rid: [(s.token_ids, [(lp.logprob, lp.top) for lp in s.logprobs]) for s in out.outputs]
        for rid, out in sorted(done.items())
    }


def assert_stack_equals_layers(loaded, dtype: str, kind: type, **overrides) -> None:
    assert isinstance(loaded.model.layers[0].qkv_weight, kind)
    stacked = outputs_of(loaded, eager=False, dtype=dtype, **overrides)
    assert stacked == outputs_of(loaded, eager=True, dtype=dtype, **overrides)


@pytest.mark.parametrize(
    ("dtype", "kind"),
    [("bfloat16", InterleavedWeight), ("float32", QuantizedWeight)],
)
def test_default_model_quantized_blocks(dtype, kind):
    """The shipped Q4_1 file: interleaved blocks in bfloat16, rows of blocks in float32."""
    assert_stack_equals_layers(default_model(getattr(torch, dtype)), dtype, kind)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_model_over_int4_blocks(dtype):
    """Old blocks re-encoded into 4 bits (a 16-token recent window, so that prompts of 40+
    tokens leave compact blocks behind): the by-age kernel in the stack, bit for bit."""
    kind = InterleavedWeight if dtype == "bfloat16" else QuantizedWeight
    loaded = default_model(getattr(torch, dtype))
    int4 = dict(kv_cache_dtype="int4", kv_recent_tokens=16)
    assert_stack_equals_layers(loaded, dtype, kind, **int4)
    engine = tiny_engine(loaded, num_blocks=64, block_size=16, dtype=dtype, **int4)
    assert engine.runner.layer_stack is not None
    engine.add_request("long", {"prompt_token_ids": prompts_with_shared_prefix()[-1]},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # fmt: skip
    compact = 0
    while engine.has_unfinished_requests():
        engine.step()
        compact = max(compact, engine.block_manager.pool.num_compact_used)
    assert compact >= 3  # 70 tokens, the newest 16 full-size: 3 blocks behind them


@pytest.mark.skipif(
    not quant_x16_supports(int(Q.Q4_1), int8_activations=True), reason="needs AVX-512 VNNI"
)
def test_default_model_int8_activations():
    loaded = load_model(None, torch.bfloat16, activation_quantization="int8")
    assert loaded.model.layers[0].qkv_weight.int8_activations
    assert_stack_equals_layers(loaded, "bfloat16", InterleavedWeight)


@pytest.mark.parametrize(
    ("dtype", "linear_kernel", "kind"),
    [
        ("float32", "packed", PackedWeight),
        ("bfloat16", "packed", PackedWeight),
        ("float32", "onednn", OneDNNWeight),
        ("bfloat16", "onednn", OneDNNWeight),
        ("bfloat16", "dense", torch.Tensor),
    ],
)
def test_tiny_model_with_biases(tmp_path_factory, dtype, linear_kernel, kind):
    if kind is OneDNNWeight and not reorderable(torch.empty(1, 1, dtype=getattr(torch, dtype))):
        kind = torch.Tensor  # oneDNN cannot take the weight here: the plain matrix
    folder = tmp_path_factory.mktemp(f"qwen-like-{dtype}")
    loaded = tiny_qwen_like(folder, getattr(torch, dtype), linear_kernel)
    assert loaded.model.layers[0].qkv_bias is not None
    assert_stack_equals_layers(loaded, dtype, kind)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_default_model_over_an_fp8_cache(dtype, kv_cache_dtype):
    """fp8 K/V (encoded as written, in C++ by encode_rows' operations): the stack equals
    the layers bit for bit, alone and as the recent window of 4-bit blocks."""
    kind = InterleavedWeight if dtype == "bfloat16" else QuantizedWeight
    loaded = default_model(getattr(torch, dtype))
    engine = tiny_engine(loaded, num_blocks=64, block_size=16, dtype=dtype,
                         kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    assert engine.runner.layer_stack is not None
    assert_stack_equals_layers(loaded, dtype, kind, kv_cache_dtype=kv_cache_dtype)
    int4 = dict(kv_cache_dtype="int4", kv_recent_tokens=16, kv_recent_dtype=kv_cache_dtype)
    assert_stack_equals_layers(loaded, dtype, kind, **int4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_default_model_over_an_int8_cache(dtype):
    """int8 K/V (keys rotated, quantized as written): the stack equals the layers bit for
    bit, alone and as the recent window of 4-bit blocks."""
    kind = InterleavedWeight if dtype == "bfloat16" else QuantizedWeight
    loaded = default_model(getattr(torch, dtype))
    assert_stack_equals_layers(loaded, dtype, kind, kv_cache_dtype="int8")
    int4 = dict(kv_cache_dtype="int4", kv_recent_tokens=16, kv_recent_dtype="int8")
    assert_stack_equals_layers(loaded, dtype, kind, **int4)


def test_cache_formats_and_architectures_it_does_not_run(tiny_model):
    """A float16 KV cache under a float32 model or a layer it does not implement: layer
    by layer, said why."""
    engine = tiny_engine(tiny_model, num_blocks=16, kv_cache_dtype="float16")
    assert engine.runner.layer_stack is None
    assert "KV cache" in unsupported_reason(tiny_model.model, engine.runner.attn)

    plain = tiny_engine(tiny_model, num_blocks=16)
    assert plain.runner.layer_stack is not None
    assert unsupported_reason(tiny_model.model, object()) == (
        "attention is not the C++ paged kernel"
    )


def test_phase_clocks_count_what_the_stack_runs(tiny_model):
    """Profiling on: every phase a layer runs gets time, once per step; off: the clocks
    stand still. Turning it on starts from zero. Over a cache in the model's dtype the K/V
    write is part of the rotary pass, and every residual add but the last layer's part of
    the norm after it."""
    engine = tiny_engine(tiny_model, num_blocks=64)
    stack = engine.runner.layer_stack
    stack.set_profiling(True)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    run_outputs(engine, [[5, 6, 7, 8, 9, 10], [11, 12, 13]], params)
    seconds = stack.phase_seconds()
    steps = seconds.pop("steps")
    assert steps == engine.step_times.steps
    ran = ("products", "attention", "norms", "rotary", "activation", "residual_adds")
    assert all(seconds[name] > 0 for name in ran)
    assert seconds["write_kv"] == 0
    assert seconds["copies"] > 0  # the last layer keeps only the sampled rows
    stack.set_profiling(False)
    run_outputs(engine, [[5, 6, 7]], params)
    assert stack.phase_seconds()["steps"] == steps
    stack.set_profiling(True)
    assert set(stack.phase_seconds().values()) == {0.0}
