"""Speculative decoding's model-free parts: the configuration, n-gram prompt lookup,
the draft-length rule, and rejection sampling checked statistically."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pagedllm.engine import spec_verify
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.sequence import TokenSequence
from pagedllm.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from pagedllm.spec_decode.draft_length import DraftLengthPolicy
from pagedllm.spec_decode.ngram import NgramProposer

# -- configuration -----------------------------------------------------------------------


def test_config_parses_dicts_and_json_in_vllms_shape():
    config = SpeculativeConfig.parse(
        json.dumps({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4})
    )
    assert config.method is SpeculativeMethod.NGRAM
    assert (config.num_speculative_tokens, config.prompt_lookup_min) == (5, 4)
    assert (config.prompt_lookup_max, config.adaptive_draft_length) == (4, True)
    suffix = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 8})
    assert suffix.method is SpeculativeMethod.SUFFIX
    assert SpeculativeConfig.parse(None) is None
    assert SpeculativeConfig.parse(config) is config


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "not valid JSON"),
        ({"method": "ngram"}, "needs 'method' and 'num_speculative_tokens'"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "integer in 1..16"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "does not take model"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
             "prompt_lookup_max": 3},
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
        ({"method": "suffix", "num_speculative_tokens": 2, "typo": 1}, "does not take typo"),
    ],
)  # fmt: skip
def test_config_refuses_what_it_does_not_read(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


# -- n-gram prompt lookup ----------------------------------------------------------------


def test_ngram_copies_what_followed_the_longest_latest_match():
    proposer = NgramProposer(2, 4)
    assert proposer.propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    # the 2-gram (1, 2) occurs twice: the later occurrence wins
    assert proposer.propose([1, 2, 7, 1, 2, 8, 9, 1, 2], 2) == [8, 9]
    # a longer match beats a later shorter one
    assert proposer.propose([5, 1, 2, 7, 0, 2, 9, 5, 1, 2], 1) == [7]
    assert proposer.propose([1, 2, 3], 2) == []  # no earlier occurrence
    assert proposer.propose([4, 4, 4, 4], 3) == [4]  # only one token follows the match
    assert NgramProposer(3, 3).propose([1, 2, 9, 1, 2], 2) == []  # below min_n
    assert proposer.propose([1, 2, 1, 2], 0) == []


def test_ngram_agrees_with_a_plain_search():
    rng = np.random.default_rng(0)
    proposer = NgramProposer(1, 3)
    for _ in range(300):
        tokens = rng.integers(0, 4, rng.integers(1, 40)).tolist()
        expected = []
        for n in range(min(3, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            starts = [i for i in range(len(tokens) - n) if tokens[i : i + n] == tail]
            if starts:
                expected = tokens[starts[-1] + n : starts[-1] + n + 4]
                break
        assert proposer.propose(tokens, 4) == expected, tokens


# -- draft length ------------------------------------------------------------------------


def feed(policy: DraftLengthPolicy, fixed: float, per_token: float, sizes) -> None:
    for size in sizes:
        policy.observe_step(size, fixed + per_token * size)


def test_policy_guesses_when_steps_cost_their_weights_and_not_when_they_cost_tokens():
    cheap = DraftLengthPolicy(4)
    feed(cheap, 0.010, 0.0001, [1, 5, 1, 5, 1, 40])
    cheap.observe_acceptance(5, 4)
    cheap.observe_acceptance(5, 5)
    assert cheap.most_worth_guessing(1, 1) == (4, False)
    assert cheap.choose([4], 1, 1) == 4
    assert cheap.choose([2], 1, 1) == 2  # a shorter proposal runs whole
    costly = DraftLengthPolicy(4)
    feed(costly, 0.001, 0.002, [64, 320, 64, 320, 64, 512])
    costly.observe_acceptance(5, 2)
    # nothing is proposed, until a one-token guess measures again
    asked = [costly.most_worth_guessing(64, 64) for _ in range(64)]
    assert asked[:63] == [(0, False)] * 63 and asked[63] == (1, True)
    assert costly.choose([4] * 64, 64, 64) == 0


def test_a_draft_models_passes_count_against_its_guesses():
    """The same steps and acceptance: a draft whose pass costs a tenth of a step still
    pays for one sequence; one whose pass costs as much as the step's weights does not,
    and the rule waits for both lines before it trusts either."""

    def policy() -> DraftLengthPolicy:
        drafted = DraftLengthPolicy(4, pays_per_guess=True)
        feed(drafted, 0.010, 0.0001, [1, 5, 1, 5, 1, 40])
        drafted.observe_acceptance(5, 4)
        drafted.observe_acceptance(5, 5)
        return drafted

    cheap = policy()
    assert cheap.most_worth_guessing(1, 1) == (4, True)  # no draft pass seen yet: measure
    for rows in (1, 2, 1, 30):
        cheap.observe_draft_pass(rows, 0.001 + 0.0001 * rows)
    assert cheap.most_worth_guessing(1, 1) == (4, False)
    assert cheap.choose([4], 1, 1) == 4
    costly = policy()
    for rows in (1, 2, 1, 30):
        costly.observe_draft_pass(rows, 0.010 + 0.0001 * rows)
    assert costly.choose([4], 1, 1) == 0
    assert costly.guessing_cost(3, 1) == pytest.approx(3 * 0.0101)


def test_a_cost_that_drifts_as_contexts_grow_is_not_read_as_free_tokens():
    """A loaded batch: each row of a step costs more as the contexts it attends to grow,
    while sequences finish and the batch shrinks from 64 to 48, with a 16-row measuring
    step now and then. Fitted against size alone, later smaller steps cost more, as if
    tokens were free; the slope of consecutive changes sees that a guessed row costs
    what any other row costs now, so at 60% acceptance it guesses nothing."""
    policy = DraftLengthPolicy(8)
    policy.observe_acceptance(8, 3)
    for i in range(160):
        size = 64 - max(0, i - 80) // 5 + 16 * (i in (1, 3, 67, 131))
        policy.observe_step(size, 0.002 + (0.0005 + 0.000003 * i) * size)
    row_now = 0.0005 + 0.000003 * 159
    assert policy.step_cost(96) - policy.step_cost(48) > 0.6 * row_now * 48
    assert policy.most_worth_guessing(48, 48) == (0, False)


def test_guesses_grow_only_as_far_as_step_sizes_were_measured():
    """Cheap tokens and high acceptance: guessing pays, but a slope measured over steps
    16 tokens apart is trusted for at most 64 more tokens; a step that guessed 64 lets
    the next guess up to 256."""
    policy = DraftLengthPolicy(8)
    for _ in range(20):
        policy.observe_acceptance(8, 8)
    feed(policy, 0.040, 0.0001, [64, 80, 64, 80, 64])
    assert policy.most_worth_guessing(64, 64) == (8, False)
    assert policy.choose([8] * 64, 64, 64) == 1
    feed(policy, 0.040, 0.0001, [128])
    assert policy.choose([8] * 64, 64, 64) == 4


def test_a_draft_remeasures_less_often_where_its_catch_up_is_long():
    """Guessing does not pay (tokens cost their share of a step, 40% acceptance). A draft
    measuring with a sequence it must first catch up by 1,000 rows (0.2 s, against 0.04 s
    steps) re-measures after about 500 steps, so that its passes take 1% of the time;
    with one row to catch up, after 64 as before. The rows the sequence falls behind
    while it waits do not move the measurement further off."""
    policy = DraftLengthPolicy(4, pays_per_guess=True)
    feed(policy, 0.002, 0.0006, [64, 80, 64, 80, 64])
    for rows in (1, 1000, 1, 1000):
        policy.observe_draft_pass(rows, 0.0002 * rows)
    policy.observe_acceptance(5, 2)
    interval = policy.explore_interval(64, 1000)
    assert 490 <= interval <= 510
    assert policy.explore_interval(64, 1) == 64

    def steps_until_measuring(rows: int) -> int:
        for step in range(1, 1000):
            if policy.most_worth_guessing(64, 64, 64, rows + step) == (4, True):
                return step
        return 0

    assert steps_until_measuring(1000) == interval
    assert steps_until_measuring(1) == 64


def test_a_draft_whose_rows_cost_more_than_the_share_still_remeasures():
    """One sequence on a CPU: a draft row of catch-up costs 2% of a step, more than
    ``EXPLORE_SHARE``, and unlucky first trials turned guessing off. The sequence falls one
    row further behind with each step it waits; were those rows counted, the catch-up
    would always cost more than 1% of the wait and guessing would stay off for good.
    Left out, the draft measures again after its guesses' share, in full: 8 tokens."""
    policy = DraftLengthPolicy(8, pays_per_guess=True)
    feed(policy, 0.014, 0.001, [1, 9, 1, 9, 1])
    for rows in (1, 300, 1, 300):
        policy.observe_draft_pass(rows, 0.004 + 0.0003 * rows)
    for _ in range(3):
        policy.observe_acceptance(1, 0)
    asked = [policy.most_worth_guessing(1, 1, 1 + step, 1 + step) for step in range(1, 1000)]
    first = asked.index((8, True))
    assert set(asked[:first]) == {(0, False)}
    # 8 passes of 4.3 ms against 1% of a 15 ms step
    assert first + 1 == math.ceil(8 * 0.0043 / (0.01 * 0.015))


