"""The server's edges, on a live ``pagedllm serve`` over a tiny random chat model:
a non-streaming client that leaves stops its request; the size of a reply is bounded;
numbers and nesting Python cannot read are 400s; HTTP that is slow, broken or cut off
gets an OpenAI-shaped answer or a quiet close; a shutdown ends every stream with an
error event and ``[DONE]``."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from tiny_chat_model import write_tiny_chat_llama

from pagedllm.server.launcher import ServerProcess

READ_TIMEOUT_S = 1.5
MAX_LOGPROB_ENTRIES = 20_000
SERVE_ARGS = [
    "--dtype", "float32",
    "--kv-cache-memory", "64MiB",
    "--log-stats-interval", "0",
    "--read-timeout", str(READ_TIMEOUT_S),
    "--max-logprob-entries", str(MAX_LOGPROB_ENTRIES),
]  # fmt: skip
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def server(model):
    with ServerProcess(["--model", str(model), *SERVE_ARGS]) as process:
        yield process


def metric(http: httpx.Client, name: str) -> float:
    """The sum of a Prometheus series over its labels."""
    lines = http.get("/metrics").text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def assert_error(response: httpx.Response, status: int, param: str | None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert error["code"] is not None, error
    for word in words:
        assert word in error["message"], error["message"]
    return error


def assert_still_serving(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    reply = http.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200, reply.text


def wait_until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


# ---- 1. a non-streaming client that leaves ---------------------------------------------


def test_a_non_streaming_request_whose_client_left_is_aborted(server, http):
    """The client gives up after 0.5 s; its 16 sequences of up to 1,000 tokens stop
    within the disconnect poll instead of running to the end."""
    aborted = metric(http, "pagedllm:num_requests_aborted_total")
    generated = metric(http, "vllm:generation_tokens_total")
    body = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "n": 16}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=0.5)
    assert wait_until(lambda: metric(http, "pagedllm:num_requests_aborted_total") > aborted)
    assert wait_until(lambda: metric(http, "pagedllm:kv_blocks_used") == 0)
    assert metric(http, "vllm:generation_tokens_total") - generated < 16 * 1000
    assert_still_serving(http)


# ---- 2. the size of a reply ---------------------------------------------------------------


def test_a_reply_past_the_logprob_limit_is_refused_up_front(http):
    prompt = "x" * 500  # one token per byte
    body = {"prompt": prompt, "echo": True, "logprobs": 5, "max_tokens": 1, "n": 8}
    error = assert_error(http.post("/v1/completions", json=body), 400, "logprobs", "20,000")
    assert "24,048 logprob entries" in error["message"], error  # 8 x 501 x 6
    chat = {**CHAT, "logprobs": True, "top_logprobs": 20, "max_tokens": 100, "n": 10}
    assert_error(http.post("/v1/chat/completions", json=chat), 400, "logprobs", "21,000")
    assert_still_serving(http)


def test_a_reply_within_the_limit_is_served_whole(http):
    body = {"prompt": "x" * 500, "echo": True, "logprobs": 5, "max_tokens": 1, "n": 4}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert len(choices) == 4
    for choice in choices:
        assert len(choice["logprobs"]["tokens"]) == 501
        # keyed by text: byte tokens that decode alike share a key
        assert all(1 <= len(top) <= 6 for top in choice["logprobs"]["top_logprobs"][1:])


# ---- 3. JSON that Python cannot read ----------------------------------------------------


def test_an_integer_of_thousands_of_digits_is_a_400(http):
    body = '{"prompt": "Hi", "max_tokens": 2, "seed": ' + "9" * 5000 + "}"
    assert_error(http.post("/v1/completions", content=body, headers=JSON), 400, None, "digits")
    nested = '{"prompt": "Hi", "metadata": {"a": [' + "7" * 5000 + "]}}"
    assert_error(http.post("/v1/completions", content=nested, headers=JSON), 400, None, "digits")
    assert_still_serving(http)


def _with_arguments(arguments: str) -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]


@pytest.mark.parametrize(
    ("arguments", "words"),
    [("[" * 100_000 + "]" * 100_000, "nested more than"), ('{"x": ' + "1" * 5000 + "}", "digits")],
    ids=["nested-100k-deep", "integer-5000-digits"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_tool_call_arguments_python_cannot_read_are_a_400(http, path, arguments, words):
    body = {"messages": _with_arguments(arguments)}
    if path != "/tokenize":
        body["max_tokens"] = 2
    assert_error(http.post(path, json=body), 400, "messages", "arguments", words)
    assert_still_serving(http)


def test_tool_call_arguments_that_are_plain_text_still_serve(http):
    body = {"messages": _with_arguments("not json"), "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# ---- 5. HTTP edges ------------------------------------------------------------------------


def raw_exchange(server, data: bytes, wait_s: float = 10.0, close: bool = False) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it (or
    ``wait_s`` passes); with ``close`` hang up right after sending instead."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait_s) as sock:
        sock.sendall(data)
        if close:
            return b""
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            pass
        return received


def json_body(answer: bytes) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"application/json" in head.lower(), answer
    return json.loads(body)


def test_a_body_that_never_completes_gets_a_408_and_the_connection_closes(server, http):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n"
    )
    start = time.monotonic()
    answer = raw_exchange(server, head + b'{"prompt": ', wait_s=30)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json_body(answer)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 30  # closed by the server, not by our give-up
    assert_still_serving(http)


@pytest.mark.parametrize(
    "trickle", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], ids=["silent", "slowloris"]
)
def test_headers_that_never_complete_get_a_408_and_the_connection_closes(server, trickle):
    start = time.monotonic()
    answer = raw_exchange(server, trickle, wait_s=30)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json_body(answer)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start < 30


def test_malformed_http_gets_an_openai_shaped_400(server, http):
    answer = raw_exchange(server, b"NOT HTTP AT ALL\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer
    error = json_body(answer)["error"]
    assert error["code"] == "invalid_http"
    assert error["type"] == "invalid_request_error"
    assert_still_serving(http)


def test_a_client_leaving_mid_body_is_no_error_in_the_log(server, http):
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n"
    )
    raw_exchange(server, head + b'{"messages": [', close=True)
    assert_still_serving(http)
    time.sleep(0.5)
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        ("GET", "/v1/nothing", None, 404, "route_not_found"),
        ("GET", "/v1/completions", None, 405, "method_not_allowed"),
        ("POST", "/v1/completions", b'{"prompt": ', 400, "invalid_json"),
        ("POST", "/v1/completions", b"\xff\xfe", 400, "invalid_json"),
    ],
)
def test_every_error_has_a_code(http, method, path, body, status, code):
    response = http.request(method, path, content=body, headers=JSON)
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


def test_grammar_errors_name_the_problem_without_the_library_s_internals(http):
    body = {**CHAT, "structured_outputs": {"regex": "(ab"}}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400, "structured_outputs")
    assert "parenthesis" in error["message"]
    assert ".cc" not in error["message"] and "/" not in error["message"], error["message"]


# ---- 4. shutdown --------------------------------------------------------------------------


def test_shutdown_ends_running_streams_with_an_error_event_then_done(model):
    """SIGTERM with a 1 s grace period while two long streams and a long non-streamed
    request run: each stream gets the shutdown error event and ``[DONE]``, the other a
    503, and the process exits 0 with no traceback in its log."""
    args = ["--model", str(model), *SERVE_ARGS, "--shutdown-timeout", "1"]
    with ServerProcess(args) as server:
        body = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "n": 16}
        streams: list[list[str]] = [[], []]
        whole: list[httpx.Response] = []

        def stream(lines: list[str]) -> None:
            with httpx.stream(
                "POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}
            ) as response:
                lines.extend(line for line in response.iter_lines() if line)

        def non_streamed() -> None:
            whole.append(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60))

        threads = [threading.Thread(target=non_streamed)]
        threads[0].start()
        with httpx.Client(base_url=server.base_url) as http:
            assert wait_until(lambda: metric(http, "pagedllm:kv_blocks_used") > 0, 30)
        threads += [threading.Thread(target=stream, args=(lines,)) for lines in streams]
        for thread in threads[1:]:
            thread.start()
        assert wait_until(lambda: all(streams), 30)
        server.process.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert server.process.wait(timeout=60) == 0
        for lines in streams:
            assert lines[-1] == "data: [DONE]", lines[-3:]
            error = json.loads(lines[-2].removeprefix("data: "))["error"]
            assert error["code"] == "shutting_down", error
        assert whole[0].status_code == 503, whole[0].text
        assert whole[0].json()["error"]["code"] == "shutting_down"
        log = server.log()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]


def test_only_a_large_reply_gives_its_memory_back_once_sent():
    from pagedllm.cpu.allocator import release_free_memory
    from pagedllm.server.serving import LARGE_REPLY_BYTES, json_reply

    assert json_reply(b"{}", {}).background is None
    large = json_reply(b" " * LARGE_REPLY_BYTES, {"X-Test": "1"})
    assert large.background.func is release_free_memory
    assert large.headers["X-Test"] == "1" and large.media_type == "application/json"
