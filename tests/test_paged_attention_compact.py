"""The C++ kernel over block tables mixing full blocks and compact 4-bit ones
(``paged_attention_compact``) against the oracle: every block decoded (full rows by
``decode_rows``, compact tiles by ``decode_tiles``, keys rotated back) and attended by
``reference_paged_attention``. A table entry ``e >= num_full`` indexes the decoded compact
blocks concatenated after the full ones, as it indexes the tiles in the kernel.

Tolerance: a share of the largest value the rows average (an output is a convex
combination of value rows: a long context averages them down, not their errors). Both
sides accumulate in float32, in different orders: over full blocks alone the kernel is
within ``TOLERANCE`` (1e-5). Over compact blocks it meets the codes in 16-bit fixed
point, the rotated query folded with the key scales and each step's weights, so scores
and weights are off by up to 1/65,000 of their largest, about a thousandth of what the
4-bit codes themselves lose: ``COMPACT_TOLERANCE`` (5e-4); measured at most 2.1e-4 over
these cases, the peaked softmax the largest. A tile read in a wrong layout is off by
1e-2 to 1.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from paged_cases import read_only_metadata

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import reference_paged_attention
from pagedllm.cpu import paged_attention_compact
from pagedllm.kv_storage.compact_blocks import (
    TileLayout,
    decode_tiles,
    encode_tiles,
    key_bit_order,
)
from pagedllm.kv_storage.int4_codec import hadamard
from pagedllm.kv_storage.kv_quant import KVFormat, decode_rows, encode_rows, resolve_kv_format

TOLERANCE = 1e-5
COMPACT_TOLERANCE = 5e-4
LAYOUTS = ["compact_first", "all_compact", "all_full", "shuffled"]
MODES = ["decode", "prefill", "mixed"]


@dataclass
class MixedCase:
    """A flattened batch over two pools: full blocks of one format, compact tiles."""

    q: torch.Tensor
    k_cache: torch.Tensor  # [num_full, Hkv, B, row] of the format's dtype
    v_cache: torch.Tensor
    tiles: torch.Tensor  # [num_compact, Hkv, tile_bytes] uint8
    metadata: AttentionMetadata
    fmt: KVFormat
    scale: float

    @property
    def num_full(self) -> int:
        return self.k_cache.shape[0]


def block_kinds(layout: str, num_blocks: int, rng: random.Random) -> list[bool]:
    """Which logical blocks of a sequence are compact: the older ones (all but the last
    two, as the cache keeps a recent window full), all, none, or any."""
    if layout == "compact_first":
        return [i < num_blocks - 2 for i in range(num_blocks)]
    if layout == "all_compact":
        return [True] * num_blocks
    if layout == "all_full":
        return [False] * num_blocks
    return [rng.random() < 0.5 for _ in range(num_blocks)]


def build_case(
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    fmt_name: str,
    layout: str,
    seed: int,
    query_scale: float = 1.0,
) -> MixedCase:
    """Random K/V in scattered blocks of both pools (a few spare blocks in each), tables
    laid out by ``layout``; the last block of a sequence is partly filled when its length
    is not a multiple of the block size."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    kinds = [block_kinds(layout, math.ceil(n / block_size), rng) for n in seq_lens]
    num_compact = sum(map(sum, kinds)) + 2
    num_full = sum(len(k) - sum(k) for k in kinds) + 2
    full_ids = torch.randperm(num_full, generator=gen).tolist()
    compact_ids = torch.randperm(num_compact, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max(map(len, kinds)) + 1), -1, dtype=torch.int32)
    for i, seq_kinds in enumerate(kinds):
        for j, compact in enumerate(seq_kinds):
            tables[i, j] = num_full + compact_ids.pop() if compact else full_ids.pop()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    fmt = resolve_kv_format("auto" if fmt_name == "float32" else fmt_name, torch.float32)
    full_shape = (num_full, num_kv_heads, block_size, head_dim)
    k_cache = encode_rows(randn(*full_shape), fmt).view(fmt.dtype)
    v_cache = encode_rows(randn(*full_shape), fmt).view(fmt.dtype)
    compact_shape = (num_compact, num_kv_heads, block_size, head_dim)
    tiles = encode_tiles(randn(*compact_shape), randn(*compact_shape))
    metadata = read_only_metadata(tables, seq_lens, query_lens)
    q = randn(metadata.num_tokens, num_q_heads, head_dim) * query_scale
    return MixedCase(q, k_cache, v_cache, tiles, metadata, fmt, head_dim**-0.5)


