"""Server-sent events for both generation endpoints: one chunk per choice update."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.server.errors import APIError
from pagedllm.server.responses import new_logprobs, sse, usage
from pagedllm.server.serving import Admitted, ServingContext

logger = logging.getLogger("pagedllm.server")


@dataclass
class ChoiceUpdate:
    """What one step added to one choice: text, logprobs, or its finish; ``first`` for
    the choice's first update. ``output`` is its request's snapshot."""

    index: int
    completion: CompletionOutput
    logprobs: list[TokenLogprobs]
    output: RequestOutput
    first: bool


@dataclass
class StreamFormat:
    """How an endpoint shapes its chunks.

    ``object_name``: the chunks' ``object``; ``opening``: choices sent before any
    token (chat's role announcements); ``choice``: the choice JSON of an update, or
    None when the update shows nothing yet (text held back).
    ``continuous_usage``: every chunk carries the usage of the outputs seen so far
    (the opening chunks then wait for the first output, which knows the prompt's
    length). ``shown``: what of each engine output the client sees (for example
    without an echo-only request's one generated token).
    """

    object_name: str
    n: int
    with_logprobs: bool
    include_usage: bool
    continuous_usage: bool
    choice: Callable[[ChoiceUpdate], dict[str, object] | None]
    opening: list[dict[str, object]]
    shown: Callable[[RequestOutput], RequestOutput] | None = None


async def choice_updates(
    ctx: ServingContext, admitted: Admitted, fmt: StreamFormat, latest: dict[str, RequestOutput]
) -> AsyncIterator[ChoiceUpdate]:
    """Updates with news in step order; each choice's last one carries its finish
    reason. ``latest`` collects each request's newest snapshot (for usage)."""
    finished: set[int] = set()
    started: set[int] = set()
    async for output in ctx.engine.outputs(admitted.group):
        if fmt.shown is not None:
            output = fmt.shown(output)
        latest[output.request_id] = output
        first_index = admitted.group.request_ids.index(output.request_id) * fmt.n
        for completion in output.outputs:
            index = first_index + completion.index
            if index in finished:
                continue
            entries = new_logprobs(completion) if fmt.with_logprobs else []
            if completion.delta_text or entries or completion.finish_reason:
                yield ChoiceUpdate(index, completion, entries, output, index not in started)
                started.add(index)
            if completion.finish_reason:
                finished.add(index)


def opening_usage(latest: dict[str, RequestOutput]) -> dict[str, int]:
    """The continuous usage of an opening chunk: the prompts' tokens and no completion
    tokens (it precedes every token, as in vLLM), though the first output is known."""
    prompt = usage(list(latest.values()))["prompt_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}


async def events(ctx: ServingContext, admitted: Admitted, fmt: StreamFormat) -> AsyncIterator[str]:
    head = {
        "id": admitted.response_id,
        "object": fmt.object_name,
        "created": admitted.created,
        "model": ctx.model_name,
    }
    latest: dict[str, RequestOutput] = {}

    def tail() -> dict[str, object]:
        if fmt.continuous_usage:
            return {"usage": usage(list(latest.values()))}
        return {"usage": None} if fmt.include_usage else {}

    opening = list(fmt.opening)
    if not fmt.continuous_usage:
        for choice in opening:
            yield sse({**head, "choices": [choice], **tail()})
        opening = []
    async for update in choice_updates(ctx, admitted, fmt, latest):
        for choice in opening:
            yield sse({**head, "choices": [choice], "usage": opening_usage(latest)})
        opening = []
        shown = fmt.choice(update)
        if shown is not None:
            yield sse({**head, "choices": [shown], **tail()})
    if fmt.include_usage:
        yield sse({**head, "choices": [], "usage": usage(list(latest.values()))})
    yield sse("[DONE]")


def event_stream(ctx: ServingContext, admitted: Admitted, fmt: StreamFormat) -> StreamingResponse:
    """An SSE response; a failure mid-stream (the engine's, or any other once the
    headers are out) becomes an OpenAI-shaped error event, then ``[DONE]``.

    The group is aborted when the response ends for any reason, also when the client
    leaves before the first event (the generator then never starts, so only the
    background task runs).
    """

    async def with_errors() -> AsyncIterator[str]:
        try:
            async for event in events(ctx, admitted, fmt):
                yield event
        except APIError as error:
            yield sse(error.body())
            yield sse("[DONE]")
        except Exception as error:
            logger.exception("stream %s failed", admitted.response_id)
            failed = APIError(
                500,
                f"The server failed while streaming: {type(error).__name__}",
                code="internal_error",
            )
            yield sse(failed.body())
            yield sse("[DONE]")

    return StreamingResponse(
        with_errors(),
        media_type="text/event-stream",
        headers=admitted.headers,
        background=BackgroundTask(ctx.engine.abort, admitted.group),
    )
