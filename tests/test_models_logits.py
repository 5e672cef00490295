"""Our decoder's logits against transformers' on tiny random checkpoints.

Tolerance: 1e-4 absolute on float32 logits. Both sides run the same float32
operations in the same order except the fused q/k/v and gate/up products, whose
different matrix blocking changes the rounding of sums of about 100 products
(about 1e-6 here); a wrong weight, rotation or mask moves logits by 1e-2 or more.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from pagedllm.attention.dense_backend import DenseAttentionBackend, dense_metadata
from pagedllm.cpu.extension import avx512_kernels_available
from pagedllm.models import fused, linear, load_model, rope

TOLERANCE = 1e-4
TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that the tiny head's slow, blended and fast pairs all occur.
    "original_max_position_embeddings": 32,
}
ARCHITECTURES = {
    "llama-gqa-untied": (LlamaForCausalLM, LlamaConfig(**TINY_SHAPE)),
    "llama-tied": (LlamaForCausalLM, LlamaConfig(**TINY_SHAPE, tie_word_embeddings=True)),
    "llama3-rope-scaling": (
        LlamaForCausalLM,
        LlamaConfig(**TINY_SHAPE, rope_parameters=LLAMA3_ROPE),
    ),
    "qwen2-bias-tied": (Qwen2ForCausalLM, Qwen2Config(**TINY_SHAPE, tie_word_embeddings=True)),
    "mistral": (MistralForCausalLM, MistralConfig(**TINY_SHAPE, sliding_window=None)),
}


def write_checkpoint(folder, name: str, max_shard_size: str | None = None):
    """Save a seeded random checkpoint of ``name``; returns transformers' eager model."""
    model_class, config = ARCHITECTURES[name]
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = model_class(config).eval()
    with torch.no_grad():  # norms away from 1 and biases away from 0, so mistakes show
        for param_name, param in model.named_parameters():
            if "norm" in param_name or param_name.endswith("bias"):
                param.normal_(1.0 if "norm" in param_name else 0.0, 0.3)
    extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **extra)
    return model


def our_logits(model, sequences: list[list[int]]) -> torch.Tensor:
    """Logits of every token of ``sequences`` run as one flattened batch."""
    ids = torch.tensor([t for seq in sequences for t in seq])
    positions = torch.cat([torch.arange(len(seq)) for seq in sequences])
    hidden = model.forward(
        ids, positions, DenseAttentionBackend(), dense_metadata([len(seq) for seq in sequences])
    )
    return model.compute_logits(hidden)


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.fixture(params=["avx512-kernels", "torch-operators"])
def kernels(request, monkeypatch) -> str:
    """Each decoder test twice: with the C++ kernels where the CPU has them, and with
    torch's operators only, as on a CPU without AVX-512 (weights are then not packed)."""
    if request.param == "torch-operators":
        for module in (fused, linear, rope):
            monkeypatch.setattr(module, "fits_avx512_kernels", lambda *tensors: False)
    return request.param


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_logits_match_transformers(tmp_path, name, kernels):
    reference = write_checkpoint(tmp_path, name)
    loaded = load_model(tmp_path)
    packed = isinstance(loaded.model.layers[0].qkv_weight, linear.PackedWeight)
    assert packed == (kernels == "avx512-kernels" and avx512_kernels_available())
    tokens = torch.randint(
        0, TINY_SHAPE["vocab_size"], (40,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    ours = our_logits(loaded.model, [tokens])
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, reference_logits(reference, tokens), atol=TOLERANCE, rtol=0)


def test_config_normalised_from_hf(tmp_path):
    write_checkpoint(tmp_path, "llama3-rope-scaling")
    config = load_model(tmp_path).config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        2,
        4,
        2,
        16,
    )
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3"
    assert not config.tie_word_embeddings


def test_sharded_checkpoint_loads_the_same_weights(tmp_path):
    reference = write_checkpoint(tmp_path, "llama-gqa-untied", max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    tokens = list(range(3, 30))
    ours = our_logits(load_model(tmp_path).model, [tokens])
    torch.testing.assert_close(ours, reference_logits(reference, tokens), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("lengths", [(1, 17, 5, 33), (9, 9, 9)], ids=["mixed", "equal"])
def test_flattened_batch_equals_each_sequence_alone(tmp_path, lengths, kernels):
    write_checkpoint(tmp_path, "qwen2-bias-tied")
    model = load_model(tmp_path).model
    gen = torch.Generator().manual_seed(2)
    sequences = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    together = our_logits(model, sequences)
    alone = torch.cat([our_logits(model, [seq]) for seq in sequences])
    torch.testing.assert_close(together, alone, atol=TOLERANCE, rtol=0)


def test_bfloat16_logits_are_close(tmp_path, kernels):
    write_checkpoint(tmp_path, "llama-gqa-untied")
    tokens = list(range(5, 25))
    full = our_logits(load_model(tmp_path).model, [tokens])
    half_model = load_model(tmp_path, dtype=torch.bfloat16).model
    assert half_model.dtype == torch.bfloat16
    half = our_logits(half_model, [tokens])
    assert half.dtype == torch.float32
    # bfloat16 keeps 8 significant bits, so only a loose bound holds.
    assert (half - full).abs().max() < 0.1 * full.abs().max()
