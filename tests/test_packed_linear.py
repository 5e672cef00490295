"""The packed matrix product (``pack_weight`` + ``packed_linear``), float32 and bfloat16,
against a float64 reference and torch's GEMM on shapes with ragged tails; a row's result
is the same whatever the batch; the decoder keeps its weights packed and a tied
embedding in one copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.cpu.extension import PANEL_WIDTH, avx512_kernels_available, pack_weight
from pagedllm.cpu.extension import packed_linear as packed_linear_op
from pagedllm.models.linear import PackedWeight, linear, prepare_weight

pytestmark = pytest.mark.skipif(
    not avx512_kernels_available(), reason="packed_linear needs AVX-512"
)

SHAPES = [
    (1, 576, 960),
    (3, 576, 49152),
    (8, 1536, 576),
    (9, 1536, 576),
    (13, 600, 100),
    (17, 600, 100),
    (300, 33, 5),
    (0, 16, 48),
]
"""(rows, in, out): one row, the LM head, a whole 8-row tile, one 9-row tile (a
speculative verification of 8 guesses), ragged K (not a multiple of the 256-value
chunks) and N (not a multiple of the panel width) with a ragged tile and with a tile
and a 9-row one, rows across many tiles, and an empty batch."""


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference).abs().max() / reference.abs().max())


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize(("dtype", "step"), [(torch.float32, 1), (torch.bfloat16, 2)])
def test_pack_weight_lays_out_panels_k_major_with_zero_padding(dtype, step):
    w = torch.arange(1, 100 * 7 + 1, dtype=torch.float32).view(100, 7).to(dtype)
    panels = pack_weight(w)
    assert panels.shape == (3, -(-7 // step), PANEL_WIDTH, step)
    for n in (0, 47, 48, 99):
        packed_row = panels[n // PANEL_WIDTH, :, n % PANEL_WIDTH, :].reshape(-1)
        assert torch.equal(packed_row[:7], w[n]) and not packed_row[7:].any()
    assert not panels[2, :, 100 - 2 * PANEL_WIDTH :].any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
def test_matches_float64_as_closely_as_torch(dtype, with_bias, rows, k, n):
    generator = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    w = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    y = linear(x, PackedWeight.pack(w), bias)
    assert y.shape == (rows, n) and y.dtype == dtype
    if rows == 0:
        return
    reference = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    torch_error = relative_error(F.linear(x, w, bias), reference)
    # float32: both sum 33-1,536 products in float32 (~1e-7 relative), chunked sums keep
    # ours near; bfloat16: both round the float32 sum once to 8 bits (~4e-3)
    assert relative_error(y, reference) <= max(2 * torch_error, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_its_batch(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 1536, generator=generator).to(dtype)
    w = PackedWeight.pack(torch.randn(576, 1536, generator=generator).to(dtype))
    together = linear(x, w)
    for row in (0, 7, 8, 1023):
        alone = linear(x[row : row + 1], w)
        assert torch.equal(alone[0], together[row])
    assert torch.equal(linear(x[3:16], w), together[3:16])
    assert torch.equal(linear(x[:9], w), together[:9])  # one 9-row tile
    assert torch.equal(linear(x[5:22], w), together[5:22])  # a tile, then a 9-row one


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "panels"), [(9, 49), (200, 3)])
def test_every_panel_is_computed_once_whatever_the_thread_count(dtype, rows, panels):
    """Threads claim tasks in pairs from both ends of a run: with 1 to 5 threads (odd
    teams leave one thread alone on its run) every output is written, with the same bits
    as on one thread. A task is a panel, or with few panels and many rows (200 rows, 3
    panels) a block of whole tiles of rows of a panel, the last block shorter. Before
    each call, memory of the output's size is filled with NaN and freed, so that a task
    no thread took would most likely show as NaN rather than as the previous call's
    result."""
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 576, generator=generator).to(dtype)
    w = torch.randn(panels * PANEL_WIDTH - 5, 576, generator=generator).to(dtype)
    w = PackedWeight.pack(w)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in range(1, 6):
            torch.set_num_threads(threads)
            torch.full((rows, w.out_features), float("nan"), dtype=dtype)  # freed at once
            y = linear(x, w)
            assert not y.isnan().any()
            results.append(y)
    finally:
        torch.set_num_threads(before)
    for y in results[1:]:
        assert torch.equal(y, results[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [21, 17, 9])
def test_a_long_row_is_summed_whole_across_blocks_of_k(dtype, rows):
    """K = 6,001: a panel too large for L2 is taken in blocks of K, and each output's sum
    carries over from block to block. Small integers keep every partial sum exact, so
    the result must be the exact sum, rounded once to the dtype: a block that restarted
    its sums, or rounded them to bfloat16 on the way, would show."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(-3, 4, (rows, 6001), generator=generator).to(dtype)
    w = torch.randint(-3, 4, (100, 6001), generator=generator).to(dtype)
    bias = torch.randint(-3, 4, (100,), generator=generator).to(dtype)
    exact = x.double() @ w.double().T + bias.double()
    packed = PackedWeight.pack(w)
    y = linear(x, packed, bias)
    assert torch.equal(y, exact.to(dtype))
    assert torch.equal(linear(x[rows - 1 :], packed, bias)[0], y[rows - 1])


def test_rejects_panels_that_do_not_match():
    w = torch.randn(100, 8)
    panels = pack_weight(w)
    with pytest.raises(RuntimeError, match="pack_weight"):
        packed_linear_op(torch.randn(2, 9), panels, 100)
    with pytest.raises(RuntimeError, match="pack_weight"):
        packed_linear_op(torch.randn(2, 8), panels, 200)
    with pytest.raises(RuntimeError, match="pack_weight"):
        packed_linear_op(torch.randn(2, 8).bfloat16(), panels, 100)
    with pytest.raises(RuntimeError, match="bias"):
        packed_linear_op(torch.randn(2, 8), panels, 100, torch.randn(99))


def test_float32_and_bfloat16_weights_are_packed_others_not():
    assert isinstance(prepare_weight(torch.randn(4, 8)), PackedWeight)
    assert isinstance(prepare_weight(torch.randn(4, 8).bfloat16()), PackedWeight)
    plain = prepare_weight(torch.randn(4, 8).half())
    assert isinstance(plain, torch.Tensor) and plain.shape == (4, 8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_rows_are_the_original_rows(dtype):
    w = torch.randn(130, 25).to(dtype)
    ids = torch.tensor([0, 47, 48, 129, 5, 5])
    assert torch.equal(PackedWeight.pack(w).rows(ids), w[ids])


def test_tied_embedding_is_kept_once_and_embeds_like_the_matrix(expanded_default_model):
    model = expanded_default_model.model
    assert model.config.tie_word_embeddings
    assert model.embed_tokens is model.lm_head
    assert isinstance(model.lm_head, PackedWeight)
    ids = torch.tensor([1, 2, model.config.vocab_size - 1])
    hidden = model.embed(ids)
    assert hidden.shape == (3, model.config.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden[:1])[0, 2], hidden[0] @ hidden[1])
