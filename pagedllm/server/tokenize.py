"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

``/tokenize`` takes a ``prompt`` (encoded with ``add_special_tokens``, default true, as
``/v1/completions`` encodes it) or chat ``messages`` (rendered through the chat
template with the assistant header, and ``tools``, as ``/v1/chat/completions`` renders
them) and
answers ``{"count", "max_model_len", "tokens", "token_strs"}`` (``token_strs`` only
with ``return_token_strs``). ``/detokenize`` turns ``tokens`` back into
``{"prompt": text}`` (special tokens kept). ``GET /tokenizer_info`` gives the
tokenizer's class, special tokens and chat template (vLLM's route, which evaluation
harnesses use to tokenize through the server). Unknown fields are ignored, as on the
generation routes. Work on long texts runs in a worker thread, off the event loop.
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from pagedllm.server.chat import chat_prompt
from pagedllm.server.errors import APIError
from pagedllm.server.field_policy import check_fields, ignored_fields_headers
from pagedllm.server.protocol import ChatMessage
from pagedllm.server.request_body import read_body
from pagedllm.server.serving import ServingContext, check_model, invalid_as_400
from pagedllm.server.tools import ToolDefinition
from pagedllm.tokenizer import Tokenizer


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens applies to 'prompt' only")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


def _tokenizer(ctx: ServingContext) -> Tokenizer:
    if ctx.tokenizer is None:
        raise APIError(400, "This model has no tokenizer", code="no_tokenizer")
    return ctx.tokenizer


async def tokenize(raw: Request, ctx: ServingContext) -> JSONResponse:
    body = await read_body(raw, TokenizeRequest)
    check_model(ctx, body)
    headers = ignored_fields_headers(check_fields(body))
    tokenizer = _tokenizer(ctx)
    if body.messages is not None:
        messages = [invalid_as_400(message.as_template_input) for message in body.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
        prompt = chat_prompt(tokenizer, messages, tools)
        try:
            ids = await run_in_threadpool(
                tokenizer.apply_chat_template, prompt.messages, True, prompt.tools
            )
        except (ValueError, TemplateError) as error:
            raise APIError(400, str(error), param="messages", code="invalid_value") from None
    else:
        special = body.add_special_tokens is not False
        ids = await run_in_threadpool(tokenizer.encode, body.prompt, special)
    answer = {
        "count": len(ids),
        "max_model_len": ctx.max_model_len,
        "tokens": ids,
        "token_strs": [ctx.texts.text(i) for i in ids] if body.return_token_strs else None,
    }
    return JSONResponse(answer, headers=headers)


async def tokenizer_info(ctx: ServingContext) -> JSONResponse:
    info = _tokenizer(ctx).info()
    return JSONResponse({**info, "model_max_length": ctx.max_model_len})


async def detokenize(raw: Request, ctx: ServingContext) -> JSONResponse:
    body = await read_body(raw, DetokenizeRequest)
    check_model(ctx, body)
    headers = ignored_fields_headers(check_fields(body))
    tokenizer = _tokenizer(ctx)
    outside = [t for t in body.tokens if not 0 <= t < ctx.vocab_size]
    if outside:
        raise APIError(
            400,
            f"tokens must be token ids in [0, {ctx.vocab_size}), got {outside[0]}",
            param="tokens",
            code="invalid_value",
        )
    text = await run_in_threadpool(tokenizer.decode, body.tokens, False)
    return JSONResponse({"prompt": text}, headers=headers)
