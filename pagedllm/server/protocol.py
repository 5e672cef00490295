"""Request bodies of the OpenAI endpoints, and their translation to ``SamplingParams``.

Pydantic checks types and presence, and that numbers are finite; ranges (n >= 1,
max_tokens >= 1, penalties in [-2, 2], ...) are checked once, by :class:`SamplingParams`,
and limits of the model (vocabulary, ``max_n``, ``max_model_len``, the KV pool) by the
engine. ``temperature`` is bounded by OpenAI's 2. Unknown fields are accepted and
ignored, as vLLM does; :mod:`pagedllm.server.field_policy` names them in a response
header and refuses the known ones whose effect is not implemented.
Besides OpenAI's fields, vLLM's common sampling extras are accepted (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, allowed_token_ids,
bad_words, include_stop_str_in_output), and structured outputs
(:mod:`pagedllm.server.structured_fields`). ``logit_bias`` keys are
token ids written as JSON strings, as OpenAI's.
"""

from __future__ import annotations

import functools
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError
from pagedllm.server.request_body import RefusedJSON, load_json
from pagedllm.server.structured_fields import StructuredFields
from pagedllm.server.tools import ToolChoice, ToolDefinition, ToolPlan
from pagedllm.structured_output import StructuredOutputsParams

MAX_TOP_LOGPROBS = 20
"""Most alternatives per position a client may ask for (OpenAI's chat limit)."""

MAX_TEMPERATURE = 2.0
"""OpenAI's upper bound on ``temperature``."""


class StreamOptions(BaseModel):
    """``continuous_usage_stats`` (vLLM's) puts the usage so far in every chunk too."""

    model_config = ConfigDict(extra="allow")

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(StructuredFields):
    """Decoding fields both endpoints share, with OpenAI's defaults."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, le=MAX_TEMPERATURE)
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: needs ``include_usage`` too, as in vLLM."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            if not key.isascii() or not key.isdigit():
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                )
            bias[int(key)] = value
        return bias

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        n: int | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range; ``n`` and
        ``prompt_logprobs``, when given, replace the body's."""
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "prompt_logprobs cannot be streamed", param="prompt_logprobs"
            )
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        return SamplingParams(
            n=self.n if n is None else n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=self._logit_bias(),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured(),
        )


class TextPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` piece of a message's content."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call an assistant made earlier in the conversation (``arguments`` is JSON)."""

    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A turn of the conversation: ``tool_calls`` on assistant turns, ``tool_call_id``
    on a tool's result."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_in_place(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        return self

    def as_template_input(self) -> dict[str, object]:
        """The dict a chat template renders: parts joined, ``developer`` as ``system``,
        tool calls' arguments as objects (what templates iterate over, as vLLM passes
        them) when they parse as JSON."""
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, object] = {"role": role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": _json_or_text(call.function.arguments)
                }}
                for call in self.tool_calls
            ]  # fmt: skip
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(arguments: str) -> object:
    """The arguments as JSON when they parse, else their text; InvalidRequestError for
    JSON the server refuses (too deep, a number out of range, a lone surrogate)."""
    try:
        return load_json(arguments)
    except json.JSONDecodeError:
        return arguments
    except RefusedJSON as error:
        raise InvalidRequestError(
            f"a tool call's arguments are refused: {error}", param="messages"
        ) from None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. Without ``max_tokens`` the reply may fill the
    context (``max_model_len`` less the prompt). ``tools`` / ``tool_choice``: see
    :mod:`pagedllm.server.tools`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @functools.cached_property
    def tool_plan(self) -> ToolPlan:
        """Raises InvalidRequestError for a ``tool_choice`` the tools cannot serve."""
        return ToolPlan(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured(self) -> StructuredOutputsParams | None:
        """The tool choice's grammar, or the one structured output asked for; both at
        once are refused."""
        asked = super().structured()
        tool_grammar = self.tool_plan.constraint()
        if tool_grammar is not None and asked is not None:
            raise InvalidRequestError(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format or structured outputs",
                param="tool_choice",
            )
        return tool_grammar or asked

    def sampling_params(self) -> SamplingParams:
        """Raises InvalidRequestError for ``top_logprobs`` without ``logprobs``."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, object]]:
        """Raises InvalidRequestError for tool-call arguments the server refuses."""
        return [message.as_template_input() for message in self.messages]


PromptIds = list[int]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: text, token ids, or a batch of either; 16 tokens by
    default, as OpenAI's API.

    ``echo`` puts the prompt before each choice's text, and with ``logprobs`` the
    prompt tokens' logprobs before the generated ones' (the first prompt token's is
    null). ``max_tokens=0`` asks for the prompt alone and needs ``echo``; the engine
    then generates one token that the response leaves out (as vLLM does).
    """

    prompt: str | list[str] | PromptIds | list[PromptIds]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """The prompt, echoed, is the whole answer (``echo`` with ``max_tokens=0``)."""
        return self.echo and self.max_tokens == 0

    @property
    def num_samples(self) -> int:
        """Sequences generated per prompt: ``best_of`` when set, else ``n``."""
        return self.n if self.best_of is None else self.best_of

    def sampling_params(self) -> SamplingParams:
        """With ``best_of``, ``best_of`` samples with their logprobs (to rank them);
        raises InvalidRequestError when ``best_of`` is below ``n`` or streamed."""
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError(
                "max_tokens=0 returns nothing without echo; set echo or max_tokens >= 1",
                param="max_tokens",
            )
        max_tokens = 1 if self.echo_only else self.max_tokens
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        if self.best_of is None or self.best_of == self.n:
            return self._sampling_params(
                max_tokens, self.logprobs, prompt_logprobs=prompt_logprobs
            )
        if self.best_of < self.n:
            raise InvalidRequestError(
                f"best_of must be >= n={self.n}, got {self.best_of}", param="best_of"
            )
        if self.stream:
            raise InvalidRequestError("best_of above n cannot be streamed", param="best_of")
        return self._sampling_params(
            max_tokens, self.logprobs or 0, n=self.best_of, prompt_logprobs=prompt_logprobs
        )

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """One engine prompt per batch entry; raises ValueError for an empty batch."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be an empty list")
        if isinstance(prompt[0], int):
            return [{"prompt_token_ids": list(prompt)}]
        if isinstance(prompt[0], str):
            return list(prompt)
        return [{"prompt_token_ids": list(ids)} for ids in prompt]
