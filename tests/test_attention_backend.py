"""PagedAttentionBackend over a KVCache, driven step by step the way the engine drives it:
chunked prefills and decodes of several sequences mixed in one batch, several layers."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.attention.reference import dense_causal_attention
from pagedllm.kv.kv_cache import KVCache

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
