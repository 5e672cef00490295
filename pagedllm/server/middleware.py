"""ASGI layers in front of the routes: the shutdown and API-key gate, the body's size
limit and deadline.

Both are plain ASGI (not ``BaseHTTPMiddleware``) so streaming responses and
disconnect detection pass through untouched.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.server.errors import APIError

API_PREFIX = "/v1/"
UNGUARDED_PATHS = ("/health", "/dashboard")
"""Paths open without the API key whatever the scope: supervisors probe ``/health``;
``/dashboard`` is a page holding no data (its feed, ``/dashboard/events``, is guarded
like ``/metrics``, and the page asks for the key)."""
API_KEY_SCOPES = ("v1", "all")
"""What ``--api-key`` guards: the ``/v1/`` routes, or every path but the unguarded ones
(``/metrics``, ``/dashboard/events``, ``/kv_events``, ``/docs``, ``/openapi.json`` too)."""


class Gate:
    """503 while draining (except ``/metrics``), 401 without the API key on the paths
    ``api_key_scope`` covers. The key travels as ``Authorization: Bearer <key>``; the
    scheme is compared case-insensitively (RFC 9110), the key exactly."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        is_draining: Callable[[], bool],
        api_key_scope: str = "v1",
    ) -> None:
        if api_key_scope not in API_KEY_SCOPES:
            raise ValueError(f"api_key_scope must be one of {API_KEY_SCOPES}: {api_key_scope!r}")
        self.app = app
        self._expected = api_key.encode() if api_key else None
        self._is_draining = is_draining
        self._guards_all = api_key_scope == "all"

    def _guarded(self, path: str) -> bool:
        if self._expected is None or path in UNGUARDED_PATHS:
            return False
        return self._guards_all or path.startswith(API_PREFIX)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        error = None
        if self._is_draining() and path != "/metrics":
            error = APIError(503, "The server is shutting down", code="shutting_down")
        elif self._guarded(path) and not self._authorized(scope):
            error = APIError(
                401,
                "Missing or incorrect API key: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        if error is None:
            await self.app(scope, receive, send)
        else:
            await error.response()(scope, receive, send)


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"The request body is larger than the limit of {limit} bytes",
            code="request_too_large",
        )


class BodyTooSlow(APIError):
    """The body did not arrive whole in time; the connection closes after the answer
    (what is left of the body would otherwise be read as the next request)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            408,
            f"The request body did not arrive whole within {timeout_s} s",
            code="request_timeout",
        )

    def response(self) -> JSONResponse:
        answer = super().response()
        answer.headers["Connection"] = "close"
        return answer


class BodyLimit:
    """413 for bodies over ``max_bytes``: at once from ``Content-Length``, else while
    the (chunked) body arrives; 408 for a body not whole ``read_timeout_s`` seconds
    after the route first asks for it. The route sees ``BodyTooLarge`` or
    ``BodyTooSlow`` raised by ``receive``; once the body is whole, ``receive`` (which
    then waits for a disconnect) passes through untouched."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float = 30.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await BodyTooLarge(self.max_bytes).response()(scope, receive, send)
            return
        received = 0
        deadline: float | None = None
        whole = False

        async def limited_receive() -> Message:
            nonlocal received, deadline, whole
            if whole:
                return await receive()
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.read_timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise BodyTooSlow(self.read_timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                whole = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)
