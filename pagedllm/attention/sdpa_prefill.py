"""Prefill attention through torch's SDPA, over one sequence's K/V gathered from the pool.

For a chunk of many query rows, copying the K/V it reads out of their blocks into
contiguous tensors costs little next to the products, and torch's fused (flash)
``scaled_dot_product_attention`` then multiplies through oneDNN's brgemm: bfloat16 on AMX
tiles where the CPU has them. Its result equals the paged kernel's to rounding, not bit
for bit (the products run in another order, and the probabilities are rounded to the
query's dtype before they weight V), so which one runs is measured
(:mod:`pagedllm.cpu.attention_choice`), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionOptions


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's query rows ``start:end`` of a flattened batch: its last
    ``end - start`` positions out of ``seq_len`` tokens, whose K/V lie in the physical
    blocks ``blocks`` (int64, its block table cut at ``seq_len``)."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.end - self.start


def attend_chunk(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    chunk: PrefillChunk,
    options: AttentionOptions,
) -> torch.Tensor:
    """Causal attention of ``chunk``'s rows of ``q`` ``[T, Hq, D]`` over a layer's
    ``keys``, ``values`` ``[num_blocks, Hkv, block_size, D]`` (``q``'s dtype); returns
    ``[rows, Hq, D]``. Blocks wholly before a sliding window are not read. Soft-capped
    layers are not taken (SDPA has no soft-cap)."""
    if options.logit_softcap is not None:
        raise ValueError("SDPA has no logit soft-cap; soft-capped layers run paged")
    num_kv_heads, block_size, head_dim = keys.shape[1:]
    first_query = chunk.seq_len - chunk.num_rows  # position of the chunk's first row
    window = options.sliding_window
    first_block = 0 if window is None else max(0, first_query - window + 1) // block_size
    first_key = first_block * block_size
    blocks = chunk.blocks[first_block:]

    def gathered(cache: torch.Tensor) -> torch.Tensor:  # [1, Hkv, keys, D]
        rows = cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
        return rows[None, :, : chunk.seq_len - first_key]

    key_positions = torch.arange(first_key, chunk.seq_len)
    query_positions = torch.arange(first_query, chunk.seq_len)[:, None]
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    attended = F.scaled_dot_product_attention(
        q[chunk.start : chunk.end].transpose(0, 1)[None],
        gathered(keys),
        gathered(values),
        attn_mask=visible,
        scale=options.scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)
