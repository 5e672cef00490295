"""GGUF blocks kept beside an expanded copy, where calls of many rows multiply it faster.

A weight kept in its GGUF blocks reads 3-6x fewer bytes than the same weight in bfloat16
or float32, which wins when a product streams the weight from memory for a few rows (a
decode step of a few sequences). When many rows share the call (prefill chunks, a crowd
decoding) the product is bound by arithmetic instead, and decoding blocks costs more than
reading an expanded matrix: on a 2-core Zen 5, 512 rows through the interleaved bfloat16
block kernels took 1.7-2x the time of the packed kernel on the expanded weight, one row
0.4-0.8x. So with a budget (``weight_expansion_memory``), each block weight also gets an
expanded copy in the form the float kernel choice picks for it
(:mod:`pagedllm.cpu.kernel_choice`), and :class:`ExpandedBlocks` hands each call to the
blocks below ``min_rows`` rows and to the copy from there on.

``min_rows`` is measured once per (dtype, block format, shape) and machine, cached like the
matrix kernels' timings: both forms multiply :data:`ROW_BUCKETS` rows, each call on
another of enough copies to exceed twice the last-level cache, so that every call streams
its weight from memory as a step over the whole model does (one weight timed hot would
hide what the blocks save). A weight gets its copy where the copy beats the blocks by
:data:`~pagedllm.cpu.kernel_choice.PREFERENCE_MARGIN` at the largest bucket (see
:func:`crossover`), in load order while the budget lasts.

Two forms make a row's result depend on how many rows share its call (the two kernels add
in different orders): the products are no longer batch invariant
(:mod:`pagedllm.models.batch_invariance`), so an engine that speculates keeps blocks alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import cycle
from typing import TYPE_CHECKING

import torch

from pagedllm.cpu.cpuinfo import last_level_cache_bytes
from pagedllm.cpu.kernel_choice import (
    PREFERENCE_MARGIN,
    KernelChoice,
    Timings,
    TimingTable,
    least_seconds,
    machine_key,
)
from pagedllm.kv.capacity import cdiv
from pagedllm.models.interleaved_weight import GROUP_ROWS, BlockWeight, InterleavedWeight
from pagedllm.models.quantized_weight import QuantizedWeight, slice_rows

if TYPE_CHECKING:
    from pagedllm.models.linear import Weight

ROW_BUCKETS = (1, 8, 12, 16, 24, 32, 48, 64, 128, 512)
"""Rows of a timed product: dense where the two forms cross (8-32 rows on a Zen 5)."""

SWITCH_MARGIN = 0.97
"""Once a weight has its copy, calls go to it from the least bucket where it is this much
faster than the blocks at every larger bucket (the margin keeps timing noise from moving
the switch)."""

MAX_TIMED_MULTIPLY_ADDS = 1 << 27
"""Multiply-adds of one timed call before the timing moves to a slice of the weight's
rows (whole groups of 16), scaled back by ``out_features / rows timed``."""

MAX_COPY_BYTES = 256 << 20
"""Bytes the copies of one timed form may take."""


@dataclass(frozen=True)
class ExpandedBlocks:
    """A weight ``[out_features, in_features]`` held twice: ``blocks`` (GGUF blocks, as the
    file stores them or interleaved) multiply calls of fewer than ``min_rows`` rows,
    ``expanded`` (the dequantized matrix in the model's dtype, in the float kernel's form)
    the calls of ``min_rows`` rows or more."""

    blocks: BlockWeight
    expanded: Weight
    min_rows: int

    @property
    def out_features(self) -> int:
        return self.blocks.out_features

    def for_rows(self, rows: int) -> Weight:
        """The form that multiplies a call of ``rows`` rows."""
        return self.expanded if rows >= self.min_rows else self.blocks

    def rows(self, indices: torch.Tensor) -> torch.Tensor:
        """Float32 rows ``indices`` of the weight (an embedding lookup), from the blocks."""
        return self.blocks.rows(indices)


@dataclass(frozen=True)
class FloatForms:
    """How the float kernels hold and multiply a matrix (:mod:`pagedllm.models.linear`):
    ``choose`` puts a matrix in the form the kernel choice picks, ``like`` puts a matrix
    in the form of another, ``multiply`` is ``linear(x, form)``."""

    choose: Callable[[torch.Tensor], Weight]
    like: Callable[[Weight, torch.Tensor], Weight]
    multiply: Callable[[torch.Tensor, Weight], torch.Tensor]


def expand_blocks(
    source: QuantizedWeight,
    blocks: BlockWeight,
    choice: KernelChoice,
    forms: FloatForms,
) -> BlockWeight | ExpandedBlocks:
    """``blocks`` (the form ``source`` runs in), or :class:`ExpandedBlocks` with an
    expanded copy in the form ``forms.choose`` picks for the dequantized matrix in
    ``choice.activations``, when ``choice``'s expansion budget holds the copy and the copy
    measures faster from some row count on (then the copy's bytes leave the budget)."""
    dtype = choice.activations
    extra = source.out_features * source.in_features * dtype.itemsize
    entry = (
        f"{str(dtype).removeprefix('torch.')} {source.ggml_type.name} "
        f"{type(blocks).__name__} {source.out_features}x{source.in_features}"
    )
    if extra > choice.expansion_budget:
        choice.note_expansion(entry, None)
        return blocks
    if choice.expansion_table is None:
        key = machine_key(ROW_BUCKETS)
        choice.expansion_table = TimingTable(key, "block-expansion", "block expansion")
    timings = choice.expansion_table.timings(
        entry, ("blocks", "expanded"), lambda: time_forms(source, blocks, dtype, forms)
    )
    min_rows = None if timings is None else crossover(timings)
    choice.note_expansion(entry, min_rows)
    if min_rows is None:
        return blocks
    choice.expansion_budget -= extra
    return ExpandedBlocks(blocks, forms.choose(source.dequantized().to(dtype)), min_rows)


def crossover(timings: Timings) -> int | None:
    """``min_rows``: ``None`` unless the copy beats the blocks by the preference margin at
    the largest bucket (else it is not worth its memory); then the least bucket from
    which it is faster by :data:`SWITCH_MARGIN` at every larger one."""
    buckets = sorted(timings["blocks"])
    ratio = {rows: timings["expanded"][rows] / timings["blocks"][rows] for rows in buckets}
    if ratio[buckets[-1]] >= PREFERENCE_MARGIN:
        return None
    min_rows = buckets[-1]
    for rows in reversed(buckets[:-1]):
        if ratio[rows] >= SWITCH_MARGIN:
            break
        min_rows = rows
    return min_rows


def time_forms(
    source: QuantizedWeight, blocks: BlockWeight, dtype: torch.dtype, forms: FloatForms
) -> Timings:
    """Seconds of one product of ``blocks`` (the form ``source`` runs in) and of its
    expanded copy (the dequantized matrix in ``dtype``, in the form ``forms.choose``
    picks) per :data:`ROW_BUCKETS` row count, each call on another copy of a slice of the
    weight's rows so that it streams from memory (see the module's docstring); scaled to
    the whole weight."""
    out_features, in_features = source.out_features, source.in_features
    matrix = source.dequantized().to(dtype)
    expanded = forms.choose(matrix)
    timings: Timings = {"blocks": {}, "expanded": {}}
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            n = _timed_rows(rows, out_features, in_features)
            part = slice_rows(source, range(n)) if n < out_features else source
            copies = _copies(n * in_features * matrix.element_size())
            block_forms = [_block_form(part, blocks) for _ in range(copies)]
            float_forms = [forms.like(expanded, matrix[:n].clone()) for _ in range(copies)]
            x = torch.randn(rows, in_features, dtype=dtype)
            rotations = {"blocks": cycle(block_forms), "expanded": cycle(float_forms)}

            def call(rotation, x=x):
                return lambda: forms.multiply(x, next(rotation))

            least = least_seconds({name: call(r) for name, r in rotations.items()})
            for name, seconds in least.items():
                timings[name][rows] = seconds * out_features / n
    return timings


def _timed_rows(rows: int, out_features: int, in_features: int) -> int:
    """Output features one timed call multiplies: all, or whole groups of 16 within
    :data:`MAX_TIMED_MULTIPLY_ADDS`."""
    if rows * out_features * in_features <= MAX_TIMED_MULTIPLY_ADDS:
        return out_features
    groups = max(1, MAX_TIMED_MULTIPLY_ADDS // (rows * in_features * GROUP_ROWS))
    return min(out_features, groups * GROUP_ROWS)


def _copies(expanded_bytes: int) -> int:
    """Copies of a form whose round-robin calls miss the last-level cache: enough to hold
    twice its bytes in the expanded form, within :data:`MAX_COPY_BYTES`."""
    wanted = cdiv(2 * last_level_cache_bytes(), expanded_bytes)
    return max(1, min(wanted, MAX_COPY_BYTES // expanded_bytes))


def _block_form(part: QuantizedWeight, like: BlockWeight) -> BlockWeight:
    """``part`` (fresh bytes) in the form of ``like``."""
    fresh = QuantizedWeight(part.blocks.clone(), part.ggml_type, part.in_features)
    if isinstance(like, InterleavedWeight):
        return InterleavedWeight.interleave(fresh)
    return fresh
