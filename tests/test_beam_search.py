"""Beam search: the selection rule by hand, transformers' ``num_beams`` on the default
model, and block sharing (forks, copy-on-write, pruned beams freed at once)."""

from __future__ import annotations

import math

import pytest
import torch
from shared_models import default_model, transformers_default_model

from pagedllm import LLM, EngineConfig, LLMEngine
from pagedllm.engine.beam_search import BeamSearchParams, BeamSelector
from pagedllm.engine.beam_search_runner import BeamSearchRunner

STOP = 0


def logprob_rows(*rows: dict[int, float], vocab: int = 8) -> torch.Tensor:
    """Log-probabilities ``[len(rows), vocab]``: the given ones, the rest very unlikely."""
    out = torch.full((len(rows), vocab), -50.0)
    for index, row in enumerate(rows):
        for token, logprob in row.items():
            out[index, token] = logprob
    return out


def test_params_are_validated():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=True)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="always")


def test_stop_candidates_finish_only_within_the_top_width():
    selector = BeamSelector(BeamSearchParams(beam_width=2, max_tokens=8), {STOP})
    first = selector.step(logprob_rows({1: -0.1, 2: -0.5, 3: -3.0}))
    assert [(c.parent, c.token_id) for c in first] == [(0, 1), (0, 2)]
    # beam 0 ends with the best candidate: a hypothesis of 2 tokens, stop token included;
    # beam 1's stop candidate ranks below the top two and is dropped
    second = selector.step(logprob_rows({STOP: -0.2, 4: -0.3}, {STOP: -0.4, 5: -1.0}))
    assert [(c.parent, c.token_id) for c in second] == [(0, 4), (1, 5)]
    (hypothesis,) = selector.hypotheses
    assert hypothesis.token_ids == (1, STOP)
    assert hypothesis.finish_reason == "stop"
    assert hypothesis.score == pytest.approx((-0.1 - 0.2) / 2)


def test_length_penalty_ranks_hypotheses_and_max_tokens_ends_the_search():
    params = BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=2.0)
    selector = BeamSelector(params, {STOP})
    selector.step(logprob_rows({STOP: -0.6, 1: -0.7, 2: -0.9}))
    assert selector.hypotheses[0].score == pytest.approx(-0.6)
    assert selector.step(logprob_rows({3: -0.1}, {4: -0.1})) == []
    assert selector.is_done
    scores = [h.score for h in selector.hypotheses]
    assert scores == pytest.approx([-0.8 / 4, -1.0 / 4])
    assert [h.finish_reason for h in selector.hypotheses] == ["length", "length"]


@pytest.mark.parametrize(
    ("early_stopping", "length_penalty", "done"),
    [(True, 1.0, True), (False, 1.0, True), ("never", 1.0, False), ("never", 0.0, True)],
)
def test_early_stopping_rules(early_stopping, length_penalty, done):
    params = BeamSearchParams(2, 10, length_penalty=length_penalty, early_stopping=early_stopping)
    selector = BeamSelector(params, {STOP})
    selector.step(logprob_rows({1: -1.0, 2: -1.1, 3: -5.0}))
    # both top candidates stop; the best running beam, at -3.0 after two tokens, cannot
    # beat them at the current length, but could at length 10 ("never" with penalty > 0)
    selector.step(logprob_rows({STOP: -0.1, 3: -2.0}, {STOP: -0.1, 4: -2.5}))
    assert [h.token_ids for h in selector.hypotheses] == [(1, STOP), (2, STOP)]
    assert selector.is_done is done


@pytest.fixture(scope="module")
def loaded():
    return default_model()


def make_engine(loaded, block_size: int = 16) -> LLMEngine:
    config = EngineConfig(
        device=str(loaded.model.device),
        dtype="float32",
        block_size=block_size,
        kv_cache_memory="32MiB",
        max_model_len=256,
        max_num_seqs=32,
        max_num_batched_tokens=64,
        log_stats_interval=0,
    )
    return LLMEngine(config, loaded)


