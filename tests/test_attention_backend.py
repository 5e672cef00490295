"""PagedAttentionBackend over a KVCache: its K/V writes at a slot mapping, and steps driven
the way the engine drives them: chunked prefills and decodes of several sequences mixed in
one batch, several layers."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.attention.reference import dense_causal_attention
from pagedllm.kv_storage.kv_cache import KVCache

HQ, HKV, D, BLOCK, LAYERS = 6, 2, 64, 4, 2


def run_steps(dtype: torch.dtype, index_dtype: torch.dtype, seed: int) -> float:
    """Three sequences of different lengths advance by random chunks (prefill) then by one
    token (decode) until done; returns the largest deviation from dense attention."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [17, 5, 24]
    cache = KVCache(LAYERS, 64, BLOCK, HKV, D, dtype)
    backend = PagedAttentionBackend(cache)
    free = list(range(cache.num_blocks))
    rng.shuffle(free)
    tables: list[list[int]] = [[] for _ in lengths]
    keys = [torch.randn(LAYERS, n, HKV, D, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(LAYERS, n, HKV, D, generator=gen).to(dtype) for n in lengths]
    queries = [torch.randn(LAYERS, n, HQ, D, generator=gen).to(dtype) for n in lengths]
    done = [0] * len(lengths)
    worst = 0.0
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        batch = [i for i, n in enumerate(lengths) if done[i] < n]
        spans = []
        for i in batch:
            prompt_left = max(0, lengths[i] // 2 - done[i])
            count = rng.randint(1, prompt_left) if prompt_left else 1
            spans.append(range(done[i], done[i] + count))
            while len(tables[i]) * BLOCK < spans[-1].stop:
                tables[i].append(free.pop())
        slot_mapping = [tables[i][p // BLOCK] * BLOCK + p % BLOCK
                        for i, s in zip(batch, spans, strict=True) for p in s]  # fmt: skip
        width = max(len(tables[i]) for i in batch)
        starts = [0]
        for s in spans:
            starts.append(starts[-1] + len(s))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            block_tables=torch.tensor([tables[i] + [-1] * (width - len(tables[i])) for i in batch],
                                      dtype=index_dtype),
            seq_lens=torch.tensor([s.stop for s in spans], dtype=index_dtype),
            query_start_loc=torch.tensor(starts, dtype=index_dtype),
            max_query_len=max(len(s) for s in spans),
            max_seq_len=max(s.stop for s in spans),
        )  # fmt: skip
        for layer in range(LAYERS):

            def rows(t: list[torch.Tensor]) -> torch.Tensor:
                return torch.cat([t[i][layer, s.start : s.stop] for i, s in zip(batch, spans)])  # noqa: B023,B905

            options = AttentionOptions(0.125)
            out = backend.forward(layer, rows(queries), rows(keys), rows(values), metadata, options)
            assert out.dtype == dtype and out.shape == (starts[-1], HQ, D)
            for row, (i, s) in enumerate(zip(batch, spans, strict=True)):
                dense = dense_causal_attention(
                    queries[i][layer, s.start : s.stop],
                    keys[i][layer, : s.stop].transpose(0, 1),
                    values[i][layer, : s.stop].transpose(0, 1),
                    0.125,
                )
                got = out[starts[row] : starts[row + 1]].float()
                worst = max(worst, (got - dense).abs().max().item())
        for i, s in zip(batch, spans, strict=True):
            done[i] = s.stop
    return worst


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_steps_in_float32_match_dense_attention(index_dtype):
    assert run_steps(torch.float32, index_dtype, seed=3) <= 2e-5


def test_steps_in_bfloat16_match_dense_attention():
    # Inputs are the same bfloat16 values on both sides; only the output rounding differs.
    assert run_steps(torch.bfloat16, torch.int32, seed=4) <= 1.6e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_stores_each_token_at_its_slot_and_skips_minus_one(dtype):
    cache = KVCache(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=16,
                    dtype=dtype)  # fmt: skip
    k = torch.randn(4, 2, 16).to(dtype)
    v = torch.randn(4, 2, 16).to(dtype)
    slots = torch.tensor(
        [13, 2, -1, 19]
    )  # block 3 offset 1, block 0 offset 2, skip, block 4 offset 3
    PagedAttentionBackend(cache).write(1, k, v, slots)
    for row, (block, offset) in {0: (3, 1), 1: (0, 2), 3: (4, 3)}.items():
        assert torch.equal(cache.key(1)[block, :, offset], k[row])
        assert torch.equal(cache.value(1)[block, :, offset], v[row])
    assert int((cache.key(1) != 0).any(-1).sum()) == 3 * 2  # 3 tokens x 2 heads, nothing else
    assert not cache.key(0).any() and not cache.value(0).any()


def test_write_rejects_a_slot_outside_the_cache():
    cache = KVCache(1, 2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        PagedAttentionBackend(cache).write(
            0, torch.ones(1, 1, 16), torch.ones(1, 1, 16), torch.tensor([8])
        )