def test_policy_measures_with_one_token_before_it_can_fit_a_cost():
    policy = DraftLengthPolicy(3)
    assert policy.step_cost(10) is None
    assert policy.most_worth_guessing(2, 2) == (1, True)
    assert policy.choose([1, 1], 2, 2) == 1
    assert policy.most_worth_guessing(0, 0) == (0, False)


def test_policy_does_not_measure_in_steps_its_cost_line_cannot_time():
    policy = DraftLengthPolicy(3, pays_per_guess=True)
    # prefill comes next: no measuring passes, and the alternation does not advance
    assert [policy.most_worth_guessing(2, 2, timed=False) for _ in range(3)] == [(0, False)] * 3
    assert policy.most_worth_guessing(2, 2) == (3, True)
    assert policy.most_worth_guessing(2, 2) == (0, False)
    assert policy.most_worth_guessing(2, 2, timed=False) == (0, False)
    assert policy.most_worth_guessing(2, 2) == (3, True)


def test_acceptance_is_the_geometric_estimate():
    policy = DraftLengthPolicy(4)
    for _ in range(200):
        policy.observe_acceptance(4, 4)  # four successes, no failure
        policy.observe_acceptance(4, 1)  # one success, then a failure
    assert policy.acceptance == pytest.approx(5 / 6, abs=0.01)


