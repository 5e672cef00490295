"""What of the Responses API this server refuses, checked before a request is read
any further: a 400 naming the field (code ``unsupported_field``) for every field or
value that asks for something the engine does not do, so that nothing is silently
dropped. A value that asks for nothing (``None``, or the neutral values listed) passes.

Refused: built-in tools (``web_search``, ``file_search``, ``computer_use_preview``,
``code_interpreter``, ``mcp``, ``image_generation``, ``local_shell``, custom tools,
...) and tool choices naming them; ``background``; ``conversation``; ``prompt``
(templates); ``truncation: "auto"``; ``context_management``; ``reasoning`` with an
effort other than ``none`` or with a summary; ``text.verbosity`` other than
``medium``; ``include`` values other than output logprobs and
``reasoning.encrypted_content`` (there is never reasoning to include); and, as extra
fields, ``n`` above 1, the chat API's ``max_tokens``, ``max_completion_tokens``,
``response_format`` and ``logit_bias``. Input parts other than text are refused by
:mod:`pagedllm.server.responses_input`. The remaining extra fields go through the
shared :mod:`pagedllm.server.field_policy` (ignored and named, or refused).
"""

from __future__ import annotations

from pagedllm.server.errors import APIError
from pagedllm.server.field_policy import Unsupported, check_fields
from pagedllm.server.responses_protocol import OUTPUT_LOGPROBS, ResponsesRequest

DECLARED_FIELDS: dict[str, Unsupported] = {
    "background": Unsupported("responses are not run in the background", (False,)),
    "conversation": Unsupported("conversations are not kept; use previous_response_id"),
    "prompt": Unsupported("prompt templates are not supported"),
    "truncation": Unsupported("the input is never truncated", ("disabled",)),
    "context_management": Unsupported("context compaction is not implemented", ([],)),
}
"""Responses API fields whose only accepted values ask for nothing."""

EXTRA_FIELDS: dict[str, Unsupported] = {
    "n": Unsupported("a response has one output; send several requests", (1,)),
    "max_tokens": Unsupported("the Responses API calls it max_output_tokens"),
    "max_completion_tokens": Unsupported("the Responses API calls it max_output_tokens"),
    "response_format": Unsupported("the Responses API calls it text.format"),
    "logit_bias": Unsupported("logit_bias is offered by the chat and completions routes", ({},)),
}
"""Fields of the other routes that would change the result here if ignored."""

ACCEPTED_INCLUDES = (OUTPUT_LOGPROBS, "reasoning.encrypted_content")
REASONING_EFFORTS = (None, "none")
TOOLS_REASON = "only function tools are served"


def check_request_fields(body: ResponsesRequest) -> list[str]:
    """The names of the extra fields ``body`` ignores; a 400 for a refused one."""
    for name, rule in DECLARED_FIELDS.items():
        _check(name, getattr(body, name), rule)
    for name, value in (body.model_extra or {}).items():
        if name in EXTRA_FIELDS:
            _check(name, value, EXTRA_FIELDS[name])
    _check_reasoning(body)
    _check_text(body)
    for value in body.include or []:
        if value not in ACCEPTED_INCLUDES:
            _refuse("include", f"include {value!r} is not supported: it needs a built-in tool, "
                    "image or file input that this server does not offer")  # fmt: skip
    for tool in body.tools or []:
        if tool.get("type") != "function":
            _refuse(
                "tools", f"tools of type {tool.get('type')!r} are not supported: {TOOLS_REASON}"
            )
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") != "function":
        _refuse(
            "tool_choice",
            f"tool_choice of type {choice.get('type')!r} is not supported: {TOOLS_REASON}",
        )
    return check_fields(body)


def _check_reasoning(body: ResponsesRequest) -> None:
    reasoning = body.reasoning
    if reasoning is None:
        return
    if reasoning.effort not in REASONING_EFFORTS:
        _refuse("reasoning", f"reasoning effort {reasoning.effort!r} is not supported: the "
                "model is run without a reasoning phase (effort 'none')")  # fmt: skip
    if reasoning.summary is not None or reasoning.generate_summary is not None:
        _refuse("reasoning", "reasoning summaries are not supported: there is no reasoning")


def _check_text(body: ResponsesRequest) -> None:
    verbosity = body.text.verbosity if body.text is not None else None
    if verbosity not in (None, "medium"):
        _refuse("text", f"text.verbosity {verbosity!r} is not supported")


def _check(name: str, value: object, rule: Unsupported) -> None:
    if not rule.allows(value):
        _refuse(name, f"'{name}' is not supported: {rule.reason}")


def _refuse(param: str, message: str) -> None:
    raise APIError(400, message, param=param, code="unsupported_field")
