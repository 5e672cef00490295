"""``POST /v1/chat/completions``: one conversation in, ``n`` assistant replies out.

With ``tools`` (:mod:`pagedllm.server.tools`) a reply may be tool calls instead of
content. Conversations with tools, tool calls or tool results go through the model's
chat template when it renders tools, else through the fallback rendering of
:mod:`pagedllm.server.tool_call_format`.
"""

from __future__ import annotations

from fastapi import Request, Response
from starlette.concurrency import run_in_threadpool

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.server.async_engine import ChatPrompt
from pagedllm.server.errors import CLIENT_CLOSED_REQUEST
from pagedllm.server.protocol import ChatCompletionRequest
from pagedllm.server.responses import chat_logprobs, prompt_logprobs_json
from pagedllm.server.serving import (
    Admitted,
    ServingContext,
    admit,
    final_outputs,
    invalid_as_400,
    parse_request,
    response_json,
)
from pagedllm.server.streaming import ChoiceUpdate, StreamFormat, event_stream
from pagedllm.server.tool_call_format import fallback_messages
from pagedllm.server.tool_stream import ToolCallStream, call_json
from pagedllm.server.tools import ToolPlan
from pagedllm.tokenizer import Tokenizer


async def create_chat_completion(raw: Request, ctx: ServingContext) -> Response:
    parsed = await parse_request(raw, ctx, ChatCompletionRequest)
    body = parsed.body
    plan = body.tool_plan  # checked with the sampling parameters
    messages = invalid_as_400(body.template_messages)
    prompt = chat_prompt(ctx.tokenizer, messages, plan.template_tools())
    admitted = await admit(ctx, "chatcmpl", [prompt], parsed)
    if body.stream:
        return event_stream(ctx, admitted, _stream_format(ctx, body, plan))
    outputs = await final_outputs(ctx, admitted, raw)
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    # a reply with logprobs can be tens of MB: built off the event loop
    return await run_in_threadpool(_response, ctx, body, plan, admitted, outputs)


def _response(
    ctx: ServingContext,
    body: ChatCompletionRequest,
    plan: ToolPlan,
    admitted: Admitted,
    outputs: list[RequestOutput],
) -> Response:
    choices = [_choice(ctx, body, plan, completion) for completion in outputs[0].outputs]
    extra = None
    if body.prompt_logprobs is not None:
        entries = outputs[0].prompt_logprobs or []
        extra = {"prompt_logprobs": prompt_logprobs_json(entries, ctx.texts, body.prompt_logprobs)}
    return response_json(ctx, admitted, "chat.completion", choices, outputs, extra)


def chat_prompt(
    tokenizer: Tokenizer | None,
    messages: list[dict[str, object]],
    tools: list[dict[str, object]] | None,
) -> ChatPrompt:
    """The conversation and tools to render; through the fallback rendering when the
    template cannot render tools or tool turns."""
    uses_tools = tools or any(m["role"] == "tool" or "tool_calls" in m for m in messages)
    if uses_tools and (tokenizer is None or not tokenizer.renders_tools):
        return ChatPrompt(fallback_messages(messages, tools))
    return ChatPrompt(messages, tools)


def _choice(
    ctx: ServingContext, body: ChatCompletionRequest, plan: ToolPlan, completion: CompletionOutput
) -> dict[str, object]:
    logprobs = None
    if body.logprobs and completion.logprobs is not None:
        logprobs = chat_logprobs(completion.logprobs[: len(completion.token_ids)], ctx.texts)
    content, calls = completion.text, []
    if plan.parses_calls:
        content, calls = plan.parse(completion.text)
    message: dict[str, object] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [call_json(call) for call in calls]
    return {
        "index": completion.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": plan.finish_reason(completion.finish_reason, calls),
    }


def _stream_format(
    ctx: ServingContext, body: ChatCompletionRequest, plan: ToolPlan
) -> StreamFormat:
    """The role first, then content (or tool-call) deltas and a finish reason per
    choice."""
    streams: dict[int, ToolCallStream] = {}

    def choice(update: ChoiceUpdate) -> dict[str, object] | None:
        completion = update.completion
        finish_reason = completion.finish_reason
        if plan.parses_calls:
            stream = streams.setdefault(update.index, ToolCallStream(plan))
            text, calls = stream.update(completion.text, finish_reason is not None)
            finish_reason = plan.finish_reason(finish_reason, stream.calls)
        else:
            text, calls = completion.delta_text, []
        delta: dict[str, object] = {"content": text} if text else {}
        if calls:
            delta["tool_calls"] = calls
        if not delta and not update.logprobs and finish_reason is None:
            return None
        return {
            "index": update.index,
            "delta": delta,
            "logprobs": chat_logprobs(update.logprobs, ctx.texts) if update.logprobs else None,
            "finish_reason": finish_reason,
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
