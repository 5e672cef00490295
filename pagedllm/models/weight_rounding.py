"""Rounding a checkpoint's matrices at load (``quantization="int8"`` or ``"q4_0"``), for
either loader: each matrix the decoder may keep quantized (projections, embedding, LM
head, rows a multiple of 32 weights) becomes blocks the CPU kernels multiply; a matrix a
GGUF file already stores in blocks is expanded to float32 first and rounded from there.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

from pagedllm.config import Quantization
from pagedllm.models.quantized_weight import Q, QuantizedWeight, int8_per_channel, is_quantizable

Source = Callable[[str], torch.Tensor | QuantizedWeight]


def q4_0_blocks(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` ``[out, in]`` (``in`` a multiple of 32) as Q4_0 blocks: per 32 weights
    a half-precision scale (the largest-magnitude weight / -8) and 4-bit codes, as ggml
    rounds them (the gguf package's quantizer)."""
    values = weight.float().numpy(force=True)
    blocks = gguf.quants.quantize(np.ascontiguousarray(values), Q.Q4_0)
    return QuantizedWeight(torch.from_numpy(blocks), Q.Q4_0, weight.shape[1])


ROUNDERS: dict[Quantization, Callable[[torch.Tensor], QuantizedWeight]] = {
    Quantization.INT8: int8_per_channel,
    Quantization.Q4_0: q4_0_blocks,
}


def rounded_source(read: Source, quantization: Quantization) -> Source:
    """``read`` with each matrix the decoder may keep quantized rounded as
    ``quantization`` (int8 or q4_0) says; other tensors as ``read`` gives them."""
    rounder = ROUNDERS[quantization]

    def read_rounded(name: str) -> torch.Tensor | QuantizedWeight:
        weight = read(name)
        if not is_quantizable(name):
            return weight
        if isinstance(weight, QuantizedWeight):
            weight = weight.dequantized()
        if weight.dim() == 2 and weight.shape[1] % 32 == 0:
            return rounder(weight)
        return weight

    return read_rounded
