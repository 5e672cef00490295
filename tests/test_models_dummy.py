"""``load_format="dummy"``: seeded random weights of a preset's or a config's shape.

The oracle for generation is transformers given the very same weights: the dummy
source is read by Hugging Face parameter name into transformers' model, so any wrong
shape, name, bias or RoPE constant shows as different greedy tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pagedllm import LLM, EngineConfig, SamplingParams
from pagedllm.attention.dense_backend import DenseAttentionBackend, dense_metadata
from pagedllm.cli import build_parser, main
from pagedllm.config_flags import config_from_flags
from pagedllm.models import ModelLoadError, load_model
from pagedllm.models.config import ModelConfig
from pagedllm.models.dummy import MATRIX_STD, dummy_weight_source, parameter_shapes
from pagedllm.models.presets import PRESETS

# Wide enough (head_dim 128, as in the presets) that std-0.02 weights make attention
# depend on positions: a wrong RoPE base changes the greedy tokens.
TINY = dict(
    num_hidden_layers=2,
    hidden_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=2048,
    vocab_size=256,
    max_position_embeddings=128,
    # no end-of-sequence token: transformers would otherwise bar it while min_new_tokens holds
    bos_token_id=None,
    eos_token_id=None,
)
TINY_CONFIGS = {
    "llama-untied": (LlamaConfig, LlamaForCausalLM, dict(model_type="llama", **TINY)),
    "qwen2-bias": (Qwen2Config, Qwen2ForCausalLM, dict(model_type="qwen2", rope_theta=1e6, **TINY)),
    # tied: each token's logits peak at itself under small random weights, so greedy
    # generation repeats the last token; used for the parameter names only
    "llama-tied": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(model_type="llama", tie_word_embeddings=True, **TINY),
    ),
}
# (layers, hidden, heads, KV heads, intermediate, vocab, context) as published.
PUBLISHED_SHAPES = {
    "llama-2-13b": (40, 5120, 40, 40, 13824, 32000, 4096),
    "qwen2.5-7b": (28, 3584, 28, 4, 18944, 152064, 32768),
    "llama-3-8b": (32, 4096, 32, 8, 14336, 128256, 8192),
}
PUBLISHED_PARAMETERS = {
    "llama-2-13b": 13_015_864_320,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3-8b": 8_030_261_248,
}


def write_config(folder, name: str):
    """``config.json`` of ``name`` in ``folder``; returns the folder."""
    (folder / "config.json").write_text(json.dumps(TINY_CONFIGS[name][2]))
    return folder


def transformers_with_dummy_weights(name: str):
    """transformers' float32 eager model holding the dummy weights of ``name`` (seed 0)."""
    config_class, model_class, raw = TINY_CONFIGS[name]
    fields = {k: v for k, v in raw.items() if k != "model_type"}
    model = model_class(config_class(**fields, attn_implementation="eager")).eval()
    ours = ModelConfig.from_hf_dict(raw)
    get = dummy_weight_source(ours, torch.float32, "cpu")
    expected = set(model.state_dict()) - ({"lm_head.weight"} if ours.tie_word_embeddings else set())
    assert set(parameter_shapes(ours)) == expected
    state = {name: get(name) for name in expected}
    if ours.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model


