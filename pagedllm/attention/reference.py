"""The oracle: gather each sequence's K/V through its block table, then dense attention.

Slow on purpose and simple enough to check by eye; the fast kernels are tested against it.
Computes in float32 and returns ``q``'s dtype.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.kv.capacity import cdiv


def gather_sequence(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one sequence as ``[num_kv_heads, length, head_dim]``.

    ``cache`` is one layer's ``[num_blocks, num_kv_heads, block_size, head_dim]`` tensor;
    ``block_table`` lists the sequence's physical blocks in logical order. Entries a
    sliding window released point at the cache's null block, whose zeros the window
    then masks.
    """
    block_size = cache.shape[2]
    num_blocks = cdiv(length, block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [n, Hkv, B, D]
    heads, dim = cache.shape[1], cache.shape[3]
    return blocks.transpose(0, 1).reshape(heads, num_blocks * block_size, dim)[:, :length]


def dense_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the last ``q_len`` positions of one sequence, in float32.

    ``q`` ``[q_len, Hq, D]``; ``k``, ``v`` ``[Hkv, seq_len, D]``. Query row ``i`` sits at
    position ``p = seq_len - q_len + i`` and sees positions ``0 ..`` itself, or only
    ``p - sliding_window + 1 .. p``. With ``logit_softcap`` ``c``, scaled scores ``s``
    become ``c * tanh(s / c)`` before the mask.
    """
    q_len, num_q_heads, _ = q.shape
    seq_len = k.shape[1]
    group = num_q_heads // k.shape[0]
    k = k.float().repeat_interleave(group, dim=0)
    v = v.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("qhd,hkd->hqk", q.float(), k) * scale
    if logit_softcap:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    query_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    key_pos = torch.arange(seq_len).unsqueeze(0)
    hidden = key_pos > query_pos
    if sliding_window:
        hidden |= key_pos <= query_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,hkd->qhd", torch.softmax(scores, dim=-1), v)


def reference_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention for every query row of a flattened batch, K/V already in the cache
    (window and soft-cap as in :func:`dense_causal_attention`)."""
    out = torch.empty_like(q)
    starts = metadata.query_start_loc.tolist()
    for i, seq_len in enumerate(metadata.seq_lens.tolist()):
        rows = slice(starts[i], starts[i + 1])
        k = gather_sequence(k_cache, metadata.block_tables[i], seq_len)
        v = gather_sequence(v_cache, metadata.block_tables[i], seq_len)
        out[rows] = dense_causal_attention(
            q[rows], k, v, scale, sliding_window, logit_softcap
        ).to(q.dtype)
    return out
