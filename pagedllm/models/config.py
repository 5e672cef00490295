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
        num_heads = raw["num_attention_heads"]
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            num_layers=raw["num_hidden_layers"],
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
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(eos),
        )


def _as_id_tuple(ids: int | list[int] | None) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, int):
        return (ids,)
    return tuple(ids)
