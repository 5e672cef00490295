"""Matrix products through oneDNN on a weight kept in oneDNN's own blocked layout.

torch's ``F.linear`` hands its GEMM the plain ``[out, in]`` matrix, which it repacks as
it multiplies, at every call. Reordered once at load time into oneDNN's blocked layout
(``mkldnn._reorder_linear_weight``, as torch.compile's CPU freezing does), a step's
products of the default model ran 2.3-3.3x faster in float32 and 1.2-2.0x in bfloat16
from 1 to 1,024 rows on a 2-core AMD EPYC Zen 5 (``benchmarks/linear.py``); on AMX
tiles oneDNN runs bfloat16 from that layout. The reordered weight is an opaque tensor:
its bytes live in oneDNN's memory, not in a storage of torch's, so it cannot be viewed,
sliced or moved (it stays out of the weight arena).
"""

from __future__ import annotations

import torch


def reorderable(weight: torch.Tensor) -> bool:
    """Whether torch's oneDNN takes ``weight`` in its blocked layout here: a CPU float32
    matrix, or bfloat16 where oneDNN multiplies bfloat16 (AVX-512 BF16 or AMX)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def reorder(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` in oneDNN's blocked layout (an opaque tensor, same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def onednn_linear(
    x: torch.Tensor, reordered: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T + bias`` for ``x`` ``[..., in]`` and a weight made by :func:`reorder`."""
    return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")
