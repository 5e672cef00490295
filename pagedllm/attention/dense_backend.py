"""A cache-free attention backend: each sequence attends over the tokens passed in.

Every call must carry whole sequences (query length equals sequence length), as
in a recompute-everything generation loop; nothing is stored between calls. It
computes attention the textbook way (scores, causal mask, float32 softmax,
weighted sum), the same order of operations as transformers' eager attention,
so it is also the numerical reference for the faster backends.
"""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata


class DenseAttentionBackend:
    """Per-sequence causal attention over whole sequences, grouped-query aware.

    Sequences of equal length (every decode-only batch, for one) run as one batched
    product; otherwise each sequence runs on its own.
    """

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor:
        num_seqs, length = metadata.num_seqs, metadata.max_query_len
        if num_seqs * length == q.shape[0]:  # all sequences have the same length
            return causal_attention(
                q.view(num_seqs, length, *q.shape[1:]),
                k.view(num_seqs, length, *k.shape[1:]),
                v.view(num_seqs, length, *v.shape[1:]),
                options,
            ).reshape(q.shape)
        out = torch.empty_like(q)
        bounds = metadata.query_start_loc.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            rows = slice(start, end)
            out[rows] = causal_attention(q[None, rows], k[None, rows], v[None, rows], options)[0]
        return out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions
) -> torch.Tensor:
    """Attention of ``B`` whole sequences: ``q`` ``[B, L, Hq, D]``, ``k``, ``v``
    ``[B, L, Hkv, D]``; returns ``[B, L, Hq, D]``. Query heads ``h * group ..
    (h + 1) * group - 1`` share KV head ``h``. Scale, soft-cap and window as in
    ``options``, in transformers' eager order (scale, cap, mask, float32 softmax).
    """
    batch, length, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    q_heads = q.view(batch, length, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    k_heads = k.permute(0, 2, 3, 1).unsqueeze(2)  # [B, Hkv, 1, D, L]
    v_heads = v.permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, L, D]
    scores = torch.matmul(q_heads, k_heads) * options.scale  # [B, Hkv, group, L, L]
    if options.logit_softcap:
        scores = torch.tanh(scores / options.logit_softcap) * options.logit_softcap
    hidden = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
    if options.sliding_window:
        hidden |= torch.ones_like(hidden).tril_(-options.sliding_window)
    scores.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    attended = torch.matmul(probs, v_heads)  # [B, Hkv, group, L, D]
    return attended.permute(0, 3, 1, 2, 4).reshape(batch, length, num_q_heads, head_dim)


def dense_metadata(seq_lens: list[int]) -> AttentionMetadata:
    """Metadata for whole sequences of ``seq_lens`` tokens laid end to end, no cache slots."""
    lengths = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    torch.cumsum(lengths, dim=0, out=starts[1:])
    num_tokens = int(starts[-1])
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        block_tables=torch.empty((len(seq_lens), 0), dtype=torch.int32),
        seq_lens=lengths,
        query_start_loc=starts,
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
    )
