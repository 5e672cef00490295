"""Quantized weights interleaved by groups of 16 rows: the same bytes, the same products.

Tolerance as in test_quant_kernels: float32 rounding (``2**-20`` of the sum of the
magnitudes of the terms) plus one bfloat16 rounding, and at least 99% of the outputs the
exact product rounded once.
"""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import assert_rounded_once, dequantized, random_blocks

from pagedllm.cpu.extension import quant_linear, quant_x16_supports
from pagedllm.cpu.kernel_choice import KernelChoice
from pagedllm.models.interleaved_weight import GROUP_ROWS, InterleavedWeight
from pagedllm.models.linear import linear, prepare_weight
from pagedllm.models.quantized_weight import Q, QuantizedWeight

X16_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1)
pytestmark = pytest.mark.skipif(
    not all(quant_x16_supports(int(t)) for t in X16_TYPES),
    reason="needs the AVX-512 bfloat16 kernels",
)
ROWS = (1, 2, 3, 4, 5, 7, 13, 17, 23)  # registers up to 16 rows, 4-row panel tiles beyond


def weight_of(ggml_type: Q, n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    blocks = random_blocks(ggml_type, n, k, seed=seed)
    return QuantizedWeight(torch.from_numpy(blocks), ggml_type, k), dequantized(
        blocks, ggml_type, n, k
    )


@pytest.mark.parametrize("ggml_type", X16_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROWS)
def test_interleaved_product_rounds_the_float32_product_once(ggml_type, rows):
    n, k = 70, 512  # 70: a partial last group of 16 and a partial panel of 32
    weight, dense = weight_of(ggml_type, n, k, seed=4)
    interleaved = InterleavedWeight.interleave(weight)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator)
    assert_rounded_once(interleaved.linear(x, bias), x, dense, bias)


@pytest.mark.parametrize("ggml_type", X16_TYPES, ids=lambda t: t.name)
def test_interleaving_keeps_the_bytes_and_every_row(ggml_type):
    n, k = 37, 128
    weight, dense = weight_of(ggml_type, n, k, seed=5)
    interleaved = InterleavedWeight.interleave(weight)
    groups = -(-n // GROUP_ROWS)
    assert interleaved.blocks.shape == (groups, weight.blocks.shape[1] * GROUP_ROWS)
    assert interleaved.nbytes == groups * GROUP_ROWS * weight.blocks.shape[1]  # + zero rows
    ids = torch.tensor([0, 36, 17, 17, 15, 16])
    assert torch.equal(interleaved.row_blocks(ids), weight.blocks[ids])
    assert torch.equal(interleaved.rows(ids), dense[ids])


@pytest.mark.parametrize("ggml_type", X16_TYPES, ids=lambda t: t.name)
def test_interleaved_rows_do_not_depend_on_the_other_rows_nor_the_path(ggml_type):
    """Registers up to 16 rows, panels beyond: both sum each block in the same order,
    so every row's result is the same bits whatever the batch. Sums in another order
    differ in about one output in 10^5 (Q8_0's 8-bit codes): hence 8,192 outputs."""
    weight, _ = weight_of(ggml_type, 8192, 576, seed=6)
    interleaved = InterleavedWeight.interleave(weight)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    batch = interleaved.linear(x)  # panels, 4-row tiles
    for rows in (slice(7, 30), slice(0, 16), slice(3, 12), slice(5, 7)):
        assert torch.equal(interleaved.linear(x[rows]), batch[rows]), rows
    for row in range(len(x)):  # one row: registers, one pass
        assert torch.equal(interleaved.linear(x[row : row + 1]), batch[row : row + 1]), row


def test_bfloat16_models_interleave_and_float32_models_keep_the_file_layout():
    weight, _ = weight_of(Q.Q8_0, 32, 64, seed=7)
    bf16 = prepare_weight(weight, KernelChoice(activations=torch.bfloat16))
    assert isinstance(bf16, InterleavedWeight)
    assert prepare_weight(weight, KernelChoice(activations=torch.float32)) is weight
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(linear(x, bf16), bf16.linear(x))
    # the two layouts sum in other orders; both round the same float32 product
    close = linear(x, bf16).float() - quant_linear(x, weight.blocks, int(Q.Q8_0)).float()
    assert close.abs().max() <= 2.0**-7 * linear(x, bf16).float().abs().max()


def test_interleaved_kernels_refuse_float32_activations_and_wrong_shapes():
    weight, _ = weight_of(Q.Q4_0, 32, 64, seed=8)
    interleaved = InterleavedWeight.interleave(weight)
    with pytest.raises(RuntimeError, match="x is bfloat16"):
        interleaved.linear(torch.randn(1, 64))
    with pytest.raises(RuntimeError, match="weight must be contiguous uint8"):
        interleaved.linear(torch.randn(1, 96).bfloat16())
