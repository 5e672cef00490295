"""Reading a JSON request body: the checks that run before pydantic sees it.

In order: the ``Content-Type`` must be ``application/json`` (415 otherwise, so a web
page cannot post to a local server without a CORS preflight); the bytes must be UTF-8
and standard JSON (``NaN`` and ``Infinity`` are not); the top level must be an object
nested at most ``MAX_JSON_DEPTH`` deep; no string may hold a lone UTF-16 surrogate
(``"\\udc00"`` is valid JSON but not Unicode text, and no tokenizer can encode it);
integers have at most ``MAX_INTEGER_DIGITS`` digits.
Then the model validates strictly ("5" is not an integer), as OpenAI's API does.
Every failure is an ``APIError`` (400 or 415) naming the field where there is one.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from pagedllm.server.errors import APIError, validation_error

Body = TypeVar("Body", bound=BaseModel)

JSON_MEDIA_TYPE = "application/json"
MAX_JSON_DEPTH = 32
"""Most nested arrays and objects a body may hold (OpenAI's bodies need about 5)."""


def check_json_content_type(raw: Request) -> None:
    """415 unless the ``Content-Type`` is ``application/json`` (parameters such as
    ``charset=utf-8`` and letter case aside)."""
    declared = raw.headers.get("content-type", "")
    if declared.split(";", 1)[0].strip().lower() != JSON_MEDIA_TYPE:
        shown = repr(declared) if declared else "none"
        raise APIError(
            415,
            f"The request body must be sent with 'Content-Type: {JSON_MEDIA_TYPE}' "
            f"(got {shown})",
            code="unsupported_media_type",
        )


async def read_body(raw: Request, model: type[Body]) -> Body:
    """The body validated as ``model``; raises ``APIError`` as the module says."""
    check_json_content_type(raw)
    data = await raw.body()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(
            400, f"The request body is not valid UTF-8 (byte {error.start})", code="invalid_json"
        ) from None
    parsed = parse_json(text)
    if not isinstance(parsed, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(parsed, strict=True)
    except ValidationError as error:
        raise validation_error(error) from None


class RefusedJSON(ValueError):
    """Well-formed JSON this server does not take: ``NaN`` or ``Infinity``, an integer
    too long, nesting deeper than ``MAX_JSON_DEPTH``, a lone surrogate. ``field``:
    the top-level field it sits in, where known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def load_json(text: str) -> object:
    """``text`` as standard JSON; ``json.JSONDecodeError`` for bad syntax,
    :class:`RefusedJSON` for what the server does not take."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_int=_bounded_int)
    except RecursionError:
        raise _too_deep() from None
    check_structure(value)
    return value


def parse_json(text: str) -> object:
    """:func:`load_json` with its failures as 400s naming the field."""
    try:
        return load_json(text)
    except json.JSONDecodeError as error:
        raise APIError(
            400, f"The request body is not valid JSON: {error}", code="invalid_json"
        ) from None
    except RefusedJSON as error:
        raise APIError(400, str(error), param=error.field, code="invalid_value") from None


MAX_INTEGER_DIGITS = 1000
"""Most digits an integer may have (Python refuses to read more than 4,300; no field
needs more than 20)."""


def _refuse_constant(name: str) -> float:
    raise RefusedJSON(f"{name} is not a JSON value (numbers must be finite)")


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INTEGER_DIGITS + 1:  # the sign
        raise RefusedJSON(f"an integer of {len(text)} digits is longer than this server reads")
    return int(text)


def check_structure(value: object) -> None:
    """RefusedJSON for nesting deeper than ``MAX_JSON_DEPTH`` or a string (key or
    value) that is not Unicode text, naming the top-level field it sits in when
    ``value`` is an object. Iterative, so a hostile body cannot exhaust the stack."""
    pending: list[tuple[object, int, str | None]] = [(value, 1, None)]
    while pending:
        value, depth, field = pending.pop()
        if isinstance(value, str):
            _check_text(value, field)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(field)
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, field or key)
                pending.append((item, depth + 1, field or key))
        else:
            pending.extend((item, depth + 1, field) for item in value)


def _check_text(text: str, field: str | None) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        where = f"'{field}'" if field else "the body"
        raise RefusedJSON(
            f"{where} holds a lone UTF-16 surrogate {text[error.start]!r}, which is not "
            "valid Unicode text",
            field,
        ) from None


def _too_deep(field: str | None = None) -> RefusedJSON:
    return RefusedJSON(f"The JSON is nested more than {MAX_JSON_DEPTH} levels deep", field)
