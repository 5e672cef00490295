"""The quantized-weight kernels equal a float32 product over the dequantized weights.

Tolerance: each output may differ from ``x @ dequantize(W).T`` (torch, float32) by
``2**-20`` times ``|x| @ |W|.T``, the sum of the magnitudes of its terms: float32 rounding
of a sum of K <= 768 products in another order (measured worst case 1.5e-7, 2**-22.7).
Reference weights come from the gguf package's dequantizer; blocks are written by
``gguf.quants.quantize`` where it implements the type, as random bytes otherwise.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedllm.cpu.extension import dequantize_rows, kernels_built, quant_linear
from pagedllm.models.quantized_weight import KERNEL_TYPES, Q, QuantizedWeight, concat_rows

pytestmark = pytest.mark.skipif(not kernels_built(), reason="needs the C++ kernels")

TOLERANCE = 2.0**-20
# Byte offsets of each K-quant block's half-precision scales (set to finite values).
HALF_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
ROWS = (1, 3, 4, 5, 130)  # one pass, a partial pass, several passes, the panel path


def random_blocks(ggml_type: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 ``[n, k / values * bytes]``: quantized random weights, or random blocks."""
    rng = np.random.default_rng(seed)
    if ggml_type not in HALF_OFFSETS:
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), ggml_type)
    values, nbytes = gguf.GGML_QUANT_SIZES[ggml_type]
    raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
    for offset in HALF_OFFSETS[ggml_type]:
        halves = rng.uniform(-0.1, 0.1, size=(n, k // values)).astype(np.float16)
        raw[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(n, k // values, 2)
    return raw.reshape(n, -1)


def dequantized(blocks: np.ndarray, ggml_type: Q, n: int, k: int) -> torch.Tensor:
    values = gguf.quants.dequantize(blocks, ggml_type).astype(np.float32)
    return torch.from_numpy(values.reshape(n, k))


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", ROWS)
def test_product_equals_float32_product_of_dequantized_weights(ggml_type, rows):
    n, k = 70, 768  # 70: output features in no whole group of 4 or panel of 48
    blocks = random_blocks(ggml_type, n, k)
    weight = dequantized(blocks, ggml_type, n, k)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator)
    bias = torch.randn(n, generator=generator)
    y = quant_linear(x, torch.from_numpy(blocks), int(ggml_type), bias)
    expected = x @ weight.T + bias
    bound = x.abs() @ weight.abs().T + bias.abs()
    assert y.dtype == torch.float32 and y.shape == (rows, n)
    assert ((y - expected).abs() <= TOLERANCE * bound).all()


BF16_ROWS = (1, 2, 3, 4, 7, 8, 9, 13)  # the register path (up to 8 rows), panel tiles of 6


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", BF16_ROWS)
def test_bfloat16_activations_round_the_float32_product_once(ggml_type, rows):
    n, k = 70, 512  # 70: a partial group of 4 outputs and a partial panel of 32
    blocks = random_blocks(ggml_type, n, k, seed=1)
    weight = dequantized(blocks, ggml_type, n, k)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator)
    y = quant_linear(x, torch.from_numpy(blocks), int(ggml_type), bias)
    assert_rounded_once(y, x, weight, bias)


def assert_rounded_once(
    y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> None:
    """``y`` (bfloat16) is ``x @ weight.T + bias`` in float64, within the float32 tolerance
    plus one bfloat16 rounding, and at least 99% of it is that product rounded once."""
    exact = x.double() @ weight.double().T + bias.double()
    assert y.dtype == torch.bfloat16 and y.shape == exact.shape
    # one bfloat16 rounding (unit roundoff 2**-8) on top of the float32 tolerance
    magnitude = x.double().abs() @ weight.double().abs().T + bias.double().abs()
    slack = TOLERANCE * magnitude + 2.0**-8 * exact.abs()
    assert ((y.double() - exact).abs() <= slack).all()
    # all but a handful are the exact result rounded once: a rounding boundary within
    # float32 rounding of the sum is the only way to land on the other neighbour
    assert (y == exact.float().bfloat16()).float().mean() >= 0.99


BATCHES = (2, 3, 4, 5, 9, 17, 64)  # the register path and panels in both dtypes
# float32 panels from 48 rows: a partial tile of 8 rows, and past a group of 64 rows
FLOAT32_BATCHES = (*BATCHES, 50, 80)
# [N, K]: partial groups of 4 outputs, partial panels of 32 (bfloat16) and 48 (float32)
SHAPES = ((70, 512), (33, 1024), (100, 768))
LONG_ROWS = (20, 3072)  # a float32 panel too large for L2 (its residues in turn)


def alone_and_in_batches(
    blocks: torch.Tensor,
    ggml_type: Q,
    x: torch.Tensor,
    bias: torch.Tensor,
    float_output: bool,
    batches: tuple[int, ...],
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Each row of ``x`` multiplied alone (stacked), and the first rows of ``x`` multiplied
    together, per batch size of ``batches``."""

    def product(rows: torch.Tensor) -> torch.Tensor:
        return quant_linear(rows, blocks, int(ggml_type), bias, float_output)

    alone = torch.cat([product(x[i : i + 1]) for i in range(len(x))])
    return alone, {rows: product(x[:rows]) for rows in batches}


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("float_output", [False, True], ids=["bfloat16", "float32_sums"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_bfloat16_row_is_the_same_bits_in_any_batch(ggml_type, float_output, shape):
    """Registers up to 8 rows and panels beyond add a row's products in one order, so a
    row alone and the same row among 1 to 63 others agree to the bit, in bfloat16 and in
    the unrounded float32 sums. (Where the panels added in another order, 76-91 % of
    the 64-row batch's float32 sums differed from the rows' alone, and 0-7 in 10^4 of
    its bfloat16 outputs.)"""
    n, k = shape
    blocks = torch.from_numpy(random_blocks(ggml_type, n, k, seed=n))
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(max(BATCHES), k, generator=generator).bfloat16()
    bias = torch.randn(n, generator=generator)
    alone, batches = alone_and_in_batches(blocks, ggml_type, x, bias, float_output, BATCHES)
    for rows, together in batches.items():
        assert torch.equal(together, alone[:rows]), rows
    if not float_output:
        weight = dequantized(blocks.numpy(), ggml_type, n, k)
        assert_rounded_once(batches[max(BATCHES)], x, weight, bias)


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("shape", (*SHAPES, LONG_ROWS), ids=lambda s: f"{s[0]}x{s[1]}")
def test_float32_row_is_the_same_bits_in_any_batch(ggml_type, shape):
    """Registers up to 47 rows and panels beyond add a row's products in one order (16
    residue chains, added as a tree of halves), so a row alone and the same row among 1
    to 79 others agree to the bit. (Where the panels added in another order, 89-90 % of
    a 64-row batch's outputs differed from the rows' alone.) The panel path stays within
    the tolerance of the float32 product."""
    n, k = shape
    blocks = torch.from_numpy(random_blocks(ggml_type, n, k, seed=n))
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(max(FLOAT32_BATCHES), k, generator=generator)
    bias = torch.randn(n, generator=generator)
    alone, batches = alone_and_in_batches(blocks, ggml_type, x, bias, False, FLOAT32_BATCHES)
    for rows, together in batches.items():
        assert torch.equal(together, alone[:rows]), rows
    weight = dequantized(blocks.numpy(), ggml_type, n, k)
    expected = x @ weight.T + bias
    bound = x.abs() @ weight.abs().T + bias.abs()
    assert ((batches[max(FLOAT32_BATCHES)] - expected).abs() <= TOLERANCE * bound).all()


@pytest.mark.parametrize("ggml_type", KERNEL_TYPES, ids=lambda t: t.name)
def test_gathered_rows_are_the_dequantized_rows_exactly(ggml_type):
    n, k = 40, 256
    blocks = random_blocks(ggml_type, n, k, seed=2)
    ids = torch.tensor([0, 39, 7, 7])
    rows = dequantize_rows(torch.from_numpy(blocks), int(ggml_type), k, ids)
    assert torch.equal(rows, dequantized(blocks, ggml_type, n, k)[ids])


def test_fused_rows_and_reordered_rows_keep_each_row_bytes():
    blocks = torch.from_numpy(random_blocks(Q.Q4_1, 12, 64))
    a, b = QuantizedWeight(blocks[:5], Q.Q4_1, 64), QuantizedWeight(blocks[5:], Q.Q4_1, 64)
    fused = concat_rows([a, b])
    assert torch.equal(fused.blocks, blocks) and fused.out_features == 12
    order = torch.tensor([3, 1, 2, 0, 4, 5, 6, 7, 8, 9, 10, 11])
    assert torch.equal(fused.reorder_rows(order).dequantized(), fused.dequantized()[order])
    with pytest.raises(ValueError, match="different block formats"):
        concat_rows(
            [a, QuantizedWeight(torch.from_numpy(random_blocks(Q.Q8_0, 2, 64)), Q.Q8_0, 64)]
        )


def test_mismatched_shapes_and_types_are_refused():
    blocks = torch.from_numpy(random_blocks(Q.Q8_0, 4, 64))
    with pytest.raises(RuntimeError, match="weight must be contiguous uint8"):
        quant_linear(torch.randn(2, 96), blocks, int(Q.Q8_0))
    with pytest.raises(RuntimeError, match="no kernels for ggml type"):
        quant_linear(torch.randn(2, 64), blocks, int(Q.Q2_K))
    with pytest.raises(RuntimeError, match="outside the weight"):
        dequantize_rows(blocks, int(Q.Q8_0), 64, torch.tensor([4]))
