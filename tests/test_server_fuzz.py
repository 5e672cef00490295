"""Fuzzing a live ``pagedllm serve`` (tiny random chat model on 127.0.0.1) with
hypothesis: generated bodies, content types, methods and paths against every route.

Every answer must be a 2xx (a generation's choices all finished; a stream ends with
``[DONE]`` and holds no error event) or an OpenAI-shaped 4xx; never a 5xx. ``/health``
answers 200 after every example, and at the end every KV block is free again.

Field names come from the request models themselves, so a new field is fuzzed as soon
as it exists. Values are a mix of plausible ones (so that many requests run) and
hostile ones: huge and negative integers, NaN and infinities, lone surrogates, wrong
types, deep structures.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.launcher import ServerProcess
from pagedllm.server.protocol import ChatCompletionRequest, CompletionRequest

MAX_EXAMPLES = 500
MAX_MODEL_LEN = 128
SERVE_ARGS = [
    "--dtype", "float32",
    "--kv-cache-memory", "2MiB",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--max-body-size", "32KiB",
    "--log-stats-interval", "0",
]  # fmt: skip
ROUTES = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
GET_ROUTES = ["/health", "/v1/models", "/v1/models/x/y", "/metrics", "/openapi.json", "/version"]
TOKEN_ROUTES = ["/tokenize", "/detokenize"]

HOSTILE_INTS = st.sampled_from([0, -1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**40])
HOSTILE_STRINGS = st.sampled_from(["", "\ud800", "x\udc00y", "<|im_end|>", "\x00", "é" * 50])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-1000, 1000),
    HOSTILE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    HOSTILE_STRINGS,
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
TEXT = st.text(min_size=1, max_size=40)
TOKEN_IDS = st.lists(st.integers(0, 258), min_size=1, max_size=12)
TEXT_PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
URL_PATH = st.text("abcdefghijklmnopqrstuvwxyz0123456789/-_.", max_size=12).map(lambda t: "/" + t)
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user"] * 4 + ["system", "assistant", "developer", "tool"]),
        "content": st.one_of(TEXT, st.none(), st.lists(TEXT_PART, max_size=2)),
    }
)
PLAUSIBLE = {
    "model": st.none(),
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "prompt": st.one_of(
        TEXT, st.lists(TEXT, min_size=1, max_size=3), TOKEN_IDS, st.lists(TOKEN_IDS, min_size=1)
    ),
    "max_tokens": st.one_of(st.integers(1, 12), st.none()),
    "max_completion_tokens": st.integers(1, 12),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 300),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries(
        {"include_usage": st.booleans()}, optional={"continuous_usage_stats": st.booleans()}
    ),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3)),
    "stop_token_ids": TOKEN_IDS,
    "logprobs": st.integers(0, 5),
    "top_logprobs": st.integers(0, 5),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 12),
    "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 258).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": TOKEN_IDS,
    "bad_words": st.lists(TEXT, max_size=2),
    "include_stop_str_in_output": st.booleans(),
    "best_of": st.integers(1, 4),
}


@st.composite
def generation_request(draw) -> tuple[str, str, dict[str, str], bytes]:
    """A plausible body (its required field and a few optional ones), then 0 to 2
    fields (a third of the time none) set to hostile values, sometimes an unknown
    field, sometimes the whole body broken or sent with the wrong content type."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    fields = list(ROUTES[path].model_fields)
    required = "messages" if path == "/v1/chat/completions" else "prompt"
    body = {required: draw(PLAUSIBLE[required])}
    for name in draw(st.lists(st.sampled_from(fields), max_size=4, unique=True)):
        body[name] = draw(PLAUSIBLE.get(name, ANY_JSON))
    if path == "/v1/chat/completions" and "logprobs" in body:
        body["logprobs"] = bool(body["logprobs"])
    for name in draw(st.lists(st.sampled_from(fields), max_size=2, unique=True)):
        if draw(st.sampled_from(["keep", "hostile", "hostile"])) == "hostile":
            body[name] = draw(ANY_JSON)
    if draw(st.sampled_from(["known"] * 19 + ["unknown"])) == "unknown":
        body[draw(st.text(min_size=1, max_size=8))] = draw(ANY_JSON)
    data = json.dumps(body, allow_nan=True).encode()
    shape = draw(st.sampled_from(["json"] * 17 + ["binary", "truncated", "any json"]))
    if shape == "binary":
        data = draw(st.binary(max_size=64))
    elif shape == "truncated":
        data = data[: draw(st.integers(0, len(data)))]
    elif shape == "any json":
        data = json.dumps(draw(ANY_JSON), allow_nan=True).encode()
    content_type = draw(
        st.sampled_from(
            ["application/json"] * 8 + ["text/plain", "", "application/json; charset=utf-8"]
        )
    )
    return "POST", path, {"Content-Type": content_type} if content_type else {}, data


TOKEN_BODY = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(TEXT, ANY_JSON),
        "messages": st.lists(MESSAGE, min_size=1, max_size=2),
        "tokens": st.one_of(TOKEN_IDS, ANY_JSON),
        "add_special_tokens": st.booleans(),
        "return_token_strs": st.booleans(),
        "model": st.one_of(st.none(), ANY_JSON),
    },
)
TOKEN_REQUEST = st.tuples(
    st.just("POST"),
    st.sampled_from(TOKEN_ROUTES),
    st.just({"Content-Type": "application/json"}),
    TOKEN_BODY.map(lambda body: json.dumps(body, allow_nan=True).encode()),
)

ANY_REQUEST = st.one_of(
    TOKEN_REQUEST,
    generation_request(),
    generation_request(),
    generation_request(),
    st.tuples(st.just("GET"), st.sampled_from(GET_ROUTES), st.just({}), st.just(b"")),
    st.tuples(
        st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
        st.one_of(st.sampled_from([*ROUTES, *GET_ROUTES, *TOKEN_ROUTES]), URL_PATH),
        st.just({}),
        st.binary(max_size=32),
    ),
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))
    with ServerProcess(["--model", str(model), *SERVE_ARGS]) as process:
        yield process


def assert_openai_error(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]


def check_stream(response: httpx.Response) -> None:
    events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        assert chunk["object"] in ("chat.completion.chunk", "text_completion")


def check_answer(response: httpx.Response, method: str, path: str) -> None:
    status = response.status_code
    assert status < 500, (method, path, response.text[:500])
    if status >= 400:
        assert_openai_error(response)
    elif path in ROUTES and method == "POST":
        if response.headers["content-type"].startswith("text/event-stream"):
            check_stream(response)
        else:
            choices = response.json()["choices"]
            assert choices and all(c["finish_reason"] in ("stop", "length") for c in choices)


def kv_blocks_used(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("pagedllm:kv_blocks_used{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("/metrics has no pagedllm:kv_blocks_used")


examples_run = []


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(request=ANY_REQUEST)
def fuzz_once(http: httpx.Client, request: tuple[str, str, dict[str, str], bytes]) -> None:
    method, path, headers, data = request
    with http.stream(method, path, headers=headers, content=data) as response:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            response.read()
        check_answer(response, method, path)
    assert http.get("/health").status_code == 200
    examples_run.append((path, response.status_code))


def test_fuzzed_requests_get_2xx_or_openai_shaped_4xx(http):
    fuzz_once(http)
    deadline = time.monotonic() + 30
    while kv_blocks_used(http) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv_blocks_used(http) == 0
    assert len(examples_run) >= MAX_EXAMPLES // 2
    generated = sum(path in ROUTES and status == 200 for path, status in examples_run)
    print(f"fuzzed {len(examples_run)} requests, {generated} generations served")



