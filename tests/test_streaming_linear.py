"""The few-row matrix product (``streaming_linear``) against a float64 reference and
torch's own GEMM, on shapes with ragged tails, with and without bias; each row's result
is the same whatever other rows share the call; the decoder's dispatch picks it only
for few rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.cpu import streaming_linear
from pagedllm.cpu.extension import avx512_kernels_available
from pagedllm.models import linear as linear_module

pytestmark = pytest.mark.skipif(
    not avx512_kernels_available(), reason="streaming_linear needs AVX-512"
)

SHAPES = [(1, 576, 960), (3, 576, 49152), (4, 1536, 576), (7, 100, 7), (13, 33, 5), (64, 64, 4)]
"""(rows, in, out): K not a multiple of the vector width, N not a multiple of 4, M
across the 6-row tile."""


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return float((y.double() - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("rows", "k", "n"), SHAPES)
def test_matches_float64_as_closely_as_torch(dtype, with_bias, rows, k, n):
    generator = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(rows, k, generator=generator).to(dtype)
    w = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    reference = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    y = streaming_linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (rows, n)
    torch_error = relative_error(F.linear(x, w, bias), reference)
    # float32: both sum 576-1,536 products in float32 (~1e-7 relative); bfloat16: both
    # round the float32 sum once to 8 bits (~4e-3)
    assert relative_error(y, reference) <= max(2 * torch_error, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_its_batch(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 576, generator=generator).to(dtype)
    w = torch.randn(960, 576, generator=generator).to(dtype)
    together = streaming_linear(x, w)
    for row in (0, 5, 39):
        assert torch.equal(streaming_linear(x[row : row + 1].contiguous(), w)[0], together[row])


def test_rejects_mixed_dtypes_and_bad_shapes():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 or both bfloat16"):
        streaming_linear(x, w.bfloat16())
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        streaming_linear(x, torch.randn(4, 9))
    with pytest.raises(RuntimeError, match="contiguous"):
        streaming_linear(torch.randn(8, 2).T, w)


def test_decoder_dispatch_uses_the_kernel_only_for_few_rows(monkeypatch):
    calls = []
    monkeypatch.setattr(
        linear_module, "streaming_linear", lambda *args: calls.append(args) or F.linear(*args)
    )
    w = torch.randn(16, 8)
    few = linear_module.STREAMING_MAX_ROWS[torch.float32]
    linear_module.linear(torch.randn(few, 8), w)
    assert len(calls) == 1
    linear_module.linear(torch.randn(few + 1, 8), w)
    linear_module.linear(torch.randn(8, 4).T, w)  # not contiguous
    assert len(calls) == 1
