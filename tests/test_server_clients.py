"""What real clients send, through the official ``openai`` SDK against a live server
(tiny random chat model with a byte-level tokenizer; transformers' tokenizer of the
same folder is the oracle): SDK and framework extras, refused fields, logit_bias,
allowed_token_ids, bad_words, best_of, streaming usage, models.retrieve, tokenize,
detokenize and version."""

from __future__ import annotations

import json
import re

import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm import __version__
from pagedllm.server.field_policy import IGNORED_FIELDS_HEADER
from pagedllm.server.launcher import ServerProcess

openai = pytest.importorskip("openai")

SERVE_ARGS = ["--dtype", "float32", "--kv-cache-memory", "4MiB", "--max-model-len", "256"]
SERVE_ARGS += ["--log-stats-interval", "0"]
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
def tokenizer(model_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_folder)


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
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "cannot be streamed"),
        ({"max_tokens": 0}, "max_tokens", "without echo"),
        ({"guided_regex": "(a"}, "structured_outputs", "does not compile"),
        ({"guided_regex": "a", "ignore_eos": True}, "structured_outputs", "ignore_eos"),
        ({"tool_choice": "required"}, "tool_choice", "chat/completions only"),
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


def test_chat_refuses_echo(client, model_name):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=2, extra_body={"echo": True}
        )
    assert caught.value.body["param"] == "echo"


