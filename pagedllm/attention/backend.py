"""The interface between a model's attention layers and the KV storage.

A model never touches K/V storage itself: each attention layer hands its freshly
projected (and rotated) q, k, v to an :class:`AttentionBackend`, which stores k and v
for later steps and returns the attention output for the query rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer attends (layers of one model may differ, e.g. Gemma's alternating
    sliding and global layers).

    ``scale``: multiplies ``q . k`` (usually ``head_dim ** -0.5``). ``sliding_window``
    ``W`` (tokens) or ``None``: a query at position ``p`` sees keys ``p - W + 1 .. p``
    only. ``logit_softcap`` ``c`` or ``None``: scaled scores ``s`` become
    ``c * tanh(s / c)`` before the mask and softmax.
    """

    scale: float
    sliding_window: int | None = None
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0 or None, got {self.logit_softcap}")


class AttentionBackend(Protocol):
    """Stores new K/V and computes causal attention over a flattened batch.

    Shapes: ``q`` ``[num_tokens, num_q_heads, head_dim]``; ``k`` and ``v``
    ``[num_tokens, num_kv_heads, head_dim]``; the result has ``q``'s shape and dtype.
    ``num_q_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention).
    ``options`` says how the layer attends (scale, sliding window, soft-cap).
    """

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor: ...
