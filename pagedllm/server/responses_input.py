"""The Responses API's ``input`` as chat messages, which the chat template renders.

A string is one user message. A list holds items:

- messages (``{"role", "content"}``, with or without ``"type": "message"``): roles
  ``user``, ``system``, ``developer`` (rendered as ``system``) and ``assistant``;
  content a string or a list of ``input_text`` / ``output_text`` / ``refusal`` parts,
  joined. Image, file and audio parts are refused (``unsupported_field``).
- ``function_call`` items (a call the model made, as a response's output holds
  them): the tool calls of an assistant message; consecutive calls, and calls right
  after an assistant message, join that message.
- ``function_call_output`` items: a tool message answering the call with the same
  ``call_id``, which must come earlier in the conversation.

Other item types (``item_reference``, ``reasoning``, built-in tool calls) are
refused. Bookkeeping fields (``id``, ``status``, ``annotations``, ...) are ignored, so
a response's ``output`` items can be sent back as they came.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedllm.server.errors import APIError
from pagedllm.server.protocol import ChatMessage, FunctionCall, ToolCall

TEXT_PARTS = ("input_text", "output_text", "refusal")
UNSUPPORTED_PARTS = ("input_image", "input_file", "input_audio")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]


ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}


def input_messages(items: str | list[dict], earlier: list[dict[str, object]]) -> list[ChatMessage]:
    """The messages of ``items`` (a request's ``input``); ``earlier`` is the
    conversation before them (template dicts), where function calls may be answered.
    APIError 400 naming ``input`` for an item that is malformed or not supported."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise APIError(400, "input must not be an empty list", "input", "invalid_value")
    call_ids = {call["id"] for message in earlier for call in message.get("tool_calls") or []}
    messages: list[ChatMessage] = []
    for index, raw in enumerate(items):
        item = _parse(index, raw)
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=_text(index, item.content)))
        elif isinstance(item, FunctionCallItem):
            function = FunctionCall(name=item.name, arguments=item.arguments)
            _add_call(messages, ToolCall(id=item.call_id, function=function))
            call_ids.add(item.call_id)
        else:
            if item.call_id not in call_ids:
                raise _invalid(index, f"no function_call with call_id {item.call_id!r} "
                               "comes before this function_call_output")  # fmt: skip
            output = _text(index, item.output)
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=output))
    return messages


def _parse(index: int, raw: dict) -> BaseModel:
    kind = raw.get("type", "message")
    model = ITEM_MODELS.get(kind)
    if model is None:
        raise APIError(
            400,
            f"input[{index}]: items of type {kind!r} are not supported (messages, "
            "function_call and function_call_output items are)",
            "input",
            "unsupported_field",
        )
    try:
        return model.model_validate(raw, strict=True)
    except ValidationError as error:
        detail = error.errors()[0]
        where = ".".join(str(part) for part in detail["loc"])
        raise _invalid(index, f"{where}: {detail['msg']}") from None


def _text(index: int, content: str | list[ContentPart]) -> str:
    if isinstance(content, str):
        return content
    pieces = []
    for part in content:
        if part.type in UNSUPPORTED_PARTS:
            raise APIError(
                400,
                f"input[{index}]: {part.type} parts are not supported: this server reads text",
                "input",
                "unsupported_field",
            )
        if part.type not in TEXT_PARTS:
            raise _invalid(index, f"unknown content part type {part.type!r}")
        text = part.refusal if part.type == "refusal" else part.text
        if text is None:
            raise _invalid(index, f"a {part.type} part needs its text")
        pieces.append(text)
    return "".join(pieces)


def _add_call(messages: list[ChatMessage], call: ToolCall) -> None:
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), call]
    else:
        messages.append(ChatMessage(role="assistant", tool_calls=[call]))


def _invalid(index: int, message: str) -> APIError:
    return APIError(400, f"input[{index}]: {message}", "input", "invalid_value")
