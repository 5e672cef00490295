"""``LLMEngine.add_request`` refuses, before queueing or allocating anything, what can
never run on this engine, naming the field; and admits whatever can."""

from __future__ import annotations

import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.request_errors import InvalidRequestError

BLOCK_SIZE = 16
NUM_BLOCKS = 40
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 1 * 64 * 4
PROMPT = list(range(65, 65 + BLOCK_SIZE))  # exactly one full block
VOCAB = 259


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> LLMEngine:
    folder = write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))
    config = EngineConfig(
        model=str(folder),
        dtype="float32",
        block_size=BLOCK_SIZE,
        kv_cache_memory=NUM_BLOCKS * BLOCK_BYTES,
        max_n=8,
        log_stats_interval=0,
    )
    return LLMEngine(config)


def refused(engine: LLMEngine, prompt, params: SamplingParams, priority: int = 0) -> str:
    """The refused field; asserts nothing was queued or allocated."""
    with pytest.raises(InvalidRequestError) as caught:
        engine.add_request("refused", prompt, params, priority=priority)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.pool.num_used == 0
    return caught.value.param


def run_all(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.pool.num_used == 0


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        (PROMPT, SamplingParams(n=9, max_tokens=1), "n"),
        (PROMPT, SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (PROMPT, SamplingParams(logprobs=VOCAB + 1), "logprobs"),
        (PROMPT, SamplingParams(max_tokens=None, min_tokens=10_000), "min_tokens"),
        ([VOCAB], SamplingParams(), "prompt"),
        ([], SamplingParams(), "prompt"),
        ("a lone \udc00 surrogate", SamplingParams(), "prompt"),
        (PROMPT * 40, SamplingParams(), "prompt"),  # beyond max_model_len
    ],
)
def test_what_can_never_run_is_refused_naming_the_field(engine, prompt, params, param):
    assert refused(engine, prompt, params) == param


def test_worst_case_at_the_pools_edge(engine):
    """A prompt of one full block, shared, and n samples of k blocks each: 1 + n * k
    blocks at worst. A normal request may hold the pool less the reserve (38 blocks), a
    priority < 0 one all 40."""
    def samples(n: int, blocks_each: int) -> SamplingParams:
        return SamplingParams(n=n, max_tokens=BLOCK_SIZE * blocks_each, ignore_eos=True)

    assert refused(engine, PROMPT, samples(8, 5)) == "n"  # 41 blocks
    assert refused(engine, PROMPT, samples(8, 5), priority=-1) == "n"
    engine.add_request("fits", {"prompt_token_ids": PROMPT}, samples(8, 4))  # 33
    run_all(engine)
    assert refused(engine, PROMPT, samples(2, 19)) == "n"  # 39: only with the reserve
    engine.add_request("high", {"prompt_token_ids": PROMPT}, samples(2, 19), priority=-1)
    run_all(engine)
    engine.add_request("edge", {"prompt_token_ids": PROMPT}, samples(2, 18))  # 37
    run_all(engine)


def test_max_n_is_validated():
    with pytest.raises(ValueError, match="max_n"):
        EngineConfig(max_n=0)
