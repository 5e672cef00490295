"""Faults inside a live ``pagedllm serve`` (started through tests/fault_injecting_cli.py):
a request that fails inside the engine step fails alone, streamed or not, while the
requests beside it finish as they would alone; a dead engine loop turns ``/health`` and
the generation routes to 503 and the process exits non-zero."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from fault_injecting_cli import DECODER_FAULT, LOOP_KILLER
from tiny_chat_model import write_tiny_chat_llama

from pagedllm import EngineConfig, LLMEngine
from pagedllm.server.app import ServerSettings, build_app
from pagedllm.server.cli import EXIT_ENGINE_DIED
from pagedllm.server.launcher import ServerProcess

ENTRY = [sys.executable, str(Path(__file__).with_name("fault_injecting_cli.py"))]
GOOD = {"prompt": "a quiet request", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
BAD = {"prompt": f"{DECODER_FAULT} please", "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_chat_llama(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture(scope="module")
def server(model):
    args = ["--model", str(model), "--dtype", "float32", "--kv-cache-memory", "4MiB"]
    args += ["--log-stats-interval", "0"]
    with ServerProcess(args, entry=ENTRY) as process:
        yield process


def metric(server, name: str) -> float:
    for line in httpx.get(f"{server.base_url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def stream_events(http: httpx.Client, body: dict) -> list[dict | str]:
    events: list[dict | str] = []
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def streamed_text(events: list[dict | str]) -> str:
    return "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e["choices"])


def test_a_request_failing_in_the_step_fails_alone(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        alone = streamed_text(stream_events(http, GOOD))
        beside: list[str] = []
        neighbour = threading.Thread(
            target=lambda: beside.append(streamed_text(stream_events(http, GOOD)))
        )
        neighbour.start()
        failed = http.post("/v1/completions", json=BAD)
        streamed = stream_events(http, BAD)
        neighbour.join(60)

        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error" and "injected decoder fault" in error["message"]
        assert streamed[-1] == "[DONE]"
        assert "injected decoder fault" in streamed[-2]["error"]["message"]
        assert beside == [alone]
        assert http.get("/health").status_code == 200
        assert http.post("/v1/completions", json=GOOD).json()["choices"][0]["text"] == alone
    assert metric(server, "pagedllm:num_requests_failed_total") == 2
    assert metric(server, "pagedllm:engine_step_failures_total") == 0
    assert metric(server, "pagedllm:kv_blocks_used") == 0


def test_health_and_generation_answer_503_once_the_loop_died(model, monkeypatch):
    """In process, where nothing exits, so the 503s stay observable."""
    from starlette.testclient import TestClient

    engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", kv_cache_memory="4MiB"))
    app = build_app(engine, ServerSettings(model_name="tiny"))
    exits: list[bool] = []
    app.state.lifecycle.request_exit = lambda: exits.append(True)
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200

        def dying_step():
            raise SystemExit("injected loop fault")

        monkeypatch.setattr(engine, "step", dying_step)
        killed = client.post("/v1/completions", json=GOOD)
        assert killed.status_code == 503 and killed.json()["error"]["code"] == "engine_dead"
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        answers = {
            "health": client.get("/health"),
            "completions": client.post("/v1/completions", json=GOOD),
            "chat": client.post("/v1/chat/completions", json=chat),
        }
        for route, answer in answers.items():
            assert answer.status_code == 503, route
            assert answer.json()["error"]["code"] == "engine_dead"
        assert app.state.lifecycle.engine_failed and exits == [True]


def test_a_dead_engine_loop_exits_the_process_non_zero(server):
    """Runs last: it ends the server."""
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        killed = http.post("/v1/completions", json={**GOOD, "prompt": LOOP_KILLER})
        assert killed.status_code == 503
        assert killed.json()["error"]["code"] == "engine_dead"
    deadline = time.monotonic() + 60
    while server.process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.process.returncode == EXIT_ENGINE_DIED, server.log()
    assert "engine loop died" in server.log()
