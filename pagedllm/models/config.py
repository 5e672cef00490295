"""ModelConfig: the shape of a Llama-family decoder, normalised from any source.

Hugging Face ``config.json`` files and GGUF metadata name the same facts
differently; both are turned into one :class:`ModelConfig` here so the decoder
never looks at a source format.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedllm.models.errors import ModelLoadError

# Hugging Face ``model_type`` values the Llama decoder runs unchanged.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and constants of a Llama-family decoder.

    Invariants: ``num_heads % num_kv_heads == 0``; ``head_dim`` is even;
    ``rope_scaling`` is ``None`` or a dict with a ``"rope_type"`` key
    (``"linear"``, ``"llama3"`` or ``"freq_factors"``) and that type's parameters.
    ``attention_bias``: q/k/v projections have biases; ``output_bias``: the output
    projection too; ``mlp_bias``: gate/up/down projections have biases.
    ``sliding_windows``: per layer, ``None`` (full causal attention) or ``W``: a query at
    position ``p`` sees keys at positions ``p - W + 1 .. p`` (transformers' rule
    ``kv > q - W``); empty when no layer slides.
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
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim={self.head_dim} must be even for RoPE")

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
        refuse_unimplemented_keys(raw)
        num_heads = raw["num_attention_heads"]
        num_layers = raw["num_hidden_layers"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            num_layers=num_layers,
            hidden_size=raw["hidden_size"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            intermediate_size=raw["intermediate_size"],
            vocab_size=raw["vocab_size"],
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in attention_bias.
            attention_bias=architecture == "qwen2" or bool(raw.get("attention_bias", False)),
            output_bias=architecture != "qwen2" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_windows=_sliding_windows(raw, architecture, num_layers),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
        )


# Config keys of other architectures that change the math; a Llama-family config that
# sets one of them to anything but its neutral value is refused rather than ignored.
FOREIGN_MATH_KEYS = {
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
}


def refuse_unimplemented_keys(raw: Mapping[str, Any]) -> None:
    """Raise :class:`ModelLoadError` naming a config key whose value changes the math in a
    way no part of the decoder implements."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"hidden_act={act!r} is not implemented (only 'silu')")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor={partial} is not implemented (only 1.0)")
    for key, neutral in FOREIGN_MATH_KEYS.items():
        if raw.get(key, neutral) != neutral:
            raise ModelLoadError(f"config key {key}={raw[key]!r} is not implemented")


def _sliding_windows(
    raw: Mapping[str, Any], architecture: str, num_layers: int
) -> tuple[int | None, ...]:
    """Each layer's window as transformers reads the config: Mistral slides every layer
    (4096 when the key is absent); Qwen2 only with ``use_sliding_window``, on the layers
    ``layer_types`` marks, else those from ``max_window_layers`` (default 28) on."""
    if architecture == "mistral":
        window = raw.get("sliding_window", 4096)
        return () if window is None else (window,) * num_layers
    if architecture == "qwen2" and raw.get("use_sliding_window", False):
        window = raw.get("sliding_window", 4096)
        if window is None:
            return ()
        layer_types = raw.get("layer_types") or [
            "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention"
            for i in range(num_layers)
        ]
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return ()


def _as_id_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, int):
        return (ids,)
    return tuple(ids)
