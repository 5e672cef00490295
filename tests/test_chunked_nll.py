"""pagedllm.bench.chunked_nll: reading a text in chunks through the paged cache gives the
NLL of reading it in one pass, and the hook sees every chunk's end."""

from __future__ import annotations

import torch

from pagedllm.bench.chunked_nll import chunked_nll, text_cache


def test_chunks_read_what_one_pass_reads(default_model):
    text = "The block table maps each sequence's logical blocks to physical ones. " * 20
    token_ids = default_model.tokenizer.encode(text)[:161]
    ends = []

    def nll(chunk: int, table_seed: int | None) -> torch.Tensor:
        cache = text_cache(default_model, len(token_ids) - 1, 16)
        table = torch.arange(cache.num_blocks)
        if table_seed is not None:
            table = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(1))
        return chunked_nll(default_model, token_ids, cache, table, chunk, ends.append)

    whole = nll(160, None)
    assert whole.shape == (160,) and ends == [160]
    ends.clear()
    chunked = nll(48, 1)
    assert ends == [48, 96, 144, 160]
    assert torch.allclose(chunked, whole, atol=1e-3)
    assert whole[-80:].mean() < whole[:80].mean()  # the repeated sentence is predictable
