"""The interface between a model's attention layers and the KV storage.

A model never touches K/V storage itself: each attention layer hands its freshly
projected (and rotated) q, k, v to an :class:`AttentionBackend`, which stores k and v
for later steps and returns the attention output for the query rows.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores new K/V and computes causal attention over a flattened batch.

    Shapes: ``q`` ``[num_tokens, num_q_heads, head_dim]``; ``k`` and ``v``
    ``[num_tokens, num_kv_heads, head_dim]``; the result has ``q``'s shape and dtype.
    ``num_q_heads`` is a multiple of ``num_kv_heads`` (grouped-query attention).
    The softmax scale is ``scale`` (usually ``head_dim ** -0.5``).
    """

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...
