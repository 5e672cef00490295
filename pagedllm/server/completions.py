"""``POST /v1/completions``: prompts (text or token ids, one or a batch) continued.

With ``echo`` each choice starts with its prompt (text given as token ids is decoded)
and, with ``logprobs``, the prompt tokens' logprobs, computed in the prefill pass
(:mod:`pagedllm.engine.prompt_logprobs`). This is how evaluation harnesses score
likelihoods: ``echo``, ``logprobs`` and ``max_tokens=0`` (or 1).
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.server.errors import CLIENT_CLOSED_REQUEST, APIError
from pagedllm.server.protocol import CompletionRequest
from pagedllm.server.responses import completion_logprobs, prompt_logprobs_json
from pagedllm.server.serving import (
    Admitted,
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
        raise APIError(400, str(error), param="prompt", code="invalid_value") from None
    admitted = await admit(ctx, "cmpl", prompts, parsed)
    if body.stream:
        return event_stream(ctx, admitted, _stream_format(ctx, body))
    outputs = await final_outputs(ctx, admitted, raw)
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # a reply with logprobs can be tens of MB: built off the event loop
    return await run_in_threadpool(_response, ctx, body, admitted, outputs)


def _response(
    ctx: ServingContext, body: CompletionRequest, admitted: Admitted, outputs: list[RequestOutput]
) -> Response:
    if body.num_samples != body.n:
        outputs = [best_of(output, body.n) for output in outputs]
    if body.echo_only:
        outputs = [without_generation(output) for output in outputs]
    choices = [
        _choice(ctx, body, number * body.n + completion.index, output, completion)
        for number, output in enumerate(outputs)
        for completion in output.outputs
    ]
    return response_json(ctx, admitted, "text_completion", choices, outputs)


def without_generation(output: RequestOutput) -> RequestOutput:
    """``output`` as an echo-only request shows it: no generated token (the one the
    engine had to sample), finish reason ``"length"`` once done."""
    hidden = [
        replace(
            c,
            text="",
            token_ids=[],
            logprobs=None if c.logprobs is None else [],
            cumulative_logprob=None if c.cumulative_logprob is None else 0.0,
            delta_text="",
            delta_token_ids=[],
        )
        for c in output.outputs
    ]
    return replace(output, outputs=hidden)


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


def _prompt_text(ctx: ServingContext, output: RequestOutput) -> str:
    if output.prompt is not None or ctx.tokenizer is None:
        return output.prompt or ""
    return ctx.tokenizer.decode(output.prompt_token_ids, skip_special_tokens=False)


def _logprobs(
    ctx: ServingContext,
    body: CompletionRequest,
    entries: list[TokenLogprobs],
    text_offset: int,
    output: RequestOutput | None,
) -> dict[str, object]:
    """The choice's logprobs from ``text_offset``, led by the prompt's when ``output``
    (the request, echoed) is given."""
    first = None
    if output is not None and output.prompt_logprobs is not None:
        first = output.prompt_token_ids[0]
        entries = [*output.prompt_logprobs[1:], *entries]
    return completion_logprobs(entries, ctx.texts, text_offset, body.logprobs, first)


def _choice(
    ctx: ServingContext,
    body: CompletionRequest,
    index: int,
    output: RequestOutput,
    completion: CompletionOutput,
) -> dict[str, object]:
    echoed = output if body.echo else None
    logprobs = None
    if body.logprobs is not None and completion.logprobs is not None:
        entries = completion.logprobs[: len(completion.token_ids)]
        logprobs = _logprobs(ctx, body, entries, 0, echoed)
    choice: dict[str, object] = {
        "index": index,
        "text": (_prompt_text(ctx, output) if body.echo else "") + completion.text,
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
    }
    if body.prompt_logprobs is not None:
        entries = output.prompt_logprobs or []
        choice["prompt_logprobs"] = prompt_logprobs_json(entries, ctx.texts, body.prompt_logprobs)
    return choice


def _stream_format(ctx: ServingContext, body: CompletionRequest) -> StreamFormat:
    """Text deltas and a finish reason per choice (an echoed prompt leads its first
    chunk); logprob text offsets keep counting across a choice's chunks."""
    text_offsets: dict[int, int] = {}

    def choice(update: ChoiceUpdate) -> dict[str, object]:
        echoed = update.output if body.echo and update.first else None
        logprobs = None
        if body.logprobs is not None and (update.logprobs or echoed):
            offset = text_offsets.get(update.index, 0)
            logprobs = _logprobs(ctx, body, update.logprobs, offset, echoed)
            text_offsets[update.index] = offset + sum(len(t) for t in logprobs["tokens"])
        prompt = _prompt_text(ctx, update.output) if echoed is not None else ""
        return {
            "index": update.index,
            "text": prompt + update.completion.delta_text,
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
        without_generation if body.echo_only else None,
    )
