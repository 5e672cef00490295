"""Gemma 2 and Gemma 3 GGUF metadata, read as llama.cpp reads it.

llama.cpp's converter does not write Gemma's ``query_pre_attn_scalar`` nor its layer
pattern: llama.cpp scales queries by ``(hidden / heads) ** -0.5`` for the 27B models
(known by their layer count) and ``head_dim ** -0.5`` otherwise, slides every even layer
of Gemma 2 and five layers of every six of Gemma 3, and rotates Gemma 3's sliding layers
with base 10000 unscaled. Gemma 2's soft-caps default to 50 (attention) and 30 (logits)
when the file holds none; Gemma 3 with a window applies no soft-cap at all, so a file
holding one is refused, as is a Gemma 3 file without a window (llama.cpp then runs it
another way).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedllm.models.errors import ModelLoadError

GEMMA_GGUF_ARCHITECTURES = ("gemma2", "gemma3")
# The layer count of each architecture's 27B model, whose query scale differs.
LAYERS_OF_27B = {"gemma2": 46, "gemma3": 62}
# Every n-th layer attends globally, the others through the window.
GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
GEMMA3_LOCAL_ROPE_BASE = 10000.0


def gemma_fields(
    arch: str,
    value: Callable[[str, Any], Any],
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    head_dim: int,
) -> dict[str, Any]:
    """The :class:`~pagedllm.models.config.ModelConfig` fields of a ``gemma2`` or
    ``gemma3`` GGUF; ``value(key, default)`` reads metadata key ``<arch>.<key>``."""
    window = value("attention.sliding_window", 4096 if arch == "gemma2" else None)
    if not window:
        raise ModelLoadError(f"GGUF {arch} without attention.sliding_window is not implemented")
    every = GLOBAL_EVERY[arch]
    scale_dim = hidden_size // num_heads if num_layers == LAYERS_OF_27B[arch] else head_dim
    fields: dict[str, Any] = dict(
        sliding_windows=tuple(window if (i + 1) % every else None for i in range(num_layers)),
        attention_scale=scale_dim**-0.5,
    )
    if arch == "gemma2":
        fields["attn_logit_softcap"] = float(value("attn_logit_softcapping", 50.0))
        fields["final_logit_softcap"] = float(value("final_logit_softcapping", 30.0))
        return fields
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if value(key, None) is not None:
            raise ModelLoadError(f"GGUF metadata {arch}.{key} is not implemented")
    fields["local_rope_theta"] = GEMMA3_LOCAL_ROPE_BASE
    return fields
