"""The norms of every architecture (see ``ArchitectureSpec.norm``), each rounding like
transformers' module: RMSNorm (the C++ kernel where it runs), LayerNorm with weight and
bias, and OLMo's LayerNorm without weights (computed in float32)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.models.fused import rms_norm


def normalize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    eps: float,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Norm ``kind`` (``"rms"``, ``"layer"`` or ``"layer_plain"``) of every row of ``x``
    ``[rows, dim]`` over its last dimension; ``weight`` / ``bias`` ``[dim]`` where the
    kind has them, of ``dtype``, the result's (default ``x``'s). ``x`` may be float32
    under a narrower ``dtype`` (a float32 residual stream): it is then normed unrounded
    and the result rounded once."""
    dtype = dtype or x.dtype
    if kind == "rms":
        return rms_norm(x, weight, eps)
    if kind == "layer":
        if x.dtype != dtype:
            weight, bias = weight.float(), None if bias is None else bias.float()
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps).to(dtype)
    return F.layer_norm(x.float(), (x.shape[-1],), None, None, eps).to(dtype)


def layer_norm_per_head(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """StableLM's q/k LayerNorm: ``x`` ``[T, heads, head_dim]`` normed over ``head_dim``,
    each head times its own ``weight`` row (``[heads, head_dim]``), no bias."""
    return F.layer_norm(x, (x.shape[-1],), None, None, eps) * weight
