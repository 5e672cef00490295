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

from pagedllm.cpu.extension import dequantize_rows, kernels_built, quant_linear

Q = gguf.GGMLQuantizationType
KERNEL_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
"""The block formats the CPU kernels multiply without expanding."""

QUANTIZABLE_NAMES = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "qkv_proj.weight",
    "o_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "down_proj.weight",
    "gate_up_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
)
"""Hugging Face names (suffixes) of the matrices the decoder may keep quantized."""


def is_quantizable(name: str) -> bool:
    """Whether the decoder may keep the matrix ``name`` quantized: projections, the
    embedding and the LM head; never experts (shared ones included), routers or norms."""
    return name.endswith(QUANTIZABLE_NAMES) and "expert" not in name


def why_kernels_cannot_run(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why a model of ``dtype`` on ``device`` cannot run quantized weights; ``None`` when
    it can (on the CPU, float32 or bfloat16, the C++ kernels built)."""
    if device.type != "cpu":
        return f"the quantized kernels run on the CPU, not {device.type}"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"the quantized kernels take float32 or bfloat16 activations, not {dtype}"
    if not kernels_built():
        return "the C++ kernels are not built"
    return None


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

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, float_output: bool = False
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` in ``x``'s dtype (float32 or bfloat16 ``[rows, in]``),
        or float32 with ``float_output`` (the sums unrounded)."""
        return quant_linear(x.contiguous(), self.blocks, int(self.ggml_type), bias, float_output)


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


def int8_per_channel(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` ``[out, in]`` (``in`` a multiple of 32) rounded to int8 with one scale
    per output channel (its largest magnitude / 127, in half precision), stored as Q8_0
    blocks (2 + 32 bytes per 32 weights) that all carry their row's scale."""
    out_features, in_features = weight.shape
    values = weight.float()
    scale = (values.abs().amax(dim=1) / 127).to(torch.float16)
    divisor = torch.where(scale > 0, scale.float(), 1.0)[:, None]
    codes = torch.round(values / divisor).clamp(-127, 127).to(torch.int8)
    blocks = torch.empty(out_features, in_features // 32, 34, dtype=torch.uint8)
    blocks[:, :, :2] = scale.view(torch.uint8).reshape(out_features, 1, 2)
    blocks[:, :, 2:] = codes.view(torch.uint8).reshape(out_features, -1, 32)
    return QuantizedWeight(blocks.reshape(out_features, -1), Q.Q8_0, in_features)


def slice_rows(weight: QuantizedWeight, rows: range) -> QuantizedWeight:
    """Rows ``rows`` of ``weight`` (each row is whole blocks, so any range cuts cleanly)."""
    blocks = weight.blocks[rows.start : rows.stop].contiguous()
    return QuantizedWeight(blocks, weight.ggml_type, weight.in_features)


def slice_columns(weight: QuantizedWeight, columns: range) -> QuantizedWeight | None:
    """Columns ``columns`` of ``weight`` as whole blocks, or ``None`` when the range does
    not start and end on a block boundary (32 or 256 weights, by format)."""
    values, nbytes = gguf.GGML_QUANT_SIZES[weight.ggml_type]
    if columns.start % values or columns.stop % values:
        return None
    first, last = columns.start // values * nbytes, columns.stop // values * nbytes
    blocks = weight.blocks[:, first:last].contiguous()
    return QuantizedWeight(blocks, weight.ggml_type, len(columns))


def pad_rows(weight: QuantizedWeight, num_rows: int) -> QuantizedWeight:
    """``weight`` with zero rows appended up to ``num_rows`` (all-zero blocks decode to
    zero weights in every format)."""
    missing = num_rows - weight.out_features
    if missing <= 0:
        return weight
    zeros = weight.blocks.new_zeros(missing, weight.blocks.shape[1])
    return QuantizedWeight(torch.cat([weight.blocks, zeros]), weight.ggml_type, weight.in_features)
