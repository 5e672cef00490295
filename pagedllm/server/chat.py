"""``POST /v1/chat/completions``: one conversation in, ``n`` assistant replies out."""

from __future__ import annotations

from fastapi import Request, Response

from pagedllm.engine.outputs import CompletionOutput
from pagedllm.server.async_engine import ChatPrompt
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.responses import chat_logprobs, prompt_logprobs_json
from pagedllm.server.serving import (
    ServingContext,
    admit,
    final_outputs,
    parse_request,
    response_json,
)
from pagedllm.server.streaming import ChoiceUpdate, StreamFormat, event_stream


async def create_chat_completion(raw: Request, ctx: ServingContext) -> Response:
    parsed = await parse_request(raw, ctx, ChatCompletionRequest)
    body = parsed.body
    admitted = await admit(ctx, "chatcmpl", [ChatPrompt(body.template_messages())], parsed)
    if body.stream:
        return event_stream(ctx, admitted, _stream_format(ctx, body))
    outputs = await final_outputs(ctx, admitted, raw)
    if outputs is None:
        return Response(status_code=499)
    choices = [_choice(ctx, body, completion) for completion in outputs[0].outputs]
    extra = None
    if body.prompt_logprobs is not None:
        entries = outputs[0].prompt_logprobs or []
        extra = {"prompt_logprobs": prompt_logprobs_json(entries, ctx.texts, body.prompt_logprobs)}
    return response_json(ctx, admitted, "chat.completion", choices, outputs, extra)


def _choice(
    ctx: ServingContext, body: ChatCompletionRequest, completion: CompletionOutput
) -> dict[str, object]:
    logprobs = None
    if body.logprobs and completion.logprobs is not None:
        logprobs = chat_logprobs(completion.logprobs[: len(completion.token_ids)], ctx.texts)
    return {
        "index": completion.index,
        "message": {"role": "assistant", "content": completion.text},
        "logprobs": logprobs,
        "finish_reason": completion.finish_reason,
    }


def _stream_format(ctx: ServingContext, body: ChatCompletionRequest) -> StreamFormat:
    """The role first, then content deltas and a finish reason per choice."""

    def choice(update: ChoiceUpdate) -> dict[str, object]:
        text = update.completion.delta_text
        return {
            "index": update.index,
            "delta": {"content": text} if text else {},
            "logprobs": chat_logprobs(update.logprobs, ctx.texts) if update.logprobs else None,
            "finish_reason": update.completion.finish_reason,
        }

    opening = [
        {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        for index in range(body.n)
    ]
    return StreamFormat(
        "chat.completion.chunk",
        body.n,
        body.logprobs,
        body.include_usage,
        body.continuous_usage,
        choice,
        opening,
    )
