"""The benchmark workloads: deterministic per seed, lengths inside the inclusive ranges,
a prefix shared exactly, and the MIN,MAX option parser."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.bench.workload import length_range, shared_prefix_workload, synthetic_workload


def test_same_seed_same_requests_and_lengths_within_ranges():
    first = synthetic_workload(50, seed=3, prompt_len=(4, 9), output_len=(1, 2))
    assert first == synthetic_workload(50, seed=3, prompt_len=(4, 9), output_len=(1, 2))
    assert first != synthetic_workload(50, seed=4, prompt_len=(4, 9), output_len=(1, 2))
    assert {len(r.prompt_token_ids) for r in first} == set(range(4, 10))
    assert {r.output_len for r in first} == {1, 2}
    assert all(16 <= t < 49152 for r in first for t in r.prompt_token_ids)


def test_shared_prefix_requests_share_exactly_the_prefix():
    requests = shared_prefix_workload(40, seed=1, prefix_len=20, unique_len=(3, 5), output_len=7)
    assert requests == shared_prefix_workload(40, 1, 20, (3, 5), 7)
    prefix = requests[0].prompt_token_ids[:20]
    assert all(r.prompt_token_ids[:20] == prefix and r.output_len == 7 for r in requests)
    assert {len(r.prompt_token_ids) - 20 for r in requests} == {3, 4, 5}
    assert len({tuple(r.prompt_token_ids[20:]) for r in requests}) == 40


def test_length_range():
    assert length_range("32,512") == (32, 512)
    assert length_range("7,7") == (7, 7)
    for bad in ("5,2", "0,4", "12", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            length_range(bad)
