"""A query row's attention output does not depend on the tile it is computed in, to the bit.

The CPU kernel scores a decode row (few query rows per tile) by dot products and a
prefill tile (16 tokens x 2-4 query heads per kv head: 24 rows or more) against a
transposed copy of each chunk's keys; both add the same products in the same order. Here every token of a prefilled chunk is also attended
alone, as the one query of a sequence ending at it, and the outputs must be equal
bit for bit, for every cache format, head size, grouping, window and soft cap.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import build_case

from pagedllm.cpu import paged_attention
from pagedllm.kv.kv_quant import encode_rows, resolve_kv_format

# (query dtype, cache format): the formats the kernel reads.
FORMATS = [
    (torch.float32, "float32"),
    (torch.bfloat16, "bfloat16"),
    (torch.float32, "bfloat16"),
    (torch.float32, "float16"),
    (torch.float32, "int8"),
    (torch.float32, "fp8_e4m3"),
]


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
    alone = attend(
        case.q, k_cache, v_cache, table, [p + 1 for p in positions], [1] * chunk, *args
    )
    assert prefilled.isfinite().all()
    assert torch.equal(prefilled, alone)
