"""ASGI layers in front of the routes: the shutdown and API-key gate, the body limit.

Both are plain ASGI (not ``BaseHTTPMiddleware``) so streaming responses and
disconnect detection pass through untouched.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedllm.server.errors import APIError

API_PREFIX = "/v1/"


class Gate:
    """503 while draining (except ``/metrics``), 401 on ``/v1/`` without the API key."""

    def __init__(self, app: ASGIApp, api_key: str | None, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self._is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        error = None
        if self._is_draining() and path != "/metrics":
            error = APIError(503, "The server is shutting down", code="shutting_down")
        elif self._expected is not None and path.startswith(API_PREFIX):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
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


class BodyLimit:
    """413 for bodies over ``max_bytes``: at once from ``Content-Length``, else while
    the (chunked) body arrives; the route sees ``BodyTooLarge`` raised by ``receive``."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await BodyTooLarge(self.max_bytes).response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)
