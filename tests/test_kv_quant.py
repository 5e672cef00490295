"""Quantized and float16 KV caches: the row codecs against torch's own conversions, the
kernels against a decode-then-dense reference, block counts, copy-on-write.

Tolerances: the kernel and the reference attend over the same decoded values, both in
float32 (the kernel multiplies each dot product by the row's scale, the reference each
element), so they agree to float32 rounding: atol = rtol = 5e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_cases import build_case

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.attention.reference import dense_causal_attention, reference_paged_attention
from pagedllm.cpu import paged_attention, write_kv, write_kv_int8
from pagedllm.kv.capacity import pool_blocks
from pagedllm.kv_storage.key_rotation import key_rotation
from pagedllm.kv_storage.kv_cache import KVCache, bytes_per_block
from pagedllm.kv_storage.kv_quant import SCALE_BYTES, decode_rows, encode_rows, resolve_kv_format

QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]
CACHE_DTYPES = ["float16", "bfloat16", *QUANTIZED]
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KERNEL_TOLERANCE = 5e-5


def stored_scale(rows: torch.Tensor) -> torch.Tensor:
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float()


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_rows_decode_like_torch(name):
    fmt = resolve_kv_format(name, torch.float32)
    x = torch.randn(64, 8, 64) * torch.logspace(-3, 3, 64).view(64, 1, 1)
    rows = encode_rows(x, fmt)
    scale = stored_scale(rows)
    expected = (x / scale).to(FP8[name]).to(torch.float32) * scale
    torch.testing.assert_close(decode_rows(rows, fmt), expected, rtol=0, atol=0)
    # every row's largest element maps near the largest finite code
    codes = rows[..., :-SCALE_BYTES].view(FP8[name]).float().abs().amax(-1)
    assert torch.all(codes <= fmt.max_code) and torch.all(codes >= fmt.max_code * 0.99)


def test_int8_rows_round_to_nearest_with_symmetric_codes():
    fmt = resolve_kv_format("int8", torch.float32)
    x = torch.randn(64, 8, 64) * torch.logspace(-3, 3, 64).view(64, 1, 1)
    rows = encode_rows(x, fmt)
    scale = stored_scale(rows)
    codes = rows[..., :-SCALE_BYTES].view(torch.int8)
    assert codes.min() >= -127
    assert torch.equal(codes, (x / scale).round().to(torch.int8))
    decoded = decode_rows(rows, fmt)
    assert torch.equal(decoded, codes.to(torch.float32) * scale)
    # the scale rounds up to bfloat16, so nothing clips: error at most half a step
    assert torch.all((decoded - x).abs() <= scale * 0.5 * (1 + 1e-6))


def test_zero_rows_stay_zero():
    for name in QUANTIZED:
        fmt = resolve_kv_format(name, torch.float32)
        assert torch.equal(
            decode_rows(encode_rows(torch.zeros(3, 64), fmt), fmt), torch.zeros(3, 64)
        )


def test_same_budget_holds_about_twice_the_blocks_of_bfloat16():
    shape = (30, 16, 3, 64)  # the default model: layers, block size, kv heads, head_dim
    budget = 2**30

    def blocks(model_dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        return pool_blocks(budget, bytes_per_block(*shape, model_dtype, kv_cache_dtype))

    for name in QUANTIZED:
        assert blocks(torch.float32, name) >= 1.9 * blocks(torch.bfloat16)
        assert blocks(torch.float32, name) >= 3.8 * blocks(torch.float32)
    assert blocks(torch.float32, "float16") == blocks(torch.bfloat16)
    cache = KVCache.from_budget(budget // 64, *shape, torch.float32, kv_cache_dtype="int8")
    assert cache.nbytes <= budget // 64
    assert cache.num_blocks == blocks(torch.float32, "int8") // 64


def encoded_case(name: str, block_size: int, ratio: int, head_dim: int, mode: str, seed: int):
    """A paged batch whose caches hold ``name`` rows; returns the case and the caches."""
    if mode == "decode":
        seq_lens, query_lens = [37, 300, 1], [1, 1, 1]
    else:
        seq_lens, query_lens = [150, 90], [150, 40]
    case = build_case(
        seq_lens, query_lens, block_size, 3 * ratio, 3, head_dim, torch.float32, seed, 1
    )
    fmt = resolve_kv_format(name, torch.float32)
    k_cache = encode_rows(case.k_cache * 3, fmt).view(fmt.dtype)
    v_cache = encode_rows(case.v_cache, fmt).view(fmt.dtype)
    return case, fmt, k_cache, v_cache


@pytest.mark.parametrize("name", CACHE_DTYPES)
@pytest.mark.parametrize(
    ("block_size", "ratio", "head_dim", "mode"),
    [(16, 3, 64, "decode"), (16, 3, 64, "prefill"), (4, 1, 128, "prefill"), (32, 4, 80, "decode")],
)
def test_kernel_equals_decode_then_dense(name, block_size, ratio, head_dim, mode):
    case, fmt, k_cache, v_cache = encoded_case(name, block_size, ratio, head_dim, mode, seed=7)
    md = case.metadata
    out = torch.empty_like(case.q)
    paged_attention(
        out,
        case.q,
        k_cache,
        v_cache,
        md.block_tables,
        md.seq_lens,
        md.query_start_loc,
        case.scale,
    )
    expected = reference_paged_attention(
        case.q, decode_rows(k_cache, fmt), decode_rows(v_cache, fmt), md, case.scale
    )
    torch.testing.assert_close(out, expected, atol=KERNEL_TOLERANCE, rtol=KERNEL_TOLERANCE)


@pytest.mark.parametrize("name", list(FP8))
def test_kernel_decodes_every_finite_fp8_code_like_torch(name):
    case, fmt, k_cache, v_cache = encoded_case(name, 16, 3, 64, "decode", seed=1)
    codes = torch.arange(256, dtype=torch.uint8).view(FP8[name])
    finite = codes[codes.float().isfinite()].view(torch.uint8)
    gen = torch.Generator().manual_seed(0)
    for cache in (k_cache, v_cache):
        raw = cache.view(torch.uint8)
        picks = torch.randint(0, finite.numel(), raw[..., :-SCALE_BYTES].shape, generator=gen)
        raw[..., :-SCALE_BYTES] = finite[picks]
        raw[..., :64:8] = finite[: raw[..., :64:8].shape[-1]]  # some codes at fixed places
    # large codes with unit scales overflow the scores: give the rows small scales
    small = torch.full(k_cache.shape[:-1] + (1,), 2**-10, dtype=torch.bfloat16)
    k_cache.view(torch.uint8)[..., -SCALE_BYTES:] = small.view(torch.uint8)
    md = case.metadata
    out = torch.empty_like(case.q)
    paged_attention(
        out, case.q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, 0.125
    )
    expected = reference_paged_attention(
        case.q, decode_rows(k_cache, fmt), decode_rows(v_cache, fmt), md, 0.125
    )
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(FP8))
def test_kernel_widens_all_256_fp8_codes_exactly(name):
    """One position whose value row holds every code (scale 1, keys 0): the output is
    that row, code for code as torch decodes it, NaN and infinities included."""
    head_dim = 256
    rows = torch.zeros(1, 1, 16, head_dim + SCALE_BYTES, dtype=torch.uint8)
    unit = torch.ones(1, dtype=torch.bfloat16).view(torch.uint8)
    rows[..., head_dim:] = unit
    keys = rows.clone().view(FP8[name])
    rows[0, 0, 0, :head_dim] = torch.arange(256, dtype=torch.uint8)
    values = rows.view(FP8[name])
    q = torch.randn(1, 2, head_dim)
    out = torch.empty_like(q)
    one = torch.ones(1, dtype=torch.int32)
    tables, starts = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    paged_attention(out, q, keys, values, tables, one, starts, head_dim**-0.5)
    want = torch.arange(256, dtype=torch.uint8).view(FP8[name]).float()
    torch.testing.assert_close(out, want.expand_as(out), atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("name", QUANTIZED)
def test_backend_write_and_cache_copy_blocks_carry_scales(name):
    cache = KVCache(2, 6, 4, 2, 64, torch.float32, kv_cache_dtype=name)
    k = torch.randn(8, 2, 64) * torch.logspace(-2, 2, 8).view(8, 1, 1)
    v = torch.randn(8, 2, 64)
    slots = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])  # blocks 1 and 2
    PagedAttentionBackend(cache).write(1, k, v, slots)
    stored = decode_rows(cache.key(1)[1:3], cache.format).transpose(1, 2).reshape(8, 2, 64)
    keys = k @ key_rotation(64) if cache.format.rotates_keys else k
    torch.testing.assert_close(stored, decode_rows(encode_rows(keys, cache.format), cache.format))
    cache.copy_blocks([(1, 4), (2, 5)])
    assert torch.equal(cache.tensor[:, :, 4:6], cache.tensor[:, :, 1:3])
    assert cache.tensor.dtype == torch.uint8 and cache.tensor.shape[-1] == 64 + SCALE_BYTES


def test_unknown_kv_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_format("int2", torch.float32)


def test_int4_keeps_its_recent_blocks_in_the_models_dtype():
    assert resolve_kv_format("int4", torch.bfloat16).dtype == torch.bfloat16
    assert not resolve_kv_format("int4", torch.float32).quantized


@pytest.mark.parametrize("head_dim", [16, 64, 80, 96, 112, 128])
def test_key_rotation_is_orthonormal_and_symmetric(head_dim):
    rotation = key_rotation(head_dim)
    torch.testing.assert_close(rotation @ rotation, torch.eye(head_dim), atol=1e-6, rtol=0)
    assert torch.equal(rotation, rotation.T)
    # every row spreads over more than one channel (no block of order 1 unless head_dim is odd)
    assert (rotation != 0).sum(dim=1).min() >= 16


def outlier_attention_error(rotated: bool) -> float:
    """Largest deviation from float32 attention of one decode row over an int8 cache whose
    keys carry two large channels (as trained models' keys do), keys stored rotated or
    not."""
    gen = torch.Generator().manual_seed(0)
    tokens, heads, dim = 64, 2, 64
    keys = torch.randn(tokens, heads, dim, generator=gen)
    keys[..., [3, 40]] = 40 + 10 * torch.randn(tokens, heads, 2, generator=gen)
    values = torch.randn(tokens, heads, dim, generator=gen)
    query = torch.randn(1, heads, dim, generator=gen)
    query[..., [3, 40]] = 0.0  # the scores rest on the small channels
    cache = KVCache(1, 16, 16, heads, dim, torch.float32, kv_cache_dtype="int8")
    if not rotated:
        cache.key_rotation = None
    backend = PagedAttentionBackend(cache)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(tokens, dtype=torch.int64),
        block_tables=torch.arange(4, dtype=torch.int32).view(1, 4),
        seq_lens=torch.tensor([tokens], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        max_query_len=1,
        max_seq_len=tokens,
    )
    backend.write(0, keys, values, metadata.slot_mapping)
    metadata = dataclasses.replace(metadata, slot_mapping=torch.full((1,), -1))
    got = backend.forward(0, query, keys[-1:], values[-1:], metadata, AttentionOptions(0.5))
    expected = dense_causal_attention(query, keys.transpose(0, 1), values.transpose(0, 1), 0.5)
    return (got - expected).abs().max().item()


def test_int8_keys_stored_rotated_keep_small_channels():
    """A rotation that the queries did not share, or no rotation, fails this."""
    rotated, plain = outlier_attention_error(True), outlier_attention_error(False)
    assert rotated < 0.12
    assert rotated < plain / 2


def test_the_int8_write_quantizes_as_encode_rows_bit_for_bit():
    """The C++ write that quantizes as it stores gives encode_rows' bytes: rows over 11
    orders of magnitude, an all-zero row, ties rounded to even, a skipped slot."""
    fmt = resolve_kv_format("int8", torch.float32)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(37, 3, 64, generator=gen) * torch.logspace(-8, 3, 37).view(37, 1, 1)
    v = torch.randn(37, 3, 64, generator=gen)
    k[0] = 0.0
    v[1, 0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale 1: codes 127, 2, -4, 0
    v[1, 0, 4:] = 0.0
    slots = torch.randperm(48, generator=gen)[:37]
    slots[5] = -1
    shape = (12, 3, 4, 64 + SCALE_BYTES)
    expected = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2)]
    got = [torch.zeros(shape, dtype=torch.uint8) for _ in range(2)]
    write_kv(*expected, encode_rows(k, fmt), encode_rows(v, fmt), slots)
    write_kv_int8(*got, k, v, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    block, offset = divmod(slots[1].item(), 4)
    assert got[1][block, 0, offset, :4].view(torch.int8).tolist() == [127, 2, -4, 0]
