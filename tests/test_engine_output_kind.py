"""vLLM's output kinds: which outputs ``LLMEngine.step`` returns, and what they hold."""

from __future__ import annotations

import pytest
from shared_models import default_model

from pagedllm import LLM, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from pagedllm.request_errors import InvalidRequestError

PROMPTS = ["The capital of France is", "Count: one, two, three,", "def add(a, b):"]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(
        dtype="float32", kv_cache_memory="32MiB", max_model_len=256, log_stats_interval=0
    )
    return LLMEngine(config, default_model())


def run(engine: LLMEngine, kind: RequestOutputKind) -> dict[str, list]:
    """Every output each request got, in step order."""
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, output_kind=kind)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"{kind.name}-{index}", prompt, params)
    seen: dict[str, list] = {f"{kind.name}-{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return {key.split("-")[1]: outs for key, outs in seen.items()}


def test_final_only_delta_and_cumulative_end_alike(engine):
    cumulative = run(engine, RequestOutputKind.CUMULATIVE)
    final_only = run(engine, RequestOutputKind.FINAL_ONLY)
    delta = run(engine, RequestOutputKind.DELTA)
    for index, outs in cumulative.items():
        assert len(outs) > 2 and all(not out.finished for out in outs[:-1])
        last = outs[-1].outputs[0]
        assert outs[-1].finished and len(last.token_ids) > 0
        # FINAL_ONLY: one output, the finished one, equal to the cumulative end
        (only,) = final_only[index]
        assert only.finished
        assert only.outputs[0].token_ids == last.token_ids
        assert only.outputs[0].text == last.text
        assert only.outputs[0].logprobs == last.logprobs
        assert only.outputs[0].finish_reason == last.finish_reason
        # DELTA: as many outputs, each holding only its step's additions
        parts = [out.outputs[0] for out in delta[index]]
        assert len(parts) == len(outs)
        assert all(len(part.token_ids) <= 1 for part in parts)
        assert sum((part.token_ids for part in parts), []) == last.token_ids
        assert "".join(part.text for part in parts) == last.text
        assert sum((part.logprobs for part in parts), []) == last.logprobs
        assert parts[-1].cumulative_logprob == last.cumulative_logprob
        assert parts[-1].finish_reason == last.finish_reason


def test_llm_generate_keeps_final_outputs_and_leaves_the_params_alone(engine):
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    reference = run(engine, RequestOutputKind.CUMULATIVE)
    for index, out in enumerate(outputs):
        assert out.finished
        assert out.outputs[0].token_ids == reference[str(index)][-1].outputs[0].token_ids


def test_output_kind_must_be_one_of_the_enum():
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="final_only")
