"""The decoder's matrix products and the form its weights are kept in.

Float32 weights on a CPU with AVX-512 are packed once, at load time, into panels
(:class:`PackedWeight`) that ``packed_linear`` (C++) streams with no per-call re-packing:
it beats torch's GEMM at every batch size of the default model, from a decode step's
single row (bound by reading the weights) to a prefill step's thousand (bound by
arithmetic); ``benchmarks/linear.py`` measures it. Other weights stay ``[out, in]``
tensors: bfloat16 runs ``streaming_linear`` for few rows (below
:data:`STREAMING_MAX_ROWS`) and torch's GEMM above; without AVX-512 torch's GEMM runs
everything. All paths accumulate in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.cpu.extension import (
    PANEL_WIDTH,
    fits_avx512_kernels,
    pack_weight,
    packed_linear,
    streaming_linear,
)

STREAMING_MAX_ROWS = {torch.float32: 128, torch.bfloat16: 64}
"""Most rows of ``x`` for which the streaming kernel is used with an unpacked weight, per
dtype: where it stops being faster in ``benchmarks/linear.py`` (bfloat16 weights are half
the bytes, so torch's GEMM catches up sooner)."""


@dataclass(frozen=True)
class PackedWeight:
    """A float32 weight ``[out_features, in_features]`` stored as panels
    ``[ceil(out_features / PANEL_WIDTH), in_features, PANEL_WIDTH]`` (k-major within a
    panel, padded with zero features): the same bytes as the plain matrix, plus padding."""

    panels: torch.Tensor
    out_features: int

    @classmethod
    def pack(cls, weight: torch.Tensor) -> PackedWeight:
        return cls(pack_weight(weight), weight.shape[0])

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Rows ``indices`` of the original matrix, ``[len(indices), in_features]``: an
        embedding lookup on a packed tied LM head."""
        return self.panels[indices // PANEL_WIDTH, :, indices % PANEL_WIDTH]


Weight = torch.Tensor | PackedWeight


def prepare_weight(weight: torch.Tensor) -> Weight:
    """The form :func:`linear` runs fastest on: packed for float32 where the AVX-512
    kernels are built, the contiguous matrix otherwise."""
    weight = weight.contiguous()
    if weight.dtype == torch.float32 and fits_avx512_kernels(weight):
        return PackedWeight.pack(weight)
    return weight


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]`` and a weight ``[out, in]`` (plain
    or packed by :func:`prepare_weight`)."""
    if isinstance(weight, PackedWeight):
        return packed_linear(x.contiguous(), weight.panels, weight.out_features, bias)
    if x.shape[0] <= STREAMING_MAX_ROWS.get(x.dtype, 0) and fits_avx512_kernels(x, weight):
        return streaming_linear(x, weight, bias)
    return F.linear(x, weight, bias)
