"""Builds random paged-attention batches with scattered and shared blocks, for tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


@dataclass
class PagedCase:
    """One flattened batch: caches already holding every position of every sequence,
    and each sequence's K/V as contiguous ``[Hkv, seq_len, D]`` tensors."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    scale: float


def build_case(
    seq_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    shared_prefix_blocks: int = 0,
) -> PagedCase:
    """Sequences get random physical blocks out of a larger pool. Every sequence longer
    than the shared prefix shares sequence 0's first ``shared_prefix_blocks`` blocks and
    their K/V."""
    gen = torch.Generator().manual_seed(seed)
    shared = min(shared_prefix_blocks, seq_lens[0] // block_size)
    blocks_needed = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 2 * sum(blocks_needed) + 3
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for i, n in enumerate(blocks_needed):
        reuse = shared if i > 0 and seq_lens[i] > shared * block_size else 0
        prefix = tables[0][:reuse] if reuse else []
        tables.append(prefix + [free.pop() for _ in range(n - reuse)])
    block_tables = torch.full((len(seq_lens), max(blocks_needed) + 1), -1, dtype=torch.int32)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cache_shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache, v_cache = randn(*cache_shape), randn(*cache_shape)
    keys, values = [], []
    for i, n in enumerate(seq_lens):
        k, v = randn(num_kv_heads, n, head_dim), randn(num_kv_heads, n, head_dim)
        if i > 0 and tables[i][:shared] == tables[0][:shared] and shared:
            k[:, : shared * block_size] = keys[0][:, : shared * block_size]
            v[:, : shared * block_size] = values[0][:, : shared * block_size]
        pos = torch.arange(n)
        physical = torch.tensor(tables[i])[pos // block_size]
        k_cache[physical, :, pos % block_size] = k.transpose(0, 1)
        v_cache[physical, :, pos % block_size] = v.transpose(0, 1)
        keys.append(k)
        values.append(v)
    metadata = read_only_metadata(block_tables, seq_lens, query_lens)
    q = randn(metadata.num_tokens, num_q_heads, head_dim)
    return PagedCase(q, k_cache, v_cache, metadata, keys, values, head_dim**-0.5)


def read_only_metadata(
    block_tables: torch.Tensor, seq_lens: list[int], query_lens: list[int]
) -> AttentionMetadata:
    """Metadata of a step whose queries write nothing (every slot -1): sequences of
    ``seq_lens`` tokens, the last ``query_lens`` of each queried."""
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def sdpa_expected(case: PagedCase, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch's scaled_dot_product_attention on the contiguous K/V, in ``dtype``, with the
    causal mask aligned to the end of each sequence."""
    out = torch.empty(case.q.shape, dtype=dtype)
    starts = case.metadata.query_start_loc.tolist()
    for i, (k, v) in enumerate(zip(case.keys, case.values, strict=True)):
        q = case.q[starts[i] : starts[i + 1]].to(dtype).transpose(0, 1)
        q_len, seq_len = q.shape[1], k.shape[1]
        visible = torch.arange(seq_len) <= torch.arange(seq_len - q_len, seq_len)[:, None]
        o = F.scaled_dot_product_attention(
            q, k.to(dtype), v.to(dtype), attn_mask=visible, scale=case.scale, enable_gqa=True
        )
        out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
    return out
