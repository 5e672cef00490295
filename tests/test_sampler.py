"""Sampler: greedy, temperature, truncation, penalties, min_tokens, seeds, logprobs."""

import pytest
import torch

from pagedllm.engine.logits_processors import mask_min_p, mask_top_k_top_p
from pagedllm.engine.penalties import apply_penalties, token_counts
from pagedllm.engine.sampler import Sampler, SamplingBatch, make_generator
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError

VOCAB = 50
EOS = 0


@pytest.fixture(autouse=True)
def seeded_global_generator():
    """Unseeded rows draw from the global generator: fix it so tests repeat exactly."""
    torch.manual_seed(0)


def sample(logits, params, outputs=None, prompts=None, generators=None, stop_ids=(EOS,)):
    """One sampler step over ``logits`` rows with per-row ``params``."""
    rows = len(params)
    batch = SamplingBatch.from_requests(
        params,
        prompts or [[] for _ in range(rows)],
        outputs or [[] for _ in range(rows)],
        generators or [make_generator(p.seed) for p in params],
        stop_token_ids=stop_ids,
    )
    return Sampler()(logits, batch)


def kept_tokens(masked_row):
    return set(torch.isfinite(masked_row).nonzero().flatten().tolist())


def logits_of(probs):
    return torch.tensor(probs, dtype=torch.float32).log()


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.zeros(1, VOCAB)
    logits[0, [7, 3, 12]] = 5.0
    assert sample(logits, [SamplingParams(temperature=0.0)]).token_ids == [3]


def test_all_greedy_batch_without_penalties_needs_no_sampling_state():
    params = [SamplingParams(temperature=0.0, min_tokens=0)] * 3
    batch = SamplingBatch.from_requests(params, [[1, 2]] * 3, [[3]] * 3, [None] * 3, EOS)
    assert batch.random is None and batch.penalties is None
    assert batch.banned_rows.numel() == 0 and batch.max_num_logprobs is None


def test_tiny_temperature_samples_the_argmax():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)).repeat(200, 1)
    logits[:, 11] = logits.max() + 0.2
    out = sample(logits, [SamplingParams(temperature=1e-3)] * 200)
    assert out.token_ids == [11] * 200


def test_top_k_one_equals_greedy_even_with_ties():
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(2))
    logits[0, [4, 9]] = 10.0
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 8).token_ids
    top1 = sample(logits, [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(8)])
    assert top1.token_ids == greedy
    assert greedy[0] == 4


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    masked = mask_top_k_top_p(logits, torch.tensor([3]), torch.tensor([1.0]))
    assert kept_tokens(masked[0]) == {1, 2, 4}
    assert torch.equal(masked[0, [1, 2, 4]], logits[0, [1, 2, 4]])


@pytest.mark.parametrize(
    ("probs", "top_p", "kept"),
    [
        ([0.1, 0.4, 0.2, 0.3], 0.65, {1, 3}),
        ([0.1, 0.4, 0.2, 0.3], 0.75, {1, 2, 3}),
        ([0.1, 0.4, 0.2, 0.3], 0.3, {1}),
        ([0.1, 0.4, 0.2, 0.3], 1.0, {0, 1, 2, 3}),
        ([0.3, 0.2, 0.3, 0.2], 0.5, {0, 2}),
        ([0.3, 0.2, 0.3, 0.2], 0.7, {0, 1, 2}),
        ([0.25, 0.25, 0.25, 0.25], 0.3, {0, 1}),
        ([0.25, 0.25, 0.25, 0.25], 0.5, {0, 1}),
        ([0.5, 0.5], 0.5, {0}),
    ],
)
def test_top_p_keeps_smallest_most_likely_set_reaching_p(probs, top_p, kept):
    masked = mask_top_k_top_p(logits_of([probs]), torch.tensor([4]), torch.tensor([top_p]))
    assert kept_tokens(masked[0]) == kept


