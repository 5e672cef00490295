"""Prefill attention through torch's SDPA, over one sequence's K/V gathered from the pool.

For a chunk of many query rows, copying the K/V it reads out of their blocks into
contiguous tensors costs little next to the products, and torch's fused (flash)
``scaled_dot_product_attention`` then multiplies through oneDNN's brgemm: bfloat16 on AMX
tiles where the CPU has them. Its result equals the paged kernel's to rounding, not bit
for bit (the products run in another order, and the probabilities are rounded to the
query's dtype before they weight V), so which one runs is measured
(:mod:`pagedllm.attention.attention_choice`), never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionOptions


@dataclass
class PrefillChunk:
    """One sequence's query rows ``start:end`` of a flattened batch: its last
    ``end - start`` positions out of ``seq_len`` tokens, whose K/V lie in the physical
    blocks ``blocks`` (int64, its block table cut at ``seq_len``). Made once per step;
    what its rows see under a window is worked out once and kept for every layer."""

    start: int
    end: int
    seq_len: int
    blocks: torch.Tensor
    _seen: dict[int | None, VisibleKeys] = field(default_factory=dict, repr=False)

    def visible_keys(self, window: int | None, block_size: int) -> VisibleKeys:
        """The keys this chunk reads under a sliding ``window`` (``None``: whole)."""
        if window not in self._seen:
            first_query = self.seq_len - (self.end - self.start)
            first_block = 0 if window is None else max(0, first_query - window + 1) // block_size
            first_key = first_block * block_size
            key_positions = torch.arange(first_key, self.seq_len)
            query_positions = torch.arange(first_query, self.seq_len)[:, None]
            mask = key_positions <= query_positions
            if window is not None:
                mask &= key_positions > query_positions - window
            self._seen[window] = VisibleKeys(self.blocks[first_block:], mask)
        return self._seen[window]


@dataclass(frozen=True)
class VisibleKeys:
    """The blocks a chunk reads (from the first its window reaches) and its mask
    ``[rows, keys]`` over their positions up to the sequence's end (True: attends)."""

    blocks: torch.Tensor
    mask: torch.Tensor


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
    seen = chunk.visible_keys(options.sliding_window, block_size)
    num_keys = seen.mask.shape[1]

    def gathered(cache: torch.Tensor) -> torch.Tensor:  # [1, Hkv, keys, D]
        rows = cache[seen.blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)
        return rows[None, :, :num_keys]

    attended = F.scaled_dot_product_attention(
        q[chunk.start : chunk.end].transpose(0, 1)[None],
        gathered(keys),
        gathered(values),
        attn_mask=seen.mask,
        scale=options.scale,
        enable_gqa=True,
    )
    return attended[0].transpose(0, 1)
