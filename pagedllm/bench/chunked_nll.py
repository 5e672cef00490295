"""A text read in chunks through the paged cache, as chunked prefill reads it (every chunk
attends to the K/V the chunks before it left): its negative log-likelihood, or the
greedy tokens after it."""

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
    reader = _Reader(loaded, cache, table)
    ids = torch.tensor(token_ids)
    nll = []
    n = len(token_ids) - 1
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        logits = reader.forward(ids[start:end], start)
        nll.append(F.cross_entropy(logits, ids[start + 1 : end + 1], reduction="none"))
        if after_chunk is not None:
            after_chunk(end)
    return torch.cat(nll)


def greedy_continuation(
    loaded: LoadedModel,
    token_ids: list[int],
    cache: KVCache,
    table: torch.Tensor,
    chunk: int,
    num_tokens: int,
    after_chunk: Callable[[int], None] | None = None,
) -> list[int]:
    """The ``num_tokens`` greedy tokens after ``token_ids``, read ``chunk`` at a time and
    then one token per pass, as :func:`chunked_nll` reads (``cache`` holds blocks for
    ``len(token_ids) + num_tokens - 1`` tokens; ``after_chunk`` after every pass)."""
    reader = _Reader(loaded, cache, table)
    ids = list(token_ids)
    start = 0
    while len(ids) < len(token_ids) + num_tokens:
        end = min(len(ids), start + chunk)
        logits = reader.forward(torch.tensor(ids[start:end]), start)
        if after_chunk is not None:
            after_chunk(end)
        if end == len(ids):
            ids.append(int(logits[-1].argmax()))
        start = end
    return ids[len(token_ids) :]


class _Reader:
    """One sequence's passes through the paged backend over ``cache`` (blocks listed in
    logical order by ``table``)."""

    def __init__(self, loaded: LoadedModel, cache: KVCache, table: torch.Tensor) -> None:
        self.model = loaded.model
        self.block_size = cache.block_size
        self.backend = PagedAttentionBackend(cache)
        self.table = table

    def forward(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Logits of positions ``start ..`` for their tokens ``ids`` (earlier ones in the
        cache already)."""
        end = start + len(ids)
        positions = torch.arange(start, end)
        b = self.block_size
        md = AttentionMetadata(
            slot_mapping=self.table[positions // b] * b + positions % b,
            block_tables=self.table.to(torch.int32).unsqueeze(0),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            max_query_len=end - start,
            max_seq_len=end,
        )
        return self.model.compute_logits(self.model.forward(ids, positions, self.backend, md))
