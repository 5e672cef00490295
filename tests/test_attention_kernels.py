"""The fast CPU kernels against the gather-then-dense oracle and torch's SDPA.

Tolerances: float32 atol = rtol = 2e-5 (both sides accumulate in float32, in different
orders). bfloat16 atol = rtol = 1.6e-2, two bfloat16 steps near 1: inputs are the same
bfloat16 values on every side, but the kernel and the oracle each round their float32
result to bfloat16 once, and SDPA is run in float32 on the upcast inputs.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_cases import build_case, sdpa_expected

from pagedllm.attention.reference import reference_paged_attention
from pagedllm.cpu import paged_attention

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
BLOCK_SIZES = [1, 4, 16, 32, 128]
GQA_RATIOS = [1, 3, 4]
MODES = ["decode", "prefill", "chunked_prefill", "mixed"]


def lengths_for(mode: str, rng: random.Random, max_len: int) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens) of a batch of 1 to 4 sequences."""

    def length() -> int:
        return min(max_len, int(2 ** rng.uniform(0, 11)))  # log-uniform in 1 .. 2000

    seq_lens = [length() for _ in range(rng.randint(1, 4))]
    if mode == "decode":
        return seq_lens, [1] * len(seq_lens)
    if mode == "prefill":
        seq_lens = [min(n, 200) for n in seq_lens]
        return seq_lens, seq_lens
    if mode == "chunked_prefill":
        return seq_lens, [rng.randint(1, min(n, 128)) for n in seq_lens]
    seq_lens = [max(2, n) for n in seq_lens] + [rng.randint(1, 150)]
    query_lens = [1] * (len(seq_lens) - 2) + [rng.randint(2, seq_lens[-2]), seq_lens[-1]]
    return seq_lens, [min(q, n) for q, n in zip(query_lens, seq_lens, strict=True)]


def grid() -> list[tuple]:
    """Every (block size, GQA ratio, mode) once; head_dim, dtype, and lengths sampled."""
    rng = random.Random(4)
    cases = []
    for block_size in BLOCK_SIZES:
        for ratio in GQA_RATIOS:
            for mode in MODES:
                head_dim = rng.choice([64, 128])
                dtype = rng.choice([torch.float32, torch.bfloat16])
                max_len = 2000 if block_size > 1 else 700
                seq_lens, query_lens = lengths_for(mode, rng, max_len)
                cases.append((block_size, ratio, head_dim, dtype, mode, seq_lens, query_lens))
    return cases


def kernel_output(case) -> torch.Tensor:
    """The CPU kernel's attention over the case's paged K/V."""
    md = case.metadata
    out = torch.empty_like(case.q)
    paged_attention(
        out, case.q, case.k_cache, case.v_cache, md.block_tables, md.seq_lens,
        md.query_start_loc, case.scale,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("block_size", "ratio", "head_dim", "dtype", "mode", "seq_lens", "query_lens"), grid()
)
def test_kernel_matches_reference_and_sdpa(
    block_size, ratio, head_dim, dtype, mode, seq_lens, query_lens
):
    num_kv_heads = 2
    case = build_case(
        seq_lens,
        query_lens,
        block_size,
        ratio * num_kv_heads,
        num_kv_heads,
        head_dim,
        dtype,
        seed=block_size * 100 + ratio * 10 + MODES.index(mode),
        shared_prefix_blocks=2,
    )
    out = kernel_output(case)
    expected = reference_paged_attention(
        case.q, case.k_cache, case.v_cache, case.metadata, case.scale
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), sdpa_expected(case), atol=tol, rtol=tol)


def test_sequence_of_length_2000_in_blocks_of_16():
    case = build_case([2000, 1999], [1, 64], 16, 9, 3, 64, torch.float32, seed=7)
    torch.testing.assert_close(kernel_output(case), sdpa_expected(case), atol=2e-5, rtol=2e-5)


def test_rejects_block_outside_the_cache():
    case = build_case([40], [1], 16, 4, 2, 64, torch.float32, seed=1)
    case.metadata.block_tables[0, 1] = case.k_cache.shape[0]
    md = case.metadata
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_attention(
            torch.empty_like(case.q), case.q, case.k_cache, case.v_cache, md.block_tables,
            md.seq_lens, md.query_start_loc, case.scale,
        )  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [64, 200, 37, 5]], ids=["decode", "prefill"])
def test_bfloat16_result_is_the_exact_one_rounded_once(head_dim, query_lens):
    """bfloat16 queries and K/V (on CPUs with AVX-512 BF16, scored by the pair dot product):
    the float32 accumulation leaves the output the exact result rounded once to bfloat16
    in >= 99.5% of values (measured 99.9%; the scores scaled by 1.001 give 70%), and
    never off by more than a bfloat16 step plus a small absolute error."""
    case = build_case([300, 200, 900, 17], query_lens, 16, 6, 2, head_dim, torch.bfloat16, 3)
    out = kernel_output(case)
    exact = sdpa_expected(case, torch.float64)
    assert (out == exact.to(torch.bfloat16)).double().mean() >= 0.995
    assert ((out.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-4).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_decode_batch_under_all_heads_at_once_has_the_bits_of_each_row_alone(
    dtype, head_dim
):
    """24 decode sequences are enough work items for the kernel to take each one under
    every kv head at once, the heads taking turns chunk by chunk; one sequence alone is
    attended one head at a time. The rows must agree to the bit, and with the reference."""
    rng = random.Random(5)
    seq_lens = [rng.randint(1, 600) for _ in range(24)]
    case = build_case(seq_lens, [1] * 24, 16, 9, 3, head_dim, dtype, seed=head_dim)
    out = kernel_output(case)
    md = case.metadata
    for i in range(len(seq_lens)):
        alone = torch.empty_like(case.q[i : i + 1])
        paged_attention(
            alone, case.q[i : i + 1], case.k_cache, case.v_cache, md.block_tables[i : i + 1],
            md.seq_lens[i : i + 1], md.query_start_loc[:2], case.scale,
        )  # fmt: skip
        assert torch.equal(alone[0], out[i])
    expected = reference_paged_attention(
        case.q, case.k_cache, case.v_cache, case.metadata, case.scale
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
