"""``quantization="int8"`` / ``"q4_0"``: a checkpoint's matrices rounded at load (to int8
per output channel, or to Q4_0 blocks), run on the block kernels, equal the same model
with those rounded weights expanded to float32; a GGUF file's blocks are rounded again."""

from __future__ import annotations

import pytest
import torch
from test_models_gguf import QType, logits_of, write_gguf
from test_models_logits import TOLERANCE, write_checkpoint

from pagedllm.config import Quantization
from pagedllm.cpu.extension import kernels_built
from pagedllm.models import ModelLoadError, load_model
from pagedllm.models.quantized_weight import Q, QuantizedWeight, int8_per_channel
from pagedllm.models.weight_rounding import q4_0_blocks, rounder

pytestmark = pytest.mark.skipif(not kernels_built(), reason="needs the C++ kernels")


def test_each_row_is_rounded_to_its_own_scale():
    weight = torch.randn(6, 64) * torch.tensor([1e-3, 0.1, 1, 10, 100, 0])[:, None]
    quantized = int8_per_channel(weight)
    assert quantized.ggml_type == Q.Q8_0 and quantized.nbytes == 6 * 2 * 34
    scale = (weight.abs().amax(dim=1) / 127).half().float()
    error = (quantized.dequantized() - weight).abs()
    assert (error <= scale[:, None] / 2 * (1 + 2**-10)).all()
    assert torch.equal(quantized.dequantized()[5], torch.zeros(64))


def test_q4_0_blocks_are_ggmls():
    """Per 32 weights, 16 levels of one scale (the largest-magnitude weight / -8): that
    weight is exact up to the scale's half precision, the others within half a step
    (a full step for those past level 7 on its other side, which clip)."""
    weight = torch.randn(4, 64) * torch.tensor([1e-3, 1, 100, 0])[:, None]
    quantized = q4_0_blocks(weight)
    assert quantized.ggml_type == Q.Q4_0 and quantized.nbytes == 4 * 2 * 18
    blocks = weight.reshape(4, 2, 32)
    largest = blocks.gather(2, blocks.abs().argmax(dim=2, keepdim=True))
    step = (largest / -8).half().float().abs()
    dequantized = quantized.dequantized().reshape(4, 2, 32)
    error = (dequantized - blocks).abs()
    clipped = blocks * largest.sign() < -7.5 * step
    assert (error[~clipped] <= (step / 2 * (1 + 2**-8)).expand_as(error)[~clipped]).all()
    assert (error <= step * (1 + 2**-8)).all()
    exact = dequantized.gather(2, blocks.abs().argmax(dim=2, keepdim=True))
    torch.testing.assert_close(exact, largest, rtol=2**-10, atol=0)
    assert torch.equal(quantized.dequantized()[3], torch.zeros(64))


ROUNDINGS = {
    "int8": lambda name, w: int8_per_channel(w),
    "q4_0": lambda name, w: rounder(Quantization.Q4_0, name)(w),
}


@pytest.mark.parametrize("quantization", ["int8", "q4_0"])
def test_rounded_model_equals_its_rounded_weights_expanded(tmp_path, quantization):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-gqa-untied")
    quantized = load_model(tmp_path / "hf", quantization=quantization).model
    assert isinstance(quantized.layers[0].qkv_weight, QuantizedWeight)
    assert isinstance(quantized.lm_head, QuantizedWeight)
    assert quantized.lm_head.ggml_type == Q.Q8_0  # q4_0 keeps the logits' matrix in 8 bits
    assert (
        quantized.layers[0].qkv_weight.ggml_type == {"int8": Q.Q8_0, "q4_0": Q.Q4_0}[quantization]
    )
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if param.ndim == 2:
                param.copy_(ROUNDINGS[quantization](name, param).dequantized())
    hf_model.save_pretrained(tmp_path / "rounded", safe_serialization=True)
    expanded = load_model(tmp_path / "rounded").model
    torch.testing.assert_close(logits_of(quantized), logits_of(expanded), atol=TOLERANCE, rtol=0)


def test_int8_is_refused_where_it_cannot_run(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-gqa-untied")
    with pytest.raises(ModelLoadError, match="not available: the quantized kernels take"):
        load_model(tmp_path / "hf", torch.float16, quantization="int8")
    path = write_gguf(tmp_path / "q8.gguf", hf_model, QType.Q8_0)
    with pytest.raises(ModelLoadError, match="not available: the quantized kernels take"):
        load_model(path, torch.float16, quantization="q4_0")
    with pytest.raises(ModelLoadError, match="needs a checkpoint"):
        load_model("llama-3-8b", load_format="dummy", quantization="int8")


def test_a_gguf_files_blocks_are_rounded_again(tmp_path):
    """``q4_0`` on a Q8_0 file: every projection becomes Q4_0 blocks rounded from the
    file's dequantized weights."""
    hf_model = write_checkpoint(tmp_path / "hf", "llama-gqa-untied")
    path = write_gguf(tmp_path / "q8.gguf", hf_model, QType.Q8_0)
    kept = load_model(path).model.layers[0].o_weight
    rounded = load_model(path, quantization="q4_0").model.layers[0].o_weight
    assert kept.ggml_type == Q.Q8_0 and rounded.ggml_type == Q.Q4_0
    assert torch.equal(rounded.blocks, q4_0_blocks(kept.dequantized()).blocks)
