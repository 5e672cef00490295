"""Rounding a checkpoint's matrices at load (``quantization="int8"`` or ``"q4_0"``), for
either loader: each matrix the decoder may keep quantized (projections, embedding, LM
head, rows a multiple of 32 weights) becomes blocks the CPU kernels multiply; a matrix a
GGUF file already stores in blocks is expanded to float32 first and rounded from there.

``q4_0`` rounds the projections to Q4_0 and the embedding and LM head to Q8_0, as
llama.cpp's quantizer keeps its output matrix at higher precision: on the default model
4-bit logits cost a Q4_0 self-draft a large share of its agreement with the model.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import torch

from pagedllm.config import Quantization
from pagedllm.models.quantized_weight import Q, QuantizedWeight, int8_per_channel, is_quantizable

Source = Callable[[str], torch.Tensor | QuantizedWeight]


def ggml_blocks(weight: torch.Tensor, kind: Q) -> QuantizedWeight:
    """``weight`` ``[out, in]`` (``in`` a multiple of 32) rounded to ``kind``'s blocks as
    ggml rounds them (the gguf package's quantizer)."""
    values = weight.float().numpy(force=True)
    blocks = gguf.quants.quantize(np.ascontiguousarray(values), kind)
    return QuantizedWeight(torch.from_numpy(blocks), kind, weight.shape[1])


def q4_0_blocks(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` as Q4_0 blocks: per 32 weights a half-precision scale (the
    largest-magnitude weight / -8) and 4-bit codes."""
    return ggml_blocks(weight, Q.Q4_0)


OUTPUT_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
"""The matrices ``q4_0`` keeps in 8 bits (Q8_0 blocks)."""


def rounder(quantization: Quantization, name: str) -> Callable[[torch.Tensor], QuantizedWeight]:
    """How ``quantization`` rounds the matrix ``name``."""
    if quantization is Quantization.INT8:
        return int8_per_channel
    if name.endswith(OUTPUT_NAMES):
        return lambda weight: ggml_blocks(weight, Q.Q8_0)
    return q4_0_blocks


def rounded_source(read: Source, quantization: Quantization) -> Source:
    """``read`` with each matrix the decoder may keep quantized rounded as
    ``quantization`` (int8 or q4_0) says; other tensors as ``read`` gives them."""

    def read_rounded(name: str) -> torch.Tensor | QuantizedWeight:
        weight = read(name)
        if not is_quantizable(name):
            return weight
        if isinstance(weight, QuantizedWeight):
            weight = weight.dequantized()
        if weight.dim() == 2 and weight.shape[1] % 32 == 0:
            return rounder(quantization, name)(weight)
        return weight

    return read_rounded
