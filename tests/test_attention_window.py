"""Sliding-window and soft-capped attention in every path against the oracle.

The oracle itself is checked against definitions: a windowed row equals full attention
over its last ``W`` keys alone (SDPA on the sliced K/V), and a soft-capped row equals a
softmax over ``c * tanh(s / c)`` written out. Then the C++ kernel, the Triton kernels
(under the interpreter without CUDA) and the dense backend are checked against the
oracle. Windows are chosen smaller than a block, across the C++ kernel's 32-position
chunks and across Triton tiles. Tolerances as in the kernels' own tests: float32 2e-5
(float32 sums in different orders), bfloat16 1.6e-2 (two bfloat16 steps near 1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from paged_cases import build_case

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.dense_backend import DenseAttentionBackend, dense_metadata
from pagedllm.attention.reference import dense_causal_attention, reference_paged_attention
from pagedllm.cpu import paged_attention

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


def test_oracle_window_equals_attention_over_the_last_keys_alone():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=gen) for s in ((5, 4, 16), (2, 40, 16), (2, 40, 16)))
    window = 7
    out = dense_causal_attention(q, k, v, 0.25, sliding_window=window)
    for i in range(5):
        pos = 35 + i
        keys = k[:, pos - window + 1 : pos + 1].repeat_interleave(2, dim=0)
        values = v[:, pos - window + 1 : pos + 1].repeat_interleave(2, dim=0)
        alone = F.scaled_dot_product_attention(q[i][:, None], keys, values, scale=0.25)
        torch.testing.assert_close(out[i], alone[:, 0], atol=2e-6, rtol=0)


def test_oracle_soft_cap_is_tanh_of_the_scaled_scores():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(*s, generator=gen) * 3 for s in ((1, 1, 16), (1, 9, 16), (1, 9, 16)))
    out = dense_causal_attention(q, k, v, 0.5, logit_softcap=2.0)
    scores = 2.0 * torch.tanh((k[0] @ q[0, 0]) * 0.5 / 2.0)
    torch.testing.assert_close(out[0, 0], torch.softmax(scores, 0) @ v[0], atol=2e-6, rtol=0)
    plain = dense_causal_attention(q, k, v, 0.5)
    assert (out - plain).abs().max() > 1e-2  # the cap is felt at these scores


# (seq_lens, query_lens, block size, window, soft-cap, dtype)
KERNEL_CASES = [
    ([200, 45, 7], [1, 1, 1], 16, 20, None, torch.float32),  # decode
    ([120, 64], [120, 30], 4, 33, None, torch.float32),  # prefill and a chunk
    ([90, 300, 5], [1, 17, 5], 1, 3, 30.0, torch.float32),  # mixed, window < block
    ([150, 70], [1, 40], 16, 64, 5.0, torch.bfloat16),
]


@pytest.mark.parametrize(
    ("seq_lens", "query_lens", "block", "window", "cap", "dtype"), KERNEL_CASES
)
def test_cpu_kernel_matches_oracle(seq_lens, query_lens, block, window, cap, dtype):
    case = build_case(seq_lens, query_lens, block, 8, 2, 64, dtype, seed=block + window,
                      shared_prefix_blocks=1)  # fmt: skip
    md = case.metadata
    out = torch.empty_like(case.q)
    paged_attention(out, case.q, case.k_cache, case.v_cache, md.block_tables, md.seq_lens,
                    md.query_start_loc, case.scale, window, cap or 0.0)  # fmt: skip
    expected = reference_paged_attention(
        case.q, case.k_cache, case.v_cache, md, case.scale, window, cap
    )
    full = reference_paged_attention(case.q, case.k_cache, case.v_cache, md, case.scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)
    assert (expected.float() - full.float()).abs().max() > 10 * tol  # the window matters


@pytest.mark.triton
@pytest.mark.parametrize("window, cap", [(20, None), (50, 4.0)])
def test_triton_kernels_match_oracle(window, cap):
    pytest.importorskip("triton")
    from pagedllm.gpu.triton_decode import decode_attention
    from pagedllm.gpu.triton_prefill import prefill_attention
    from pagedllm.kv_storage.kv_quant import resolve_kv_format

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fmt = resolve_kv_format("auto", torch.float32)
    caches = {}

    def run(seq_lens, query_lens, kernel, **tuning):
        case = build_case(seq_lens, query_lens, 8, 4, 2, 64, torch.float32, seed=window)
        md = case.metadata
        on = {n: getattr(md, n).to(device) for n in ("block_tables", "seq_lens", "query_start_loc")}
        args = [case.q.to(device), case.k_cache.to(device), case.v_cache.to(device),
                on["block_tables"], on["seq_lens"]]  # fmt: skip
        if kernel is prefill_attention:
            args += [on["query_start_loc"], md.max_query_len]
        else:
            args += [md.max_seq_len]
        out = kernel(*args, case.scale, fmt, sliding_window=window, logit_softcap=cap, **tuning)
        caches[kernel] = case
        return out.cpu(), reference_paged_attention(
            case.q, case.k_cache, case.v_cache, md, case.scale, window, cap
        )

    out, expected = run([130, 9, 64], [1, 1, 1], decode_attention, split_tokens=32,
                        tile_tokens=16)  # fmt: skip
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    out, expected = run([100, 70], [40, 1], prefill_attention, block_m=16, block_n=16)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_dense_backend_matches_oracle():
    gen = torch.Generator().manual_seed(3)
    lengths = [30, 12]
    q = torch.randn(sum(lengths), 4, 16, generator=gen)
    k, v = (torch.randn(sum(lengths), 2, 16, generator=gen) for _ in range(2))
    options = AttentionOptions(0.25, sliding_window=5, logit_softcap=3.0)
    out = DenseAttentionBackend().forward(0, q, k, v, dense_metadata(lengths), options)
    start = 0
    for n in lengths:
        rows = slice(start, start + n)
        expected = dense_causal_attention(
            q[rows], k[rows].transpose(0, 1), v[rows].transpose(0, 1), 0.25, 5, 3.0
        )
        torch.testing.assert_close(out[rows], expected, atol=2e-6, rtol=0)
        start += n


def test_options_refuse_meaningless_values():
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionOptions(0.1, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        AttentionOptions(0.1, logit_softcap=-1.0)


def released(case, window: int, block: int):
    """``case``'s caches with one more block, all NaN, and block tables whose entries
    before each sequence's window point at it, as a sliding window releases them (the
    blocks no query of this step reads); a kernel that loads any such row returns NaN."""
    md = case.metadata
    poison = torch.full_like(case.k_cache[:1], float("nan"))
    k_cache, v_cache = torch.cat([case.k_cache, poison]), torch.cat([case.v_cache, poison])
    tables = md.block_tables.clone()
    starts = md.query_start_loc.tolist()
    for i, seq_len in enumerate(md.seq_lens.tolist()):
        first_query = seq_len - (starts[i + 1] - starts[i])
        tables[i, : max(0, first_query - window + 1) // block] = case.k_cache.shape[0]
    return k_cache, v_cache, tables


# (seq_lens, query_lens, block size, window): decode and chunks whose windows start
# inside a C++ chunk of 32 positions and inside a Triton tile, mid-block
RELEASE_CASES = [([200, 77], [1, 1], 4, 21), ([150, 90], [30, 1], 8, 37)]


@pytest.mark.parametrize(("seq_lens", "query_lens", "block", "window"), RELEASE_CASES)
def test_cpu_kernel_never_reads_released_blocks(seq_lens, query_lens, block, window):
    case = build_case(seq_lens, query_lens, block, 8, 2, 64, torch.float32, seed=window)
    md = case.metadata
    k_cache, v_cache, tables = released(case, window, block)
    assert (tables == case.k_cache.shape[0]).sum() > 10
    out = torch.empty_like(case.q)
    paged_attention(out, case.q, k_cache, v_cache, tables, md.seq_lens, md.query_start_loc,
                    case.scale, window, 0.0)  # fmt: skip
    expected = reference_paged_attention(
        case.q, case.k_cache, case.v_cache, md, case.scale, window
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.triton
@pytest.mark.parametrize(("seq_lens", "query_lens", "block", "window"), RELEASE_CASES)
def test_triton_kernels_never_read_released_blocks(seq_lens, query_lens, block, window):
    pytest.importorskip("triton")
    from pagedllm.gpu.triton_decode import decode_attention
    from pagedllm.gpu.triton_prefill import prefill_attention
    from pagedllm.kv_storage.kv_quant import resolve_kv_format

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fmt = resolve_kv_format("auto", torch.float32)
    case = build_case(seq_lens, query_lens, block, 4, 2, 64, torch.float32, seed=window)
    md = case.metadata
    k_cache, v_cache, tables = released(case, window, block)
    common = [case.q, k_cache, v_cache, tables, md.seq_lens]
    common = [t.to(device) for t in common]
    if md.is_decode_only:
        out = decode_attention(*common, md.max_seq_len, case.scale, fmt, sliding_window=window,
                               split_tokens=32, tile_tokens=16)  # fmt: skip
    else:
        out = prefill_attention(*common, md.query_start_loc.to(device), md.max_query_len,
                                case.scale, fmt, sliding_window=window, block_m=16,
                                block_n=16)  # fmt: skip
    expected = reference_paged_attention(
        case.q, case.k_cache, case.v_cache, md, case.scale, window
    )
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
