"""The shutdown/API-key gate, the body limit and the error shapes, in front of a
stand-in app."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from pagedllm.server.errors import install_error_handlers
from pagedllm.server.middleware import BodyLimit, Gate

LIMIT = 100


def stand_in_app(draining: list[bool], api_key: str | None, scope: str = "v1") -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    @app.post("/v1/broken")
    async def broken() -> None:
        raise KeyError("a bug")

    @app.get("/metrics")
    async def metrics() -> dict[str, str]:
        return {"ok": "yes"}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {}

    app.add_middleware(BodyLimit, max_bytes=LIMIT)
    app.add_middleware(
        Gate, api_key=api_key, is_draining=lambda: draining[0], api_key_scope=scope
    )
    return app


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def call(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
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


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_auth_scheme_is_case_insensitive_and_the_key_is_not(scheme):
    app = stand_in_app([False], api_key="Key")
    ok = call(app, "POST", "/v1/echo", content=b"x", headers={"Authorization": f"{scheme} Key"})
    assert ok.status_code == 200
    wrong_case = {"Authorization": f"{scheme} key"}
    assert_openai_error(call(app, "POST", "/v1/echo", content=b"x", headers=wrong_case), 401)
    no_scheme = {"Authorization": "Key"}
    assert_openai_error(call(app, "POST", "/v1/echo", content=b"x", headers=no_scheme), 401)


def test_scope_all_guards_metrics_and_docs_but_not_health():
    app = stand_in_app([False], api_key="k", scope="all")
    for path in ("/metrics", "/docs", "/openapi.json"):
        assert_openai_error(call(app, "GET", path), 401)
        assert call(app, "GET", path, headers={"Authorization": "Bearer k"}).status_code == 200
    assert call(app, "GET", "/health").status_code == 200
    default = stand_in_app([False], api_key="k")
    assert call(default, "GET", "/openapi.json").status_code == 200


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="api_key_scope"):
        Gate(FastAPI(), api_key="k", is_draining=lambda: False, api_key_scope="most")


def test_404_405_and_500_are_openai_shaped():
    app = stand_in_app([False], api_key=None)
    error = assert_openai_error(call(app, "GET", "/v1/nowhere"), 404)
    assert "/v1/nowhere" in error["message"]
    not_allowed = call(app, "GET", "/v1/echo")
    assert "GET" in assert_openai_error(not_allowed, 405)["message"]
    assert not_allowed.headers["allow"] == "POST"
    error = assert_openai_error(call(app, "POST", "/v1/broken"), 500)
    assert error["type"] == "server_error" and "a bug" not in error["message"]
