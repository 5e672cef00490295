"""The Triton kernels against the gather-and-dense oracle: K/V write, split-K decode and
the mixed-batch prefill, over float, int8 and fp8 caches.

Without CUDA they run on CPU tensors under Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``), where bfloat16 products run in float32 (see
``pagedllm.gpu.kernel_dtypes``); on a CUDA device the same tests run the compiled kernels.
Tolerances (absolute, outputs of size ~1): float32 1e-5; float16 4e-3; bfloat16 3e-2
(the output itself is rounded to bfloat16, and a GPU rounds the probabilities to
bfloat16 before multiplying V).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import build_case  # noqa: E402

from pagedllm.attention.backend import AttentionOptions  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.attention.reference import (  # noqa: E402
    dense_causal_attention,
    reference_paged_attention,
)
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.gpu.triton_decode import decode_attention, plan_splits  # noqa: E402
from pagedllm.gpu.triton_kv_write import write_kv  # noqa: E402
from pagedllm.gpu.triton_prefill import prefill_attention  # noqa: E402
from pagedllm.kv_storage.kv_cache import KVCache  # noqa: E402
from pagedllm.kv_storage.kv_quant import decode_rows, encode_rows, resolve_kv_format  # noqa: E402

pytestmark = pytest.mark.triton

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def on_device(metadata: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=metadata.slot_mapping.to(DEVICE),
        block_tables=metadata.block_tables.to(DEVICE),
        seq_lens=metadata.seq_lens.to(DEVICE),
        query_start_loc=metadata.query_start_loc.to(DEVICE),
        max_query_len=metadata.max_query_len,
        max_seq_len=metadata.max_seq_len,
    )


def max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    return (got.cpu().float() - expected.float()).abs().max().item()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16", "float16", "int8", "fp8_e4m3",
                                            "fp8_e5m2"])  # fmt: skip
@pytest.mark.parametrize("source_dtype", [torch.float32, torch.bfloat16])
def test_write_stores_encode_rows_bytes(kv_cache_dtype, source_dtype):
    """Every written row holds exactly the bytes of ``encode_rows`` (codes and scale);
    slots marked -1 and slots not in the mapping keep their old bytes."""
    gen = torch.Generator().manual_seed(1)
    heads, dim, block, tokens = 3, 64, 4, 24
    cache = KVCache(1, 10, block, heads, dim, torch.float32, DEVICE, kv_cache_dtype)
    cache.tensor.view(torch.uint8).fill_(0xA5)  # sentinel bytes
    before = cache.tensor.clone()
    magnitudes = torch.logspace(-30, 4, tokens)[:, None, None]  # fp8 subnormals to large
    k = (torch.randn(tokens, heads, dim, generator=gen) * magnitudes).to(source_dtype)
    k[0] = 0.0  # an all-zero row: smallest scale, zero codes
    k[1, 0, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 3.5, -1e-3])  # int8 ties
    v = torch.randn(tokens, heads, dim, generator=gen).to(source_dtype)
    slots = torch.randperm(cache.num_slots, generator=gen)[:tokens]
    slots[[3, 17]] = -1
    write_kv(k.to(DEVICE), v.to(DEVICE), cache.tensor[0, 0], cache.tensor[0, 1],
             slots.to(DEVICE), cache.format)  # fmt: skip

    def rows(layer_half: torch.Tensor) -> torch.Tensor:  # [slot, head, row]
        return layer_half.cpu().transpose(1, 2).reshape(cache.num_slots, heads, -1)

    written = slots >= 0
    for half, source in ((0, k), (1, v)):
        got, old = rows(cache.tensor[0, half]), rows(before[0, half])
        expected = encode_rows(source[written], cache.format)
        assert torch.equal(got[slots[written]].view(torch.uint8), expected.view(torch.uint8))
        untouched = torch.ones(cache.num_slots, dtype=torch.bool)
        untouched[slots[written]] = False
        assert torch.equal(got[untouched].view(torch.uint8), old[untouched].view(torch.uint8))


def test_plan_splits_covers_the_longest_sequence_in_whole_tiles():
    plans = [(64, 8, 4096, 32, 528), (1, 1, 1, 16, 8), (3, 2, 1000, 64, 1), (2, 4, 0, 32, 64)]
    for seqs, heads, max_len, tile, programs in plans:
        split_tokens, num_splits = plan_splits(seqs, heads, max_len, tile, programs)
        assert split_tokens % tile == 0 and num_splits >= 1
        assert split_tokens * num_splits >= max_len
        assert split_tokens * (num_splits - 1) < max(max_len, 1)  # no split starts past it
        assert num_splits <= max(1, math.ceil(programs / (seqs * heads)))
    assert plan_splits(1, 1, 4096, 32, 132 * 4)[1] > 1


# (block_size, q heads, kv heads, head_dim, query dtype, split_tokens): GQA 4, 2, 1 and MQA
DECODE_CASES = [
    (16, 8, 2, 64, torch.bfloat16, None),
    (8, 4, 4, 64, torch.float32, 32),
    (32, 8, 1, 128, torch.float16, 32),
    (16, 4, 2, 128, torch.float32, 64),
]


@pytest.mark.parametrize(("block", "hq", "hkv", "dim", "dtype", "split"), DECODE_CASES)
def test_decode_matches_reference(block, hq, hkv, dim, dtype, split):
    """Scattered blocks, sequences sharing prefix blocks, lengths off the block grid; with
    ``split`` set the long sequences are cut into several splits merged by pass 2."""
    case = build_case([150, 5, 77, 33], [1] * 4, block, hq, hkv, dim, dtype, seed=block + dim,
                      shared_prefix_blocks=2)  # fmt: skip
    fmt = resolve_kv_format("auto", dtype)
    meta = on_device(case.metadata)
    out = decode_attention(
        case.q.to(DEVICE), case.k_cache.to(DEVICE), case.v_cache.to(DEVICE),
        meta.block_tables, meta.seq_lens, meta.max_seq_len, case.scale, fmt, split_tokens=split,
        tile_tokens=32 if split else None,
    )  # fmt: skip
    expected = reference_paged_attention(case.q, case.k_cache, case.v_cache, case.metadata,
                                         case.scale)  # fmt: skip
    assert max_error(out, expected) <= TOLERANCE[dtype]


def test_decode_of_an_empty_sequence_is_zero_and_leaves_the_others_alone():
    """A padding row (seq_len 0, as in a captured batch larger than the real one)."""
    case = build_case([40, 1, 9], [1] * 3, 8, 4, 2, 64, torch.float32, seed=3)
    meta = on_device(case.metadata)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 0
    out = decode_attention(case.q.to(DEVICE), case.k_cache.to(DEVICE), case.v_cache.to(DEVICE),
                           meta.block_tables, seq_lens, 40, case.scale,
                           resolve_kv_format("auto", torch.float32), split_tokens=16,
                           tile_tokens=16)  # fmt: skip
    expected = reference_paged_attention(case.q, case.k_cache, case.v_cache, case.metadata,
                                         case.scale)  # fmt: skip
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
    assert max_error(out[[0, 2]], expected[[0, 2]]) <= 1e-5


# (block_size, q heads, kv heads, head_dim, query dtype, block_m)
PREFILL_CASES = [
    (16, 8, 2, 64, torch.bfloat16, 32),
    (8, 4, 1, 64, torch.float16, 16),
    (32, 4, 4, 128, torch.float32, 16),
]


@pytest.mark.parametrize(("block", "hq", "hkv", "dim", "dtype", "block_m"), PREFILL_CASES)
def test_prefill_mixed_batch_matches_reference(block, hq, hkv, dim, dtype, block_m):
    """One launch for: a chunk that is the tail of a sequence whose prefix is cached
    (and shared), a whole prompt, two decode rows, and a one-token chunk."""
    case = build_case([70, 37, 51, 9, 20], [23, 37, 1, 1, 1], block, hq, hkv, dim, dtype,
                      seed=block + hq, shared_prefix_blocks=1)  # fmt: skip
    fmt = resolve_kv_format("auto", dtype)
    meta = on_device(case.metadata)
    out = prefill_attention(
        case.q.to(DEVICE), case.k_cache.to(DEVICE), case.v_cache.to(DEVICE), meta.block_tables,
        meta.seq_lens, meta.query_start_loc, meta.max_query_len, case.scale, fmt,
        block_m=block_m, block_n=max(16, block),
    )  # fmt: skip
    expected = reference_paged_attention(case.q, case.k_cache, case.v_cache, case.metadata,
                                         case.scale)  # fmt: skip
    assert max_error(out, expected) <= TOLERANCE[dtype]


def write_case_through_backend(case, kv_cache_dtype: str, model_dtype: torch.dtype):
    """A KVCache of ``kv_cache_dtype`` holding ``case``'s K/V, written by the Triton write
    kernel at the case's block tables, and the backend over it."""
    num_blocks, hkv, block, dim = case.k_cache.shape
    cache = KVCache(1, num_blocks, block, hkv, dim, model_dtype, DEVICE, kv_cache_dtype)
    backend = TritonAttentionBackend(cache)
    tables = case.metadata.block_tables.long()
    slots, keys, values = [], [], []
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        pos = torch.arange(k.shape[1])
        slots.append(tables[i, pos // block] * block + pos % block)
        keys.append(k.transpose(0, 1))
        values.append(v.transpose(0, 1))
    write_kv(torch.cat(keys).to(DEVICE), torch.cat(values).to(DEVICE), cache.tensor[0, 0],
             cache.tensor[0, 1], torch.cat(slots).to(DEVICE), cache.format)  # fmt: skip
    return cache, backend


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [12, 1, 5]], ids=["decode", "mixed"])
def test_quantized_cache_matches_reference_on_decoded_rows(kv_cache_dtype, query_lens):
    """The kernels decode codes x scale inside; the oracle attends over ``decode_rows`` of
    the same cache bytes, so only the arithmetic order differs (bfloat16 query)."""
    dtype = torch.bfloat16
    case = build_case([45, 30, 18], query_lens, 16, 8, 2, 64, dtype, seed=7,
                      shared_prefix_blocks=1)  # fmt: skip
    cache, backend = write_case_through_backend(case, kv_cache_dtype, dtype)
    meta = on_device(case.metadata)
    fmt = cache.format
    if meta.is_decode_only:
        out = decode_attention(case.q.to(DEVICE), cache.tensor[0, 0], cache.tensor[0, 1],
                               meta.block_tables, meta.seq_lens, meta.max_seq_len, case.scale,
                               fmt, split_tokens=32, tile_tokens=32)  # fmt: skip
    else:
        out = prefill_attention(case.q.to(DEVICE), cache.tensor[0, 0], cache.tensor[0, 1],
                                meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                meta.max_query_len, case.scale, fmt, block_m=16)  # fmt: skip
    keys, values = decode_rows(cache.key(0).cpu(), fmt), decode_rows(cache.value(0).cpu(), fmt)
    expected = reference_paged_attention(case.q, keys, values, case.metadata, case.scale)
    assert max_error(out, expected) <= TOLERANCE[dtype]


