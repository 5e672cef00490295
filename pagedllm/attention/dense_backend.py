"""A cache-free attention backend: each sequence attends over the tokens passed in.

Every call must carry whole sequences (query length equals sequence length), as
in a recompute-everything generation loop; nothing is stored between calls. It
computes attention the textbook way (scores, causal mask, float32 softmax,
weighted sum), the same order of operations as transformers' eager attention,
so it is also the numerical reference for the faster backends.
"""

from __future__ import annotations

import torch

from pagedllm.attention.metadata import AttentionMetadata


class DenseAttentionBackend:
    """Per-sequence causal attention over whole sequences, grouped-query aware."""

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        group = q.shape[1] // num_kv_heads
        out = torch.empty_like(q)
        bounds = metadata.query_start_loc.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            length = end - start
            # Query heads h * group .. h * group + group - 1 share KV head h.
            q_seq = q[start:end].view(length, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            k_seq = k[start:end].permute(1, 2, 0).unsqueeze(1)  # [Hkv, 1, D, T]
            v_seq = v[start:end].permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, T, D]
            scores = torch.matmul(q_seq, k_seq) * scale
            future = torch.ones(length, length, dtype=torch.bool).triu_(1)
            scores.masked_fill_(future, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            attended = torch.matmul(probs, v_seq)  # [Hkv, group, T, D]
            out[start:end] = attended.permute(2, 0, 1, 3).reshape(length, -1, head_dim)
        return out


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
