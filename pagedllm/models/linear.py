"""The decoder's matrix products and the form its weights are kept in.

On a CPU with AVX-512, weights are packed once, at load time, into panels
(:class:`PackedWeight`) that ``packed_linear`` (C++) streams with no per-call re-packing:
it beats torch's GEMM at every batch size of the default model, from a decode step's
single row (bound by reading the weights) to a prefill step's thousand (bound by
arithmetic); ``benchmarks/linear.py`` measures it. Elsewhere weights stay ``[out, in]``
tensors and torch's GEMM runs them. Weights a GGUF file stores quantized may stay in its
block format (:class:`~pagedllm.models.quantized_weight.QuantizedWeight`). All accumulate
in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.cpu.extension import PANEL_WIDTH, fits_avx512_kernels, pack_weight, packed_linear
from pagedllm.models.quantized_weight import QuantizedWeight, concat_rows


@dataclass(frozen=True)
class PackedWeight:
    """A weight ``[out_features, in_features]`` stored as panels (see
    :func:`~pagedllm.cpu.extension.pack_weight`): the same bytes as the plain matrix, plus
    padding to whole panels."""

    panels: torch.Tensor
    out_features: int
    in_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        return cls(pack_weight(weight), weight.shape[0], weight.shape[1])

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` of the original matrix, ``[len(indices), in_features]``: an
        embedding lookup on a packed tied LM head."""
        gathered = self.panels[indices // PANEL_WIDTH, :, indices % PANEL_WIDTH, :]
        return gathered.reshape(len(indices), -1)[:, : self.in_features]


Weight = torch.Tensor | PackedWeight | QuantizedWeight


def prepare_weight(weight: torch.Tensor | QuantizedWeight) -> Weight:
    """The form :func:`linear` runs fastest on: a quantized weight as it is; packed where
    the AVX-512 kernels are built (float32 and bfloat16), the contiguous matrix otherwise."""
    if isinstance(weight, QuantizedWeight):
        return weight
    weight = weight.contiguous()
    return PackedWeight.pack(weight) if fits_avx512_kernels(weight) else weight


def fuse_rows(parts: list[torch.Tensor] | list[QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """The rows of ``parts`` one after another (q, k and v into one matrix): all plain
    tensors, or all quantized in one block format."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return concat_rows(parts)
    if any(isinstance(p, QuantizedWeight) for p in parts):
        raise ValueError("cannot fuse quantized and expanded weights into one matrix")
    return torch.cat(parts)


def weight_storage(weight: Weight) -> torch.Tensor:
    """The tensor holding a weight's bytes: the matrix, its panels, or its blocks."""
    if isinstance(weight, PackedWeight):
        return weight.panels
    return weight.blocks if isinstance(weight, QuantizedWeight) else weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]`` and a weight ``[out, in]`` (plain
    or packed by :func:`prepare_weight`, or quantized)."""
    if isinstance(weight, QuantizedWeight):
        return weight.linear(x, bias)
    if isinstance(weight, PackedWeight):
        return packed_linear(x.contiguous(), weight.panels, weight.out_features, bias)
    return F.linear(x, weight, bias)
