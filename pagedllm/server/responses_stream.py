"""A streamed response: server-sent events in the Responses API's form, each
``event: <type>`` then ``data: <json>`` with a ``sequence_number`` counting from 0.

``response.created`` and ``response.in_progress`` (the Response object, in progress,
no output), the output's events (:class:`ResponseOutput`), then
``response.completed`` with the whole Response object: also for a response cut at
``max_output_tokens``, whose status says ``incomplete`` (as vLLM streams it; clients
such as ``vllm bench`` read the usage there). No ``[DONE]`` follows.

A failure once the headers are out (the engine's, or any other) becomes an ``error``
event (``code``, ``message``, ``param``) and ends the stream. The request is aborted
when the response ends for any reason, also when the client leaves.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from pagedllm.engine.outputs import RequestOutput
from pagedllm.server.errors import APIError
from pagedllm.server.responses_output import Event, ResponseOutput, response_object
from pagedllm.server.serving import Admitted, ServingContext

logger = logging.getLogger("pagedllm.server")


def response_stream(
    ctx: ServingContext,
    admitted: Admitted,
    head: dict[str, object],
    output: ResponseOutput,
    on_completed: Callable[[dict[str, object]], None],
) -> StreamingResponse:
    """The SSE response of an admitted request; ``on_completed`` gets the final
    Response object just before ``response.completed`` is sent."""
    numbers = itertools.count()

    def sse(event: Event) -> str:
        data = json.dumps({**event, "sequence_number": next(numbers)}, ensure_ascii=False)
        return f"event: {event['type']}\ndata: {data}\n\n"

    async def events() -> AsyncIterator[str]:
        in_progress = response_object(head)
        yield sse({"type": "response.created", "response": in_progress})
        yield sse({"type": "response.in_progress", "response": in_progress})
        final: RequestOutput | None = None
        try:
            async for final in ctx.engine.outputs(admitted.group):
                for event in output.update(final.outputs[0]):
                    yield sse(event)
            response = response_object(head, output.items, final)
            on_completed(response)
        except APIError as error:
            yield sse(_error_event(error))
            return
        except Exception as error:
            logger.exception("stream %s failed", head["id"])
            message = f"The server failed while streaming: {type(error).__name__}"
            failed = APIError(500, message, code="internal_error")
            yield sse(_error_event(failed))
            return
        yield sse({"type": "response.completed", "response": response})

    return StreamingResponse(
        events(),
        media_type="text/event-stream",
        headers=admitted.headers,
        background=BackgroundTask(ctx.engine.abort, admitted.group),
    )


def _error_event(error: APIError) -> Event:
    return {"type": "error", "code": error.code, "message": error.message, "param": error.param}
