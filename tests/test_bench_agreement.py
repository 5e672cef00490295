"""Greedy agreement counts (pagedllm.bench.agreement)."""

import pytest

from pagedllm.bench.agreement import agreement


def test_equal_positions_and_first_differences():
    result = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 0, 4], [5, 6, 7, 8]])
    assert (result.equal, result.total) == (7, 8)
    assert result.first_differences == [2, 4]
    assert result.equal_share == 7 / 8


def test_outputs_of_other_lengths_are_refused():
    with pytest.raises(ValueError):
        agreement([[1, 2]], [[1]])
