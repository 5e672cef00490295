"""``POST /v1/completions``: prompts (text or token ids, one or a batch) continued."""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request, Response

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.server.errors import APIError
from pagedllm.server.protocol import CompletionRequest
from pagedllm.server.responses import completion_logprobs
from pagedllm.server.serving import (
    ServingContext,
    admit,
    final_outputs,
    parse_request,
    response_json,
)
from pagedllm.server.streaming import ChoiceUpdate, StreamFormat, event_stream


async def create_completion(raw: Request, ctx: ServingContext) -> Response:
    parsed = await parse_request(raw, ctx, CompletionRequest)
    body = parsed.body
    if body.suffix is not None:
        raise _suffix_refusal(ctx)
    try:
        prompts = body.prompts()
    except ValueError as error:
        raise APIError(400, str(error), param="prompt") from None
    admitted = await admit(ctx, "cmpl", prompts, parsed)
    if body.stream:
        return event_stream(ctx, admitted, _stream_format(ctx, body))
    outputs = await final_outputs(ctx, admitted, raw)
    if outputs is None:
        return Response(status_code=499)
    if body.num_samples != body.n:
        outputs = [best_of(output, body.n) for output in outputs]
    choices = [
        _choice(ctx, body, number * body.n + completion.index, completion)
        for number, output in enumerate(outputs)
        for completion in output.outputs
    ]
    return response_json(ctx, admitted, "text_completion", choices, outputs)


def best_of(output: RequestOutput, n: int) -> RequestOutput:
    """``output`` with only its ``n`` samples of highest cumulative logprob (of the raw
    model distribution), best first, renumbered 0 to n - 1; ties keep sample order."""
    ranked = sorted(output.outputs, key=lambda c: -(c.cumulative_logprob or 0.0))
    chosen = [replace(c, index=index) for index, c in enumerate(ranked[:n])]
    return replace(output, outputs=chosen)


def _suffix_refusal(ctx: ServingContext) -> APIError:
    if ctx.tokenizer is None or not ctx.tokenizer.has_fill_in_the_middle:
        reason = "this model has no fill-in-the-middle tokens"
    else:
        reason = "fill-in-the-middle prompts are not implemented yet"
    return APIError(400, f"'suffix' is not supported: {reason}", "suffix", "unsupported_field")


def _choice(
    ctx: ServingContext, body: CompletionRequest, index: int, completion: CompletionOutput
) -> dict[str, object]:
    logprobs = None
    if body.logprobs is not None and completion.logprobs is not None:
        entries = completion.logprobs[: len(completion.token_ids)]
        logprobs = completion_logprobs(entries, ctx.texts, 0)
    return {
        "index": index,
        "text": completion.text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
    }


def _stream_format(ctx: ServingContext, body: CompletionRequest) -> StreamFormat:
    """Text deltas and a finish reason per choice; logprob text offsets keep counting
    across a choice's chunks."""
    text_offsets: dict[int, int] = {}

    def choice(update: ChoiceUpdate) -> dict[str, object]:
        logprobs = None
        if update.logprobs:
            offset = text_offsets.get(update.index, 0)
            logprobs = completion_logprobs(update.logprobs, ctx.texts, offset)
            text_offsets[update.index] = offset + sum(len(t) for t in logprobs["tokens"])
        return {
            "index": update.index,
            "text": update.completion.delta_text,
            "logprobs": logprobs,
            "finish_reason": update.completion.finish_reason,
        }

    with_logprobs = body.logprobs is not None
    return StreamFormat(
        "text_completion",
        body.n,
        with_logprobs,
        body.include_usage,
        body.continuous_usage,
        choice,
        [],
    )
