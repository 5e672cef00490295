"""A draft model stops guessing where it is unsure: the calibration of its confidence
against the verifications, the rule that weighs another guess against its cost, and the
engine keeping the target's greedy tokens while the rule cuts guesses short."""

from __future__ import annotations

import pytest
from tiny_checkpoints import run_outputs

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.spec_decode.draft_length import DraftLengthPolicy
from pagedllm.spec_decode.guess_calibration import GuessCalibration


def test_calibration_learns_which_confidences_are_kept():
    calibration = GuessCalibration()
    for _ in range(300):
        calibration.observe([0.95, 0.97, 0.2], 2)  # the sure guesses kept, the unsure not
    assert calibration.chance_kept(0.96) > 0.95
    assert calibration.chance_kept(0.25) < 0.05
    assert calibration.chance_kept(0.55) == pytest.approx(0.5)  # never seen: the prior


def test_guesses_after_the_first_rejected_one_teach_nothing():
    calibration = GuessCalibration()
    for _ in range(300):
        calibration.observe([0.15, 0.95, 0.95, 0.95], 0)
    assert calibration.chance_kept(0.15) < 0.05
    assert calibration.chance_kept(0.95) == pytest.approx(0.5)


def fitted(draft_pass_seconds: float) -> DraftLengthPolicy:
    """A policy that has seen one-sequence steps of 10 ms plus 0.1 ms per token, draft
    passes of ``draft_pass_seconds`` plus 0.1 ms per row, and 80% of guesses kept."""
    policy = DraftLengthPolicy(8, pays_per_guess=True)
    for size in (1, 5, 1, 5, 1, 40):
        policy.observe_step(size, 0.010 + 0.0001 * size)
    for rows in (1, 2, 1, 30):
        policy.observe_draft_pass(rows, draft_pass_seconds + 0.0001 * rows)
    for _ in range(20):
        policy.observe_acceptance(5, 4)
    return policy


def test_a_sure_sequence_guesses_on_and_an_unsure_one_stops():
    policy = fitted(0.002)
    # two guesses so far: one sequence likely right so far, the other likely wrong
    keep = policy.keep_guessing([0.9, 0.05], 4, 2.0, 2, 2)
    assert keep == [True, False]


def test_a_costlier_draft_stops_sooner():
    chances = [0.6]
    assert fitted(0.001).keep_guessing(chances, 3, 2.2, 2, 1) == [True]
    assert fitted(0.008).keep_guessing(chances, 3, 2.2, 2, 1) == [False]


def test_the_pass_is_shared_by_those_that_go_on():
    """The same step: alone, a middling sequence does not pay for a whole pass; with
    sure ones sharing the pass, its extra row costs little and it goes on."""
    policy = fitted(0.004)
    assert policy.keep_guessing([0.6], 16, 8.0, 1, 1) == [False]
    assert policy.keep_guessing([0.6] + [0.95] * 7, 16, 8.0, 1, 8) == [True] * 8


def test_without_fitted_costs_every_sequence_goes_on():
    policy = DraftLengthPolicy(8, pays_per_guess=True)
    assert policy.keep_guessing([0.01, 0.9], 2, 1.0, 1, 2) == [True, True]


def test_the_engine_cuts_guesses_and_keeps_the_targets_tokens(expanded_default_model, monkeypatch):
    """The quantized self-draft with adaptive lengths, one request at a time: once its
    costs are fitted, the rule lets some sequences guess on and stops others short of
    ``num_speculative_tokens``, and greedy tokens are the float32 target's."""
    from pagedllm import EngineConfig, LLMEngine

    decisions: list[bool] = []
    keep_guessing = DraftLengthPolicy.keep_guessing

    def spy(self, *args, **kwargs):
        keep = keep_guessing(self, *args, **kwargs)
        decisions.extend(keep)
        return keep

    monkeypatch.setattr(DraftLengthPolicy, "keep_guessing", spy)
    tokenizer = expanded_default_model.tokenizer
    questions = ("What is a block table?", "Name three colours.", "Count from one to ten.")
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in questions
    ]
    params = SamplingParams(temperature=0.0, max_tokens=48)

    def run(**settings):
        config = EngineConfig(dtype="float32", quantization="none", kv_cache_memory="64MiB",
                              log_stats_interval=0, **settings)  # fmt: skip
        engine = LLMEngine(config, expanded_default_model)
        return engine, [run_outputs(engine, [p], params)["0"] for p in prompts]

    _, expected = run()
    spec = {"method": "draft_model", "model": "default", "num_speculative_tokens": 8,
            "activation_quantization": "int8"}  # fmt: skip
    engine, got = run(speculative_config=spec)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert False in decisions and True in decisions
    assert engine.get_stats().num_blocks_used == 0
