"""``quantization="int8"``: a safetensors checkpoint's matrices rounded to int8 per output
channel at load, run on the Q8_0 kernels, equal the same model with those rounded weights
expanded to float32."""

from __future__ import annotations

import pytest
import torch
from test_models_gguf import QType, logits_of, write_gguf
from test_models_logits import TOLERANCE, write_checkpoint

from pagedllm.cpu.extension import kernels_built
from pagedllm.models import ModelLoadError, load_model
from pagedllm.models.quantized_weight import Q, QuantizedWeight, int8_per_channel

pytestmark = pytest.mark.skipif(not kernels_built(), reason="needs the C++ kernels")


def test_each_row_is_rounded_to_its_own_scale():
    weight = torch.randn(6, 64) * torch.tensor([1e-3, 0.1, 1, 10, 100, 0])[:, None]
    quantized = int8_per_channel(weight)
    assert quantized.ggml_type == Q.Q8_0 and quantized.nbytes == 6 * 2 * 34
    scale = (weight.abs().amax(dim=1) / 127).half().float()
    error = (quantized.dequantized() - weight).abs()
    assert (error <= scale[:, None] / 2 * (1 + 2**-10)).all()
    assert torch.equal(quantized.dequantized()[5], torch.zeros(64))


def test_int8_model_equals_its_rounded_weights_expanded(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-gqa-untied")
    quantized = load_model(tmp_path / "hf", quantization="int8").model
    assert isinstance(quantized.layers[0].qkv_weight, QuantizedWeight)
    assert isinstance(quantized.lm_head, QuantizedWeight)
    with torch.no_grad():
        for param in hf_model.parameters():
            if param.ndim == 2:
                param.copy_(int8_per_channel(param).dequantized())
    hf_model.save_pretrained(tmp_path / "rounded", safe_serialization=True)
    expanded = load_model(tmp_path / "rounded").model
    torch.testing.assert_close(logits_of(quantized), logits_of(expanded), atol=TOLERANCE, rtol=0)


def test_int8_is_refused_where_it_cannot_run(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-gqa-untied")
    with pytest.raises(ModelLoadError, match="not available: the quantized kernels take"):
        load_model(tmp_path / "hf", torch.float16, quantization="int8")
    path = write_gguf(tmp_path / "q8.gguf", hf_model, QType.Q8_0)
    with pytest.raises(ModelLoadError, match="is for safetensors checkpoints"):
        load_model(path, quantization="int8")
    with pytest.raises(ModelLoadError, match="needs a checkpoint"):
        load_model("llama-3-8b", load_format="dummy", quantization="int8")