def test_backend_writes_then_attends_over_chunked_steps():
    """The backend as the engine drives it: a prompt prefilled in two chunks beside
    another prompt that then decodes, then a decode-only step; each step's K/V are
    written at slot_mapping before attention reads them."""
    dtype, block, hq, hkv, dim = torch.float16, 8, 4, 2, 64
    gen = torch.Generator().manual_seed(11)
    cache = KVCache(1, 16, block, hkv, dim, dtype, DEVICE)
    backend = TritonAttentionBackend(cache)
    tables = [[5, 2, 9, 12], [7, 0, 14]]
    lengths = [30, 21]
    keys = [torch.randn(n, hkv, dim, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(n, hkv, dim, generator=gen).to(dtype) for n in lengths]
    queries = [torch.randn(n, hq, dim, generator=gen).to(dtype) for n in lengths]
    scale = dim**-0.5
    # (positions of sequence 0, positions of sequence 1) run by each step
    steps = [(range(0, 12), range(0, 20)), (range(12, 29), range(20, 21)), (range(29, 30), None)]
    for spans in steps:
        batch = [(i, s) for i, s in enumerate(spans) if s is not None]
        rows = [(i, p) for i, s in batch for p in s]
        slot_mapping = [tables[i][p // block] * block + p % block for i, p in rows]
        q = torch.stack([queries[i][p] for i, p in rows])
        k = torch.stack([keys[i][p] for i, p in rows])
        v = torch.stack([values[i][p] for i, p in rows])
        starts = [0]
        for _, s in batch:
            starts.append(starts[-1] + len(s))
        width = max(len(tables[i]) for i, _ in batch)
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            block_tables=torch.tensor([tables[i] + [-1] * (width - len(tables[i]))
                                       for i, _ in batch], dtype=torch.int32),
            seq_lens=torch.tensor([s.stop for _, s in batch], dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(len(s) for _, s in batch),
            max_seq_len=max(s.stop for _, s in batch),
        )  # fmt: skip
        out = backend.forward(0, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), on_device(metadata),
                              AttentionOptions(scale)).cpu()  # fmt: skip
        assert out.dtype == dtype
        for j, (i, s) in enumerate(batch):
            k_seq, v_seq = (x[i][: s.stop].transpose(0, 1) for x in (keys, values))
            q_rows = queries[i][s.start : s.stop]
            expected = dense_causal_attention(q_rows, k_seq, v_seq, scale).to(dtype)
            assert max_error(out[starts[j] : starts[j] + len(s)], expected) <= TOLERANCE[dtype]


def test_backend_refuses_what_the_kernels_do_not_take():
    with pytest.raises(ValueError, match="head_dim"):
        TritonAttentionBackend(KVCache(1, 4, 8, 2, 48, torch.float32, DEVICE))
    backend = TritonAttentionBackend(KVCache(1, 4, 8, 2, 64, torch.float32, DEVICE))
    q = torch.zeros(2, 4, 64, dtype=torch.float64, device=DEVICE)
    kv = torch.zeros(2, 2, 64, device=DEVICE)
    meta = AttentionMetadata(torch.tensor([0, 1]), torch.tensor([[0]], dtype=torch.int32),
                             torch.tensor([2], dtype=torch.int32),
                             torch.tensor([0, 2], dtype=torch.int32), 2, 2)  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        backend.forward(0, q, kv, kv, on_device(meta), AttentionOptions(0.125))
