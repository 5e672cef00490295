"""SamplingParams: vLLM's defaults, validation of every field, normalisation, seeds."""

import pytest

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError
from pagedllm.structured_output import StructuredOutputsParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.has_penalties


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 0),
        ("n", 1.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -2),
        ("top_k", 2.0),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", 2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("logprobs", -1),
        ("seed", 1.5),
        ("stop", 42),
        ("stop", ["ok", 3]),
        ("stop", [""]),
        ("stop_token_ids", [1, "2"]),
        ("stop_token_ids", 7),
        ("stop_token_ids", [-1]),
        ("temperature", float("inf")),
        ("temperature", 10**400),
        ("temperature", True),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("presence_penalty", float("nan")),
        ("frequency_penalty", float("-inf")),
        ("repetition_penalty", float("inf")),
        ("repetition_penalty", float("nan")),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("seed", 2**70),
        ("seed", True),
        ("top_k", 2**63),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"1": 1.0}),
        ("logit_bias", {1: float("nan")}),
        ("logit_bias", [1, 2]),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", 3),
        ("bad_words", [" "]),
        ("bad_words", "word"),
        ("bad_words", ["ok", 5]),
    ],
)
def test_bad_value_raises_naming_field_and_value(field, value):
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value)
    assert info.value.param == field


def test_seed_range_is_signed_64_bit():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)
    assert SamplingParams(min_tokens=10, max_tokens=None).min_tokens == 10


def test_boundary_values_are_accepted():
    p = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.01,
        max_tokens=1,
        logprobs=0,
    )
    assert p.is_greedy and p.has_penalties
    assert SamplingParams(max_tokens=None).max_tokens is None


def test_top_k_minus_one_means_off_like_zero():
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_is_normalised_to_lists():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(2, 3)).stop_token_ids == [2, 3]


def test_tiny_temperature_counts_as_greedy():
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_derived_seeds_are_seed_plus_sample_index():
    p = SamplingParams(n=4, seed=100)
    assert [p.derived_seed(i) for i in range(4)] == [100, 101, 102, 103]
    assert SamplingParams(seed=7).derived_seed(0) == 7
    assert SamplingParams(n=3).derived_seed(2) is None
    with pytest.raises(ValueError, match="sample_index"):
        p.derived_seed(4)


ENCODINGS = {"cat": [5, 6], " cat": [9, 6], "dog": [7], " dog": [7, 8], "big": [11], " big": [12]}


class WordTokenizer:
    """Encodes the words of ``ENCODINGS``, without special tokens as bad words need."""

    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return ENCODINGS[text]


def test_check_for_model_resolves_bad_words_and_checks_the_vocabulary():
    params = SamplingParams(
        bad_words=["cat", " dog", "big"], logit_bias={3: -2}, allowed_token_ids=[1]
    )
    params.check_for_model(20, WordTokenizer())
    # the spaced form counts when it starts with another token and is as long
    assert params.bad_words_token_ids == [[5, 6], [9, 6], [7], [11], [12]]
    assert params.logit_bias == {3: -2.0}
    for field, value in [("logit_bias", {20: 1.0}), ("allowed_token_ids", [0, 25])]:
        with pytest.raises(InvalidRequestError, match=r"\[0, 20\)") as info:
            SamplingParams(**{field: value}).check_for_model(20, WordTokenizer())
        assert info.value.param == field
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        SamplingParams(bad_words=["cat"]).check_for_model(20, None)
    with pytest.raises(InvalidRequestError, match="bad_words"):
        SamplingParams(bad_words=["cat"]).check_for_model(6, WordTokenizer())


class StopTokenizer(WordTokenizer):
    stop_token_ids = {0, 2}


def test_allowed_token_ids_must_keep_a_token_the_bans_leave():
    tokenizer = StopTokenizer()
    SamplingParams(allowed_token_ids=[0, 2]).check_for_model(20, tokenizer)
    SamplingParams(allowed_token_ids=[0, 7], min_tokens=1, bad_words=["cat"]).check_for_model(
        20, tokenizer
    )
    for fields in (
        {"allowed_token_ids": [0, 2], "min_tokens": 1},
        {"allowed_token_ids": [0, 7], "min_tokens": 1, "bad_words": ["dog"]},
        {"allowed_token_ids": [11, 12], "bad_words": ["big"]},
    ):
        with pytest.raises(InvalidRequestError, match="must keep a token") as info:
            SamplingParams(**fields).check_for_model(20, tokenizer)
        assert info.value.param == "allowed_token_ids"


def test_structured_outputs_leave_the_token_choice_to_the_grammar():
    regex = StructuredOutputsParams(regex="a+")
    for fields in ({"ignore_eos": True}, {"min_tokens": 2}, {"allowed_token_ids": [1]},
                   {"bad_words": ["x"]}):  # fmt: skip
        with pytest.raises(InvalidRequestError, match="cannot be combined") as info:
            SamplingParams(structured_outputs=regex, **fields)
        assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a+"})
