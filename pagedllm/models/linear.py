"""The decoder's matrix products: torch's GEMM for many rows, the streaming kernel for few.

A decode step multiplies a few rows (one per running sequence) by every weight matrix,
so it is bound by reading the weights from memory. torch's GEMM reaches about a third of
the memory bandwidth there; ``streaming_linear`` (C++, AVX-512) reads each weight row
once and reaches about two thirds. Above :data:`STREAMING_MAX_ROWS` rows the product is
bound by arithmetic and torch's GEMM is faster (``benchmarks/linear.py`` measures the
crossover). Both accumulate in float32; results agree to float32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.cpu.extension import streaming_linear, streaming_linear_available

STREAMING_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 64}
"""Most rows of ``x`` for which the streaming kernel is used, per dtype: where it stops
being faster in ``benchmarks/linear.py`` (bfloat16 weights are half the bytes, so
torch's GEMM catches up sooner)."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]`` and ``weight`` ``[out, in]``."""
    max_rows = STREAMING_MAX_ROWS.get(x.dtype, 0)
    if (
        x.shape[0] <= max_rows
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.is_contiguous()
        and weight.is_contiguous()
        and streaming_linear_available()
    ):
        return streaming_linear(x, weight, bias)
    return F.linear(x, weight, bias)
