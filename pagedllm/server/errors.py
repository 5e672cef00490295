"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure the server reports goes through :class:`APIError`, so each status code
has one place that decides its JSON; handlers turn FastAPI's and pydantic's own
validation errors (422 by default) into 400s of the same shape, Starlette's 404 and
405 into the same shape, a client that left mid-body into a quiet 499 (nobody reads
it), and any exception nothing else caught into a logged 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable",
}

CLIENT_CLOSED_REQUEST = 499
"""The status logged for a request whose client left before its answer (nginx's)."""

logger = logging.getLogger("pagedllm.server")


class APIError(Exception):
    """A failure to report to the client with an HTTP status and a readable message."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, dict[str, object]]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, dict[str, object]]:
    """The JSON an OpenAI client expects for a failed request."""
    error_type = ERROR_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """A 400 naming the first offending field of a pydantic validation failure."""
    details = error.errors()
    first = details[0] if details else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = location[0] if location else None
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    else:
        where = f"'{param}': " if param else ""
        message = f"Invalid request: {where}{first.get('msg', 'the body does not validate')}"
    if len(details) > 1:
        message += f" (and {len(details) - 1} more problem(s))"
    return APIError(400, message, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app raises, its own or the framework's, OpenAI-shaped."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, error: RequestValidationError) -> JSONResponse:
        return validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message, code = str(error.detail), None
        if error.status_code == 404:
            message, code = f"There is no route {request.url.path}", "route_not_found"
        elif error.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        response = APIError(error.status_code, message, code=code).response()
        response.headers.update(error.headers or {})  # e.g. Allow on a 405
        return response

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, _: ClientDisconnect) -> Response:
        logger.info("client left during its request body: %s %s", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        logger.error("unhandled %r on %s %s", error, request.method, request.url.path)
        return APIError(500, "The server failed on this request", code="internal_error").response()
