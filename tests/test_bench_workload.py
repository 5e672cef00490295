"""The benchmark workload: deterministic per seed, lengths inside the inclusive ranges,
and the MIN,MAX option parser."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.bench.workload import length_range, synthetic_workload


def test_same_seed_same_requests_and_lengths_within_ranges():
    first = synthetic_workload(50, seed=3, prompt_len=(4, 9), output_len=(1, 2))
    assert first == synthetic_workload(50, seed=3, prompt_len=(4, 9), output_len=(1, 2))
    assert first != synthetic_workload(50, seed=4, prompt_len=(4, 9), output_len=(1, 2))
    assert {len(r.prompt_token_ids) for r in first} == set(range(4, 10))
    assert {r.output_len for r in first} == {1, 2}
    assert all(16 <= t < 49152 for r in first for t in r.prompt_token_ids)


def test_length_range():
    assert length_range("32,512") == (32, 512)
    assert length_range("7,7") == (7, 7)
    for bad in ("5,2", "0,4", "12", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            length_range(bad)
