"""GGUF files of the LayerNorm decoders (GPT-NeoX, GPT-2, StableLM, OLMo), read as
llama.cpp's converter writes them and llama.cpp runs them.

The converter stores q/k/v of GPT-NeoX and GPT-2 as one ``attn_qkv`` tensor, all q rows,
then k, then v (it reorders GPT-NeoX's per-head rows and transposes GPT-2's ``Conv1D``
matrices back), StableLM's per-head q/k norms stacked into ``attn_q_norm`` / ``attn_k_norm``
``[heads, head_dim]``, OLMo's q/k rows interleaved as Llama's. The rotated part of a
head is ``rope.dimension_count``; GPT-NeoX says ``use_parallel_residual``; a StableLM
layer without ``ffn_norm`` runs attention and MLP in parallel off one norm; OLMo's
``clip_qkv`` is ``attention.clamp_kqv``.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from typing import Any

from pagedllm.models.errors import ModelLoadError

# GGUF architecture -> our architecture.
LAYERNORM_GGUF_ARCHITECTURES = {
    "gptneox": "gpt_neox",
    "gpt2": "gpt2",
    "stablelm": "stablelm",
    "olmo": "olmo",
}
# GGUF architectures whose metadata may rotate only part of each head.
PARTIAL_ROTARY = ("gptneox", "stablelm")


def layernorm_fields(
    arch: str, value: Callable[[str, Any], Any], tensor_names: Set[str], head_dim: int
) -> dict[str, Any]:
    """The :class:`~pagedllm.models.config.ModelConfig` fields a LayerNorm GGUF sets
    beyond the Llama ones; ``value(key, default)`` reads metadata key ``<arch>.<key>``."""
    fields: dict[str, Any] = dict(
        attention_bias={"blk.0.attn_qkv.bias", "blk.0.attn_q.bias"} & tensor_names != set(),
        partial_rotary_factor=value("rope.dimension_count", head_dim) / head_dim,
    )
    if arch in ("gptneox", "gpt2"):
        fields["qkv_layout"] = "stacked"
    if arch == "gptneox":
        parallel = value("use_parallel_residual", None)
        if parallel is None:
            raise ModelLoadError("GGUF metadata gptneox.use_parallel_residual missing")
        fields["norm_layout"] = "parallel" if parallel else "pre"
    elif arch == "gpt2":
        fields["hidden_act"] = "gelu_pytorch_tanh"  # GPT-2's gelu_new
    elif arch == "stablelm":
        fields["norm_layout"] = "pre" if "blk.0.ffn_norm.weight" in tensor_names else (
            "parallel_shared"
        )
        fields["qk_norm"] = "layer_head" if "blk.0.attn_q_norm.weight" in tensor_names else None
    elif arch == "olmo":
        if fields["attention_bias"]:  # the converter interleaves q/k weight rows, not biases
            raise ModelLoadError("GGUF olmo with q/k/v biases is not implemented")
        clip = value("attention.clamp_kqv", None)
        fields["clip_qkv"] = None if clip is None else float(clip)
    return fields
