"""pagedllm.bench.chunked_nll: reading a text in chunks through the paged cache gives the
NLL of reading it in one pass, the hook sees every chunk's end, and the greedy tokens
after it are the engine's."""

from __future__ import annotations

import torch
from tiny_checkpoints import run_outputs

from pagedllm.bench.chunked_nll import chunked_nll, greedy_continuation, text_cache


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


def test_the_greedy_continuation_is_the_engines(default_model):
    from pagedllm import EngineConfig, LLMEngine, SamplingParams

    prompt = default_model.tokenizer.encode("A paged KV cache keeps each sequence's keys in")
    cache = text_cache(default_model, len(prompt) + 11, 16)
    ends = []
    table = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(2))
    got = greedy_continuation(default_model, prompt, cache, table, 4, 12, ends.append)
    assert ends[: -(-len(prompt) // 4)] == [*range(4, len(prompt), 4), len(prompt)]
    assert ends[-11:] == list(range(len(prompt) + 1, len(prompt) + 12))
    config = EngineConfig(dtype="float32", kv_cache_memory="64MiB", log_stats_interval=0)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = run_outputs(LLMEngine(config, default_model), [prompt], params)["0"]
    assert got == expected.outputs[0].token_ids
