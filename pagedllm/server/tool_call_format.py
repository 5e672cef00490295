"""Tool calls as text: the ``<tool_call>`` format (Hermes', also Qwen 2.5's and
SmolLM3's) that a model writes in ``tool_choice="auto"``, and the fallback rendering of
tools, tool calls and tool results for chat templates that know nothing of tools.

A call is one JSON object ``{"name": ..., "arguments": {...}}`` between
``<tool_call>`` and ``</tool_call>``; text before the first call is the message's
content. Fallback: the tools' JSON schemas go into the system message with an
instruction to answer in that format, an assistant's earlier calls become that text,
and each tool result becomes a user turn between ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
_CALL = re.compile(re.escape(OPEN_TAG) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE_TAG) + r"|$)", re.S)

FALLBACK_SYSTEM_PROMPT = (
    "You may call one or more functions to assist with the user query. The functions "
    "are described by these JSON schemas:\n<tools>\n{tools}\n</tools>\nTo call a "
    "function, answer with a JSON object holding its name and arguments between tags, "
    'one per call:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


@dataclass
class ParsedToolCall:
    """One call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str


def new_call_id() -> str:
    """A fresh tool-call id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def parse_tool_calls(text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """The content before the first call (None when empty) and the calls in ``text``;
    if any call is not a JSON object with a string ``name``, the whole text is content
    and there are no calls (the model did not follow the format)."""
    start = text.find(OPEN_TAG)
    if start < 0:
        return text, []
    calls = []
    for body in _CALL.findall(text, start):
        try:
            call = json.loads(body, strict=False)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(ParsedToolCall(call["name"], json.dumps(arguments, ensure_ascii=False)))
    content = text[:start].rstrip()
    return content or None, calls


def fallback_messages(
    messages: list[dict[str, object]], tools: list[dict[str, object]] | None
) -> list[dict[str, object]]:
    """``messages`` with tools, tool calls and tool results written as plain turns (see
    the module docstring), for a chat template that does not render them."""
    plain: list[dict[str, object]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "tool":
            result = f"<tool_response>\n{content}\n</tool_response>"
            plain.append({"role": "user", "content": result})
            continue
        calls = message.get("tool_calls") or []
        if calls:
            written = [
                OPEN_TAG + "\n" + json.dumps(
                    {"name": call["function"]["name"], "arguments": call["function"]["arguments"]},
                    ensure_ascii=False,
                ) + "\n" + CLOSE_TAG
                for call in calls
            ]  # fmt: skip
            content = "\n".join([content, *written] if content else written)
        plain.append({"role": role, "content": content})
    if tools:
        described = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
        system = FALLBACK_SYSTEM_PROMPT.format(tools=described)
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": f"{plain[0]['content']}\n\n{system}"}
        else:
            plain.insert(0, {"role": "system", "content": system})
    return plain
