"""What both generation endpoints share: reading the body, admitting the request,
collecting or streaming its outputs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.request_errors import InvalidRequestError
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.server.async_engine import AsyncEngine, EnginePrompt, RequestGroup
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import SamplingFields
from pagedllm.server.request_body import read_body
from pagedllm.server.responses import TokenTexts, usage

Fields = TypeVar("Fields", bound=SamplingFields)


@dataclass
class ServingContext:
    """What a handler needs besides its request."""

    engine: AsyncEngine
    model_name: str
    texts: TokenTexts


@dataclass
class Admitted:
    """A request the engine accepted: its id, creation time (Unix seconds) and group."""

    response_id: str
    created: int
    group: RequestGroup


async def parse_request(
    raw: Request, ctx: ServingContext, model: type[Fields]
) -> tuple[Fields, SamplingParams]:
    """The validated body and its sampling parameters; APIError 400/404/415 otherwise."""
    body = await read_body(raw, model)
    check_model(ctx, body)
    return body, sampling_params(body.sampling_params)


def check_model(ctx: ServingContext, body: SamplingFields) -> None:
    """404 unless the body names the served model (or no model at all)."""
    if body.model is not None and body.model != ctx.model_name:
        raise APIError(
            404,
            f"The model '{body.model}' does not exist; this server serves '{ctx.model_name}'",
            param="model",
            code="model_not_found",
        )


def sampling_params(make: Callable[[], SamplingParams]) -> SamplingParams:
    """``make()``, with its ``InvalidRequestError`` as a 400 naming the field."""
    try:
        return make()
    except InvalidRequestError as error:
        raise APIError(400, str(error), param=error.param, code="invalid_value") from None


async def admit(
    ctx: ServingContext, prefix: str, prompts: list[EnginePrompt], params: SamplingParams
) -> Admitted:
    """Queue one engine request per prompt; raises APIError if the engine refuses."""
    arrival_time = time.monotonic()
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    request_ids = [f"{response_id}-{index}" for index in range(len(prompts))]
    group = await ctx.engine.add_group(request_ids, prompts, params, arrival_time)
    return Admitted(response_id, int(time.time()), group)


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
) -> JSONResponse:
    """A whole (non-streamed) response with its usage counts."""
    return JSONResponse(
        {
            "id": admitted.response_id,
            "object": object_name,
            "created": admitted.created,
            "model": ctx.model_name,
            "choices": choices,
            "usage": usage(outputs),
        }
    )
