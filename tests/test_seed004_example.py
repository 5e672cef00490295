"""Seed 004's worked example: lengths 10 and 7, block size 4, tables A: [5, 1, 6] and
B: [5, 3] sharing physical block 5 (the same first four tokens).

The seed uses 4 query heads, 2 kv heads and head_dim 8; the fast kernel needs head_dim
to be a multiple of 16, so this test uses 16, and the seed's own 8 (which the backend
serves through the reference) is checked too.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.attention.reference import dense_causal_attention
from pagedllm.kv.fragmentation import fragmentation_stats
from pagedllm.kv_storage.kv_cache import KVCache

HQ, HKV, BLOCK = 4, 2, 4
TABLES = [[5, 1, 6], [5, 3]]
LENGTHS = [10, 7]


def slots(table: list[int], positions: range) -> list[int]:
    return [table[p // BLOCK] * BLOCK + p % BLOCK for p in positions]


def step(backend, q, k, v, seqs, positions) -> torch.Tensor:
    """One engine step: sequence ``seqs[i]`` runs the tokens at ``positions[i]``."""
    starts = [0]
    for p in positions:
        starts.append(starts[-1] + len(p))
    width = max(len(TABLES[s]) for s in seqs)
    slot_mapping = [x for s, p in zip(seqs, positions, strict=True) for x in slots(TABLES[s], p)]
    tables = [TABLES[s] + [-1] * (width - len(TABLES[s])) for s in seqs]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        seq_lens=torch.tensor([p.stop for p in positions], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(len(p) for p in positions),
        max_seq_len=max(p.stop for p in positions),
    )
    return backend.forward(0, q, k, v, metadata, AttentionOptions(q.shape[-1] ** -0.5))


@pytest.mark.parametrize(("head_dim", "fast"), [(16, True), (8, False)])
def test_paged_attention_over_shared_scattered_blocks_equals_dense(head_dim, fast):
    torch.manual_seed(53)
    prefix_k, prefix_v = torch.randn(HKV, 4, head_dim), torch.randn(HKV, 4, head_dim) * 0.5
    keys = [torch.cat((prefix_k, torch.randn(HKV, n - 4, head_dim)), 1) for n in LENGTHS]
    values = [torch.cat((prefix_v, torch.randn(HKV, n - 4, head_dim)), 1) for n in LENGTHS]
    queries = [torch.randn(n, HQ, head_dim) for n in LENGTHS]
    backend = PagedAttentionBackend(KVCache(1, 7, BLOCK, HKV, head_dim))
    assert backend.uses_fast_kernel == fast

    def rows(seq: int, positions: range) -> tuple[torch.Tensor, ...]:
        return (
            queries[seq][positions.start : positions.stop],
            keys[seq][:, positions.start : positions.stop].transpose(0, 1).contiguous(),
            values[seq][:, positions.start : positions.stop].transpose(0, 1).contiguous(),
        )

    # Step 1: A's whole prompt. Step 2: B reuses block 5 (a prefix-cache hit) and only
    # computes positions 4..6, into block 3.
    out_a = step(backend, *rows(0, range(10)), [0], [range(10)])
    out_b = step(backend, *rows(1, range(4, 7)), [1], [range(4, 7)])

    dense_a = dense_causal_attention(queries[0], keys[0], values[0], head_dim**-0.5)
    dense_b = dense_causal_attention(queries[1][4:], keys[1], values[1], head_dim**-0.5)
    assert (out_a - dense_a).abs().max().item() <= 1e-6
    assert (out_b - dense_b).abs().max().item() <= 1e-6

    stats = fragmentation_stats(TABLES, LENGTHS, BLOCK)
    assert stats.unique_blocks == 4
    assert stats.allocated_slots == 16
    assert stats.live_tokens == 13
    assert stats.internal_fragmentation_slots == 3
    assert stats.slots_saved_by_sharing == 4


def test_both_sequences_decode_in_one_batch_after_the_shared_prefix():
    head_dim = 16
    torch.manual_seed(53)
    keys = [torch.randn(HKV, n + 1, head_dim) for n in LENGTHS]
    keys[1][:, :4] = keys[0][:, :4]
    values = [torch.randn(HKV, n + 1, head_dim) for n in LENGTHS]
    values[1][:, :4] = values[0][:, :4]
    backend = PagedAttentionBackend(KVCache(1, 7, BLOCK, HKV, head_dim))
    # Fill both sequences' cached tokens directly, then decode one token each.
    cache = backend.kv_cache
    for seq, n in enumerate(LENGTHS):
        for pos, slot in enumerate(slots(TABLES[seq], range(n))):
            cache.key(0)[slot // BLOCK, :, slot % BLOCK] = keys[seq][:, pos]
            cache.value(0)[slot // BLOCK, :, slot % BLOCK] = values[seq][:, pos]
    q = torch.randn(2, HQ, head_dim)
    k = torch.stack([keys[0][:, 10], keys[1][:, 7]])
    v = torch.stack([values[0][:, 10], values[1][:, 7]])
    out = step(backend, q, k, v, [0, 1], [range(10, 11), range(7, 8)])
    for i in range(2):
        dense = dense_causal_attention(q[i : i + 1], keys[i], values[i], head_dim**-0.5)
        assert (out[i : i + 1] - dense).abs().max().item() <= 1e-6