def test_top_p_applies_to_the_distribution_left_by_top_k():
    logits = logits_of([[0.5, 0.3, 0.2]])
    without_k = mask_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.6]))
    with_k = mask_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert kept_tokens(without_k[0]) == {0, 1}
    assert kept_tokens(with_k[0]) == {0}  # renormalised: 0.625 >= 0.6


def sorted_prefix_oracle(row, k, p):
    """Top-k then top-p by a full stable sort: the definition, one row at a time."""
    values, order = row.sort(descending=True, stable=True)
    values = values[:k]
    probs = values.double().softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    count = max(1, int((mass_before < p).sum())) if p < 1.0 else len(values)
    return set(order[:count].tolist())


@pytest.mark.parametrize("quantised", [False, True])
def test_top_k_top_p_match_a_full_sort_including_wide_nuclei_and_ties(quantised):
    vocab = 3000
    generator = torch.Generator().manual_seed(4)
    scales = torch.tensor([0.3, 1.0, 3.0, 0.1, 2.0, 0.5, 1.0, 0.2])[:, None]
    logits = torch.randn(8, vocab, generator=generator) * scales
    if quantised:
        logits = (logits * 4).round() / 4
    top_k = torch.tensor([vocab, vocab, 1, vocab, 5, 300, vocab, 2000])
    top_p = torch.tensor([0.95, 0.5, 0.9, 0.999, 0.7, 0.9, 1.0, 0.99])
    masked = mask_top_k_top_p(logits, top_k, top_p)
    for row in range(8):
        expected = sorted_prefix_oracle(logits[row], int(top_k[row]), float(top_p[row]))
        assert kept_tokens(masked[row]) == expected
        assert torch.equal(masked[row, list(expected)], logits[row, list(expected)])


def test_min_p_drops_tokens_below_fraction_of_the_top_probability():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3], [0.15, 0.5, 0.05, 0.3]])
    mask_min_p(probs, torch.tensor([0.2, 0.0]))
    assert probs[0].tolist() == pytest.approx([0.15, 0.5, 0.0, 0.3])
    assert probs[1].tolist() == pytest.approx([0.15, 0.5, 0.05, 0.3])


def test_sampled_tokens_stay_inside_the_truncated_set():
    logits = logits_of([[0.1, 0.4, 0.2, 0.25, 0.05]]).repeat(300, 1)
    params = [SamplingParams(top_p=0.6)] * 100 + [SamplingParams(top_k=2)] * 100
    params += [SamplingParams(min_p=0.7)] * 100
    tokens = sample(logits, params).token_ids
    assert set(tokens[:100]) == {1, 3}
    assert set(tokens[100:200]) == {1, 3}
    assert set(tokens[200:]) == {1}


