"""One request that raises inside the engine step fails alone.

Sixteen requests run together (greedy and seeded random, different prompts); one of
them raises after a few tokens, once while its row is sampled and once while its
token is detokenized. The other fifteen finish with exactly the tokens each gets
alone, the failed one ends with its error, and every KV block is free again.
"""

from __future__ import annotations

import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine

NUM_REQUESTS = 16
VICTIM = 5
FAIL_AFTER_TOKENS = 3
VICTIM_LOGPROBS = 7
"""Only the victim asks for 7 logprobs: how the faulty sampler finds its row."""


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    folder = write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))
    return LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", log_stats_interval=0)


def params(index: int) -> SamplingParams:
    """Even requests greedy, odd ones seeded at temperature 0.9; 12 to 27 tokens."""
    return SamplingParams(
        temperature=0.0 if index % 2 == 0 else 0.9,
        seed=None if index % 2 == 0 else 1000 + index,
        max_tokens=12 + index,
        ignore_eos=True,
        logprobs=VICTIM_LOGPROBS if index == VICTIM else None,
    )


PROMPTS = [f"request {i}: " + "paged blocks " * (i % 5) for i in range(NUM_REQUESTS)]


class FaultySampler:
    """The engine's sampler, except that it raises once the victim's row has had
    ``FAIL_AFTER_TOKENS`` tokens; it samples first, so seeded generators have moved."""

    def __init__(self, real) -> None:
        self.real = real
        self.victim_tokens = 0

    def __call__(self, logits, batch):
        out = self.real(logits, batch)
        if VICTIM_LOGPROBS in batch.num_logprobs:
            self.victim_tokens += 1
            if self.victim_tokens > FAIL_AFTER_TOKENS:
                raise RuntimeError("injected sampler fault")
        return out


class FaultyDecoder:
    """A streaming decoder that raises on its ``FAIL_AFTER_TOKENS + 1``-th token."""

    def __init__(self, real) -> None:
        self.real = real
        self.tokens = 0

    def add(self, token_id: int) -> str:
        self.tokens += 1
        if self.tokens > FAIL_AFTER_TOKENS:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected decoder fault")
        return self.real.add(token_id)


def inject_decoder_fault(monkeypatch, engine: LLMEngine) -> None:
    victim_ids = engine.tokenizer.encode(PROMPTS[VICTIM])
    real = engine.tokenizer.incremental_decoder

    def decoder(prompt_ids=None):
        made = real(prompt_ids)
        return FaultyDecoder(made) if list(prompt_ids or []) == victim_ids else made

    monkeypatch.setattr(engine.tokenizer, "incremental_decoder", decoder)


@pytest.mark.parametrize("fault", ["sample", "detokenize"])
def test_one_failing_request_leaves_the_other_fifteen_untouched(llm, monkeypatch, fault):
    engine = llm.llm_engine
    alone = [
        llm.generate(prompt, params(i), use_tqdm=False)[0].outputs[0]
        for i, prompt in enumerate(PROMPTS)
    ]
    if fault == "sample":
        monkeypatch.setattr(engine, "sampler", FaultySampler(engine.sampler))
    else:
        inject_decoder_fault(monkeypatch, engine)

    together = llm.generate(PROMPTS, [params(i) for i in range(NUM_REQUESTS)], use_tqdm=False)

    for index, output in enumerate(together):
        if index == VICTIM:
            continue
        assert output.error is None
        assert output.outputs[0].token_ids == alone[index].token_ids, index
        assert output.outputs[0].text == alone[index].text
        assert output.outputs[0].finish_reason == "length"
    failed = together[VICTIM]
    assert failed.finished
    assert "injected" in failed.error
    assert failed.outputs[0].finish_reason == "abort"
    assert len(failed.outputs[0].token_ids) <= FAIL_AFTER_TOKENS + 1
    assert engine.block_manager.pool.num_used == 0
    assert not engine.has_unfinished_requests()

    monkeypatch.undo()  # the engine serves normally again
    again = llm.generate(PROMPTS[VICTIM], params(VICTIM), use_tqdm=False)[0]
    assert again.error is None
    assert again.outputs[0].token_ids == alone[VICTIM].token_ids
