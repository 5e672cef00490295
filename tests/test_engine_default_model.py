"""The engine on the default model against transformers: batching, chunked prefill and
preemption must not change a single greedy token."""

from __future__ import annotations

import pytest
import torch
from shared_models import default_model, transformers_greedy

from pagedllm import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedllm.kv_storage.kv_cache import bytes_per_block

pytestmark = pytest.mark.slow

TOPICS = [
    "the moon",
    "bread",
    "rivers",
    "compilers",
    "chess",
    "tea",
    "volcanoes",
    "owls",
    "bicycles",
    "glass",
    "jazz",
    "maps",
    "salt",
    "clocks",
    "bees",
    "bridges",
]
FILLER = "Please answer carefully, with concrete details and no repetition. "
NUM_TOKENS = 32
POOL_BLOCKS = 40


def chat_prompts(count: int) -> list[list[int]]:
    """Chat prompts from about 30 to about 300 tokens."""
    tokenizer = default_model().tokenizer
    prompts = []
    for i in range(count):
        content = FILLER * (i * 7 % 23) + f"Tell me about {TOPICS[i % len(TOPICS)]}."
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": content}]))
    return prompts


@pytest.fixture(scope="module")
def small_pool_llm() -> LLM:
    """A pool of 40 blocks (640 tokens): a few requests at a time, so preemptions happen;
    a 64-token step budget, so prompts are prefilled in chunks."""
    mc = default_model().config
    block_bytes = bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    config = EngineConfig(
        dtype="float32",
        kv_cache_memory=POOL_BLOCKS * block_bytes,
        max_model_len=512,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        log_stats_interval=0,
    )
    return LLM.from_engine(LLMEngine(config, default_model()))


def test_batched_preempted_chunked_greedy_equals_alone_and_transformers(small_pool_llm):
    prompts = chat_prompts(32)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    engine = small_pool_llm.llm_engine
    batched = small_pool_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    stats = engine.get_stats()
    assert stats.num_preemptions_total > 0, "the small pool should have forced preemptions"
    assert stats.num_blocks_used == 0 and stats.num_blocks_free == POOL_BLOCKS
    for prompt, output in zip(prompts, batched, strict=True):
        assert len(output.outputs[0].token_ids) == NUM_TOKENS
        alone = small_pool_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert output.outputs[0].token_ids == alone[0].outputs[0].token_ids
        assert output.outputs[0].token_ids == transformers_greedy(prompt, NUM_TOKENS)


def test_seeded_sampling_is_independent_of_the_batch(small_pool_llm):
    prompts = chat_prompts(6)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)
    alone = small_pool_llm.generate({"prompt_token_ids": prompts[0]}, seeded, use_tqdm=False)
    others = [SamplingParams(temperature=0.8, max_tokens=24)] * 5
    batch = small_pool_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], [seeded, *others], use_tqdm=False
    )
    assert batch[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert batch[0].outputs[0].text == alone[0].outputs[0].text
    reseeded = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24)
    other_seed = small_pool_llm.generate({"prompt_token_ids": prompts[0]}, reseeded, use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_text_prompt_chat_and_stop_string(small_pool_llm):
    chat = small_pool_llm.chat(
        [{"role": "user", "content": "Count from one to ten in words, separated by commas."}],
        SamplingParams(temperature=0.0, max_tokens=40),
        use_tqdm=False,
    )
    text = chat[0].outputs[0].text
    assert text and chat[0].outputs[0].finish_reason in ("stop", "length")
    stop_word = text.split()[2] if len(text.split()) > 3 else text[-3:]
    stopped = small_pool_llm.chat(
        [{"role": "user", "content": "Count from one to ten in words, separated by commas."}],
        SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_word]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_word
    assert stop_word not in stopped.text
    assert text.startswith(stopped.text)