# -- rejection sampling ------------------------------------------------------------------

VOCAB = 6
DRAWS = 20_000


def sequence_with(params: SamplingParams, seed: int | None = None) -> TokenSequence:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return TokenSequence("r", [0], params, 0.0, generator=generator)


def emitted_counts(logits: torch.Tensor, guesses: list[int], params: SamplingParams):
    """Counts of the first emitted token, and of the second given the first guess kept,
    over DRAWS verifications (one batch: rows are independent draws)."""
    seqs = [sequence_with(params) for _ in range(DRAWS)]
    rows = logits.repeat(DRAWS, 1)
    results = spec_verify.verify(seqs, [guesses] * DRAWS, rows, stop_token_ids=())
    first = np.bincount([r.token_ids[0] for r in results], minlength=VOCAB)
    second = np.bincount([r.token_ids[1] for r in results if r.num_accepted >= 1], minlength=VOCAB)
    return first, second


def target(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """The distribution plain sampling draws from at a row (temperature and top-k)."""
    tempered = logits / params.temperature
    kth = tempered.topk(params.top_k).values[-1]
    return tempered.masked_fill(tempered < kth, float("-inf")).softmax(-1).double().numpy()


def p_value(counts: np.ndarray, probs: np.ndarray) -> float:
    support = probs > 0
    assert counts[~support].sum() == 0, "a token outside the distribution's support"
    expected = probs[support] / probs[support].sum() * counts.sum()
    statistic = float((((counts[support] - expected) ** 2) / expected).sum())
    dof = int(support.sum()) - 1  # chi-square survival: the regularised upper gamma
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(statistic / 2)))


LOGITS = torch.tensor(
    [[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 1.5, 1.5, 0.2, -0.5, 3.0], [1.0] * 6]
)
PARAMS = SamplingParams(temperature=0.8, top_k=5, seed=None)


def test_rejection_sampling_emits_the_targets_distribution():
    """Guess 0 (likely) then 4 (unlikely) at two rows: the first emitted token follows
    the first row's distribution, the second (after a kept guess) the second row's;
    top-k leaves token 5 out of the first row's support and token 4 in the second's."""
    first, second = emitted_counts(LOGITS, [0, 4], PARAMS)
    assert p_value(first, target(LOGITS[0], PARAMS)) > 1e-4
    assert p_value(second, target(LOGITS[1], PARAMS)) > 1e-4
    assert second.sum() > DRAWS / 3  # the first guess was kept often enough to test


