"""A :class:`ModelConfig` written back as a Hugging Face ``config.json``.

Clients that read a model's config from its tokenizer folder (vLLM-based tools load
``AutoConfig`` from it) get the shape, context length, rope, sliding windows, experts
and special token ids under transformers' names for the architecture. The inverse of
:meth:`ModelConfig.from_hf_dict` for the Llama-like architectures (``from_hf_dict`` of
the result gives the config back); the layout switches of the LayerNorm decoders
(:mod:`pagedllm.models.config_variants`) are not written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagedllm.models.config import ModelConfig

# ModelConfig fields written only when they differ from their neutral value, by the
# config key that carries them.
_SCALES = {
    "embedding_multiplier": "embedding_multiplier",
    "residual_multiplier": "residual_multiplier",
    "logits_divisor": "logits_scaling",
    "attn_logit_softcap": "attn_logit_softcapping",
    "final_logit_softcap": "final_logit_softcapping",
    "clip_qkv": "clip_qkv",
}


def causal_lm_class(architecture: str) -> str | None:
    """transformers' causal-LM class name for ``model_type`` ``architecture``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(architecture)


def hf_config_dict(config: ModelConfig) -> dict[str, Any]:
    """``config`` as the fields of a ``config.json`` (JSON-serialisable)."""
    spec = config.spec
    raw: dict[str, Any] = {
        "model_type": config.architecture,
        "architectures": [name] if (name := causal_lm_class(config.architecture)) else [],
        "num_hidden_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        spec.activation_key: config.hidden_act,
        "mlp_bias": config.mlp_bias,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": _ids(config.eos_token_ids),
        **_attention_bias(config),
        **_rope(config),
        **_windows(config),
        **_experts(config),
        **{key: value for key, value in _scales(config).items() if value is not None},
    }
    if spec.kv_heads_key:
        raw[spec.kv_heads_key] = config.num_kv_heads
    if spec.norm_eps_key:
        raw[spec.norm_eps_key] = config.rms_norm_eps
    for hf_name, own_name in spec.config_keys:
        if hf_name in raw:
            raw[own_name] = raw.pop(hf_name)
    return raw


def _ids(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _attention_bias(config: ModelConfig) -> dict[str, bool]:
    """The bias switches: ``attention_bias`` gives q/k/v and o biases, except where q/k/v
    always have them (Qwen2) or have their own key (Qwen2-MoE)."""
    spec = config.spec
    if spec.qkv_bias_key:
        return {spec.qkv_bias_key: config.attention_bias}
    if spec.qkv_bias_always:
        return {"attention_bias": config.output_bias}
    return {"attention_bias": config.attention_bias}


def _rope(config: ModelConfig) -> dict[str, Any]:
    """The rope base and scaling; a GGUF's per-frequency factors (``freq_factors``) have
    no transformers form and are left out."""
    rope: dict[str, Any] = {"rope_theta": config.rope_theta}
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] != "freq_factors":
        rope["rope_scaling"] = dict(scaling)
    if config.local_rope_theta is not None:
        rope["rope_local_base_freq"] = config.local_rope_theta
    if config.partial_rotary_factor != 1.0 or config.spec.partial_rotary:
        rope["partial_rotary_factor"] = config.partial_rotary_factor
    return rope


def _windows(config: ModelConfig) -> dict[str, Any]:
    """Sliding windows by the architecture's rule; ``sliding_window`` null when no layer
    slides (the key's absence would mean the architecture's default window)."""
    rule, windows = config.spec.window_rule, config.sliding_windows
    if rule is None:
        return {}
    switch = {"use_sliding_window": bool(windows)} if rule.startswith("qwen") else {}
    if not windows:
        return {"sliding_window": None, **switch}
    fields = {"sliding_window": max(w for w in windows if w is not None), **switch}
    if rule != "all":
        fields["layer_types"] = [
            "full_attention" if w is None else "sliding_attention" for w in windows
        ]
    return fields


def _experts(config: ModelConfig) -> dict[str, Any]:
    moe = config.spec.moe
    if moe is None:
        return {}
    if moe == "mixtral":
        return {
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "intermediate_size": config.moe_intermediate_size,
        }
    return {
        "num_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.moe_renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i, sparse in enumerate(config.sparse_layers) if not sparse],
        "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
    }


def _scales(config: ModelConfig) -> dict[str, Any]:
    """The numbers some architectures read (:attr:`ArchitectureSpec.math_keys`), and
    the attention scale in the architecture's form (Gemma's ``query_pre_attn_scalar``,
    Granite's ``attention_multiplier``)."""
    neutral = ModelConfig.__dataclass_fields__
    values = {
        key: getattr(config, name)
        for name, key in _SCALES.items()
        if getattr(config, name) != neutral[name].default
    }
    scale, keys = config.attention_scale, config.spec.math_keys
    if scale is not None and "attention_multiplier" in keys:
        values["attention_multiplier"] = scale
    elif scale is not None and "query_pre_attn_scalar" in keys:
        values["query_pre_attn_scalar"] = round(scale**-2)  # an integer in transformers
    return values


def write_hf_config(folder: Path, config: ModelConfig) -> Path:
    """Write ``folder/config.json`` describing ``config``; returns its path."""
    path = Path(folder) / "config.json"
    path.write_text(json.dumps(hf_config_dict(config), indent=2) + "\n", encoding="utf-8")
    return path
