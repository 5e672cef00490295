"""Tool calling on ``/v1/chat/completions``: OpenAI's ``tools`` and ``tool_choice``.

- ``none``: the tools are rendered into the prompt (as vLLM does) but the reply is
  plain content.
- ``auto`` (the default when tools are given): the model may answer with calls in the
  ``<tool_call>`` format (:mod:`pagedllm.server.tool_call_format`); they are parsed
  from its text, and text that does not follow the format stays content.
- ``required``: the output is constrained by the grammar to a JSON array of one or
  more ``{"name", "parameters"}`` objects, each valid against its function's schema
  (one call at most with ``parallel_tool_calls: false``).
- a named function: the output is constrained to that function's arguments.

Both grammars write compact JSON (no whitespace between tokens), so a call's length
is bounded by its schema rather than by where the model stops adding blanks.

Arguments always come back as a JSON string, as OpenAI's API gives them.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.request_errors import InvalidRequestError
from pagedllm.server.tool_call_format import ParsedToolCall, parse_tool_calls
from pagedllm.structured_output import StructuredOutputsParams


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @property
    def schema(self) -> dict:
        """The arguments' JSON schema (any object when the tool declares none)."""
        return self.parameters or {"type": "object"}


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolPlan:
    """What ``tools`` and ``tool_choice`` ask of one chat request."""

    def __init__(
        self,
        tools: list[ToolDefinition] | None,
        tool_choice: ToolChoice | None,
        parallel_tool_calls: bool | None,
    ) -> None:
        self.tools = tools or []
        if tool_choice is None:
            tool_choice = "auto" if self.tools else "none"
        if tool_choice != "none" and not self.tools:
            raise InvalidRequestError(
                "tool_choice other than 'none' needs 'tools'", param="tool_choice"
            )
        names = [tool.function.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tool function names must be unique", param="tools")
        if isinstance(tool_choice, NamedToolChoice) and tool_choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names {tool_choice.function.name!r}, which is not in tools",
                param="tool_choice",
            )
        self.choice = tool_choice
        self.single_call = parallel_tool_calls is False

    @property
    def named(self) -> FunctionDefinition | None:
        """The function every reply calls, for a named ``tool_choice``."""
        if not isinstance(self.choice, NamedToolChoice):
            return None
        return next(t.function for t in self.tools if t.function.name == self.choice.function.name)

    @property
    def parses_calls(self) -> bool:
        """Whether replies are read as tool calls (every mode but ``none``)."""
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, object]] | None:
        """The tools as chat templates take them (OpenAI's JSON), None without tools."""
        if not self.tools:
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of ``required`` and named choices; None for ``auto``/``none``."""
        named = self.named
        if named is not None:
            return StructuredOutputsParams(json=named.schema, compact_json=True)
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"enum": [tool.function.name]},
                    "parameters": tool.function.schema,
                },
                "required": ["name", "parameters"],
            }
            for tool in self.tools
        ]
        schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if self.single_call:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, compact_json=True)

    def parse(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """A finished reply as (content, calls)."""
        named = self.named
        if named is not None:
            return None, [ParsedToolCall(named.name, text)]
        if self.choice == "required":
            try:  # the grammar guarantees the shape unless max_tokens cut it short;
                # it lets raw control characters into strings, which strict JSON refuses
                calls = json.loads(text, strict=False)
            except json.JSONDecodeError:
                return text, []
            return None, [
                ParsedToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                for c in calls
            ]
        if self.choice == "auto":
            return parse_tool_calls(text)
        return text, []

    def finish_reason(self, reason: str | None, calls: list[ParsedToolCall]) -> str | None:
        """``"tool_calls"`` for a reply that ended in calls it chose to make (``auto``
        and ``required``, as OpenAI reports them); the engine's reason otherwise."""
        if reason == "stop" and calls and self.named is None:
            return "tool_calls"
        return reason
