"""What both generation endpoints share: reading the body, admitting the request,
collecting or streaming its outputs."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from pagedllm.cpu.allocator import release_free_memory
from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError
from pagedllm.server.async_engine import AsyncEngine, EnginePrompt, RequestGroup
from pagedllm.server.errors import APIError
from pagedllm.server.field_policy import check_fields, ignored_fields_headers
from pagedllm.server.protocol import SamplingFields
from pagedllm.server.request_body import read_body
from pagedllm.server.responses import TokenTexts, usage
from pagedllm.tokenizer import Tokenizer

Fields = TypeVar("Fields", bound=SamplingFields)
Result = TypeVar("Result")


@dataclass
class ServingContext:
    """What a handler needs besides its request."""

    engine: AsyncEngine
    model_name: str
    texts: TokenTexts
    tokenizer: Tokenizer | None
    vocab_size: int
    max_model_len: int


@dataclass
class Admitted:
    """A request the engine accepted: its id, creation time (Unix seconds), group, and
    the headers of its response."""

    response_id: str
    created: int
    group: RequestGroup
    headers: dict[str, str]


@dataclass
class ParsedRequest:
    """A validated body, its sampling parameters (checked against the model) and the
    response headers that name the fields it ignored."""

    body: SamplingFields
    params: SamplingParams
    headers: dict[str, str]


async def parse_request(raw: Request, ctx: ServingContext, model: type[Fields]) -> ParsedRequest:
    """The request read and checked; APIError 400/404/415 otherwise."""
    body = await read_body(raw, model)
    check_model(ctx, body)
    headers = ignored_fields_headers(check_fields(body))
    params = invalid_as_400(body.sampling_params)

    def check() -> None:
        params.check_for_model(ctx.vocab_size, ctx.tokenizer)

    if params.structured_outputs is None:
        invalid_as_400(check)
    else:  # compiling a grammar can take a while: off the event loop
        await run_in_threadpool(invalid_as_400, check)
    return ParsedRequest(body, params, headers)


def check_model(ctx: ServingContext, body: BaseModel) -> None:
    """404 unless the body names the served model (or no model at all)."""
    name = getattr(body, "model", None)
    if name is not None and name != ctx.model_name:
        raise model_not_found(ctx, name)


def model_not_found(ctx: ServingContext, name: str) -> APIError:
    """OpenAI's 404 for a model this server does not serve."""
    return APIError(
        404,
        f"The model '{name}' does not exist; this server serves '{ctx.model_name}'",
        param="model",
        code="model_not_found",
    )


def invalid_as_400(make: Callable[[], Result]) -> Result:
    """``make()``, with its ``InvalidRequestError`` as a 400 naming the field."""
    try:
        return make()
    except InvalidRequestError as error:
        raise APIError(400, str(error), param=error.param, code="invalid_value") from None


async def admit(
    ctx: ServingContext, prefix: str, prompts: list[EnginePrompt], parsed: ParsedRequest
) -> Admitted:
    """Queue one engine request per prompt; raises APIError if the engine refuses."""
    arrival_time = time.monotonic()
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    request_ids = [f"{response_id}-{index}" for index in range(len(prompts))]
    group = await ctx.engine.add_group(request_ids, prompts, parsed.params, arrival_time)
    return Admitted(response_id, int(time.time()), group, parsed.headers)


async def final_outputs(
    ctx: ServingContext, admitted: Admitted, raw: Request
) -> list[RequestOutput] | None:
    """The finished outputs in prompt order, or None if the client went away first."""
    latest: dict[str, RequestOutput] = {}
    async for output in ctx.engine.outputs(admitted.group, raw.is_disconnected):
        latest[output.request_id] = output
    outputs = [latest.get(request_id) for request_id in admitted.group.request_ids]
    if any(output is None or not output.finished for output in outputs):
        return None
    return outputs


def response_json(
    ctx: ServingContext,
    admitted: Admitted,
    object_name: str,
    choices: list[dict[str, object]],
    outputs: list[RequestOutput],
    extra: dict[str, object] | None = None,
) -> Response:
    """A whole (non-streamed) response with its usage counts (and ``extra`` fields)."""
    envelope = {
        "id": admitted.response_id,
        "object": object_name,
        "created": admitted.created,
        "model": ctx.model_name,
        "choices": choices,
        "usage": usage(outputs),
        **(extra or {}),
    }
    return json_reply(encode_in_pieces(envelope), admitted.headers)


LARGE_REPLY_BYTES = 4 << 20
"""From this size up, a reply's building memory (its Python objects, several times its
size) is given back to the OS once it is sent, rather than kept by the heap."""


def json_reply(body: bytes, headers: dict[str, str]) -> Response:
    """A JSON response of ``body`` (encoded), releasing free heap pages after a large
    one (:func:`~pagedllm.cpu.allocator.release_free_memory`)."""
    after = BackgroundTask(release_free_memory) if len(body) >= LARGE_REPLY_BYTES else None
    return Response(body, media_type="application/json", headers=headers, background=after)


def encode_in_pieces(envelope: dict[str, object]) -> bytes:
    """``envelope`` as compact JSON, the items of its list fields encoded one by one.

    The C encoder holds the GIL for the whole of one call: a reply of tens of MB
    encoded at once would stall the event loop (and ``/health``) for a third of a
    second; a choice at a time, it never waits more than a choice's encoding."""
    pieces = []
    for key, value in envelope.items():
        if isinstance(value, list):
            encoded = "[" + ",".join(_dumps(item) for item in value) + "]"
        else:
            encoded = _dumps(value)
        pieces.append(f"{_dumps(key)}:{encoded}")
    return ("{" + ",".join(pieces) + "}").encode()


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
