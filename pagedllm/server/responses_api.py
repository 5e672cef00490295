"""OpenAI's Responses API: ``POST /v1/responses`` (whole or streamed),
``GET /v1/responses/{id}`` and ``DELETE /v1/responses/{id}`` for stored responses.

A request becomes one chat conversation, rendered by the model's chat template as on
``/v1/chat/completions`` (the same engine work: greedy outputs are equal):
``instructions`` as a system message in front, then the conversation of
``previous_response_id`` (its inputs and outputs, turn by turn, without its
instructions), then ``input``. Function tools, ``tool_choice`` and
``parallel_tool_calls`` go through the chat route's :class:`ToolPlan`,
``text.format`` through structured outputs. What the engine does not do is refused
by :mod:`pagedllm.server.responses_policy`.

A response is stored (``store``, default true) once it is complete, or cut at
``max_output_tokens``; an unknown ``previous_response_id`` is a 404
(``previous_response_not_found``), as OpenAI answers it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from pagedllm.engine.outputs import RequestOutput
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError
from pagedllm.server.async_engine import ChatPrompt
from pagedllm.server.chat import chat_prompt
from pagedllm.server.errors import CLIENT_CLOSED_REQUEST, APIError
from pagedllm.server.field_policy import ignored_fields_headers
from pagedllm.server.protocol import ChatMessage
from pagedllm.server.request_body import read_body
from pagedllm.server.response_store import ResponseStore, StoredResponse
from pagedllm.server.responses_input import input_messages
from pagedllm.server.responses_output import ResponseOutput, response_object
from pagedllm.server.responses_policy import check_request_fields
from pagedllm.server.responses_protocol import FIELD_NAMES, ResponsesRequest
from pagedllm.server.responses_stream import response_stream
from pagedllm.server.serving import (
    Admitted,
    ParsedRequest,
    ServingContext,
    admit,
    check_model,
    encode_in_pieces,
    final_outputs,
    json_reply,
)

Result = TypeVar("Result")
Message = dict[str, object]


class ResponsesAPI:
    """The routes' handlers over one engine and one store."""

    def __init__(self, ctx: ServingContext, store: ResponseStore) -> None:
        self.ctx = ctx
        self.store = store

    async def create(self, raw: Request) -> Response:
        body = await read_body(raw, ResponsesRequest)
        check_model(self.ctx, body)
        headers = ignored_fields_headers(check_request_fields(body))
        previous = self._previous(body.previous_response_id)
        earlier = previous.conversation() if previous is not None else []
        turn = _checked(lambda: _template(input_messages(body.input, earlier)))
        params = await self._sampling_params(body)
        admitted = await self._admit(self._prompt(body, earlier + turn), body, params, headers)
        head = {
            "id": admitted.response_id.replace("resp-", "resp_", 1),
            "created_at": admitted.created,
            "model": self.ctx.model_name,
            **body.echoed(),
        }
        output = ResponseOutput(body.tool_plan, self.ctx.texts, body.with_logprobs)

        def completed(response: dict[str, object]) -> None:
            if body.stores:
                replies = _template(input_messages(response["output"], earlier + turn))
                self.store.put(
                    response["id"], StoredResponse(response, (*turn, *replies), previous)
                )

        if body.stream:
            return response_stream(self.ctx, admitted, head, output, completed)
        outputs = await final_outputs(self.ctx, admitted, raw)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        # a reply with logprobs can be megabytes: built off the event loop
        response, encoded = await run_in_threadpool(_whole, head, output, outputs[0])
        completed(response)
        return json_reply(encoded, admitted.headers)

    def retrieve(self, response_id: str, stream: bool = False) -> JSONResponse:
        """A stored response; streaming one again is refused (that is for background
        responses, which this server does not run)."""
        if stream:
            raise APIError(
                400,
                "'stream' is not supported: only background responses can be streamed "
                "again, and this server runs none",
                "stream",
                "unsupported_field",
            )
        return JSONResponse(self._stored(response_id).response)

    def delete(self, response_id: str) -> JSONResponse:
        self._stored(response_id)
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"Response with id '{response_id}' not found.",
                "response_id",
                "response_not_found",
            )
        return entry

    def _previous(self, response_id: str | None) -> StoredResponse | None:
        if response_id is None:
            return None
        entry = self.store.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"Previous response with id '{response_id}' not found.",
                "previous_response_id",
                "previous_response_not_found",
            )
        return entry

    async def _sampling_params(self, body: ResponsesRequest) -> SamplingParams:
        params = _checked(body.sampling_params)

        def check() -> None:
            params.check_for_model(self.ctx.vocab_size, self.ctx.tokenizer)

        if params.structured_outputs is None:
            _checked(check)
        else:  # compiling a grammar can take a while: off the event loop
            await run_in_threadpool(_checked, check)
        return params

    def _prompt(self, body: ResponsesRequest, conversation: list[Message]) -> ChatPrompt:
        if body.instructions is not None:
            system = ChatMessage(role="system", content=body.instructions)
            conversation = [system.as_template_input(), *conversation]
        return chat_prompt(self.ctx.tokenizer, conversation, body.tool_plan.template_tools())

    async def _admit(
        self,
        prompt: ChatPrompt,
        body: ResponsesRequest,
        params: SamplingParams,
        headers: dict[str, str],
    ) -> Admitted:
        try:
            return await admit(self.ctx, "resp", [prompt], ParsedRequest(body, params, headers))
        except APIError as error:  # the engine names its own fields
            error.param = FIELD_NAMES.get(error.param, error.param)
            raise


def _whole(
    head: dict[str, object], output: ResponseOutput, final: RequestOutput
) -> tuple[dict[str, object], bytes]:
    """The Response object of a finished request, and its JSON."""
    output.update(final.outputs[0])
    response = response_object(head, output.items, final)
    return response, encode_in_pieces(response)


def _template(messages: list[ChatMessage]) -> list[Message]:
    return [message.as_template_input() for message in messages]


def _checked(make: Callable[[], Result]) -> Result:
    """``make()``, with its ``InvalidRequestError`` as a 400 naming the request's field."""
    try:
        return make()
    except InvalidRequestError as error:
        param = FIELD_NAMES.get(error.param, error.param)
        raise APIError(400, str(error), param=param, code="invalid_value") from None
