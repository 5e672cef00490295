"""Nothing silently wrong: a config key or tensor that changes the math and that the
decoder does not implement is refused at load, with an error naming it; what is known
not to change the math loads."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models_gguf import write_gguf
from test_models_logits import write_checkpoint

from pagedllm.models import ModelConfig, ModelLoadError, load_model

BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def write_tiny(folder, model_type: str, **overrides):
    """A seeded random checkpoint of ``model_type`` written by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def edit_config(folder, **changes):
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


# Checkpoints transformers writes whose math we do not compute: (model_type, config
# overrides, words the error must contain).
REFUSED_CHECKPOINTS = {
    "llama-relu": ("llama", dict(hidden_act="relu"), "hidden_act"),
    "rope-partial": (
        "llama",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                              "partial_rotary_factor": 0.5}),
        "partial_rotary_factor",
    ),
    "rope-longrope-past-original": (
        "llama",
        dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4,
                              "original_max_position_embeddings": 64,
                              "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}),
        "longrope",
    ),
    "falcon-alibi": ("falcon", dict(alibi=True), "alibi"),
    "gpt2-inverse-layer-scale": (
        "gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"
    ),
    "gpt2-reordered-upcast": (
        "gpt2", dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"
    ),
    "gpt2-cross-attention": ("gpt2", dict(add_cross_attention=True), "add_cross_attention"),
    "clip-qkv-outside-olmo": ("llama", dict(clip_qkv=2.0), "clip_qkv"),
}


@pytest.mark.parametrize("case", list(REFUSED_CHECKPOINTS))
def test_unimplemented_checkpoint_is_refused_naming_it(tmp_path, case):
    model_type, overrides, words = REFUSED_CHECKPOINTS[case]
    write_tiny(tmp_path, model_type, **overrides)
    with pytest.raises(ModelLoadError, match=words):
        load_model(tmp_path)


def test_unknown_rope_type_is_refused(tmp_path):
    write_tiny(tmp_path, "llama")
    edit_config(tmp_path, rope_parameters={"rope_type": "ntk-by-parts", "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match="ntk-by-parts"):
        load_model(tmp_path)


def test_windows_that_never_slide_load(tmp_path):
    """Qwen2 ignores its window without use_sliding_window, and a window as long as the
    model's context never hides a key: both load."""
    write_tiny(tmp_path / "q", "qwen2", use_sliding_window=False, sliding_window=16)
    assert load_model(tmp_path / "q").config.sliding_windows == ()
    write_tiny(tmp_path / "m", "mistral", sliding_window=128)
    assert load_model(tmp_path / "m").config.sliding_windows == (128, 128)


def test_windows_per_layer_follow_transformers():
    raw = dict(BASE, model_type="qwen2", num_hidden_layers=4, use_sliding_window=True,
               sliding_window=8, max_window_layers=2)  # fmt: skip
    assert ModelConfig.from_hf_dict(raw).sliding_windows == (None, None, 8, 8)
    # Mistral's window defaults to 4096 when the key is absent.
    assert ModelConfig.from_hf_dict(dict(BASE, model_type="mistral")).sliding_windows == (
        4096,
        4096,
    )


@pytest.mark.parametrize(
    "key, value",
    [("attn_logit_softcapping", 50.0), ("logits_scaling", 8.0), ("num_local_experts", 8)],
)
def test_foreign_math_keys_are_refused(key, value):
    with pytest.raises(ModelLoadError, match=key):
        ModelConfig.from_hf_dict(dict(BASE, model_type="llama", **{key: value}))


def add_tensors(folder, tensors: dict[str, torch.Tensor]):
    path = folder / "model.safetensors"
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})


def test_unused_tensor_is_refused_naming_it(tmp_path):
    write_tiny(tmp_path, "llama")
    add_tensors(tmp_path, {"model.layers.0.self_attn.q_norm.weight": torch.ones(8)})
    with pytest.raises(ModelLoadError, match="model.layers.0.self_attn.q_norm.weight"):
        load_model(tmp_path)


def test_known_unused_tensors_load(tmp_path):
    """RoPE's cached frequencies are recomputed; a tied checkpoint's stored LM head is
    ignored, as transformers ignores it."""
    write_tiny(tmp_path, "llama", tie_word_embeddings=True)
    add_tensors(
        tmp_path,
        {
            "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
            "lm_head.weight": torch.zeros(64, 32),
        },
    )
    load_model(tmp_path)


def test_gguf_unused_tensor_is_refused(tmp_path):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-gqa-untied")
    extra = {"blk.0.attn_q_norm.weight": np.ones(16)}
    with pytest.raises(ModelLoadError, match="blk.0.attn_q_norm.weight"):
        load_model(write_gguf(tmp_path / "x.gguf", hf_model, extra=extra))


def test_gguf_sliding_window_is_refused(tmp_path, monkeypatch):
    hf_model = write_checkpoint(tmp_path / "hf", "llama-gqa-untied")
    original = gguf.GGUFWriter.add_vocab_size

    def with_window(writer, size):
        original(writer, size)
        writer.add_sliding_window(16)

    monkeypatch.setattr(gguf.GGUFWriter, "add_vocab_size", with_window)
    with pytest.raises(ModelLoadError, match="sliding_window"):
        load_model(write_gguf(tmp_path / "w.gguf", hf_model))


def test_gpt2_original_names_and_causal_mask_buffers_load(tmp_path):
    """The original GPT-2 files name tensors without ``transformer.`` and hold each layer's
    causal mask (``attn.bias``, ``attn.masked_bias``): the same weights, the same logits."""
    from transformers_oracle import our_logits

    write_tiny(tmp_path / "new", "gpt2")
    tensors = load_file(tmp_path / "new" / "model.safetensors")
    old = {name.removeprefix("transformer."): t for name, t in tensors.items()}
    for layer in range(BASE["num_hidden_layers"]):
        old[f"h.{layer}.attn.bias"] = torch.ones(1, 1, 128, 128).tril()
        old[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    save_file(old, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})
    tokens = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = our_logits(load_model(tmp_path / "new").model, tokens)
    assert torch.equal(our_logits(load_model(tmp_path / "old").model, tokens), expected)


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("gpt2", "transformer.h.0.attn.q_attn.weight"),
        ("gpt_neox", "gpt_neox.layers.0.attention.q_norm.weight"),
        ("falcon", "transformer.h.0.post_attention_layernorm.weight"),
        ("olmo", "model.layers.0.input_layernorm.weight"),
    ],
)
def test_unread_tensor_of_a_renamed_architecture_is_refused(tmp_path, model_type, extra):
    """A parallel-attention Falcon has no second norm, OLMo no norm weights at all: such a
    tensor in the checkpoint means math the decoder would skip."""
    write_tiny(tmp_path, model_type)
    add_tensors(tmp_path, {extra: torch.ones(8)})
    with pytest.raises(ModelLoadError, match=extra):
        load_model(tmp_path)
