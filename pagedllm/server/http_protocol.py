"""The HTTP/1.1 connection: uvicorn's httptools protocol with two guards.

- A request's line and headers must arrive whole within ``read_timeout_s`` of their
  first byte (of the connection's opening, for its first request): a client that
  trickles them (slowloris) or opens a connection and sends nothing gets a 408 and is
  disconnected. The body has its own deadline, kept by :class:`~pagedllm.server.
  middleware.BodyLimit`; an idle keep-alive connection, uvicorn's ``timeout_keep_alive``.
- Bytes that are not HTTP get the OpenAI-shaped JSON error every other failure has
  (uvicorn answers in plain text), then the connection closes.
"""

from __future__ import annotations

import asyncio
import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pagedllm.server.errors import error_body


class GuardedHttpProtocol(HttpToolsProtocol):
    """Use :func:`guarded_protocol` to make one with its timeout."""

    read_timeout_s: float = 30.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._header_timer is None:
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        self._send_error(400, f"Malformed HTTP request: {msg}", "invalid_http")

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.read_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        message = f"The request's line and headers did not arrive within {self.read_timeout_s} s"
        self._send_error(408, message, "request_timeout")

    def _send_error(self, status: int, message: str, code: str) -> None:
        """Answer with an OpenAI-shaped error and close the connection."""
        self._cancel_header_timer()
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a pipelined request: the running answer owns the bytes
            return
        body = json.dumps(error_body(status, message, code=code)).encode()
        reason = {400: b"Bad Request", 408: b"Request Timeout"}[status]
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
        defaults = self.server_state.default_headers
        head += [name + b": " + value + b"\r\n" for name, value in defaults]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


def guarded_protocol(read_timeout_s: float) -> type[GuardedHttpProtocol]:
    """The protocol class for uvicorn's ``http`` setting, with its header deadline."""
    settings = {"read_timeout_s": read_timeout_s}
    return type(GuardedHttpProtocol.__name__, (GuardedHttpProtocol,), settings)
