"""Request parsing and error shapes of the server, without a model or a socket."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pagedllm.request_errors import InvalidRequestError
from pagedllm.server.app import served_model_name
from pagedllm.server.errors import APIError, error_body, validation_error
from pagedllm.server.field_policy import (
    IGNORED_FIELDS_HEADER,
    MAX_NAMED_FIELDS,
    check_fields,
    ignored_fields_headers,
)
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.structured_output import StructuredOutputsParams

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields}, strict=True)


def test_chat_maps_openai_fields_to_sampling_params():
    params = chat(
        max_tokens=9, max_completion_tokens=7, n=2, seed=3, stop="x", logprobs=True,
        top_logprobs=4, presence_penalty=0.5, frequency_penalty=-0.5, top_p=0.9,
    ).sampling_params()  # fmt: skip
    assert params.max_tokens == 7  # max_completion_tokens wins over the deprecated name
    assert (params.n, params.seed, params.stop, params.logprobs) == (2, 3, ["x"], 4)
    assert (params.presence_penalty, params.frequency_penalty, params.top_p) == (0.5, -0.5, 0.9)
    assert chat().sampling_params().max_tokens is None  # fill the context, as OpenAI does
    assert chat(logprobs=True).sampling_params().logprobs == 0


def test_chat_messages_render_as_role_and_text():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = chat(
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": parts}]
    )
    assert body.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "ab"},
    ]


def test_completion_prompts_of_every_form():
    def prompts(prompt):
        return CompletionRequest.model_validate({"prompt": prompt}, strict=True).prompts()

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([5, 6]) == [{"prompt_token_ids": [5, 6]}]
    assert prompts([[5], [6, 7]]) == [{"prompt_token_ids": [5]}, {"prompt_token_ids": [6, 7]}]
    with pytest.raises(ValueError, match="empty"):
        prompts([])
    assert CompletionRequest.model_validate({"prompt": "a"}).sampling_params().max_tokens == 16


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"max_tokens": "5"}, "max_tokens", "valid integer"),
        ({"temperature": "hot"}, "temperature", "valid number"),
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "user", "content": "x", "frob": 1}]}, "messages", "Unrecognized"),
        ({"top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages", "messages"),
        ({"temperature": float("inf")}, "temperature", "finite number"),
        ({"top_p": float("nan")}, "top_p", "finite number"),
        ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
        ({"temperature": 1e308}, "temperature", "less than or equal to 2"),
    ],
)
def test_type_errors_name_the_field(fields, param, words):
    with pytest.raises(ValidationError) as caught:
        chat(**fields)
    error = validation_error(caught.value)
    assert error.status == 400 and error.param == param
    assert words in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs=true
        ({"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ],
)
def test_range_errors_name_the_field(fields, param):
    with pytest.raises(InvalidRequestError) as caught:
        chat(**fields).sampling_params()
    assert caught.value.param == param
    assert str(caught.value).startswith(param)


def test_empty_stop_list_means_no_stop_strings():
    assert chat(stop=[]).sampling_params().stop == []


def test_error_body_has_the_openai_shape():
    body = error_body(404, "no such model", param="model", code="model_not_found")
    assert body == {
        "error": {
            "message": "no such model",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


def test_served_model_name():
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/Qwen2-0.5B/") == "Qwen2-0.5B"
    assert served_model_name("weights/tiny.Q8_0.gguf") == "tiny.Q8_0"


def test_unknown_fields_are_ignored_and_named():
    body = chat(
        metadata={"a": "b"}, store=True, parallel_tool_calls=False, reasoning_effort="low",
        service_tier="auto", frobnicate=1, stream_options={"include_usage": True, "x y": 1},
        tools=[], tool_choice="none", response_format={"type": "text"}, echo=False,
    )  # fmt: skip
    ignored = check_fields(body)
    # refused fields whose values ask for nothing are not named
    assert ignored == [
        "metadata", "store", "reasoning_effort", "service_tier", "frobnicate",
        "stream_options.x y",
    ]  # fmt: skip
    header = ignored_fields_headers(ignored)[IGNORED_FIELDS_HEADER]
    assert header.endswith("frobnicate, stream_options.x%20y")
    assert ignored_fields_headers([]) == {}
    many = [f"f{i}" for i in range(MAX_NAMED_FIELDS + 3)]
    assert ignored_fields_headers(many)[IGNORED_FIELDS_HEADER].endswith(", and 3 more")


@pytest.mark.parametrize(
    "fields",
    [
        {"functions": [{"name": "f"}]},
        {"echo": True},
        {"best_of": 2},
        {"suffix": "tail"},
        {"guided_whitespace_pattern": " "},
        {"skip_special_tokens": False},
        {"add_generation_prompt": False},
    ],
)
def test_known_fields_that_change_results_are_refused(fields):
    with pytest.raises(APIError) as caught:
        check_fields(chat(**fields))
    (name,) = fields
    assert caught.value.status == 400 and caught.value.param == name
    assert "not supported" in caught.value.message


def test_new_sampling_fields_reach_sampling_params():
    params = chat(
        logit_bias={"5": -100, "7": 2.5}, allowed_token_ids=[5, 7], bad_words=["no"],
        include_stop_str_in_output=True,
    ).sampling_params()  # fmt: skip
    assert params.logit_bias == {5: -100.0, 7: 2.5} and params.allowed_token_ids == [5, 7]
    assert params.bad_words == ["no"] and params.include_stop_str_in_output
    with pytest.raises(InvalidRequestError) as caught:
        chat(logit_bias={"x": 1}).sampling_params()
    assert caught.value.param == "logit_bias"
    with pytest.raises(InvalidRequestError) as caught:
        chat(logit_bias={"5": 101}).sampling_params()
    assert caught.value.param == "logit_bias"


def test_best_of_samples_more_and_ranks_by_logprob():
    def completion(**fields):
        return CompletionRequest.model_validate({"prompt": "a", **fields}, strict=True)

    params = completion(n=2, best_of=5).sampling_params()
    assert (params.n, params.logprobs) == (5, 0)
    assert completion(n=2, best_of=2).sampling_params().logprobs is None
    for fields in ({"n": 3, "best_of": 2}, {"best_of": 3, "stream": True}):
        with pytest.raises(InvalidRequestError) as caught:
            completion(**fields).sampling_params()
        assert caught.value.param == "best_of"


def test_structured_output_fields_map_to_one_constraint():
    schema = {"type": "object"}
    named = {"name": "s", "schema": schema}
    formats = [
        ({"response_format": {"type": "json_schema", "json_schema": named}},
         StructuredOutputsParams(json=schema)),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ({"guided_grammar": "root ::= \"a\""}, StructuredOutputsParams(grammar='root ::= "a"')),
        ({"response_format": {"type": "text"}}, None),
    ]  # fmt: skip
    for fields, expected in formats:
        assert chat(**fields).sampling_params().structured_outputs == expected
    for fields, param in [
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
    ]:
        with pytest.raises(InvalidRequestError) as caught:
            chat(**fields).sampling_params()
        assert caught.value.param == param