def kernel_output(
    case: MixedCase, tiles: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    md = case.metadata
    head_dim = case.q.shape[-1]
    out = torch.full_like(case.q, float("nan"))
    paged_attention_compact(
        out, case.q, (case.q @ hadamard(head_dim)).contiguous(), case.k_cache, case.v_cache,
        case.tiles if tiles is None else tiles, case.num_full, md.block_tables, md.seq_lens,
        md.query_start_loc, case.scale, window, softcap,
    )  # fmt: skip
    return out


def oracle_output(
    case: MixedCase, window: int = 0, softcap: float = 0.0
) -> tuple[torch.Tensor, float]:
    """The oracle's output and the absolute tolerance: the share for the blocks the
    tables read (any compact one, or full ones only) of the largest value averaged."""
    block_size, head_dim = case.k_cache.shape[2], case.q.shape[-1]
    compact_keys, compact_values = decode_tiles(case.tiles, block_size, head_dim)
    keys = torch.cat([decode_rows(case.k_cache, case.fmt), compact_keys])
    values = torch.cat([decode_rows(case.v_cache, case.fmt), compact_values])
    out = reference_paged_attention(
        case.q, keys, values, case.metadata, case.scale, window or None, softcap or None
    )
    reads_compact = bool((case.metadata.block_tables >= case.num_full).any())
    share = COMPACT_TOLERANCE if reads_compact else TOLERANCE
    return out, share * values.abs().max().item()


def assert_matches(out: torch.Tensor, oracle: tuple[torch.Tensor, float]) -> None:
    expected, atol = oracle
    torch.testing.assert_close(out, expected, atol=atol, rtol=0)


def lengths_for(mode: str, rng: random.Random, block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, query_lens) of 1 to 4 sequences of different lengths: decode rows,
    prefill chunks (whole short sequences, the last tokens of long ones), or both."""
    num_seqs = rng.randint(1, 4)
    seq_lens = [rng.randint(2 * block_size, 40 * block_size) for _ in range(num_seqs)]
    if mode == "decode":
        return seq_lens, [1] * num_seqs
    if mode == "prefill":
        seq_lens = [min(n, 300) if rng.random() < 0.5 else n for n in seq_lens]
        return seq_lens, [min(n, rng.randint(20, 90)) for n in seq_lens]
    query_lens = [1] * (num_seqs - 1) + [rng.randint(2, 70)]
    return seq_lens, query_lens


def grid() -> list[tuple]:
    """Every (block size, layout, mode) once; head dim, GQA ratio, format and lengths
    sampled."""
    rng = random.Random(11)
    cases = []
    for block_size in (16, 64):
        for layout in LAYOUTS:
            for mode in MODES:
                head_dim = rng.choice([64, 128])
                ratio = rng.choice([1, 3, 4])
                fmt_name = rng.choice(["float32", "bfloat16", "int8"])
                seq_lens, query_lens = lengths_for(mode, rng, block_size)
                cases.append(
                    (block_size, layout, mode, head_dim, ratio, fmt_name, seq_lens, query_lens)
                )
    return cases


@pytest.mark.parametrize(
    ("block_size", "layout", "mode", "head_dim", "ratio", "fmt_name", "seq_lens", "query_lens"),
    grid(),
)
def test_matches_the_oracle(
    block_size, layout, mode, head_dim, ratio, fmt_name, seq_lens, query_lens
):
    num_kv_heads = 2
    case = build_case(
        seq_lens, query_lens, block_size, ratio * num_kv_heads, num_kv_heads, head_dim,
        fmt_name, layout, seed=block_size + 7 * LAYOUTS.index(layout) + 31 * MODES.index(mode),
    )  # fmt: skip
    assert_matches(kernel_output(case), oracle_output(case))


@pytest.mark.parametrize("head_dim", [32, 256])
@pytest.mark.parametrize("fmt_name", ["float16", "fp8_e4m3", "fp8_e5m2"])
def test_other_head_dims_and_formats(head_dim, fmt_name):
    case = build_case([700, 93], [1, 40], 16, 6, 2, head_dim, fmt_name, "shuffled", seed=head_dim)
    assert_matches(kernel_output(case), oracle_output(case))


@pytest.mark.parametrize("ratio", [5, 7])
def test_query_heads_in_no_multiple_of_2_to_4(ratio):
    """Rows go 4 at a time and the 1 or 3 left over when no count up to 4 divides them."""
    case = build_case([1200, 77], [1, 33], 64, ratio, 1, 128, "int8", "compact_first", seed=ratio)
    assert_matches(kernel_output(case), oracle_output(case))


@pytest.mark.parametrize("layout", ["compact_first", "shuffled"])
@pytest.mark.parametrize(("window", "softcap"), [(37, 0.0), (200, 0.0), (0, 8.0), (150, 5.0)])
def test_sliding_window_and_softcap(layout, window, softcap):
    case = build_case(
        [1500, 301, 64], [1, 60, 64], 16, 9, 3, 64, "bfloat16", layout, seed=window,
        query_scale=3.0,
    )  # fmt: skip
    expected = oracle_output(case, window, softcap)
    assert_matches(kernel_output(case, window=window, softcap=softcap), expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_long_decode_split_between_threads(threads):
    """A few long sequences decoding: with several threads each (sequence, kv head) is
    split into parts whose softmax states are merged; the same result either way."""
    case = build_case([8000, 5000], [1, 1], 64, 9, 3, 64, "bfloat16", "compact_first", seed=5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernel_output(case)
    finally:
        torch.set_num_threads(before)
    assert_matches(out, oracle_output(case))


def sharp_case() -> MixedCase:
    """Peaked softmax (queries 4x larger) over all-compact tables, decode and prefill."""
    return build_case(
        [900, 450], [1, 70], 64, 6, 2, 64, "float32", "all_compact", seed=3, query_scale=4.0
    )


def test_peaked_softmax():
    case = sharp_case()
    assert_matches(kernel_output(case), oracle_output(case))


def corrupted(tiles: torch.Tensor, how: str, block_size: int, head_dim: int) -> torch.Tensor:
    """Tiles in a wrong layout: code bytes with their nibbles swapped, key codes stored
    channel-major (as [D/2, B] for a [B, D/2] section), the keys' fifth bits where their
    key nibbles lie rather than where key_bit_order moves them, or the key scale and zero
    sections swapped."""
    layout = TileLayout(block_size, head_dim)
    tiles = tiles.clone()
    codes = tiles[..., : 2 * layout.codes_bytes]
    if how == "nibbles":
        codes.copy_((codes >> 4) | (codes << 4))
    elif how == "transposed":
        keys = tiles[..., : layout.codes_bytes]
        shape = (*keys.shape[:-1], block_size, head_dim // 2)
        keys.copy_(keys.reshape(shape).transpose(-1, -2).reshape(keys.shape))
    elif how == "fifth_bits_unmoved":
        values = tiles[..., layout.codes_bytes : 2 * layout.codes_bytes]
        rows = values.reshape(*values.shape[:-1], block_size, head_dim // 2)
        unmoved = (rows & 0x77) | key_bit_order(rows & 0x88)
        values.copy_(unmoved.reshape(values.shape))
    else:
        scale = tiles[..., layout.key_scale_offset : layout.key_zero_offset].clone()
        tiles[..., layout.key_scale_offset : layout.key_zero_offset] = tiles[
            ..., layout.key_zero_offset : layout.value_scale_offset
        ]
        tiles[..., layout.key_zero_offset : layout.value_scale_offset] = scale
    return tiles


@pytest.mark.parametrize("how", ["nibbles", "transposed", "fifth_bits_unmoved", "scale_zero"])
def test_a_wrong_tile_layout_fails(how):
    """The comparison can fail: tiles written in another layout than the kernel reads."""
    case = sharp_case()
    wrong = corrupted(case.tiles, how, 64, 64)
    with pytest.raises(AssertionError):
        assert_matches(kernel_output(case, tiles=wrong), oracle_output(case))


def test_rejects_block_outside_the_pools():
    case = build_case([100], [1], 16, 4, 2, 64, "float32", "shuffled", seed=1)
    case.metadata.block_tables[0, 2] = case.num_full + case.tiles.shape[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel_output(case)


def test_rejects_tiles_of_another_block_size():
    case = build_case([100], [1], 16, 4, 2, 64, "float32", "shuffled", seed=1)
    other = encode_tiles(torch.zeros(3, 2, 32, 64), torch.zeros(3, 2, 32, 64))
    with pytest.raises(RuntimeError, match="tiles are contiguous uint8"):
        kernel_output(case, tiles=other)
