"""Quantized weights reordered once at load for the bfloat16 kernels: the blocks of 16
output features side by side.

GGUF stores a weight row by row; :class:`InterleavedWeight` holds the same blocks with
each group of 16 rows transposed at 2-byte granularity (``quant_x16.cpp`` describes the
layout), so that one vector holds a pair of weights of 16 outputs and one block's 16
scales. A decode step then multiplies without per-output reductions or scalar scale
handling. Bytes held: the file's, plus zero blocks completing the last group.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from pagedllm.cpu.extension import dequantize_rows, quant_linear_x16, quant_x16_supports
from pagedllm.kv.capacity import cdiv
from pagedllm.models.quantized_weight import Q, QuantizedWeight, pad_rows

GROUP_ROWS = 16
"""Output features per interleaved group."""


def interleavable(weight: QuantizedWeight) -> bool:
    """Whether the interleaved kernels run ``weight``'s block format on this CPU."""
    return quant_x16_supports(int(weight.ggml_type))


@dataclass(frozen=True)
class InterleavedWeight:
    """A weight ``[out_features, in_features]`` of ``ggml_type`` blocks as uint8
    ``[ceil(out_features / 16), in_features / block values * block bytes * 16]``: for
    group ``g`` and block column ``b``, the 2-byte units ``u`` of row ``16 g + o``'s block
    at unit index ``(b * units + u) * 16 + o``. ``int8_activations``: products quantize
    their input to int8 per block of 32 values (see
    :mod:`pagedllm.models.activation_quantization`) instead of multiplying it exactly."""

    blocks: torch.Tensor
    ggml_type: Q
    in_features: int
    out_features: int
    int8_activations: bool = False

    @classmethod
    def interleave(cls, weight: QuantizedWeight) -> InterleavedWeight:
        rows, groups = weight.out_features, cdiv(weight.out_features, GROUP_ROWS)
        blocks = pad_rows(weight, groups * GROUP_ROWS).blocks
        units = blocks.view(torch.int16).view(groups, GROUP_ROWS, *_unit_shape(weight))
        grouped = units.permute(0, 2, 3, 1).contiguous().view(torch.uint8)
        return cls(grouped.view(groups, -1), weight.ggml_type, weight.in_features, rows)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def row_blocks(self, indices: torch.Tensor) -> torch.Tensor:
        """The GGUF blocks of rows ``indices``: uint8 ``[len(indices), row bytes]``."""
        units = self.blocks.view(torch.int16).view(len(self.blocks), *_unit_shape(self), -1)
        picked = units[indices // GROUP_ROWS, :, :, indices % GROUP_ROWS]
        return picked.contiguous().view(torch.uint8).view(len(indices), -1)

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``indices`` ``[len(indices), in_features]``: an embedding lookup."""
        blocks = self.row_blocks(indices)
        every = torch.arange(len(indices))
        return dequantize_rows(blocks, int(self.ggml_type), self.in_features, every)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, float_output: bool = False
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` in bfloat16 for bfloat16 ``x`` ``[rows, in]``; with
        ``float_output``, the float32 sums unrounded."""
        return quant_linear_x16(
            x.contiguous(), self.blocks, int(self.ggml_type), self.out_features, bias,
            self.int8_activations, float_output,
        )  # fmt: skip


BlockWeight = QuantizedWeight | InterleavedWeight
"""A weight kept in GGUF blocks, in the file's row order or interleaved."""


def _unit_shape(weight: QuantizedWeight | InterleavedWeight) -> tuple[int, int]:
    """(blocks per row, 2-byte units per block)."""
    values, block_bytes = gguf.GGML_QUANT_SIZES[weight.ggml_type]
    return weight.in_features // values, block_bytes // 2
