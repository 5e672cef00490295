"""The decoder's matrix products and the form its weights are kept in.

A float32 or bfloat16 weight on the CPU is kept, from load time on, in the layout of the
kernel that multiplies it, chosen per shape by capability and measurement
(:mod:`pagedllm.cpu.kernel_choice`) or forced: panels (:class:`PackedWeight`) that
``packed_linear`` (C++, AVX-512) streams, oneDNN's blocked layout
(:class:`OneDNNWeight`), or the plain ``[out, in]`` matrix for ``F.linear``, as
everywhere off the CPU. Weights a GGUF file stores quantized may stay in its block format
(:class:`~pagedllm.models.quantized_weight.QuantizedWeight`), interleaved by groups of 16
rows where bfloat16 activations meet a kernel for the format
(:class:`~pagedllm.models.interleaved_weight.InterleavedWeight`), and with an expansion
budget beside an expanded copy for calls of many rows
(:class:`~pagedllm.models.block_expansion.ExpandedBlocks`). All accumulate in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.cpu.extension import PANEL_WIDTH, fits_avx512_kernels, pack_weight, packed_linear
from pagedllm.cpu.kernel_choice import KernelChoice, LinearKernel
from pagedllm.cpu.onednn import onednn_linear, reorder, reorderable
from pagedllm.models.block_expansion import ExpandedBlocks, FloatForms, expand_blocks
from pagedllm.models.interleaved_weight import BlockWeight, InterleavedWeight, interleavable
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


@dataclass(frozen=True)
class OneDNNWeight:
    """A weight ``[out_features, in_features]`` in oneDNN's blocked layout (see
    :mod:`pagedllm.cpu.onednn`): an opaque tensor, held instead of the plain matrix."""

    reordered: torch.Tensor

    @classmethod
    def reorder(cls, weight: torch.Tensor) -> OneDNNWeight:
        return cls(reorder(weight))

    @property
    def out_features(self) -> int:
        return self.reordered.shape[0]


Weight = torch.Tensor | PackedWeight | OneDNNWeight | BlockWeight | ExpandedBlocks


def prepare_weight(
    weight: torch.Tensor | QuantizedWeight,
    choice: KernelChoice | None = None,
    rows_read: bool = False,
) -> Weight:
    """The form :func:`linear` runs ``weight`` in: a quantized weight interleaved when
    ``choice`` says the activations are bfloat16 and a kernel takes its format, else as it
    is, and with an expanded copy beside it where ``choice``'s expansion budget allows
    and measurement favours it (:mod:`pagedllm.models.block_expansion`); a float weight
    in the form :func:`float_form` gives it. ``rows_read``: the weight's rows are looked
    up too (an LM head tied to the embedding)."""
    if isinstance(weight, QuantizedWeight):
        blocks: BlockWeight = weight
        if choice is not None and choice.activations == torch.bfloat16 and interleavable(weight):
            blocks = InterleavedWeight.interleave(weight)
        if choice is None or choice.expansion_budget <= 0:
            return blocks
        forms = FloatForms(lambda m: float_form(m, choice, rows_read), form_like, linear)
        return expand_blocks(weight, blocks, choice, forms)
    return float_form(weight, choice, rows_read)


def float_form(
    weight: torch.Tensor, choice: KernelChoice | None = None, rows_read: bool = False
) -> Weight:
    """A float weight packed, in oneDNN's layout, or the contiguous matrix, as ``choice``
    picks among the kernels able to run it (see :mod:`pagedllm.cpu.kernel_choice`);
    without ``choice``, the first of them. ``rows_read``: the weight's rows are looked up
    too, which oneDNN's opaque layout cannot serve, so it is not a candidate (one copy,
    never two)."""
    weight = weight.contiguous()
    kernels = [LinearKernel.PACKED] if fits_avx512_kernels(weight) else []
    if reorderable(weight) and not rows_read:
        kernels.append(LinearKernel.ONEDNN)
    kernels.append(LinearKernel.DENSE)
    kernel = choice.choose(weight, kernels) if choice else kernels[0]
    if kernel == LinearKernel.PACKED:
        return PackedWeight.pack(weight)
    return OneDNNWeight.reorder(weight) if kernel == LinearKernel.ONEDNN else weight


def form_like(form: Weight, weight: torch.Tensor) -> Weight:
    """The float ``weight`` in the form of the float weight ``form``."""
    if isinstance(form, PackedWeight):
        return PackedWeight.pack(weight)
    return OneDNNWeight.reorder(weight) if isinstance(form, OneDNNWeight) else weight.contiguous()


def fuse_rows(parts: list[torch.Tensor] | list[QuantizedWeight]) -> torch.Tensor | QuantizedWeight:
    """The rows of ``parts`` one after another (q, k and v into one matrix): all plain
    tensors, or all quantized in one block format."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return concat_rows(parts)
    if any(isinstance(p, QuantizedWeight) for p in parts):
        raise ValueError("cannot fuse quantized and expanded weights into one matrix")
    return torch.cat(parts)


def weight_storage(weight: Weight) -> torch.Tensor:
    """The tensor holding a weight's bytes: the matrix, its panels, or its blocks (those
    of a weight with an expanded copy: :func:`expanded_storage` holds the copy's)."""
    if isinstance(weight, ExpandedBlocks):
        return weight_storage(weight.blocks)
    if isinstance(weight, PackedWeight):
        return weight.panels
    if isinstance(weight, OneDNNWeight):
        return weight.reordered
    return weight.blocks if isinstance(weight, BlockWeight) else weight


def expanded_storage(weight: Weight) -> list[torch.Tensor]:
    """The tensor holding the bytes of a block weight's expanded copy; none for other
    weights."""
    return [weight_storage(weight.expanded)] if isinstance(weight, ExpandedBlocks) else []


def linear(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, float_output: bool = False
) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]`` and a weight ``[out, in]`` (plain
    or packed by :func:`prepare_weight`, or quantized), in ``x``'s dtype. With
    ``float_output``, in float32: a packed or quantized weight's float32 sums unrounded,
    the others' results (torch's, rounded to ``x``'s dtype) widened."""
    if isinstance(weight, ExpandedBlocks):
        weight = weight.for_rows(x.shape[0])
    if isinstance(weight, BlockWeight):
        return weight.linear(x, bias, float_output)
    if isinstance(weight, PackedWeight):
        return packed_linear(x.contiguous(), weight.panels, weight.out_features, bias, float_output)
    if isinstance(weight, OneDNNWeight):
        y = onednn_linear(x, weight.reordered, bias)
    else:
        y = F.linear(x, weight, bias)
    return y.float() if float_output else y
