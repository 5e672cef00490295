"""The config keys that shape a layer of a LayerNorm decoder (StableLM, GPT-NeoX, OLMo,
GPT-2, Falcon): which norms it has and where, how its q/k/v tensor is laid out, which
projections carry biases, how many key/value heads it has.

Each function turns one architecture's ``config.json`` (its keys already renamed to the
Hugging Face names, see :func:`renamed_keys`) into :class:`~pagedllm.models.config.ModelConfig`
fields; what the decoder does not compute is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pagedllm.models.architectures import ArchitectureSpec
from pagedllm.models.errors import ModelLoadError

# Values transformers assumes when a config.json omits the key.
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpt2": {"tie_word_embeddings": True},
    "falcon": {"tie_word_embeddings": True},
}
# Old GPT-NeoX configs name the rope's base and rotary fraction so.
LEGACY_ROPE_KEYS = (("rope_theta", "rotary_emb_base"), ("partial_rotary_factor", "rotary_pct"))


def renamed_keys(raw: Mapping[str, Any], spec: ArchitectureSpec) -> dict[str, Any]:
    """``raw`` with the architecture's own key names (``spec.config_keys``, and GPT-NeoX's
    legacy rope keys) copied to the Hugging Face names, over any value already there, and
    transformers' defaults for absent keys."""
    pairs = spec.config_keys + (LEGACY_ROPE_KEYS if raw.get("model_type") == "gpt_neox" else ())
    own = {hf: raw[name] for hf, name in pairs if name in raw}
    return {**DEFAULTS.get(str(raw.get("model_type")), {}), **raw, **own}


def _refuse(raw: Mapping[str, Any], key: str, allowed: Any) -> None:
    if raw.get(key, allowed) != allowed:
        raise ModelLoadError(f"config key {key}={raw[key]!r} is not implemented")


def _stablelm(raw: Mapping[str, Any]) -> dict[str, Any]:
    parallel = bool(raw.get("use_parallel_residual", False))
    return dict(
        norm_layout="parallel_shared" if parallel else "pre",
        qk_norm="layer_head" if raw.get("qk_layernorm", False) else None,
        attention_bias=bool(raw.get("use_qkv_bias", False)),
        output_bias=False,
    )


def _gpt_neox(raw: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", True))
    return dict(
        norm_layout="parallel" if raw.get("use_parallel_residual", True) else "pre",
        qkv_layout="per_head",
        attention_bias=bias,
        output_bias=bias,
        mlp_bias=True,
    )


def _olmo(raw: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    clip = raw.get("clip_qkv")
    clip = None if clip is None else float(clip)
    return dict(attention_bias=bias, output_bias=bias, clip_qkv=clip)


def _gpt2(raw: Mapping[str, Any]) -> dict[str, Any]:
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        _refuse(raw, key, False)
    _refuse(raw, "add_cross_attention", False)
    head_dim = raw["hidden_size"] // raw["num_attention_heads"]
    return dict(
        qkv_layout="stacked",
        attention_bias=True,
        output_bias=True,
        mlp_bias=True,
        intermediate_size=raw.get("intermediate_size") or 4 * raw["hidden_size"],
        attention_scale=head_dim**-0.5 if raw.get("scale_attn_weights", True) else 1.0,
    )


def _falcon(raw: Mapping[str, Any]) -> dict[str, Any]:
    _refuse(raw, "alibi", False)
    heads = raw["num_attention_heads"]
    new = bool(raw.get("new_decoder_architecture", False))
    parallel = bool(raw.get("parallel_attn", True))
    norms = raw.get("num_ln_in_parallel_attn") or (2 if new else 1)
    if new and not parallel:
        raise ModelLoadError("config key parallel_attn=False with new_decoder_architecture")
    if not new and norms != 1:
        raise ModelLoadError(
            f"config key num_ln_in_parallel_attn={norms} without new_decoder_architecture"
        )
    if new:
        kv_heads, layout = raw.get("num_kv_heads") or heads, "per_group"
    elif raw.get("multi_query", True):
        kv_heads, layout = 1, "stacked"
    else:
        kv_heads, layout = heads, "per_head"
    bias = bool(raw.get("bias", False))
    return dict(
        norm_layout=("parallel" if norms == 2 else "parallel_shared") if parallel else "pre",
        num_kv_heads=kv_heads,
        qkv_layout=layout,
        attention_bias=bias,
        output_bias=bias,
        mlp_bias=bias,
        intermediate_size=raw.get("intermediate_size") or 4 * raw["hidden_size"],
    )


VARIANTS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "stablelm": _stablelm,
    "gpt_neox": _gpt_neox,
    "olmo": _olmo,
    "gpt2": _gpt2,
    "falcon": _falcon,
}


def variant_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~pagedllm.models.config.ModelConfig` fields ``raw``'s architecture sets
    from its own keys (none for the Llama family)."""
    variant = VARIANTS.get(str(raw.get("model_type")))
    return variant(raw) if variant else {}