@pytest.fixture(scope="module")
def reference_logprobs(model_folder):
    """transformers' float32 log-softmax at every position of a prompt (token ids)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder, torch_dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)

    return logprobs


def test_echo_with_max_tokens_0_scores_the_prompt(client, model_name, tokenizer,
                                                   reference_logprobs):  # fmt: skip
    ids = tokenizer.encode("Paged attention, scored.")
    reply = complete(client, model_name, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    (choice,) = reply.choices
    assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0 and reply.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [tokenizer.decode([i]) for i in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    ref = reference_logprobs(ids)
    for position, token in enumerate(ids[1:]):
        assert logprobs.token_logprobs[position + 1] == pytest.approx(
            ref[position, token].item(), abs=1e-4
        )
        top = logprobs.top_logprobs[position + 1]  # keyed by text: two bytes may share one
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(
            ref[position].max().item(), abs=1e-4
        )
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(len(ids))]


def test_echo_batch_as_evaluation_harnesses_send_it(client, model_name, tokenizer,
                                                    reference_logprobs):  # fmt: skip
    batch = [tokenizer.encode("The cat sat"), tokenizer.encode("A dog ran far away")]
    reply = complete(client, model_name, prompt=batch, max_tokens=1, echo=True, logprobs=1)
    for ids, choice in zip(batch, sorted(reply.choices, key=lambda c: c.index), strict=True):
        token_logprobs = choice.logprobs.token_logprobs
        assert len(token_logprobs) == len(ids) + 1 and token_logprobs[0] is None
        ref = reference_logprobs(ids)
        greedy = int(ref[-1].argmax())
        assert choice.text.startswith(tokenizer.decode(ids))
        assert choice.logprobs.tokens[-1] == tokenizer.decode([greedy])
        total = sum(ref[p, t].item() for p, t in enumerate(ids[1:]))
        assert sum(token_logprobs[1:-1]) == pytest.approx(total, abs=1e-3)


def test_streamed_echo_leads_with_the_prompt(client, model_name):
    fields = dict(max_tokens=5, echo=True, logprobs=1, extra_body={"ignore_eos": True})
    whole = complete(client, model_name, **fields).choices[0]
    chunks = [c.choices[0] for c in complete(client, model_name, stream=True, **fields)]
    assert chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs]
    assert streamed == whole.logprobs.token_logprobs
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    only = list(complete(client, model_name, stream=True, max_tokens=0, echo=True))
    assert [c.choices[0].text for c in only] == [PROMPT]


def test_prompt_logprobs_in_vllm_shape(client, model_name, tokenizer, reference_logprobs):
    ids = tokenizer.encode(PROMPT)
    reply = complete(client, model_name, max_tokens=1, extra_body={"prompt_logprobs": 2})
    shown = reply.choices[0].model_extra["prompt_logprobs"]
    assert len(shown) == len(ids) and shown[0] is None
    ref = reference_logprobs(ids)
    for position, token in enumerate(ids[1:]):
        entry = shown[position + 1]
        assert entry[str(token)]["logprob"] == pytest.approx(ref[position, token].item(), abs=1e-4)
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        best = str(int(ref[position].argmax()))
        assert entry[best]["rank"] == 1
    chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    rendered = tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert len(chat.model_extra["prompt_logprobs"]) == len(rendered)


def test_tokenizer_info(http, tokenizer):
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["model_max_length"] == 256


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


def shown_with_its_token(logprobs, position: int) -> bool:
    """Whether the token at ``position`` is among its ``top_logprobs`` with its logprob."""
    top, token = logprobs.top_logprobs[position], logprobs.tokens[position]
    return top.get(token) == logprobs.token_logprobs[position]


def test_top_logprobs_include_the_sampled_token(client, model_name):
    """Up to ``logprobs + 1`` entries per position, as OpenAI and vLLM: the sampled (or
    echoed prompt) token is shown even when it is not among the ``logprobs`` most likely."""
    fields = dict(max_tokens=16, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    sampled = complete(client, model_name, logprobs=1, **fields).choices[0].logprobs
    outside = [
        i for i, top in enumerate(sampled.top_logprobs)
        if sampled.token_logprobs[i] < max(top.values())
    ]  # fmt: skip
    assert outside, "no sampled token outside the top 1: pick another seed"
    for position in outside:
        assert len(sampled.top_logprobs[position]) == 2
        assert shown_with_its_token(sampled, position)
    assert all(len(top) <= 2 for top in sampled.top_logprobs)
    alone = complete(client, model_name, logprobs=0, **fields).choices[0].logprobs
    assert alone.tokens == sampled.tokens  # same seed, same samples
    for position, token in enumerate(alone.tokens):
        assert alone.top_logprobs[position] == {token: alone.token_logprobs[position]}
    echoed = complete(client, model_name, logprobs=1, echo=True, max_tokens=1).choices[0]
    prompt_positions = range(1, len(echoed.logprobs.tokens) - 1)
    assert all(shown_with_its_token(echoed.logprobs, i) for i in prompt_positions)


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
    opening = chunks[0].usage  # before any token, as in vLLM
    assert opening.completion_tokens == 0 and opening.total_tokens == whole.usage.prompt_tokens
    assert chunks[1].usage.completion_tokens >= 1
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


def test_disable_any_whitespace_per_request(client, model_name):
    """vLLM's ``structured_outputs.disable_any_whitespace``: xgrammar's fixed separators
    (json.dumps' own) and no other whitespace outside strings, for a schema and for any
    object (unfinished ones too)."""
    schema = {
        "type": "object",
        "properties": {"pet": {"enum": ["cat", "dog"]}, "n": {"enum": [1, 2, 3]}},
        "required": ["pet", "n"],
    }

    def texts(constraint: dict) -> list[str]:
        extra = {"structured_outputs": {**constraint, "disable_any_whitespace": True}}
        fields = dict(max_tokens=60, temperature=1.0, seed=4, n=3, extra_body=extra)
        return [choice.text for choice in complete(client, model_name, **fields).choices]

    assert all(t == json.dumps(json.loads(t)) for t in texts({"json": schema}))
    for text in texts({"json_object": True}):
        skeleton = re.sub(r'"(?:\\.|[^"\\])*(?:"|$)', '""', text)  # strings emptied
        assert text.startswith("{") and not re.search(r"[\n\r\t]|(?<![,:]) ", skeleton)
