"""The row argmax kernel against torch.argmax: the same index for every row, ties,
NaNs, infinities and row lengths that are not a multiple of the kernel's 16 lanes
included; and the wrapper hands what the kernel does not take to torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.cpu.extension import argmax_rows, kernels_built

pytestmark = pytest.mark.skipif(not kernels_built(), reason="the C++ kernels are not built")

SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0]


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(1, 5),
    n=st.integers(1, 70),
    levels=st.integers(1, 4),
    specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=6),
    seed=st.integers(0, 2**31 - 1),
)
def test_equals_torch_argmax(rows, n, levels, specials, seed):
    """Few distinct values make ties common; specials land at random places."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, n), generator=generator).float() - 1.5
    flat = x.view(-1)
    for where, value in specials:
        flat[where % flat.numel()] = value
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("case", ["random", "first_of_ties", "nan_after_max", "all_minus_inf"])
def test_vocabulary_sized_rows(case):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 49_153, generator=generator)  # 3,072 lane groups and one more
    if case == "first_of_ties":
        x[:, [7, 20_000, 49_152]] = 10.0
    elif case == "nan_after_max":
        x[:, 40_000] = float("nan")
        x[:, 100] = float("inf")
    elif case == "all_minus_inf":
        x[:] = float("-inf")
    expected = x.argmax(dim=-1)
    assert torch.equal(argmax_rows(x), expected)
    if case != "random":
        assert expected.unique().numel() == 1  # the case says what it means to
        assert expected[0].item() == {"first_of_ties": 7, "nan_after_max": 40_000,
                                      "all_minus_inf": 0}[case]  # fmt: skip


def test_rows_the_kernel_does_not_take_go_to_torch():
    x = torch.randn(6, 40)
    for other in (x.t(), x.bfloat16(), x.double(), x[:, ::2]):
        assert torch.equal(argmax_rows(other), other.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 5)).shape == (0,)
    with pytest.raises(IndexError):
        argmax_rows(torch.empty(3, 0))
