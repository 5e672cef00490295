"""bfloat16 products with a float32 output (``float_output``, an LM head's logits): the
float32 sums the kernel would have rounded, unrounded. Each kernel path (packed panels,
including a K too long for one panel block; GGUF blocks in the file's order and
interleaved, with bfloat16 or int8 activations; few rows in registers and many against
panels) is checked against its own bfloat16 output: rounding the float32 output must give
those bits exactly, and the float32 output must not already be rounded."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import random_blocks

from pagedllm.cpu.extension import (
    avx512_kernels_available,
    pack_weight,
    packed_linear,
    quant_linear,
    quant_linear_x16,
    quant_x16_supports,
)
from pagedllm.models.interleaved_weight import InterleavedWeight
from pagedllm.models.linear import linear
from pagedllm.models.quantized_weight import Q, QuantizedWeight

ROWS = (1, 3, 5, 17, 70)


def assert_unrounded_sums(float_output: torch.Tensor, rounded: torch.Tensor) -> None:
    assert float_output.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert torch.equal(float_output.bfloat16(), rounded)
    assert not torch.equal(float_output, rounded.float())


def inputs(rows: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rows)
    return torch.randn(rows, k, generator=generator).bfloat16(), torch.randn(n, generator=generator)


@pytest.mark.skipif(not avx512_kernels_available(), reason="the packed kernel needs AVX-512")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("k", [576, 6000], ids=["one-block", "blocks-of-k"])
def test_packed_panels(rows, k):
    n = 100  # a partial last panel
    x, bias = inputs(rows, k, n)
    panels = pack_weight(torch.randn(n, k).bfloat16())
    assert_unrounded_sums(
        packed_linear(x, panels, n, bias, float_output=True), packed_linear(x, panels, n, bias)
    )


@pytest.mark.skipif(not quant_x16_supports(int(Q.Q4_1)), reason="needs the bfloat16 kernels")
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("layout", ["file-order", "interleaved", "interleaved-int8"])
def test_gguf_blocks(rows, layout):
    n, k = 70, 512
    weight = QuantizedWeight(torch.from_numpy(random_blocks(Q.Q4_1, n, k, seed=3)), Q.Q4_1, k)
    x, bias = inputs(rows, k, n)
    if layout == "file-order":
        def product(float_output):
            return quant_linear(x, weight.blocks, int(Q.Q4_1), bias, float_output)
    else:
        if layout == "interleaved-int8" and not quant_x16_supports(int(Q.Q4_1), True):
            pytest.skip("needs AVX-512 VNNI")
        blocks = InterleavedWeight.interleave(weight).blocks

        def product(float_output):
            return quant_linear_x16(x, blocks, int(Q.Q4_1), n, bias,
                                    layout == "interleaved-int8", float_output)  # fmt: skip
    assert_unrounded_sums(product(True), product(False))


def test_torch_products_are_widened():
    """Weights torch multiplies (plain matrices) give their rounded result, widened."""
    x, weight = torch.randn(3, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert torch.equal(linear(x, weight, float_output=True), linear(x, weight).float())
