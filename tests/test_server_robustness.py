"""One regression test per robustness bug found against ``pagedllm serve``, on a live
server process over a tiny random chat model: each bad request gets its OpenAI-shaped
4xx naming the cause, the engine keeps serving, and a request that fits is served."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.launcher import ServerProcess

API_KEY = "sk-robust"
BLOCK_SIZE = 16
NUM_BLOCKS = 128
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 1 * 64 * 4
"""One block of the tiny chat model in float32: 2 layers, K and V, 1 KV head of 64."""
CAPACITY = NUM_BLOCKS - NUM_BLOCKS * 5 // 100
"""Blocks a normal-priority request may hold: the pool less the 5 % reserve."""
SERVE_ARGS = [
    "--dtype", "float32",
    "--kv-cache-memory", str(NUM_BLOCKS * BLOCK_BYTES),
    "--block-size", str(BLOCK_SIZE),
    "--api-key", API_KEY,
    "--log-stats-interval", "0",
]  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "Hello", "max_tokens": 4}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))
    with ServerProcess(["--model", str(model), *SERVE_ARGS]) as process:
        yield process


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error["message"]


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    reply = http.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udc00"}]}',
         "messages"),
        ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\udfff"]}', "prompt"),
    ],
)  # fmt: skip
def test_lone_surrogate_is_a_400_and_the_engine_lives(http, path, body, param):
    assert_error(http.post(path, content=body, headers=JSON), 400, param, "surrogate")
    assert_still_serving(http)


def test_huge_n_is_refused_at_once_without_disturbing_a_stream(http):
    body = {**COMPLETION, "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        chunks = [next(line for line in lines if line)]
        huge = http.post("/v1/completions", json={**COMPLETION, "n": 1_000_000, "max_tokens": 1})
        assert_error(huge, 400, "n", "max_n", "128")
        many = http.post("/v1/completions", json={**COMPLETION, "n": 128, "max_tokens": 500})
        assert_error(many, 400, "n", "KV blocks", str(CAPACITY))
        chunks += [line for line in lines if line]
    assert chunks[-1] == "data: [DONE]"
    assert "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1]) == alone


def test_a_request_whose_worst_case_just_fits_is_served(http):
    """A prompt of one full block shared by n samples of max_tokens = one block each:
    1 + n blocks at worst. n = CAPACITY - 1 fits exactly, n = CAPACITY does not."""
    prompt = list(range(65, 65 + BLOCK_SIZE))
    body = {"prompt": prompt, "max_tokens": BLOCK_SIZE, "ignore_eos": True}
    over = http.post("/v1/completions", json={**body, "n": CAPACITY})
    assert_error(over, 400, "n", str(CAPACITY + 1), str(CAPACITY))
    fits = http.post("/v1/completions", json={**body, "n": CAPACITY - 1})
    assert fits.status_code == 200, fits.text
    choices = fits.json()["choices"]
    assert len(choices) == CAPACITY - 1
    assert all(choice["finish_reason"] == "length" for choice in choices)


def test_deep_nesting_is_an_openai_shaped_400(http):
    for depth, param in ((40, "prompt"), (100_000, None)):  # checked, or too deep to parse
        body = '{"prompt": ' + "[" * depth + "]" * depth + "}"
        response = http.post("/v1/completions", content=body, headers=JSON)
        assert_error(response, 400, param, "nested more than 32")
    assert_still_serving(http)


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_non_json_content_type_is_a_415(http, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    response = http.post("/v1/completions", content=json.dumps(COMPLETION), headers=headers)
    assert_error(response, 415, None, "application/json")
    assert response.json()["error"]["code"] == "unsupported_media_type"


def test_json_content_type_with_charset_and_any_case_is_accepted(http):
    headers = {"Content-Type": "Application/JSON; charset=utf-8"}
    response = http.post("/v1/completions", content=json.dumps(COMPLETION), headers=headers)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("raw_fields", "param", "words"),
    [
        ('"temperature": Infinity', None, "Infinity"),
        ('"temperature": NaN', None, "NaN"),
        ('"temperature": 1e400', "temperature", "finite"),
        ('"temperature": 1e308', "temperature", "2"),
        ('"stop_token_ids": [259]', "stop_token_ids", "[0, 259)"),
        ('"stop": ""', "stop", "non-empty"),
        ('"stop": [""]', "stop", "non-empty"),
        ('"seed": 18446744073709551616', "seed", "2**63"),
        ('"seed": -9223372036854775809', "seed", "2**63"),
        ('"repetition_penalty": 1e999', "repetition_penalty", "finite"),
        ('"logprobs": 21', "logprobs", "20"),
    ],
)
def test_sampling_fields_follow_vllm_rules(http, raw_fields, param, words):
    body = '{"prompt": "Hello", "max_tokens": 2, ' + raw_fields + "}"
    assert_error(http.post("/v1/completions", content=body, headers=JSON), 400, param, words)


def test_top_logprobs_without_logprobs_is_a_400(http):
    response = http.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 3})
    assert_error(response, 400, "top_logprobs", "logprobs")
    with_logprobs = http.post(
        "/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 3}
    )
    assert with_logprobs.status_code == 200
    content = with_logprobs.json()["choices"][0]["logprobs"]["content"]
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)


def test_seed_at_the_int64_edges_is_served(http):
    for seed in (2**63 - 1, -(2**63)):
        response = http.post("/v1/completions", json={**COMPLETION, "seed": seed, "n": 2})
        assert response.status_code == 200, response.text


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_auth_scheme_is_case_insensitive(server, scheme):
    headers = {"Authorization": f"{scheme} {API_KEY}"}
    response = httpx.post(f"{server.base_url}/v1/completions", json=COMPLETION, headers=headers)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", "/v1/nothing-here", 404), ("DELETE", "/v1/completions", 405), ("PUT", "/health", 405)],
)
def test_unknown_routes_and_methods_are_openai_shaped(http, method, path, status):
    assert_error(http.request(method, path), status, None, path)


def test_a_client_leaving_mid_stream_frees_its_blocks(http):
    body = {**COMPLETION, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        next(line for line in response.iter_lines() if line)
    deadline = time.monotonic() + 10
    while blocks_used(http) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert blocks_used(http) == 0
    assert_still_serving(http)


def blocks_used(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("pagedllm:kv_blocks_used{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("/metrics has no pagedllm:kv_blocks_used")
