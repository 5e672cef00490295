"""GGUF files of the newer architectures, written the way llama.cpp's converter writes
them (its tensor names; Q/K rows in Hugging Face order for the NeoX-rope Qwen models),
against transformers on the same weights; and the architectures whose llama.cpp layout
is not implemented are refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_models_gguf import TOKENS, interleave_rope_rows, logits_of, write_gguf
from transformers_oracle import LOGITS_TOLERANCE, our_logits, write_random_checkpoint

from pagedllm.models import ModelLoadError, load_model
from pagedllm.models.loader_gguf import EXPERT_TENSOR_NAMES, gguf_name


def test_qwen3_gguf_with_qk_norms_matches_transformers(tmp_path):
    hf_model = write_random_checkpoint(tmp_path / "hf", "qwen3", head_dim=16)
    loaded = load_model(write_gguf(tmp_path / "q.gguf", hf_model, arch="qwen3"))
    assert loaded.config.architecture == "qwen3"
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=LOGITS_TOLERANCE, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "olmo2", "qwen2moe"])
def test_other_gguf_architectures_are_refused_by_name(tmp_path, arch):
    writer = gguf.GGUFWriter(tmp_path / "x.gguf", arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=f"unsupported GGUF architecture '{arch}'"):
        load_model(tmp_path / "x.gguf")


def write_mixtral_gguf(path, folder, config):
    """llama.cpp's Mixtral: a "llama" GGUF with Q/K rows interleaved, and each layer's
    experts stacked per kind into ``ffn_{gate,up,down}_exps`` ``[experts, rows, cols]``."""
    weights = load_file(folder / "model.safetensors")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in weights.items():
        if ".experts." in name:
            continue
        data = tensor.numpy()
        if name.split(".")[-2] in heads:
            data = interleave_rope_rows(data, heads[name.split(".")[-2]])
        writer.add_tensor(gguf_name(name), data.astype(np.float32))
    for layer in range(config.num_hidden_layers):
        for kind, stored in EXPERT_TENSOR_NAMES.items():
            stack = np.stack([
                weights[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{kind}.weight"].numpy()
                for e in range(config.num_local_experts)
            ])  # fmt: skip
            writer.add_tensor(f"blk.{layer}.{stored}.weight", stack.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_mixtral_gguf_with_stacked_experts_matches_transformers(tmp_path):
    hf_model = write_random_checkpoint(
        tmp_path / "hf", "mixtral", num_local_experts=4, num_experts_per_tok=2
    )
    gguf_path = write_mixtral_gguf(tmp_path / "m.gguf", tmp_path / "hf", hf_model.config)
    loaded = load_model(gguf_path)
    assert loaded.config.architecture == "mixtral" and loaded.config.num_experts == 4
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=LOGITS_TOLERANCE, rtol=0)


def test_phi3_gguf_with_fused_tensors_and_a_window_matches_transformers(tmp_path, monkeypatch):
    """llama.cpp's Phi-3: attn_qkv and ffn_up (gate and up rows) as stored, the window
    in the metadata, on every layer."""
    hf_model = write_random_checkpoint(tmp_path / "hf", "phi3", sliding_window=12)
    original = gguf.GGUFWriter.add_vocab_size

    def with_window(writer, size):
        original(writer, size)
        writer.add_sliding_window(12)

    monkeypatch.setattr(gguf.GGUFWriter, "add_vocab_size", with_window)
    loaded = load_model(write_gguf(tmp_path / "p.gguf", hf_model, arch="phi3"))
    assert loaded.config.sliding_windows == (12, 12)
    tokens = TOKENS + TOKENS  # 66 positions, far past the window
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(
        our_logits(loaded.model, tokens), expected, atol=LOGITS_TOLERANCE, rtol=0
    )


def test_phi3_gguf_longrope_factors_are_refused_by_name(tmp_path):
    hf_model = write_random_checkpoint(tmp_path / "hf", "phi3")
    extra = {"rope_factors_long.weight": np.ones(8), "rope_factors_short.weight": np.ones(8)}
    with pytest.raises(ModelLoadError, match="rope_factors_long.weight"):
        load_model(write_gguf(tmp_path / "p.gguf", hf_model, arch="phi3", extra=extra))


def test_granite_gguf_with_its_scales_matches_transformers(tmp_path, monkeypatch):
    """llama.cpp's Granite: Llama's interleaved Q/K rows, the four multipliers as
    embedding_scale, residual_scale, attention.scale and logit_scale."""
    scales = dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                  attention_multiplier=0.1, logits_scaling=2.0)  # fmt: skip
    hf_model = write_random_checkpoint(tmp_path / "hf", "granite", **scales)
    original = gguf.GGUFWriter.add_vocab_size

    def with_scales(writer, size):
        original(writer, size)
        writer.add_embedding_scale(3.0)
        writer.add_residual_scale(0.5)
        writer.add_attention_scale(0.1)
        writer.add_logit_scale(2.0)

    monkeypatch.setattr(gguf.GGUFWriter, "add_vocab_size", with_scales)
    loaded = load_model(write_gguf(tmp_path / "g.gguf", hf_model, arch="granite"))
    assert loaded.config.architecture == "granite" and loaded.config.logits_divisor == 2.0
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=LOGITS_TOLERANCE, rtol=0)