def test_parameter_names_are_transformers_names_with_tied_embeddings():
    reference = transformers_with_dummy_weights("llama-tied")
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("name", ["llama-untied", "qwen2-bias"])
def test_greedy_generation_equals_transformers_on_the_same_weights(tmp_path, name):
    llm = LLM(
        model=str(write_config(tmp_path, name)),
        load_format="dummy",
        dtype="float32",
        kv_cache_memory="16MiB",
        log_stats_interval=0,
    )
    assert llm.get_tokenizer() is None
    assert llm.llm_engine.loaded.source == tmp_path
    prompts = [[5, 17, 200, 3, 64, 9], [42, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    reference = transformers_with_dummy_weights(name)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert list(output.outputs[0].token_ids) == expected


def test_same_seed_same_weights_in_any_order_other_seed_other_weights():
    config = ModelConfig.from_hf_dict(TINY_CONFIGS["qwen2-bias"][2])
    names = list(parameter_shapes(config))
    first = dummy_weight_source(config, torch.bfloat16, "cpu", seed=3)
    again = dummy_weight_source(config, torch.bfloat16, "cpu", seed=3)
    other = dummy_weight_source(config, torch.bfloat16, "cpu", seed=4)
    weights = {name: first(name) for name in names}
    for name in reversed(names):
        assert torch.equal(again(name), weights[name])
        tensor = weights[name]
        assert tensor.dtype == torch.bfloat16 and tensor.shape == parameter_shapes(config)[name]
        if name.endswith("norm.weight"):
            assert torch.equal(tensor, torch.ones_like(tensor))
        else:
            assert not torch.equal(other(name), tensor)
    # independent per name: two matrices of one shape differ
    q0, q1 = (weights[f"model.layers.{i}.self_attn.q_proj.weight"] for i in (0, 1))
    assert not torch.equal(q0, q1)
    embed = weights["model.embed_tokens.weight"].float()
    assert abs(embed.mean()) < 0.1 * MATRIX_STD
    assert abs(embed.std() - MATRIX_STD) < 0.05 * MATRIX_STD


def test_loaded_decoders_with_the_default_seed_are_identical(tmp_path):
    folder = write_config(tmp_path, "llama-untied")
    first, second = (load_model(folder, torch.bfloat16, load_format="dummy") for _ in range(2))
    for a, b in zip(first.model.weights(), second.model.weights(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(PUBLISHED_SHAPES))
def test_big_preset_has_its_published_shape_and_count_without_allocating(name):
    loaded = load_model(name.upper(), torch.bfloat16, device="meta", load_format="dummy")
    c = loaded.config
    shape = (
        c.num_layers,
        c.hidden_size,
        c.num_heads,
        c.num_kv_heads,
        c.intermediate_size,
        c.vocab_size,
        c.max_position_embeddings,
    )
    assert shape == PUBLISHED_SHAPES[name]
    weights = loaded.model.weights()
    assert all(w.device.type == "meta" and w.dtype == torch.bfloat16 for w in weights)
    assert loaded.model.rotary.cos.device.type == "meta"
    assert sum(w.numel() for w in weights) == PUBLISHED_PARAMETERS[name]
    assert PRESETS[name].num_parameters == PUBLISHED_PARAMETERS[name]
    assert loaded.source.name == name and loaded.tokenizer is None


def test_presets_carry_rope_base_eps_and_qwen_biases():
    qwen = ModelConfig.from_hf_dict(PRESETS["qwen2.5-7b"].hf_config)
    assert (qwen.rope_theta, qwen.rms_norm_eps, qwen.attention_bias) == (1e6, 1e-6, True)
    assert not qwen.tie_word_embeddings
    llama3 = ModelConfig.from_hf_dict(PRESETS["llama-3-8b"].hf_config)
    assert (llama3.rope_theta, llama3.rms_norm_eps, llama3.attention_bias) == (5e5, 1e-5, False)
    llama2 = ModelConfig.from_hf_dict(PRESETS["llama-2-13b"].hf_config)
    assert (llama2.rope_theta, llama2.rms_norm_eps) == (1e4, 1e-5)


def test_bfloat16_dummy_logits_stay_finite_and_spread_through_40_layers(tmp_path):
    raw = dict(
        TINY_CONFIGS["llama-untied"][2],
        num_hidden_layers=40,
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=512,
    )
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(tmp_path, torch.bfloat16, load_format="dummy").model
    tokens = torch.arange(3, 35)
    hidden = model.forward(
        tokens, torch.arange(len(tokens)), DenseAttentionBackend(), dense_metadata([len(tokens)])
    )
    logits = model.compute_logits(hidden)
    assert torch.isfinite(logits).all()
    # a final-normed row times a std-0.02 head: spread about 0.02 * sqrt(hidden) = 0.32
    assert logits.std(dim=-1).min() > 0.05 and logits.std(dim=-1).max() < 1.0
    assert len(set(logits.argmax(dim=-1).tolist())) > 1


def test_unknown_preset_or_format_is_a_clear_error():
    with pytest.raises(ModelLoadError) as error:
        load_model("llama-9-1t", load_format="dummy")
    assert "not a preset" in str(error.value)
    assert all(name in str(error.value) for name in PRESETS)
    with pytest.raises(ModelLoadError, match="load_format"):
        load_model("llama-3-8b", load_format="pickle")
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        EngineConfig(load_format="pickle")


def test_cli_flag_reaches_the_engine_config():
    args = build_parser().parse_args(
        ["generate", "--prompt", "x", "--model", "llama-3-8b", "--load-format", "dummy"]
    )
    config = config_from_flags(args)
    assert (config.model, config.load_format) == ("llama-3-8b", "dummy")
    default_args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert config_from_flags(default_args).load_format == "auto"


def test_plan_takes_the_new_presets_by_option_or_position(capsys):
    for argv in (["--model", "llama-2-13b"], ["llama-2-13b"]):
        assert main(["plan", *argv, "--json", "--kv-dtype", "bfloat16"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["model"]["num_parameters"] == PUBLISHED_PARAMETERS["llama-2-13b"]
        # no grouped-query attention: 2 (K, V) x 40 layers x 40 heads x 128 x 2 bytes
        assert plan["kv_dtypes"][0]["kv_bytes_per_token"] == 2 * 40 * 40 * 128 * 2
    assert main(["plan", "llama-2-13b", "--model", "qwen2.5-7b"]) == 2
    assert "two models given" in capsys.readouterr().err


def test_default_model_shape_from_its_gguf_metadata_equals_its_preset():
    loaded = load_model(None, torch.bfloat16, device="meta", load_format="dummy")
    assert loaded.source.suffix == ".gguf" and loaded.tokenizer is None
    assert sum(w.numel() for w in loaded.model.weights()) == PRESETS["smollm2-135m"].num_parameters
    preset = ModelConfig.from_hf_dict(PRESETS["smollm2-135m"].hf_config)
    fields = (
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
        "rope_theta",
        "rms_norm_eps",
        "tie_word_embeddings",
        "attention_bias",
    )
    for field in fields:
        assert getattr(loaded.config, field) == pytest.approx(getattr(preset, field)), field
