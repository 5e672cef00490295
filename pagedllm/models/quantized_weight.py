"""Weights kept in a GGUF block format, as the file stores them, and run without expanding.

A row of ``in_features`` weights is ``in_features / block values`` blocks (32 weights per
block for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1; 256 for Q4_K, Q5_K, Q6_K) laid end to end, the
bytes of ggml's tensor unchanged; ``quant_linear`` (C++) decodes them in registers and
equals a float32 product over the dequantized weights up to float32 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from pagedllm.cpu.extension import dequantize_rows, quant_linear

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
"""The block formats the CPU kernels multiply without expanding."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight ``[out_features, in_features]`` as ``blocks``: uint8
    ``[out_features, in_features / block values * block bytes]``, each row the GGUF blocks
    of ``ggml_type`` (one of :data:`KERNEL_TYPES`)."""

    blocks: torch.Tensor
    ggml_type: Q
    in_features: int

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held: exactly the file's bytes of this tensor."""
        return self.blocks.numel()

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``indices`` ``[len(indices), in_features]``, only those decoded: an
        embedding lookup."""
        return dequantize_rows(self.blocks, int(self.ggml_type), self.in_features, indices)

    def dequantized(self) -> torch.Tensor:
        """The whole weight as float32 ``[out_features, in_features]``."""
        return self.rows(torch.arange(self.out_features))

    def reorder_rows(self, order: torch.Tensor) -> QuantizedWeight:
        """The weight whose row ``i`` is row ``order[i]`` of this one."""
        return QuantizedWeight(self.blocks[order].contiguous(), self.ggml_type, self.in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` in ``x``'s dtype (float32 or bfloat16 ``[rows, in]``)."""
        return quant_linear(x.contiguous(), self.blocks, int(self.ggml_type), bias)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The rows of ``parts`` one after another (q, k, v fused into one matrix); the parts
    must share a block format and ``in_features``."""
    first = parts[0]
    if any((p.ggml_type, p.in_features) != (first.ggml_type, first.in_features) for p in parts):
        raise ValueError(
            "cannot fuse quantized weights of different block formats or widths: "
            + ", ".join(f"{p.ggml_type.name} [{p.out_features}, {p.in_features}]" for p in parts)
        )
    return QuantizedWeight(torch.cat([p.blocks for p in parts]), first.ggml_type, first.in_features)
