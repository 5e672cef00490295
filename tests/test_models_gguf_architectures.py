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
from test_models_gguf import (
    TOKENS,
    add_decoder_shape,
    interleave_rope_rows,
    logits_of,
    write_gguf,
)
from transformers_oracle import (
    LOGITS_TOLERANCE,
    assert_exact,
    our_logits,
    write_random_checkpoint,
)

from pagedllm.models import ModelLoadError, load_model
from pagedllm.models.loader_gguf import expert_index, gguf_name


def test_qwen3_gguf_with_qk_norms_matches_transformers(tmp_path):
    hf_model = write_random_checkpoint(tmp_path / "hf", "qwen3", head_dim=16)
    loaded = load_model(write_gguf(tmp_path / "q.gguf", hf_model, arch="qwen3"))
    assert loaded.config.architecture == "qwen3"
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=LOGITS_TOLERANCE, rtol=0)


@pytest.mark.parametrize("arch", ["olmoe", "falcon", "bloom"])
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


def write_moe_gguf(path, folder, config, arch: str):
    """A mixture of experts as llama.cpp writes it: each layer's experts stacked per kind
    into ``ffn_{gate,up,down}_exps`` ``[experts, rows, cols]``; Mixtral as a ``llama``
    (Q/K rows interleaved), the Qwen models in Hugging Face row order."""
    weights = load_file(folder / "model.safetensors")
    mixtral = arch == "llama"
    writer = gguf.GGUFWriter(path, arch)
    add_decoder_shape(writer, config)
    writer.add_expert_count(config.num_local_experts if mixtral else config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if not mixtral:
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    stacks: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, tensor in weights.items():
        data = tensor.numpy()
        stored = gguf_name(name)
        if expert_index(name) is not None:
            stacks.setdefault(stored, []).append((expert_index(name), data))
            continue
        if mixtral and name.split(".")[-2] in heads:
            data = interleave_rope_rows(data, heads[name.split(".")[-2]])
        writer.add_tensor(stored, data.astype(np.float32))
    for stored, experts in stacks.items():
        stack = np.stack([data for _, data in sorted(experts, key=lambda e: e[0])])
        writer.add_tensor(stored, stack.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


MOE_CASES = {
    "mixtral": ("mixtral", "llama", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2-moe": ("qwen2_moe", "qwen2moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)),
    "qwen3-moe": ("qwen3_moe", "qwen3moe", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=True)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_gguf_with_stacked_experts_matches_transformers(tmp_path, name):
    model_type, arch, overrides = MOE_CASES[name]
    hf_model = write_random_checkpoint(tmp_path / "hf", model_type, **overrides)
    gguf_path = write_moe_gguf(tmp_path / "m.gguf", tmp_path / "hf", hf_model.config, arch)
    loaded = load_model(gguf_path)
    assert loaded.config.architecture == model_type and loaded.config.num_experts == 4
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


GEMMAS = (gguf.MODEL_ARCH.GEMMA, gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3)


def write_converted_gguf(path, folder, config, arch: gguf.MODEL_ARCH):
    """A GGUF written as llama.cpp's converter writes ``arch``: names from the gguf
    package's own name map, Hugging Face row order, Gemma's norms stored as ``1 + w``,
    no LM head when tied; Gemma 2's window and soft-caps, Gemma 3's window, global rope
    base and linear scaling (no query_pre_attn_scalar, no layer pattern: llama.cpp
    derives those)."""
    name = gguf.MODEL_ARCH_NAMES[arch]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, name)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == gguf.MODEL_ARCH.GEMMA2:
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch in (gguf.MODEL_ARCH.GEMMA2, gguf.MODEL_ARCH.GEMMA3):
        writer.add_sliding_window(config.sliding_window)
    if arch == gguf.MODEL_ARCH.GEMMA3:
        rope = config.rope_parameters["full_attention"]
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif arch not in GEMMAS:  # Gemma's and Gemma 2's converters leave llama.cpp's default
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    for hf_name, tensor in load_file(folder / "model.safetensors").items():
        data = tensor.numpy()
        if arch in GEMMAS and hf_name.endswith("norm.weight"):
            data = data + 1
        stored = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(stored, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "model_type, arch",
    [("gemma", gguf.MODEL_ARCH.GEMMA), ("olmo2", gguf.MODEL_ARCH.OLMO2)],
)
def test_converted_gguf_matches_transformers(tmp_path, model_type, arch):
    """Gemma (1 + w norms, GeGLU, scaled embeddings) and OLMo 2 (post-norms, q/k norms
    over the projections) from files named as the converter names them."""
    hf_model = write_random_checkpoint(tmp_path / "hf", model_type, head_dim=16)
    path = write_converted_gguf(tmp_path / "c.gguf", tmp_path / "hf", hf_model.config, arch)
    loaded = load_model(path)
    assert loaded.config.architecture == model_type
    with torch.no_grad():
        expected = hf_model(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(logits_of(loaded.model), expected, atol=LOGITS_TOLERANCE, rtol=0)


# Gemma 2 and 3 as llama.cpp runs them: query_pre_attn_scalar = head_dim (llama.cpp's
# rule below 27B), Gemma 3's local rope base 10000; six Gemma 3 layers so that one is
# global (windows 8, far shorter than the sequences).
GEMMA_GGUF_CASES = {
    "gemma2": (gguf.MODEL_ARCH.GEMMA2, dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0, final_logit_softcapping=10.0)),
    "gemma3_text": (gguf.MODEL_ARCH.GEMMA3, dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=16, num_hidden_layers=6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}  # fmt: skip


@pytest.mark.parametrize("model_type", list(GEMMA_GGUF_CASES))
def test_gemma2_and_gemma3_gguf_are_exact(tmp_path, model_type):
    """Logits within the tolerance and greedy tokens through the engine equal to
    transformers', from files holding only what the converter writes."""
    arch, overrides = GEMMA_GGUF_CASES[model_type]
    hf_model = write_random_checkpoint(tmp_path / "hf", model_type, **overrides)
    path = write_converted_gguf(tmp_path / "g.gguf", tmp_path / "hf", hf_model.config, arch)
    config = load_model(path).config
    assert config.architecture == model_type
    sliding = [t == "sliding_attention" for t in hf_model.config.layer_types]
    assert [w is not None for w in config.sliding_windows] == sliding
    assert_exact(path, hf_model)


def write_gemma_metadata(path, arch: str, layers: int, **metadata) -> None:
    """A GGUF holding a Gemma shape's metadata and a tied embedding only."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(4608)
    writer.add_feed_forward_length(64)
    writer.add_head_count(32)
    writer.add_head_count_kv(16)
    writer.add_key_length(128)
    writer.add_value_length(128)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(8)
    for key, value in metadata.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4608), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "layers", "scale_dim"),
    [("gemma2", 46, 144), ("gemma2", 42, 128), ("gemma3", 62, 144), ("gemma3", 48, 128)],
)
def test_gemma_gguf_query_scale_follows_llama_cpp_by_model_size(
    tmp_path, arch, layers, scale_dim
):
    """The 27B models (46 and 62 layers) scale queries by (hidden / heads) ** -0.5, the
    others by head_dim ** -0.5; Gemma 2's soft-caps default to llama.cpp's 50 and 30."""
    from pagedllm.models.loader_gguf import gguf_config, open_gguf

    write_gemma_metadata(tmp_path / "m.gguf", arch, layers, sliding_window=4096)
    config = gguf_config(open_gguf(tmp_path / "m.gguf"), tmp_path / "m.gguf")
    assert config.attention_scale == scale_dim**-0.5
    softcaps = (50.0, 30.0) if arch == "gemma2" else (None, None)
    assert (config.attn_logit_softcap, config.final_logit_softcap) == softcaps


@pytest.mark.parametrize(
    ("metadata", "words"),
    [({"sliding_window": 512, "final_logit_softcapping": 30.0}, "final_logit_softcapping"),
     ({}, "sliding_window")],
)  # fmt: skip
def test_gemma3_gguf_that_llama_cpp_runs_otherwise_is_refused(tmp_path, metadata, words):
    """llama.cpp applies no soft-cap to a windowed Gemma 3, and runs one without a window
    another way: such files are refused by name."""
    write_gemma_metadata(tmp_path / "m.gguf", "gemma3", 2, **metadata)
    with pytest.raises(ModelLoadError, match=words):
        load_model(tmp_path / "m.gguf")


def write_layernorm_gguf(path, folder, config, arch: gguf.MODEL_ARCH):
    """A GPT-NeoX, GPT-2, StableLM or OLMo GGUF as llama.cpp's converter writes one: its
    metadata keys, q/k/v rows stacked (GPT-NeoX's reordered, GPT-2's ``Conv1D`` matrices
    transposed back, its LM head a copy of the embedding), StableLM's per-head norms
    stacked, OLMo's q/k rows interleaved."""
    layers = config.num_hidden_layers
    names = gguf.get_tensor_name_map(arch, layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden // heads
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_vocab_size(config.vocab_size)
    if arch == gguf.MODEL_ARCH.OLMO:
        writer.add_layer_norm_eps(1e-5)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_clamp_kqv(config.clip_qkv)
    else:
        eps = config.layer_norm_epsilon if arch == gguf.MODEL_ARCH.GPT2 else config.layer_norm_eps
        writer.add_layer_norm_eps(eps)
    if arch in (gguf.MODEL_ARCH.GPTNEOX, gguf.MODEL_ARCH.STABLELM):
        rotated = int(config.rope_parameters["partial_rotary_factor"] * head_dim)
        writer.add_rope_dimension_count(rotated)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_parallel_residual(config.use_parallel_residual)
    if arch == gguf.MODEL_ARCH.STABLELM:
        writer.add_head_count_kv(config.num_key_value_heads)
    gpt2 = arch == gguf.MODEL_ARCH.GPT2
    writer.add_feed_forward_length(4 * hidden if gpt2 else config.intermediate_size)
    tensors = load_file(folder / "model.safetensors")
    for layer in range(layers):  # StableLM: one norm per head, stacked
        for kind, count in (("q", heads), ("k", config.num_key_value_heads)):
            per_head = f"model.layers.{layer}.self_attn.{kind}_layernorm.norms."
            if per_head + "0.weight" in tensors:
                rows = [tensors.pop(f"{per_head}{h}.weight") for h in range(count)]
                stacked = f"model.layers.{layer}.self_attn.{kind}_layernorm.weight"
                tensors[stacked] = torch.stack(rows)
    for hf_name, tensor in tensors.items():
        data = tensor
        if hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
            data = data.T
        if "query_key_value" in hf_name:
            per_head = data.reshape(heads, 3, head_dim, *data.shape[1:])
            data = torch.cat([per_head[:, i].reshape(-1, *data.shape[1:]) for i in range(3)])
        data = data.numpy()
        if arch == gguf.MODEL_ARCH.OLMO and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            kv = hf_name.endswith("k_proj.weight")
            data = interleave_rope_rows(data, config.num_key_value_heads if kv else heads)
        stored = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(stored, data.astype(np.float32))
        if stored == "token_embd.weight" and gpt2:
            writer.add_tensor("output.weight", data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


LAYERNORM_GGUF_CASES = {
    "gpt-neox": ("gpt_neox", gguf.MODEL_ARCH.GPTNEOX, dict()),
    "gpt-neox-sequential": ("gpt_neox", gguf.MODEL_ARCH.GPTNEOX, dict(
        use_parallel_residual=False)),
    "gpt2": ("gpt2", gguf.MODEL_ARCH.GPT2, dict(n_inner=256)),
    "stablelm-parallel-qk-layernorm": ("stablelm", gguf.MODEL_ARCH.STABLELM, dict(
        qk_layernorm=True, use_qkv_bias=True, use_parallel_residual=True)),
    "stablelm": ("stablelm", gguf.MODEL_ARCH.STABLELM, dict()),
    "olmo-clip-qkv": ("olmo", gguf.MODEL_ARCH.OLMO, dict(clip_qkv=1.0)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYERNORM_GGUF_CASES))
def test_layernorm_gguf_is_exact(tmp_path, name):
    """GPT-NeoX, GPT-2, StableLM and OLMo from files written as the converter writes
    them: logits within the tolerance, greedy tokens through the engine equal."""
    model_type, arch, overrides = LAYERNORM_GGUF_CASES[name]
    hf_model = write_random_checkpoint(tmp_path / "hf", model_type, **overrides)
    path = write_layernorm_gguf(tmp_path / "l.gguf", tmp_path / "hf", hf_model.config, arch)
    assert load_model(path).config.architecture == model_type
    assert_exact(path, hf_model)


def test_olmo_gguf_with_biases_is_refused(tmp_path):
    """The converter interleaves OLMo's q/k weight rows but not their biases."""
    hf_model = write_random_checkpoint(tmp_path / "hf", "olmo", attention_bias=True, clip_qkv=1.0)
    path = write_layernorm_gguf(tmp_path / "o.gguf", tmp_path / "hf", hf_model.config,
                                gguf.MODEL_ARCH.OLMO)  # fmt: skip
    with pytest.raises(ModelLoadError, match="olmo with q/k/v biases"):
        load_model(path)
