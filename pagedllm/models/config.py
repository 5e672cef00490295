"""ModelConfig: the shape of a decoder, normalised from any source.

Hugging Face ``config.json`` files and GGUF metadata name the same facts
differently; both are turned into one :class:`ModelConfig` here so the decoder
never looks at a source format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.models.architectures import (
    ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    ArchitectureSpec,
)
from pagedllm.models.config_variants import renamed_keys, variant_fields
from pagedllm.models.errors import ModelLoadError

# MLP activations the decoder computes, by their transformers names.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")
# transformers' other names of the same functions: GPT-2's "gelu_new" is the tanh form.
ACTIVATION_ALIASES = {"gelu_new": "gelu_pytorch_tanh"}
# Rope types the rotary tables compute (see pagedllm.models.rope).
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope", "freq_factors")

# Config keys of some architectures that change the math, with their neutral value; an
# architecture that does not read one of them refuses any other value.
MATH_KEYS = {
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "query_pre_attn_scalar": None,
    "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0,
    "attention_multiplier": None,
    "logits_scaling": 1.0,
    "num_local_experts": None,
    "num_experts": None,
    "use_qk_norm": False,
    "use_bidirectional_attention": False,
    "clip_qkv": None,
}


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of a decoder of one of :data:`SUPPORTED_ARCHITECTURES`.

    Invariants: ``num_heads % num_kv_heads == 0``; ``head_dim`` and :attr:`rotary_dim`
    are even; ``rope_scaling`` is ``None`` or a dict with a ``"rope_type"`` key (one of
    :data:`ROPE_TYPES`) and that type's parameters.
    ``rms_norm_eps``: the epsilon of every norm, RMSNorm or LayerNorm.
    ``attention_bias``: q/k/v projections have biases; ``output_bias``: the output
    projection too; ``mlp_bias``: gate/up/down projections have biases.
    ``norm_layout`` / ``qk_norm``: the architecture's (see
    :class:`~pagedllm.models.architectures.ArchitectureSpec`) unless the config changes
    them; ``None`` here means the architecture's.
    ``qkv_layout``: ``None`` (q, k and v stored apart, or Phi-3's fused rows) or the row
    order of one stored q/k/v tensor: ``"stacked"`` (all q heads, all k, all v),
    ``"per_head"`` (q, k, v of head 0, then of head 1, ...: GPT-NeoX) or ``"per_group"``
    (per key/value head: its query heads, then k, then v: Falcon's new decoder).
    ``partial_rotary_factor``: the leading fraction of each head that RoPE rotates.
    ``clip_qkv``: q, k and v are clamped to ``[-clip_qkv, clip_qkv]`` (OLMo).
    ``sliding_windows``: per layer, ``None`` (full causal attention) or ``W``: a query at
    position ``p`` sees keys at positions ``p - W + 1 .. p`` (transformers' rule
    ``kv > q - W``); empty when no layer slides.
    ``attention_scale``: multiplies ``q . k`` (``None``: ``head_dim ** -0.5``).
    ``attn_logit_softcap`` / ``final_logit_softcap``: ``c`` turns attention scores / final
    logits ``s`` into ``c * tanh(s / c)``. ``embedding_multiplier``,
    ``residual_multiplier`` (on each branch before its residual add) and
    ``logits_divisor`` (Granite's ``logits_scaling``) are plain factors.
    ``local_rope_theta`` / ``local_rope_scaling``: the rope of sliding-window layers when
    it differs from the global one (Gemma 3), else ``None``.
    ``sparse_layers``: per layer, whether its MLP is a mixture of ``num_experts`` experts
    of width ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token,
    weighted by router probabilities renormalised over them when ``moe_renormalize``;
    plus a shared expert of width ``shared_expert_intermediate_size`` when it is not 0.
    Empty for dense models.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    output_bias: bool = False
    mlp_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"
    attention_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0
    local_rope_theta: float | None = None
    local_rope_scaling: dict[str, Any] | None = None
    sparse_layers: tuple[bool, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    shared_expert_intermediate_size: int = 0
    norm_layout: str | None = None
    qk_norm: str | None = None
    qkv_layout: str | None = None
    partial_rotary_factor: float = 1.0
    clip_qkv: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.norm_layout is None:
            object.__setattr__(self, "norm_layout", self.spec.norm_layout)
        if self.qk_norm is None:
            object.__setattr__(self, "qk_norm", self.spec.qk_norm)
        if self.head_dim % 2 or self.rotary_dim % 2:
            raise ModelLoadError(
                f"head_dim={self.head_dim} and its rotated part {self.rotary_dim} must be even"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(
                f"hidden_act={self.hidden_act!r} is not implemented ({', '.join(ACTIVATIONS)})"
            )
        for scaling in (self.rope_scaling, self.local_rope_scaling):
            if scaling is not None and scaling["rope_type"] not in ROPE_TYPES:
                raise ModelLoadError(f"unsupported rope scaling type {scaling['rope_type']!r}")

    @property
    def spec(self) -> ArchitectureSpec:
        """The architecture's fixed parts."""
        return ARCHITECTURES[self.architecture]

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (0 without RoPE)."""
        if self.spec.positions != "rope":
            return 0
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def q_size(self) -> int:
        """Width of the query projection: ``num_heads * head_dim``."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (or value) projection: ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face ``config.json`` (old or new rope fields)."""
        architecture = raw.get("model_type", "<missing model_type>")
        if architecture not in SUPPORTED_ARCHITECTURES:
            found = raw.get("architectures") or architecture
            raise ModelLoadError(
                f"unsupported architecture {found!r} (model_type={architecture!r}); "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        spec = ARCHITECTURES[architecture]
        raw = renamed_keys(raw, spec)
        refuse_unimplemented_keys(raw, spec)
        num_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        rope_params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        local_theta, local_scaling = None, None
        if "full_attention" in rope_params:  # per layer type (Gemma 3)
            local = dict(rope_params.get("sliding_attention") or {})
            rope_params = rope_params["full_attention"]
            local_theta, local_scaling = _rope(local, raw, raw.get("rope_local_base_freq"))
        elif "rope_local_base_freq" in raw:
            local_theta = float(raw["rope_local_base_freq"])
        partial = _partial_rotary_factor(raw, rope_params, spec)
        rope_theta, rope_scaling = _rope(dict(rope_params), raw, raw.get("rope_theta"))
        query_scalar = raw.get("query_pre_attn_scalar")
        attention_scale = query_scalar**-0.5 if query_scalar else None
        if "attention_multiplier" in spec.math_keys:  # Granite: the scale itself, default 1
            attention_scale = float(raw.get("attention_multiplier", 1.0))
        bias = bool(raw.get("attention_bias", False))
        qkv_bias = spec.qkv_bias_always or bias
        if spec.qkv_bias_key:
            qkv_bias, bias = bool(raw.get(spec.qkv_bias_key, True)), False
        act = raw.get(spec.activation_key) or spec.default_activation
        if act == "gelu" and spec.gelu_means_tanh:
            act = "gelu_pytorch_tanh"
        act = ACTIVATION_ALIASES.get(act, act)
        eps = raw.get(spec.norm_eps_key) if spec.norm_eps_key else None
        eos = raw.get("eos_token_id")
        fields: dict[str, Any] = dict(
            architecture=architecture,
            num_layers=num_layers,
            hidden_size=raw["hidden_size"],
            num_heads=num_heads,
            num_kv_heads=(raw.get(spec.kv_heads_key) if spec.kv_heads_key else None) or num_heads,
            head_dim=head_dim,
            intermediate_size=raw.get("intermediate_size"),
            vocab_size=raw["vocab_size"],
            rms_norm_eps=float(spec.default_norm_eps if eps is None else eps),
            rope_theta=rope_theta,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            output_bias=not spec.qkv_bias_always and bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(raw, spec, num_layers),
            rope_scaling=rope_scaling,
            hidden_act=act,
            attention_scale=attention_scale,
            attn_logit_softcap=raw.get("attn_logit_softcapping"),
            final_logit_softcap=raw.get("final_logit_softcapping"),
            embedding_multiplier=float(raw.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(raw.get("residual_multiplier", 1.0)),
            logits_divisor=float(raw.get("logits_scaling", 1.0)),
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
            **_experts(raw, spec, num_layers),
            partial_rotary_factor=partial,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
        )
        return cls(**{**fields, **variant_fields(raw)})


def refuse_unimplemented_keys(raw: Mapping[str, Any], spec: ArchitectureSpec) -> None:
    """Raise :class:`ModelLoadError` naming a config key whose value changes the math in a
    way no part of the decoder implements."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    for params in rope.values() if "full_attention" in rope else [rope]:
        partial = _partial_rotary_factor(raw, params or {}, spec)
        if partial != 1.0 and not spec.partial_rotary:
            raise ModelLoadError(f"partial_rotary_factor={partial} is not implemented (only 1.0)")
    for key, neutral in MATH_KEYS.items():
        if key not in spec.math_keys and raw.get(key, neutral) not in (neutral, None):
            raise ModelLoadError(f"config key {key}={raw[key]!r} is not implemented")


def _partial_rotary_factor(
    raw: Mapping[str, Any], params: Mapping[str, Any], spec: ArchitectureSpec
) -> float:
    """The rotated fraction of each head: the rope parameters', else the top-level key's,
    else transformers' default (a quarter for the architectures that read it)."""
    default = 0.25 if spec.partial_rotary else 1.0
    return float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default)))


