"""Negative log-likelihood of a text read in chunks through the paged cache: every chunk
attends to the K/V the chunks before it left, as chunked prefill does."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.models.loader import LoadedModel


def text_cache(
    loaded: LoadedModel, num_tokens: int, block_size: int, kv_cache_dtype: str = "auto"
) -> KVCache:
    """A cache of ``loaded``'s shape and dtype with blocks for ``num_tokens`` tokens."""
    mc = loaded.config
    num_blocks = -(-num_tokens // block_size)
    return KVCache(
        mc.num_layers,
        num_blocks,
        block_size,
        mc.num_kv_heads,
        mc.head_dim,
        loaded.model.dtype,
        kv_cache_dtype=kv_cache_dtype,
    )


def chunked_nll(
    loaded: LoadedModel,
    token_ids: list[int],
    cache: KVCache,
    table: torch.Tensor,
    chunk: int,
    after_chunk: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """NLL (nats) of tokens ``1 ..`` given the ones before: all but the last token run
    ``chunk`` at a time through the paged backend over ``cache``, whose blocks ``table``
    lists in logical order (at least ``len(token_ids) - 1`` tokens' worth);
    ``after_chunk(end)`` runs after each chunk, positions ``< end`` written."""
    model, block_size = loaded.model, cache.block_size
    backend = PagedAttentionBackend(cache)
    n = len(token_ids) - 1
    ids = torch.tensor(token_ids)
    nll = []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        positions = torch.arange(start, end)
        md = AttentionMetadata(
            slot_mapping=table[positions // block_size] * block_size + positions % block_size,
            block_tables=table.to(torch.int32).unsqueeze(0),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            max_query_len=end - start,
            max_seq_len=end,
        )
        logits = model.compute_logits(model.forward(ids[start:end], positions, backend, md))
        nll.append(F.cross_entropy(logits, ids[start + 1 : end + 1], reduction="none"))
        if after_chunk is not None:
            after_chunk(end)
    return torch.cat(nll)