def test_penalties_on_crafted_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    prompt_ids = torch.tensor([[0, 1, 0], [1, 0, 0]])  # row 1: one real token, padding
    output_ids = torch.tensor([[3, 3, 4], [0, 0, 0]])
    prompt = token_counts(prompt_ids, torch.tensor([2, 1]), 5)
    output = token_counts(output_ids, torch.tensor([3, 0]), 5)
    assert prompt.tolist() == [[1, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert output.tolist() == [[0, 0, 0, 2, 1], [0, 0, 0, 0, 0]]
    penalised = apply_penalties(
        logits,
        prompt,
        output,
        repetition=torch.tensor([2.0, 2.0]),
        presence=torch.tensor([0.5, 0.5]),
        frequency=torch.tensor([0.25, 0.25]),
    )
    # token 0 prompt only, positive: /2; token 1 prompt only, negative: *2; token 2
    # unseen; token 3 output twice: 3/2 - 0.5 - 2*0.25; token 4 output once: -2*2 - 0.75
    assert penalised[0].tolist() == [1.0, -2.0, 0.5, 0.5, -4.75]
    assert penalised[1].tolist() == [2.0, -2.0, 0.5, 3.0, -2.0]


def test_presence_and_frequency_ignore_prompt_tokens_and_steer_greedy():
    logits = torch.tensor([[5.0, 4.0, 4.5, 0.0]])
    greedy = dict(temperature=0.0)
    prompts = [[0, 0, 2]]
    presence = SamplingParams(presence_penalty=2.0, **greedy)
    assert sample(logits, [presence], prompts=prompts).token_ids == [0]
    assert sample(logits, [presence], prompts=prompts, outputs=[[0]]).token_ids == [2]
    frequency = SamplingParams(frequency_penalty=0.4, **greedy)
    assert sample(logits, [frequency], outputs=[[0]]).token_ids == [0]
    assert sample(logits, [frequency], outputs=[[0, 0]]).token_ids == [2]
    repetition = SamplingParams(repetition_penalty=1.3, **greedy)
    assert sample(logits, [repetition], prompts=prompts).token_ids == [1]


def test_penalties_apply_only_to_rows_that_ask():
    logits = torch.tensor([[5.0, 4.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, presence_penalty=2.0), SamplingParams(temperature=0)]
    assert sample(logits, params, outputs=[[0], [0]]).token_ids == [1, 0]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[2])
    assert sample(logits, [params], outputs=[[4, 4]]).token_ids == [3]
    assert sample(logits, [params], outputs=[[4, 4, 4]]).token_ids == [0]
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert sample(logits, [ignoring], outputs=[[4]]).token_ids == [0]
    assert sample(logits, [params], outputs=[[4]], stop_ids=()).token_ids == [0]


def test_min_tokens_masks_every_id_of_the_engine_stop_set():
    logits = torch.tensor([[9.0, 1.0, 8.0, 7.0, 0.0]])
    params = SamplingParams(temperature=0.0, min_tokens=2)
    assert sample(logits, [params], outputs=[[4]], stop_ids={0, 2}).token_ids == [3]
    assert sample(logits, [params], outputs=[[4, 4]], stop_ids={0, 2}).token_ids == [0]
    ignoring = SamplingParams(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [ignoring], outputs=[[4]], stop_ids={0, 2}).token_ids == [0]


def step_logits(step, rows=1):
    """The same pseudo-model logits for a given step, whatever the batch."""
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1000 + step)).repeat(
        rows, 1
    )


def run_seeded(params_per_row, steps=12):
    """Token sequences of each row over ``steps`` steps, generators kept across steps."""
    generators = [make_generator(p.seed) for p in params_per_row]
    outputs = [[] for _ in params_per_row]
    for step in range(steps):
        tokens = sample(
            step_logits(step, len(params_per_row)),
            params_per_row,
            outputs=[list(o) for o in outputs],
            generators=generators,
        ).token_ids
        for output, token in zip(outputs, tokens, strict=True):
            output.append(token)
    return outputs


@pytest.mark.parametrize(
    "seeded",
    [
        SamplingParams(temperature=1.0, top_p=0.95, seed=1234),
        SamplingParams(temperature=0.9, seed=99),  # alone it skips truncation entirely
    ],
)
def test_seeded_row_is_the_same_alone_and_anywhere_in_a_batch(seeded):
    (alone,) = run_seeded([seeded])
    others = [
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(temperature=1.3, top_k=10),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, frequency_penalty=0.5),
    ]
    in_batch = run_seeded(others[:2] + [seeded] + others[2:])
    assert in_batch[2] == alone
    assert run_seeded([seeded] + others)[0] == alone


def test_n_samples_equal_separate_requests_with_derived_seeds():
    params = SamplingParams(n=4, seed=77, temperature=1.2)
    generators = [make_generator(params.derived_seed(i)) for i in range(4)]
    together = sample(step_logits(0, 4), [params] * 4, generators=generators).token_ids
    apart = [
        sample(step_logits(0), [SamplingParams(seed=77 + i, temperature=1.2)]).token_ids[0]
        for i in range(4)
    ]
    assert together == apart


def test_different_seeds_give_different_sequences():
    sequences = [tuple(run_seeded([SamplingParams(seed=seed)], steps=30)[0]) for seed in range(5)]
    assert len(set(sequences)) == 5


