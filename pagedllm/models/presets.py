"""Popular model shapes, stored as the fields of their Hugging Face ``config.json``.

Each preset holds the fields :meth:`ModelConfig.from_hf_dict` reads, with the values of
the model's published ``config.json`` (RoPE base and RMSNorm epsilon included, so that
``load_format="dummy"`` builds the real decoder; Qwen2's q/k/v biases follow from its
``model_type``), plus the published parameter count (the planner's weight bytes are
parameters x bytes per weight; a test checks the count against the shape). Max context is
the config's ``max_position_embeddings``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    """A named model shape: ``hf_config`` (config.json fields) and ``num_parameters``."""

    title: str
    hf_config: dict[str, Any]
    num_parameters: int


def _llama_like(
    model_type: str,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int,
    max_context: int,
    *,
    rope_theta: float,
    rms_norm_eps: float,
    tied: bool = False,
) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "intermediate_size": intermediate,
        "vocab_size": vocab,
        "max_position_embeddings": max_context,
        "tie_word_embeddings": tied,
        "rope_theta": rope_theta,
        "rms_norm_eps": rms_norm_eps,
    }


PRESETS: dict[str, Preset] = {
    "llama-2-7b": Preset(
        "Llama-2-7B",
        _llama_like(
            "llama", 32, 4096, 32, 32, 11008, 32000, 4096, rope_theta=1e4, rms_norm_eps=1e-5
        ),
        6_738_415_616,
    ),
    "llama-2-13b": Preset(
        "Llama-2-13B",
        _llama_like(
            "llama", 40, 5120, 40, 40, 13824, 32000, 4096, rope_theta=1e4, rms_norm_eps=1e-5
        ),
        13_015_864_320,
    ),
    "llama-3-8b": Preset(
        "Llama-3-8B",
        _llama_like(
            "llama", 32, 4096, 32, 8, 14336, 128256, 8192, rope_theta=5e5, rms_norm_eps=1e-5
        ),
        8_030_261_248,
    ),
    "llama-3-70b": Preset(
        "Llama-3-70B",
        _llama_like(
            "llama", 80, 8192, 64, 8, 28672, 128256, 8192, rope_theta=5e5, rms_norm_eps=1e-5
        ),
        70_553_706_496,
    ),
    "mistral-7b": Preset(
        "Mistral-7B-v0.1",
        _llama_like(
            "mistral", 32, 4096, 32, 8, 14336, 32000, 32768, rope_theta=1e4, rms_norm_eps=1e-5
        ),
        7_241_732_096,
    ),
    "qwen2-7b": Preset(
        "Qwen2-7B-Instruct",
        _llama_like(
            "qwen2", 28, 3584, 28, 4, 18944, 152064, 32768, rope_theta=1e6, rms_norm_eps=1e-6
        ),
        7_615_616_512,
    ),
    "qwen2.5-7b": Preset(
        "Qwen2.5-7B-Instruct",
        _llama_like(
            "qwen2", 28, 3584, 28, 4, 18944, 152064, 32768, rope_theta=1e6, rms_norm_eps=1e-6
        ),
        7_615_616_512,
    ),
    "gemma-3-1b": Preset(
        "Gemma-3-1B (five sliding-window layers of 512 tokens to each global one)",
        {
            "model_type": "gemma3_text",
            "num_hidden_layers": 26,
            "hidden_size": 1152,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "intermediate_size": 6912,
            "vocab_size": 262144,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
            "rope_theta": 1e6,
            "rope_local_base_freq": 1e4,
            "rms_norm_eps": 1e-6,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        999_885_952,
    ),
    "smollm2-135m": Preset(
        "SmolLM2-135M",
        _llama_like(
            "llama", 30, 576, 9, 3, 1536, 49152, 8192, rope_theta=1e5, rms_norm_eps=1e-5, tied=True
        ),
        134_515_008,
    ),
}
