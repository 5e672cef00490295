"""A query row's attention output does not depend on the tile it is computed in, to the bit.

The CPU kernel scores a decode row (few query rows per tile) by dot products and a
prefill tile (up to 32 tokens x 2-4 query heads per kv head: 24 rows or more) against a
transposed copy of each chunk's keys; both add the same products in the same order. And
decode rows of sequences that share leading blocks are attended together over them, then
each alone over the rest. Here every row is also attended alone, as the one query of a
sequence ending at it, and the outputs must be equal bit for bit, for every cache format,
head size, grouping, window and soft cap.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import build_case

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import reference_paged_attention
from pagedllm.cpu import paged_attention
from pagedllm.kv_storage.kv_quant import decode_rows, encode_rows, resolve_kv_format

# (query dtype, cache format): the formats the kernel reads.
FORMATS = [
    (torch.float32, "float32"),
    (torch.bfloat16, "bfloat16"),
    (torch.float32, "bfloat16"),
    (torch.float32, "float16"),
    (torch.float32, "int8"),
    (torch.float32, "fp8_e4m3"),
]
QUANTIZED = ("int8", "fp8_e4m3")


def caches(case, query_dtype: torch.dtype, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's K/V stored as ``name`` rows."""
    if name == "float32" or query_dtype == torch.bfloat16:
        return case.k_cache, case.v_cache
    fmt = resolve_kv_format(name, torch.float32)
    if name in ("bfloat16", "float16"):
        return case.k_cache.to(fmt.dtype), case.v_cache.to(fmt.dtype)
    k = encode_rows(case.k_cache * 3, fmt).view(fmt.dtype)
    return k, encode_rows(case.v_cache, fmt).view(fmt.dtype)


def attend(q, k_cache, v_cache, table, seq_lens, query_lens, scale, window, softcap):
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = torch.empty_like(q)
    paged_attention(
        out, q, k_cache, v_cache, table.expand(len(seq_lens), -1).contiguous(),
        torch.tensor(seq_lens, dtype=torch.int32), starts, scale, window, softcap,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(("query_dtype", "name"), FORMATS)
@pytest.mark.parametrize(
    ("head_dim", "ratio", "window", "softcap"),
    [(64, 3, 0, 0.0), (128, 2, 0, 0.0), (80, 4, 0, 0.0), (64, 2, 50, 0.0), (64, 3, 0, 20.0)],
)
def test_row_in_a_prefill_tile_equals_the_row_decoded_alone(
    query_dtype, name, head_dim, ratio, window, softcap
):
    seq_len, chunk = 300, 40  # the last 40 tokens are prefilled over 260 cached ones
    dtype = torch.bfloat16 if query_dtype == torch.bfloat16 else torch.float32
    case = build_case([seq_len], [chunk], 16, 2 * ratio, 2, head_dim, dtype, seed=head_dim)
    k_cache, v_cache = caches(case, query_dtype, name)
    table = case.metadata.block_tables[:1]
    args = (case.scale, window, softcap)
    prefilled = attend(case.q, k_cache, v_cache, table, [seq_len], [chunk], *args)
    positions = range(seq_len - chunk, seq_len)
    alone = attend(case.q, k_cache, v_cache, table, [p + 1 for p in positions], [1] * chunk, *args)
    assert prefilled.isfinite().all()
    assert torch.equal(prefilled, alone)


def sharing_tables(gen: torch.Generator, num_blocks: int, blocks_per_seq: int) -> torch.Tensor:
    """20 block tables: 1-11 share sequence 0's first 20 blocks, 12-15 its first 3, and
    16-19 nothing; the rest of every table is blocks of its own."""
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(blocks_per_seq)]]
    for i in range(1, 20):
        shared = 20 if i < 12 else 3 if i < 16 else 0
        tables.append(tables[0][:shared] + [free.pop() for _ in range(blocks_per_seq - shared)])
    return torch.tensor(tables, dtype=torch.int32)


@pytest.mark.parametrize(("query_dtype", "name"), FORMATS)
@pytest.mark.parametrize(("head_dim", "ratio"), [(64, 3), (128, 4)])
def test_decode_rows_sharing_a_prefix_equal_each_row_alone(query_dtype, name, head_dim, ratio):
    """Decode rows of sequences that share leading blocks are attended together over
    them; each row's output is still the one it gets alone, and the reference's."""
    gen = torch.Generator().manual_seed(head_dim + ratio)
    block_size, blocks_per_seq = 16, 27
    dtype = torch.bfloat16 if query_dtype == torch.bfloat16 else torch.float32
    case = build_case([16], [1], block_size, 2 * ratio, 2, head_dim, dtype, seed=ratio)
    num_blocks = 20 * blocks_per_seq + 5
    shape = (num_blocks, 2, block_size, head_dim)
    case.k_cache = torch.randn(*shape, generator=gen).to(dtype)
    case.v_cache = torch.randn(*shape, generator=gen).to(dtype)
    k_cache, v_cache = caches(case, query_dtype, name)
    tables = sharing_tables(gen, num_blocks, blocks_per_seq)
    seq_lens = torch.randint(330, 27 * block_size, (20,), generator=gen).tolist()
    # The last: a prefill chunk over the shared prefix, whose 5-token tail tile is grouped.
    query_lens = [1] * 19 + [37]
    q = torch.randn(sum(query_lens), 2 * ratio, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    together = torch.empty_like(q)
    paged_attention(
        together, q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
        starts, case.scale,
    )  # fmt: skip
    for i in range(20):
        rows = slice(starts[i], starts[i + 1])
        alone = attend(
            q[rows], k_cache, v_cache, tables[i : i + 1], [seq_lens[i]], [query_lens[i]],
            case.scale, 0, 0.0,
        )  # fmt: skip
        assert torch.equal(together[rows], alone), f"sequence {i}"
    metadata = AttentionMetadata(
        slot_mapping=torch.full((len(q),), -1, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=starts,
        max_query_len=37,
        max_seq_len=max(seq_lens),
    )
    if name in QUANTIZED:
        fmt = resolve_kv_format(name, torch.float32)
        keys, values = decode_rows(k_cache, fmt), decode_rows(v_cache, fmt)
    else:
        keys, values = k_cache.float(), v_cache.float()
    expected = reference_paged_attention(q.float(), keys, values, metadata, case.scale)
    tol = 1.6e-2 if dtype == torch.bfloat16 else 5e-5
    torch.testing.assert_close(together.float(), expected, atol=tol, rtol=tol)
