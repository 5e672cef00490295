"""The request body of ``POST /v1/responses`` (OpenAI's Responses API), and its
translation to the engine's ``SamplingParams`` and the chat endpoint's ``ToolPlan``.

Pydantic checks types; :mod:`pagedllm.server.responses_policy` refuses the fields and
values this server does not implement before anything here runs, so every tool that
reaches :meth:`ResponsesRequest.tool_plan` is a function tool. Ranges are checked by
``SamplingParams`` (its field names are those of the chat API: ``max_tokens`` is
``max_output_tokens`` here, see :data:`SAMPLING_PARAM_NAMES`).

Besides OpenAI's fields, vLLM's common sampling extras are accepted (``top_k``,
``min_p``, ``repetition_penalty``, ``seed``, ``stop``, ``ignore_eos``, ``min_tokens``),
so ``vllm bench serve --backend openai-responses --ignore-eos`` works.
"""

from __future__ import annotations

import functools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError
from pagedllm.server.protocol import MAX_TEMPERATURE, MAX_TOP_LOGPROBS
from pagedllm.server.tools import (
    FunctionDefinition,
    FunctionName,
    NamedToolChoice,
    ToolChoice,
    ToolDefinition,
    ToolPlan,
)
from pagedllm.structured_output import StructuredOutputsParams

OUTPUT_LOGPROBS = "message.output_text.logprobs"
"""The ``include`` value that puts the output tokens' logprobs in the output text."""

FIELD_NAMES = {
    "max_tokens": "max_output_tokens",
    "logprobs": "top_logprobs",
    "structured_outputs": "text",
    "prompt": "input",
    "messages": "input",
}
"""The request field behind each field name that ``SamplingParams``, the engine and
the chat messages report in their errors, where it differs here."""


class FunctionTool(BaseModel):
    """A function tool in the Responses API's flat shape."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def as_tool_definition(self) -> ToolDefinition:
        """The chat API's nested shape, which :class:`ToolPlan` and templates take."""
        function = FunctionDefinition(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )
        return ToolDefinition(type="function", function=function)


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON following ``schema``
    (always enforced, whatever ``strict`` says)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def structured(self) -> StructuredOutputsParams | None:
        """The constraint asked for; InvalidRequestError for a schema format without
        its ``schema``."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise InvalidRequestError("text.format of type json_schema needs 'schema'", "text")
        return StructuredOutputsParams(json=self.json_schema)


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. ``input`` items are read by
    :mod:`pagedllm.server.responses_input`; without ``max_output_tokens`` the output
    may fill the context. ``store`` (default true, as OpenAI's) keeps the response for
    ``previous_response_id`` and ``GET /v1/responses/{id}``."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(default=None, le=MAX_TEMPERATURE)
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    max_tool_calls: int | None = None
    # refused unless they ask for nothing (responses_policy)
    background: bool | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    conversation: str | dict | None = None
    prompt: dict | None = None
    context_management: list | None = None
    # vLLM's sampling extras
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def with_logprobs(self) -> bool:
        """Whether the output text carries its tokens' logprobs."""
        return OUTPUT_LOGPROBS in (self.include or [])

    @property
    def stores(self) -> bool:
        return self.store is not False

    @functools.cached_property
    def function_tools(self) -> list[FunctionTool]:
        """InvalidRequestError for a malformed tool (the policy has refused every
        non-function tool)."""
        try:
            return [FunctionTool.model_validate(tool, strict=True) for tool in self.tools or []]
        except ValidationError as error:
            raise InvalidRequestError(f"invalid function tool: {_first(error)}", "tools") from None

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        """InvalidRequestError for a malformed tool or a ``tool_choice`` the tools
        cannot serve."""
        tools = [tool.as_tool_definition() for tool in self.function_tools]
        return ToolPlan(tools, self._tool_choice(), self.parallel_tool_calls)

    def _tool_choice(self) -> ToolChoice | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            if choice not in (None, "none", "auto", "required"):
                raise InvalidRequestError(
                    f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                    "tool_choice",
                )
            return choice
        try:
            named = FunctionToolChoice.model_validate(choice, strict=True)
        except ValidationError as error:
            message = f"invalid tool_choice: {_first(error)}"
            raise InvalidRequestError(message, "tool_choice") from None
        return NamedToolChoice(type="function", function=FunctionName(name=named.name))

    def structured(self) -> StructuredOutputsParams | None:
        """The tool choice's grammar or ``text.format``'s; both at once are refused."""
        asked = None
        if self.text is not None and self.text.format is not None:
            asked = self.text.format.structured()
        tool_grammar = self.tool_plan.constraint()
        if tool_grammar is not None and asked is not None:
            raise InvalidRequestError(
                "tool_choice 'required' or a named function cannot be combined with a "
                "text.format other than 'text'",
                "tool_choice",
            )
        return tool_grammar or asked

    def sampling_params(self) -> SamplingParams:
        """InvalidRequestError naming the field for a value out of range, and for
        logprobs of a reply that may hold tool calls (their text is not the output
        text)."""
        if self.with_logprobs and self.tool_plan.parses_calls:
            raise InvalidRequestError(
                f"include {OUTPUT_LOGPROBS!r} is not supported with tools unless "
                "tool_choice is 'none'",
                "include",
            )
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            max_tokens=self.max_output_tokens,
            min_tokens=self.min_tokens,
            logprobs=(self.top_logprobs or 0) if self.with_logprobs else None,
            structured_outputs=self.structured(),
        )

    def echoed(self) -> dict[str, object]:
        """The request's parameters as the Response object repeats them (OpenAI's
        defaults where the request left them out)."""
        text = {"format": {"type": "text"}}
        if self.text is not None:
            text = self.text.model_dump(by_alias=True, exclude_none=True)
            text.setdefault("format", {"type": "text"})
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "previous_response_id": self.previous_response_id,
            "reasoning": {"effort": self.reasoning and self.reasoning.effort, "summary": None},
            "store": self.stores,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "text": text,
            "tool_choice": "auto" if self.tool_choice is None else self.tool_choice,
            "tools": [tool.model_dump() for tool in self.function_tools],
            "top_logprobs": self.top_logprobs or 0,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "truncation": "disabled",
            "background": False,
            "user": self.user,
        }


def _first(error: ValidationError) -> str:
    detail = error.errors()[0]
    where = ".".join(str(part) for part in detail["loc"])
    return f"{where}: {detail['msg']}" if where else detail["msg"]