def chat_ids(loaded, question: str) -> list[int]:
    return loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def transformers_beams(loaded, prompt_ids: list[int], params: BeamSearchParams) -> list[int]:
    """The best sequence of transformers' beam search, generated tokens only."""
    with torch.inference_mode():
        out = transformers_default_model().generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            num_beams=params.beam_width,
            do_sample=False,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=sorted(loaded.tokenizer.stop_token_ids),
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


CASES = [
    ("What is the capital of France?", 1.0, False),
    ("Write a haiku about the sea.", 2.0, "never"),
    ("What is 2+2?", 0.5, True),
]


@pytest.mark.slow
def test_width_four_equals_transformers(loaded):
    llm = LLM.from_engine(make_engine(loaded))
    stop_ids = loaded.tokenizer.stop_token_ids
    reasons = set()
    for question, length_penalty, early_stopping in CASES:
        params = BeamSearchParams(4, 24, length_penalty, early_stopping)
        prompt_ids = chat_ids(loaded, question)
        (output,) = llm.beam_search([{"prompt_token_ids": prompt_ids}], params)
        best = output.sequences[0]
        assert best.token_ids == transformers_beams(loaded, prompt_ids, params), question
        assert len(output.sequences) == 4
        assert [s.score for s in output.sequences] == sorted(
            (s.score for s in output.sequences), reverse=True
        )
        assert best.tokens == prompt_ids + best.token_ids
        assert best.score == pytest.approx(best.cum_logprob / len(best.token_ids) ** length_penalty)
        assert (best.token_ids[-1] in stop_ids) == (best.finish_reason == "stop")
        reasons.add(best.finish_reason)
    assert reasons == {"stop", "length"}


def shared_and_unique_blocks(engine: LLMEngine, runner: BeamSearchRunner) -> tuple[int, int]:
    """Blocks held by the live beams: how many are shared, how many distinct."""
    tables = [engine.block_manager.block_table(seq.seq_id) for seq in runner.live_beams]
    held = [block for table in tables for block in table]
    return sum(held.count(b) > 1 for b in set(held)), len(set(held))


@pytest.mark.slow
def test_beams_share_blocks_and_pruned_beams_free_them_at_once(loaded):
    block_size = 4
    engine = make_engine(loaded, block_size)
    manager, pool = engine.block_manager, engine.block_manager.pool
    prompt_ids = chat_ids(loaded, "Write a haiku about the sea.")
    params = BeamSearchParams(4, 16, ignore_eos=True)
    runner = BeamSearchRunner(engine)
    runner.add(prompt_ids, params)
    max_shared = peak = pruned = 0
    results = []
    while runner.has_unfinished:
        before = {seq.seq_id for seq in runner.live_beams}
        results += runner.step()
        after = {seq.seq_id for seq in runner.live_beams}
        pruned += len(before - after)
        assert not any(seq_id in manager for seq_id in before - after)
        shared, unique = shared_and_unique_blocks(engine, runner)
        assert pool.num_used == unique  # nothing held beyond the live beams' tables
        max_shared, peak = max(max_shared, shared), max(peak, unique)
    per_beam = math.ceil((len(prompt_ids) + params.max_tokens - 1) / block_size)
    assert max_shared >= len(prompt_ids) // block_size
    assert peak <= engine.worst_case_blocks(len(prompt_ids), params.max_tokens, params.beam_width)
    assert peak < 0.5 * params.beam_width * per_beam
    assert pruned > 0
    assert pool.num_used == 0  # every block is free or merely cached
    assert results[0][1].sequences[0].finish_reason == "length"


@pytest.mark.slow
def test_prefix_cache_hits_change_nothing(loaded):
    engine = make_engine(loaded)
    llm = LLM.from_engine(engine)
    prompt = {"prompt_token_ids": chat_ids(loaded, "Name a color.")}
    params = BeamSearchParams(3, 8)
    cold = llm.beam_search([prompt], params)[0]
    hits = engine.block_manager.stats().prefix_cache_hits
    (warm,) = llm.beam_search([prompt], params)
    assert engine.block_manager.stats().prefix_cache_hits > hits
    assert [s.token_ids for s in warm.sequences] == [s.token_ids for s in cold.sequences]
