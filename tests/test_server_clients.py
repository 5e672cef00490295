"""What real clients send, through the official ``openai`` SDK against a live server
(tiny random chat model with a byte-level tokenizer; transformers' tokenizer of the
same folder is the oracle): SDK and framework extras, refused fields, logit_bias,
allowed_token_ids, bad_words, best_of, streaming usage, models.retrieve, tokenize,
detokenize and version."""

from __future__ import annotations

import json

import httpx
import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm import __version__
from pagedllm.server.field_policy import IGNORED_FIELDS_HEADER
from pagedllm.server.launcher import ServerProcess

openai = pytest.importorskip("openai")

SERVE_ARGS = ["--kv-cache-memory", "4MiB", "--max-model-len", "256", "--log-stats-interval", "0"]
PROMPT = "The cat sat on"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def server(model_folder):
    with ServerProcess(["--model", str(model_folder), *SERVE_ARGS]) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder)


@pytest.fixture(scope="module")
def model_name(model_folder):
    return model_folder.name


def complete(client, model_name, **fields):
    fields = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, **fields}
    return client.completions.create(model=model_name, **fields)


def test_models_retrieve_and_unknown_model(client, model_name):
    card = client.models.retrieve(model_name)
    assert card.id == model_name and card.object == "model"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("no-such-model")
    assert caught.value.code == "model_not_found"