def _rope(
    params: dict[str, Any], raw: Mapping[str, Any], theta: float | None
) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from one rope parameter dict (``theta``: the value
    outside it, if any)."""
    rope_theta = float(params.pop("rope_theta", theta if theta is not None else 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return rope_theta, None
    if "original_max_position_embeddings" in raw:  # Phi-3 keeps it at the top level
        params.setdefault(
            "original_max_position_embeddings", raw["original_max_position_embeddings"]
        )
    return rope_theta, {**params, "rope_type": rope_type}


def _experts(raw: Mapping[str, Any], spec: ArchitectureSpec, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelConfig` (none for dense models)."""
    if spec.moe is None:
        return {}
    if spec.moe == "mixtral":
        return dict(
            sparse_layers=(True,) * num_layers,
            num_experts=raw["num_local_experts"],
            num_experts_per_tok=raw["num_experts_per_tok"],
            moe_intermediate_size=raw["intermediate_size"],
        )
    # Qwen3-MoE saves the count as num_local_experts, an alias of num_experts.
    counts = {raw[key] for key in ("num_experts", "num_local_experts") if key in raw}
    if len(counts) != 1:
        raise ModelLoadError(f"num_experts / num_local_experts missing or differing: {counts}")
    experts, step = counts.pop(), raw.get("decoder_sparse_step", 1)
    dense = set(raw.get("mlp_only_layers") or ())
    return dict(
        sparse_layers=tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers)
        ),
        num_experts=experts,
        num_experts_per_tok=raw["num_experts_per_tok"],
        moe_intermediate_size=raw["moe_intermediate_size"],
        moe_renormalize=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            raw.get("shared_expert_intermediate_size", 0) if spec.shared_expert else 0
        ),
    )


def _sliding_windows(
    raw: Mapping[str, Any], spec: ArchitectureSpec, num_layers: int
) -> tuple[int | None, ...]:
    """Each layer's window as transformers reads the config (see
    :attr:`ArchitectureSpec.window_rule`); empty when no layer slides."""
    window = raw.get("sliding_window", spec.default_window)
    if spec.window_rule is None or window is None:
        return ()
    if spec.window_rule == "all":
        return (window,) * num_layers
    if spec.window_rule == "qwen":
        if not raw.get("use_sliding_window", False):
            return ()
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
    elif spec.window_rule == "qwen2_moe":
        if not raw.get("use_sliding_window", False):
            return ()
        layer_types = raw.get("layer_types") or [
            "sliding_attention"
            if (i + 1) % 2 and i < raw.get("max_window_layers", 28)
            else "full_attention"
            for i in range(num_layers)
        ]
    else:
        pattern = raw.get("sliding_window_pattern", spec.window_pattern)
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(num_layers)
        ]
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return windows if any(w is not None for w in windows) else ()


def _as_id_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, int):
        return (ids,)
    return tuple(ids)
