"""Architectures beyond the Llama family, each exact against transformers (float32,
eager): logits within ``LOGITS_TOLERANCE`` (see ``transformers_oracle``) and greedy tokens
equal for 3 prompts x 32 tokens, on tiny random checkpoints transformers writes here.

Each configuration turns on what makes the architecture differ, at values where a
mistake shows: soft-caps small enough that tanh bends the scores, windows shorter than
the sequences, multipliers away from 1, a local rope base that differs from the global
one."""

from __future__ import annotations

import math

import pytest
from transformers_oracle import (
    PROMPTS,
    assert_exact,
    engine_greedy,
    reference_greedy,
    write_random_checkpoint,
)

from pagedllm.models import load_model

SHORT = [1.0 + i / 8 for i in range(8)]  # longrope factors for head_dim 16
ARCHITECTURES = {
    "qwen3": ("qwen3", dict(head_dim=16)),
    "gemma": ("gemma", dict(head_dim=16)),
    "gemma2": ("gemma2", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=10.0)),
    "gemma3-text": ("gemma3_text", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "olmo2": ("olmo2", dict()),
    "granite": ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                attention_multiplier=0.1, logits_scaling=2.0)),
    "phi3-longrope-window": ("phi3", dict(
        sliding_window=12, original_max_position_embeddings=256,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": SHORT,
                         "long_factor": [4.0] * 8, "original_max_position_embeddings": 256})),
    "mixtral-window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                       sliding_window=12)),
    "qwen2-moe-shared-expert": ("qwen2_moe", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3-moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32, norm_topk_prob=True)),
    # LayerNorm decoders. Rotary on a quarter of each head by default (StableLM, NeoX).
    "stablelm-qk-layernorm": ("stablelm", dict(qk_layernorm=True, use_qkv_bias=True)),
    "stablelm-parallel": ("stablelm", dict(use_parallel_residual=True)),
    "gpt-neox": ("gpt_neox", dict()),
    "gpt-neox-sequential-half-rotary": ("gpt_neox", dict(
        use_parallel_residual=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5})),
    "olmo-clip-qkv": ("olmo", dict(clip_qkv=1.0, attention_bias=True)),
    "gpt2": ("gpt2", dict(n_inner=128)),
    "falcon-new-decoder": ("falcon", dict(new_decoder_architecture=True, num_kv_heads=2,
                                          ffn_hidden_size=128, bias=True)),
    "falcon-new-decoder-one-norm": ("falcon", dict(
        new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=1,
        ffn_hidden_size=128)),
    "falcon-multi-query": ("falcon", dict(ffn_hidden_size=128)),
    "falcon-sequential": ("falcon", dict(multi_query=False, parallel_attn=False, bias=True,
                                         ffn_hidden_size=128, tie_word_embeddings=False)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_architecture_is_exact(tmp_path, name):
    model_type, overrides = ARCHITECTURES[name]
    reference = write_random_checkpoint(tmp_path, model_type, **overrides)
    assert_exact(tmp_path, reference)


def test_gemma3_layers_alternate_windows_and_ropes(tmp_path):
    model_type, overrides = ARCHITECTURES["gemma3-text"]
    write_random_checkpoint(tmp_path, model_type, **overrides)
    model = load_model(tmp_path).model
    assert [layer.attention.sliding_window for layer in model.layers] == [8, None]
    assert [layer.local_rope for layer in model.layers] == [True, False]
    assert model.config.local_rope_theta == 1e4 and model.config.rope_theta == 1e6


def test_gpt_neox_legacy_rope_keys_are_read_as_transformers_reads_them(tmp_path):
    """Pythia-era configs name the rotated fraction ``rotary_pct`` and the base
    ``rotary_emb_base``: transformers reloads such a config with both, and so do we."""
    import json

    from transformers import AutoModelForCausalLM

    rope = {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5}
    write_random_checkpoint(tmp_path, "gpt_neox", rope_parameters=rope)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["rope_parameters"]
    legacy = dict(raw, rotary_pct=0.5, rotary_emb_base=500)
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    config = load_model(tmp_path).config
    assert (config.partial_rotary_factor, config.rope_theta, config.rotary_dim) == (0.5, 500.0, 8)
    assert_exact(tmp_path, reference.eval())


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_dummy_shapes_are_the_checkpoint_shapes(tmp_path, name):
    """``load_format="dummy"`` makes exactly the tensors, and shapes, transformers saves."""
    import json

    from safetensors import safe_open

    from pagedllm.models import ModelConfig
    from pagedllm.models.dummy import parameter_shapes

    model_type, overrides = ARCHITECTURES[name]
    write_random_checkpoint(tmp_path, model_type, **overrides)
    config = ModelConfig.from_hf_dict(json.loads((tmp_path / "config.json").read_text()))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        saved = {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}  # noqa: SIM118
    assert parameter_shapes(config) == saved


@pytest.mark.parametrize(
    "name",
    ["gemma2", "olmo2", "qwen2-moe-shared-expert", "stablelm-qk-layernorm", "gpt-neox",
     "olmo-clip-qkv", "gpt2", "falcon-new-decoder", "falcon-sequential"],
)  # fmt: skip
def test_planner_counts_every_checkpoint_parameter(tmp_path, name):
    """Experts, q/k norms, extra norms, LayerNorm biases and GPT-2's position embeddings
    are all weights the planner must hold."""
    from safetensors import safe_open

    from pagedllm.plan.model_shape import resolve_model

    model_type, overrides = ARCHITECTURES[name]
    write_random_checkpoint(tmp_path, model_type, **overrides)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as handle:
        shapes = [handle.get_slice(key).get_shape() for key in handle.keys()]  # noqa: SIM118
    assert resolve_model(str(tmp_path)).num_parameters == sum(math.prod(s) for s in shapes)


@pytest.mark.parametrize(
    ("name", "kv_heads"),
    [("falcon-multi-query", 1), ("falcon-new-decoder", 2), ("falcon-sequential", 4),
     ("gpt-neox", 4), ("gpt2", 4), ("stablelm-parallel", 2)],
)  # fmt: skip
def test_planner_counts_the_kv_heads_a_layer_stores(tmp_path, name, kv_heads):
    """K/V bytes per token: Falcon's multi-query layers store one head, its new decoder one
    per group; GPT-NeoX and GPT-2 one per query head, whatever ``num_key_value_heads`` the
    config carries (the test's shape sets 2, which they ignore)."""
    from pagedllm.plan.capacity import KV_DTYPES, kv_bytes_per_token
    from pagedllm.plan.model_shape import resolve_model

    model_type, overrides = ARCHITECTURES[name]
    write_random_checkpoint(tmp_path, model_type, **overrides)
    config = resolve_model(str(tmp_path)).config
    layers, head_dim, float32_bytes = 2, 16, 4
    expected = layers * 2 * kv_heads * head_dim * float32_bytes
    assert kv_bytes_per_token(config, KV_DTYPES["float32"]) == expected


@pytest.mark.triton
def test_gemma2_over_the_triton_backend_is_exact(tmp_path, monkeypatch):
    """Sliding windows and attention soft-caps in the Triton kernels, through the engine
    (under Triton's interpreter without CUDA): greedy tokens equal transformers'."""
    pytest.importorskip("triton")
    import pagedllm.engine.model_worker as model_worker
    from pagedllm.attention.triton_backend import TritonAttentionBackend

    model_type, overrides = ARCHITECTURES["gemma2"]
    reference = write_random_checkpoint(tmp_path, model_type, **overrides)
    built = []

    def triton_backend(kv_cache, sdpa_min_rows=None):  # the SDPA option is the CPU kernel's
        built.append(TritonAttentionBackend(kv_cache))
        return built[-1]

    monkeypatch.setattr(model_worker, "attention_backend_for", triton_backend)
    expected = [reference_greedy(reference, p, 12) for p in PROMPTS]
    assert engine_greedy(tmp_path, new_tokens=12, block_size=4) == expected
    assert built


@pytest.mark.parametrize(("name", "capturable"), [("qwen3", True), ("qwen3-moe", False)])
def test_only_models_without_host_reads_are_captured_in_cuda_graphs(tmp_path, name, capturable):
    """Mixture-of-experts routing reads each expert's token count on the host, which a
    CUDA graph cannot replay: such models decode eagerly on CUDA."""
    model_type, overrides = ARCHITECTURES[name]
    write_random_checkpoint(tmp_path, model_type, **overrides)
    assert load_model(str(tmp_path)).model.supports_cuda_graphs is capturable