def test_a_wrong_residual_fails_the_same_test(monkeypatch):
    """Drawing after a rejection from the target itself (not the residual without the
    guess) over-weights the guessed token; the test above must see it."""
    monkeypatch.setattr(
        spec_verify, "residual_distribution", lambda probs, token, draft_probs=None: probs
    )
    first, _ = emitted_counts(LOGITS, [0, 4], PARAMS)
    assert p_value(first, target(LOGITS[0], PARAMS)) < 1e-6


# a draft's distributions at the two guessed rows, far from the target's
DRAFT_PROBS = torch.tensor(
    [[0.05, 0.05, 0.1, 0.3, 0.3, 0.2], [0.4, 0.1, 0.1, 0.1, 0.2, 0.1]], dtype=torch.float32
)


def counts_with_drawn_guesses(seed: int = 0):
    """Like :func:`emitted_counts`, with each draw's two guesses drawn from
    ``DRAFT_PROBS`` and verified against them (rejection sampling with a draft's ``q``)."""
    generator = torch.Generator().manual_seed(seed)
    drawn = torch.stack(
        [torch.multinomial(DRAFT_PROBS[j], DRAWS, replacement=True, generator=generator)
         for j in range(2)], dim=1,
    ).tolist()  # fmt: skip
    seqs = [sequence_with(PARAMS) for _ in range(DRAWS)]
    rows = LOGITS.repeat(DRAWS, 1)
    results = spec_verify.verify(seqs, drawn, rows, (), [DRAFT_PROBS] * DRAWS)
    first = np.bincount([r.token_ids[0] for r in results], minlength=VOCAB)
    second = np.bincount([r.token_ids[1] for r in results if r.num_accepted >= 1], minlength=VOCAB)
    return first, second, sum(r.num_accepted for r in results)


def test_rejection_sampling_against_a_drafts_distribution_emits_the_targets():
    """Guesses drawn from a draft's ``q``, kept with ``min(1, p/q)``, the residual
    ``max(p - q, 0)`` after a rejection: both emitted tokens follow the target's rows,
    though ``q`` puts most of its mass where ``p`` puts little (top-k leaves token 5
    out of the first row's support while ``q`` proposes it)."""
    first, second, accepted = counts_with_drawn_guesses()
    assert p_value(first, target(LOGITS[0], PARAMS)) > 1e-4
    assert p_value(second, target(LOGITS[1], PARAMS)) > 1e-4
    assert second.sum() > DRAWS / 10 and 0 < accepted < 2 * DRAWS


def test_a_residual_that_ignores_the_drafts_distribution_fails_it(monkeypatch):
    """The point-mass residual (``p`` without the guess) is wrong for a draft's ``q``:
    it over-weights the tokens ``q`` favours; the test above must see it."""
    point_mass = spec_verify.residual_distribution
    monkeypatch.setattr(
        spec_verify,
        "residual_distribution",
        lambda probs, token, draft_probs=None: point_mass(probs, token),
    )
    first, _, _ = counts_with_drawn_guesses()
    assert p_value(first, target(LOGITS[0], PARAMS)) < 1e-6


def test_greedy_rows_keep_guesses_while_they_are_the_argmax():
    params = SamplingParams(temperature=0.0)
    seqs = [sequence_with(params) for _ in range(3)]
    rows = torch.cat([LOGITS, LOGITS[:2], LOGITS[:1]])
    results = spec_verify.verify(seqs, [[0, 5], [0], []], rows, stop_token_ids=())
    # row 0's argmax is 0 (kept), row 1's is 5 (kept), row 2 (all equal) gives 0
    assert [r.token_ids for r in results] == [[0, 5, 0], [0, 5], [0]]


def test_penalties_see_the_kept_guesses_as_history():
    """Row j is processed with the output history ending in the first j guesses: a
    presence penalty that bans a repeated token moves the argmax off it."""
    params = SamplingParams(temperature=0.0, presence_penalty=2.0)
    seq = sequence_with(params)
    logits = torch.tensor([[3.0, 2.0, 0.0], [3.0, 2.0, 0.0]])
    # without history the argmax is 0; after guessing 0, row 1 penalises it: 1 wins
    assert spec_verify.verify([seq], [[0]], logits, stop_token_ids=())[0].token_ids == [0, 1]


def test_seeded_verification_repeats():
    params = SamplingParams(temperature=1.0, seed=7)
    runs = [
        spec_verify.verify([sequence_with(params, seed=7)], [[3, 1]], LOGITS, ())[0].token_ids
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