def chi_square(tokens, probs):
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).double()
    expected = probs.double() * len(tokens)
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_unseeded_draws_follow_the_tempered_softmax(temperature):
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.3, -1.0, 1.2]])
    draws = 20_000
    tokens = sample(logits.repeat(draws, 1), [SamplingParams(temperature=temperature)] * draws)
    # 7 degrees of freedom: the 99.99th percentile of chi-square is about 29.9
    assert chi_square(tokens.token_ids, (logits[0] / temperature).softmax(-1)) < 30


def test_seeded_draws_follow_the_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.3, -1.0, 1.2]])
    rows = 400
    params = [SamplingParams(seed=seed) for seed in range(rows)]
    generators = [make_generator(seed) for seed in range(rows)]
    tokens = []
    for _ in range(10):
        tokens += sample(logits.repeat(rows, 1), params, generators=generators).token_ids
    assert chi_square(tokens, logits[0].softmax(-1)) < 30


def test_logprobs_are_raw_log_softmax_with_sorted_alternatives():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    params = [
        SamplingParams(temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=5, seed=1),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=0),
    ]
    out = sample(logits, params, prompts=[[1, 2, 3], [], []])
    raw = logits.log_softmax(dim=-1)
    first, second, third = out.logprobs
    assert second is None
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item())
    assert first.rank == int((raw[0] > raw[0, first.token_id]).sum()) + 1
    assert [lp for _, lp in first.top] == pytest.approx(
        raw[0].sort(descending=True)[0][:5].tolist()
    )
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    assert all(lp == pytest.approx(raw[0, token].item()) for token, lp in first.top)
    assert third.top == [] and third.rank == 1
    assert third.logprob == pytest.approx(raw[2].max().item())


def test_a_step_with_no_rows_samples_nothing():
    out = sample(torch.empty(0, VOCAB), [])
    assert out.token_ids == [] and out.logprobs is None


def test_mismatched_row_counts_are_rejected():
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.from_requests([SamplingParams()], [[1]], [], [None], EOS)


def test_logit_bias_moves_the_greedy_token_of_its_row_only():
    logits = torch.tensor([[5.0, 4.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, logit_bias={2: 10.0}),
        SamplingParams(temperature=0.0, logit_bias={0: -100.0, 1: 0.5}),
        SamplingParams(temperature=0.0),
    ]
    assert sample(logits, params).token_ids == [2, 1, 0]


def test_allowed_token_ids_restrict_greedy_and_random_rows():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)).repeat(300, 1)
    allowed = [7, 19, 33]
    greedy = SamplingParams(temperature=0.0, allowed_token_ids=allowed)
    drawn = SamplingParams(temperature=1.5, allowed_token_ids=allowed)
    free = SamplingParams(temperature=1.5)
    out = sample(logits, [greedy, *[drawn] * 200, *[free] * 99])
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert set(out.token_ids[1:201]) == set(allowed)  # all three, nothing else
    assert not set(out.token_ids[201:]) <= set(allowed)


def test_bad_words_ban_the_last_token_after_their_prefix():
    logits = torch.tensor([[9.0, 8.0, 7.0, 6.0, 5.0]])
    params = SamplingParams(temperature=0.0, bad_words=["x"])
    params.bad_words_token_ids = [[0], [3, 1]]  # as check_for_model sets them
    assert sample(logits, [params], outputs=[[4]]).token_ids == [1]
    assert sample(logits, [params], outputs=[[1, 3]]).token_ids == [2]
    assert sample(logits, [params], outputs=[[3, 4]]).token_ids == [1]


def test_bad_words_need_resolving_and_ids_the_vocabulary_holds():
    logits = torch.zeros(1, VOCAB)
    with pytest.raises(InvalidRequestError, match="check_for_model"):
        sample(logits, [SamplingParams(bad_words=["x"])])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        sample(logits, [SamplingParams(logit_bias={VOCAB: 1.0})])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        sample(logits, [SamplingParams(allowed_token_ids=[1, VOCAB + 3])])
