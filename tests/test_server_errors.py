"""Bad input to ``pagedllm serve``: each gets its 4xx (or 503) as OpenAI-style JSON
with a clear message, and a well-formed request right after still succeeds. The
last test shuts the server down gracefully, and the server draws its block-pool trace."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.server.launcher import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "sk-test-key"
MAX_BODY = 16 * 1024
SERVE_ARGS = [
    "--dtype", "float32",
    "--kv-cache-memory", "32MiB",
    "--max-model-len", "256",
    "--api-key", API_KEY,
    "--max-body-size", str(MAX_BODY),
    "--max-pending-requests", "4",
    "--log-stats-interval", "0",
]  # fmt: skip
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pool_trace_png(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("trace") / "pool.png"


@pytest.fixture(scope="module")
def server(pool_trace_png):
    with ServerProcess([*SERVE_ARGS, "--trace-pool", str(pool_trace_png)]) as process:
        yield process


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120.0) as client:
        yield client


def assert_error(response: httpx.Response, status: int, *words: str) -> dict:
    """The response is an OpenAI error with ``status`` whose message has ``words``."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"], error["message"]
    return error


def assert_still_serving(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


BAD_BODIES = [
    pytest.param("/v1/chat/completions", b'{"messages": [', "not valid JSON", id="malformed-json"),
    pytest.param("/v1/completions", b"[1, 2]", "JSON object", id="not-an-object"),
    pytest.param(
        "/v1/chat/completions",
        json.dumps({**CHAT, "max_tokens": "four"}).encode(),
        "max_tokens",
        id="wrong-type",
    ),
    pytest.param(
        "/v1/chat/completions",
        json.dumps({**CHAT, "messages": [{"role": "user", "content": 5}]}).encode(),
        "messages",
        id="wrong-nested-type",
    ),
    pytest.param(
        "/v1/chat/completions", json.dumps({"model": MODEL}).encode(), "messages", id="missing"
    ),
    pytest.param("/v1/completions", json.dumps({**COMPLETION, "n": 0}).encode(), "n", id="n=0"),
    pytest.param(
        "/v1/completions",
        json.dumps({**COMPLETION, "max_tokens": -1}).encode(),
        "max_tokens",
        id="max_tokens=-1",
    ),
    pytest.param(
        "/v1/completions",
        json.dumps({**COMPLETION, "temperature": -0.5}).encode(),
        "temperature",
        id="temperature<0",
    ),
    pytest.param(
        "/v1/completions",
        json.dumps({**COMPLETION, "functions": [{"name": "f"}]}).encode(),
        "functions",
        id="unsupported-field",
    ),
    pytest.param(
        "/v1/completions", b'{"prompt": "caf\xe9", "max_tokens": 2}', "UTF-8", id="invalid-utf8"
    ),
]


@pytest.mark.parametrize(("path", "body", "word"), BAD_BODIES)
def test_bad_body_is_a_400(http, path, body, word):
    response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    error = assert_error(response, 400, word)
    assert error["type"] == "invalid_request_error"
    assert_still_serving(http)


def test_prompt_over_max_model_len_says_how_long(http):
    response = http.post("/v1/completions", json={**COMPLETION, "prompt": "word " * 300})
    assert_error(response, 400, "max_model_len", "256", "tokens")
    chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 300}]}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "256")
    assert_still_serving(http)


def test_unknown_model_is_a_404(http):
    error = assert_error(
        http.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"}), 404, "gpt-9", MODEL
    )
    assert error["code"] == "model_not_found"
    assert_still_serving(http)


def test_body_over_the_limit_is_a_413(http):
    big = {**COMPLETION, "prompt": "a" * (2 * MAX_BODY)}
    assert_error(http.post("/v1/completions", json=big), 413, str(MAX_BODY))

    def chunks():
        data = json.dumps(big).encode()
        for start in range(0, len(data), 4096):
            yield data[start : start + 4096]

    chunked = http.post(
        "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert "content-length" not in chunked.request.headers
    assert_error(chunked, 413, str(MAX_BODY))
    assert_still_serving(http)


def test_missing_or_wrong_api_key_is_a_401(server, http):
    url = f"{server.base_url}/v1/chat/completions"
    assert_error(httpx.post(url, json=CHAT), 401, "API key")
    wrong = {"Authorization": "Bearer sk-wrong"}
    error = assert_error(httpx.post(url, json=CHAT, headers=wrong), 401, "API key")
    assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # no key needed
    assert_still_serving(http)


def test_over_the_pending_limit_is_a_503(http):
    batch = {**COMPLETION, "prompt": ["a", "b", "c", "d", "e"]}
    assert_error(http.post("/v1/completions", json=batch), 503, "limit of 4")
    assert_still_serving(http)


def test_openai_client_raises_typed_errors(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    bad_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_errors_do_not_disturb_a_request_in_flight(http):
    body = {**COMPLETION, "max_tokens": 12, "temperature": 0.0}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        lines = response.iter_lines()
        chunks = [next(line for line in lines if line)]
        for param in BAD_BODIES:
            path, bad, _ = param.values
            assert 400 <= http.post(path, content=bad).status_code < 500
        chunks += [line for line in lines if line]
    assert chunks[-1] == "data: [DONE]"
    streamed = "".join(json.loads(c[6:])["choices"][0]["text"] for c in chunks[:-1])
    alone = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert streamed == alone


def test_graceful_shutdown_finishes_in_flight_then_exits(server, http, pool_trace_png):
    """Runs last: SIGTERM while a stream runs; new connections are refused, the stream
    completes, the process exits 0 after drawing the pool it traced."""
    received: list[str] = []

    def stream() -> None:
        body = {**COMPLETION, "max_tokens": 24, "stream": True, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            for line in response.iter_lines():
                if line:
                    received.append(line)

    client_thread = threading.Thread(target=stream)
    client_thread.start()
    deadline = time.monotonic() + 60
    while not received and time.monotonic() < deadline:
        time.sleep(0.05)
    server.process.send_signal(signal.SIGTERM)
    time.sleep(1.0)
    with pytest.raises(httpx.TransportError):  # the listening socket is closed
        httpx.post(f"{server.base_url}/v1/completions", json=COMPLETION, timeout=5.0)
    client_thread.join(120)
    assert received[-1] == "data: [DONE]"
    assert server.process.wait(timeout=120) == 0  # drawing the trace, then exiting by itself
    assert "Block-pool trace written" in server.log()
    assert pool_trace_png.read_bytes()[:8] == PNG_SIGNATURE
