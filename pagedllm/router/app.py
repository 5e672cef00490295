"""The router's HTTP face: OpenAI-compatible, passing each request through to the
replica :class:`~pagedllm.router.router.Router` chooses.

- ``POST /v1/completions``, ``/v1/chat/completions``: routed; the replica's answer is
  passed through byte for byte (streams as they come), and the usage it reports is
  counted.
- A replica that cannot be reached, or that fails before its answer has started,
  costs nothing: the request goes to another replica (a re-send). A stream that breaks
  midway ends with an error event (``code`` ``replica_failed``) and ``[DONE]``.
- ``GET /v1/models``, ``POST /tokenize``, ``/detokenize``: from any healthy replica.
- ``GET /health``: 200 while a replica is healthy; ``GET /metrics``: the router's own.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedllm.router.policy import NoReplicaError
from pagedllm.router.replica import Replica
from pagedllm.router.router import Router
from pagedllm.server.errors import APIError, install_error_handlers

_PASSED_HEADERS = ("authorization", "content-type", "accept")
_ROUTED = ("/v1/completions", "/v1/chat/completions")
_ANY_REPLICA = ("/v1/models", "/tokenize", "/detokenize", "/version")


def build_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="pagedllm router", lifespan=lifespan)
    install_error_handlers(app)

    for path in _ROUTED:
        app.add_api_route(path, _routed(router, path), methods=["POST"])
    for path in _ANY_REPLICA:
        app.add_api_route(path, _any_replica(router, path), methods=["GET", "POST"])

    @app.get("/health")
    async def health() -> Response:
        if not router.healthy():
            raise APIError(503, "No replica is serving", code="no_replica")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.follow(router.replicas)
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}


def _any_replica(router: Router, path: str):
    async def forward(request: Request) -> Response:
        body = await request.body()
        for replica in router.healthy():
            try:
                answer = await router.http.request(
                    request.method, f"{replica.base_url}{path}", content=body,
                    headers=_headers(request), params=request.query_params,
                )  # fmt: skip
            except httpx.TransportError:
                replica.lost()
                continue
            return Response(answer.content, answer.status_code, media_type=_media(answer))
        raise APIError(503, "No replica is serving", code="no_replica")

    return forward


def _routed(router: Router, path: str):
    async def route(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {}  # a replica answers the malformed body with its own 400
        token_ids = await router.prompt_ids(path, body) if body else None
        tried: set[int] = set()
        while True:
            try:
                replica, charge = router.choose(token_ids, body, tried)
            except NoReplicaError:
                raise APIError(
                    503, "No replica can take this request", code="no_replica"
                ) from None
            upstream = router.http.build_request(
                "POST", f"{replica.base_url}{path}", content=raw, headers=_headers(request)
            )
            try:
                answer = await router.http.send(upstream, stream=True)
                if not body.get("stream"):
                    await answer.aread()
            except httpx.TransportError:
                # nothing reached the client: send it to another replica
                router.release(replica, charge)
                replica.lost()
                tried.add(replica.index)
                router.metrics.resends.inc()
                continue
            if not body.get("stream") or answer.status_code != 200:
                router.release(replica, charge)
                await answer.aread()
                _count_reply(router, answer)
                return Response(answer.content, answer.status_code, media_type=_media(answer))
            return StreamingResponse(
                _relay(router, replica, charge, answer),
                status_code=answer.status_code,
                media_type=_media(answer),
            )

    return route


def _media(answer: httpx.Response) -> str | None:
    return answer.headers.get("content-type")


def _count_reply(router: Router, answer: httpx.Response) -> None:
    with contextlib.suppress(ValueError, AttributeError):
        router.count_usage(answer.json().get("usage"))


async def _relay(
    router: Router, replica: Replica, charge: int, answer: httpx.Response
) -> AsyncIterator[bytes]:
    """The replica's stream, passed on; its usage counted; an error event if it breaks."""
    try:
        async for line in answer.aiter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                with contextlib.suppress(ValueError):
                    router.count_usage(json.loads(line[len("data: ") :]).get("usage"))
            yield (line + "\n").encode()
    except httpx.TransportError:
        replica.lost()
        router.metrics.broken_streams.inc()
        error = {
            "error": {
                "message": f"replica {replica.index} failed while streaming this request",
                "type": "server_error",
                "code": "replica_failed",
            }
        }
        yield f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    finally:
        router.release(replica, charge)
        await answer.aclose()