def test_sdk_and_framework_extras_are_ignored_and_named(client, model_name):
    extras = {
        "metadata": {"run": "7"},
        "store": False,
        "parallel_tool_calls": True,
        "reasoning_effort": "low",
        "service_tier": "auto",
        "frobnicate": {"deep": [1]},
    }
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=MESSAGES, max_tokens=4, temperature=0.0, extra_body=extras
    )
    named = raw.headers[IGNORED_FIELDS_HEADER].split(", ")
    assert named == list(extras)
    plain = client.chat.completions.with_raw_response.create(
        model=model_name, messages=MESSAGES, max_tokens=4, temperature=0.0
    )
    assert IGNORED_FIELDS_HEADER not in plain.headers
    assert raw.parse().choices[0].message.content == plain.parse().choices[0].message.content


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt logprobs"),
        ({"guided_regex": "(a"}, "structured_outputs", "does not compile"),
        ({"guided_regex": "a", "ignore_eos": True}, "structured_outputs", "ignore_eos"),
        ({"tool_choice": "required"}, "tool_choice", "tool calling"),
        ({"echo": True}, "echo", "echo"),
        ({"suffix": " mat."}, "suffix", "fill-in-the-middle tokens"),
        ({"logit_bias": {"999999": 5}}, "logit_bias", "[0, 259)"),
        ({"allowed_token_ids": [300]}, "allowed_token_ids", "[0, 259)"),
    ],
)
def test_fields_that_would_change_results_are_refused(client, model_name, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(client, model_name, extra_body=extra)
    assert caught.value.body["param"] == param
    assert words in caught.value.body["message"]


def test_logit_bias_changes_the_greedy_token(client, model_name, tokenizer):
    (forced,) = tokenizer.encode("Q")
    plain = complete(client, model_name, max_tokens=3).choices[0].text
    biased = complete(client, model_name, max_tokens=3, logit_bias={str(forced): 100})
    assert biased.choices[0].text == "QQQ" != plain


def test_allowed_token_ids_and_bad_words(client, model_name, tokenizer):
    allowed = tokenizer.encode("ab")
    text = complete(client, model_name, max_tokens=12, extra_body={"allowed_token_ids": allowed})
    assert len(text.choices[0].text) == 12 and set(text.choices[0].text) <= {"a", "b"}
    free = complete(client, model_name, max_tokens=12, extra_body={"ignore_eos": True})
    word = next(c for c in free.choices[0].text if c.isascii() and c.isprintable() and c != " ")
    banned = complete(
        client, model_name, max_tokens=12, extra_body={"ignore_eos": True, "bad_words": [word]}
    )
    assert word not in banned.choices[0].text and len(banned.choices[0].text) == 12


def test_best_of_returns_the_samples_of_highest_cumulative_logprob(client, model_name):
    fields = dict(max_tokens=5, temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    every = complete(client, model_name, n=4, logprobs=0, **fields)
    totals = [sum(c.logprobs.token_logprobs) for c in every.choices]
    ranked = sorted(range(4), key=lambda i: -totals[i])
    best = complete(client, model_name, n=2, best_of=4, **fields)
    assert [c.text for c in best.choices] == [every.choices[i].text for i in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None


def test_streaming_with_continuous_usage_stats(client, model_name):
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=6, temperature=0.0,
            stream=True, stream_options=options, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    whole = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=6, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 6
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    assert chunks[-1].usage == whole.usage
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    plain = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usages = [chunk.usage for chunk in plain]
    assert all(u is None for u in usages[:-1]) and usages[-1] is not None


def test_tokenize_detokenize_and_version(http, tokenizer, model_name):
    tokens = http.post("/tokenize", json={"model": model_name, "prompt": PROMPT}).json()
    ids = tokenizer.encode(PROMPT)
    assert tokens == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    chat = http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    rendered = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat["tokens"] == list(rendered)
    assert "".join(chat["token_strs"]) == tokenizer.decode(rendered)
    back = http.post("/detokenize", json={"tokens": ids})
    assert back.json() == {"prompt": PROMPT}
    bad = http.post("/detokenize", json={"tokens": [5, 259]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    neither = http.post("/tokenize", json={"model": model_name})
    assert neither.status_code == 400
    assert http.get("/version").json() == {"version": __version__}


def test_fuzz_style_new_fields_never_fail_the_server(http):
    bodies = [
        {"prompt": "x", "logit_bias": {"1": float("nan")}},
        {"prompt": "x", "logit_bias": {"-1": 1}},
        {"prompt": "x", "logit_bias": {str(10**30): 1}},
        {"prompt": "x", "allowed_token_ids": []},
        {"prompt": "x", "bad_words": [""]},
        {"prompt": "x", "bad_words": ["\u00e9\u00e9"], "max_tokens": 3},
        {"prompt": "x", "best_of": 0},
        {"prompt": "0", "allowed_token_ids": [0], "guided_regex": ""},
        {"prompt": "0", "allowed_token_ids": [256, 258], "min_tokens": 2},
        {"prompt": "x", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
    ]
    for body in bodies:
        data = json.dumps(body, allow_nan=True)
        response = http.post(
            "/v1/completions", content=data, headers={"Content-Type": "application/json"}
        )
        assert response.status_code in (200, 400), (body, response.text)
        if body.get("allowed_token_ids"):
            assert response.status_code == 400 and "allowed_token_ids" in response.text
    assert http.get("/health").status_code == 200


def test_structured_outputs_through_the_sdk(client, model_name):
    schema = {
        "type": "object",
        "properties": {"pet": {"enum": ["cat", "dog"]}, "n": {"enum": [1, 2, 3]}},
        "required": ["pet", "n"],
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}
    reply = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=200, temperature=1.0, seed=5, n=3,
        response_format=response_format,
    )  # fmt: skip
    for choice in reply.choices:
        assert choice.finish_reason == "stop", repr(choice.message.content)
        value = json.loads(choice.message.content)
        assert set(value) == {"pet", "n"} and value["pet"] in ("cat", "dog")
        assert value["n"] in (1, 2, 3)
    choices = ["alpha", "beta gamma"]
    picked = complete(
        client, model_name, max_tokens=20, temperature=1.0, n=4, seed=2,
        extra_body={"structured_outputs": {"choice": choices}},
    )  # fmt: skip
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)
    stream = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=20, stream=True,
        extra_body={"guided_regex": "[0-9]{4}"},
    )  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert len(text) == 4 and text.isdigit()
