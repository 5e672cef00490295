"""The shutdown/API-key gate and the body limit, in front of a stand-in app."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request

from pagedllm.server.errors import install_error_handlers
from pagedllm.server.middleware import BodyLimit, Gate

LIMIT = 100


def stand_in_app(draining: list[bool], api_key: str | None) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @app.get("/metrics")
    async def metrics() -> dict[str, str]:
        return {"ok": "yes"}

    app.add_middleware(BodyLimit, max_bytes=LIMIT)
    app.add_middleware(Gate, api_key=api_key, is_draining=lambda: draining[0])
    return app


def call(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_draining_refuses_everything_but_metrics():
    draining = [False]
    app = stand_in_app(draining, api_key=None)
    assert call(app, "POST", "/v1/echo", content=b"x").status_code == 200
    draining[0] = True
    refused = call(app, "POST", "/v1/echo", content=b"x")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "shutting_down"
    assert call(app, "GET", "/metrics").status_code == 200


def test_api_key_guards_v1_only():
    app = stand_in_app([False], api_key="k")
    assert call(app, "POST", "/v1/echo", content=b"x").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert call(app, "POST", "/v1/echo", content=b"x", headers=wrong).status_code == 401
    right = {"Authorization": "Bearer k"}
    assert call(app, "POST", "/v1/echo", content=b"x", headers=right).status_code == 200
    assert call(app, "GET", "/metrics").status_code == 200


def test_body_limit_with_and_without_content_length():
    app = stand_in_app([False], api_key=None)
    assert call(app, "POST", "/v1/echo", content=b"x" * LIMIT).json() == {"bytes": LIMIT}
    declared = call(app, "POST", "/v1/echo", content=b"x" * (LIMIT + 1))
    assert declared.status_code == 413 and str(LIMIT) in declared.json()["error"]["message"]

    async def chunks():
        for _ in range(5):
            yield b"x" * 40

    streamed = call(app, "POST", "/v1/echo", content=chunks())
    assert "content-length" not in streamed.request.headers
    assert streamed.status_code == 413
    assert streamed.json()["error"]["code"] == "request_too_large"
