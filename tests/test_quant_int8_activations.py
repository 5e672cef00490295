"""Activations rounded to int8 per block of 32 where they meet Q8_0 / Q4_0 / Q4_1 weights
(``activation_quantization="int8"``, llama.cpp's arithmetic).

The kernel's result is the float64 product of the quantized activations with the
dequantized weights, rounded once to bfloat16, up to float32 rounding; it is not the
exact product (the test checks both, so it fails if the activations are not rounded). A
row's result does not depend on the other rows, whichever path (registers up to 64 rows,
panels beyond) runs it.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys

import pytest
import torch
from test_models_logits import write_checkpoint
from test_models_smollm2 import chat_ids, greedy_cached
from test_quant_kernels import TOLERANCE, random_blocks
from test_quant_model import PROMPTS, TEXT, nll_per_token
from test_quant_x16 import weight_of

from pagedllm.config import EngineConfig
from pagedllm.cpu.extension import quant_linear_x16, quant_x16_supports
from pagedllm.models import load_model
from pagedllm.models.errors import ModelLoadError
from pagedllm.models.interleaved_weight import InterleavedWeight
from pagedllm.models.quantized_weight import Q, QuantizedWeight

INT8_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1)
needs_int8_kernels = pytest.mark.skipif(
    not all(quant_x16_supports(int(t), int8_activations=True) for t in INT8_TYPES),
    reason="needs AVX-512 VNNI and bfloat16",
)
def int8_product(x, blocks, ggml_type: int, n: int, bias=None) -> torch.Tensor:
    return quant_linear_x16(x, blocks, ggml_type, n, bias, int8_activations=True)


ROWS = (1, 2, 3, 4, 5, 7, 13, 23, 64, 65, 71)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernel reads it: per block of 32 values, scale = largest |x| / 127
    (float32), codes rounded to nearest (ties to even); float64."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(blocks / torch.where(scale > 0, scale, 1)), 0)
    return (codes.double() * scale.double()).view(x.shape)


def assert_int8_product(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias) -> None:
    """``y`` is the quantized-activation product rounded once to bfloat16, within float32
    rounding, and not the exact product."""
    xq = quantized_activations(x)
    product = xq @ dense.double().T + bias.double()
    magnitude = xq.abs() @ dense.double().abs().T + bias.double().abs()
    slack = TOLERANCE * magnitude + 2.0**-8 * product.abs()
    assert ((y.double() - product).abs() <= slack).all()
    assert (y == product.float().bfloat16()).float().mean() >= 0.99
    exact = (x.double() @ dense.double().T + bias.double()).float().bfloat16()
    assert (y != exact).float().mean() > 0.2  # the activations were rounded


@needs_int8_kernels
@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROWS)
def test_product_rounds_the_quantized_activation_product_once(ggml_type, rows):
    n, k = 70, 512  # 70: a partial last group of 16 and a partial panel of 32
    weight, dense = weight_of(ggml_type, n, k, seed=6)
    interleaved = InterleavedWeight.interleave(weight)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    x[0, 32:64] = 0  # an all-zero block: scale 0, codes 0
    bias = torch.randn(n, generator=generator)
    y = int8_product(x, interleaved.blocks, int(ggml_type), n, bias)
    assert_int8_product(y, x, dense, bias)
    switched = dataclasses.replace(interleaved, int8_activations=True)
    assert torch.equal(switched.linear(x, bias), y)


@needs_int8_kernels
@pytest.mark.parametrize("ggml_type", INT8_TYPES, ids=lambda t: t.name)
def test_rows_do_not_depend_on_the_other_rows_or_the_path(ggml_type):
    n, k = 48, 256
    blocks = torch.from_numpy(random_blocks(ggml_type, n, k, seed=2))
    weight = InterleavedWeight.interleave(QuantizedWeight(blocks, ggml_type, k))
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    batch = int8_product(x, weight.blocks, int(ggml_type), n)  # panels
    assert int8_product(x[:0], weight.blocks, int(ggml_type), n).shape == (0, n)
    for rows in (slice(0, 1), slice(5, 9), slice(2, 9), slice(11, 19), slice(1, 65)):
        assert torch.equal(int8_product(x[rows], weight.blocks, int(ggml_type), n),
                           batch[rows])  # fmt: skip


@pytest.fixture(scope="module")
def int8_default_model():
    return load_model(None, torch.bfloat16, activation_quantization="int8")


@needs_int8_kernels
@pytest.mark.slow
def test_default_model_quality_against_float32(int8_default_model, default_model):
    model = int8_default_model.model
    layer = model.layers[0]
    for weight in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight):
        assert isinstance(weight, InterleavedWeight) and weight.int8_activations
    assert model.lm_head is model.embed_tokens and model.lm_head.int8_activations
    ids = default_model.tokenizer.encode(TEXT)
    int8 = nll_per_token(model, ids)
    exact = nll_per_token(default_model.model, ids)  # float32 activations, same weights
    # measured: perplexity 0.4% above the float32 model's (exact bfloat16: 0.5% below)
    assert abs(torch.tensor(int8 - exact).exp().item() - 1) < 0.01
    prompts = [chat_ids(default_model.tokenizer, p) for p in PROMPTS]
    eos = default_model.tokenizer.eos_token_id
    ours = greedy_cached(model, prompts, 8, eos)
    reference = greedy_cached(default_model.model, prompts, 8, eos)
    # measured: 7 of 8 agree for 8 tokens; "Why is the sky blue?" starts on a near-tie
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= 6


def test_refused_where_it_cannot_apply(tmp_path):
    with pytest.raises(ValueError, match="activation_quantization must be one of"):
        EngineConfig(activation_quantization="int4")
    with pytest.raises(ValueError, match="quantization='none' expands them"):
        EngineConfig(dtype="bfloat16", quantization="none", activation_quantization="int8")
    with pytest.raises(ValueError, match="bfloat16 models on the CPU, not torch.float32"):
        EngineConfig(dtype="float32", activation_quantization="int8")
    with pytest.raises(ModelLoadError, match="runs bfloat16 models, not torch.float32"):
        load_model(None, torch.float32, activation_quantization="int8")
    with pytest.raises(ModelLoadError, match="has none"):
        load_model("smollm2-135m", torch.bfloat16, load_format="dummy",
                   activation_quantization="int8")  # fmt: skip


@needs_int8_kernels
def test_safetensors_checkpoint_rounded_to_int8(tmp_path):
    """quantization="int8" keeps Q8_0 blocks, which take int8 activations too; a
    checkpoint left in bfloat16 has no quantized weights and is refused."""
    write_checkpoint(tmp_path, "llama-gqa-untied")
    with pytest.raises(ModelLoadError, match="has none"):
        load_model(tmp_path, torch.bfloat16, activation_quantization="int8")
    loaded = load_model(tmp_path, torch.bfloat16, quantization="int8",
                        activation_quantization="int8")  # fmt: skip
    weight = loaded.model.layers[0].qkv_weight
    assert weight.ggml_type == Q.Q8_0 and weight.int8_activations


def test_command_line_flag():
    out = subprocess.run(
        [sys.executable, "-m", "pagedllm.cli", "generate", "--help"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "--activation-quantization {none,int8}" in out


@needs_int8_kernels
def test_log_line_counts_the_switched_matrices(caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        load_model(None, torch.bfloat16, activation_quantization="int8")
    assert "int8 activations for 121 quantized matrices" in caplog.text
