"""What the server does with a request field it does not use.

As vLLM does, a field the server does not know is accepted and ignored: it is logged,
and named in the response header ``IGNORED_FIELDS_HEADER`` (comma-separated,
percent-encoded, at most ``MAX_NAMED_FIELDS`` names), so SDK and framework defaults
(``metadata``, ``store``, ``parallel_tool_calls``, ``reasoning_effort``,
``service_tier``, ...) never break a request. Unknown keys of ``stream_options`` are
named as ``stream_options.<key>``.

A known field whose effect this server does not implement would change the result
if ignored, so it is refused with a 400 naming it (code ``unsupported_field``) unless
its value is one that asks for nothing (``None``, or the neutral values listed).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from urllib.parse import quote

from pydantic import BaseModel

from pagedllm.server.errors import APIError

logger = logging.getLogger("pagedllm.server")

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
MAX_NAMED_FIELDS = 32
"""Most names the header and the log line list; the rest are counted."""


@dataclass(frozen=True)
class Unsupported:
    """Why a known field is refused, and the values that ask for nothing."""

    reason: str
    neutral: tuple[object, ...] = ()

    def allows(self, value: object) -> bool:
        return value is None or any(type(value) is type(ok) and value == ok for ok in self.neutral)


_TOOLS = "tools are offered by /v1/chat/completions only"

UNSUPPORTED_FIELDS: dict[str, Unsupported] = {
    "guided_whitespace_pattern": Unsupported("guided_whitespace_pattern is not supported"),
    "tools": Unsupported(_TOOLS, ([],)),
    "tool_choice": Unsupported(_TOOLS, ("none",)),
    "functions": Unsupported("the legacy functions API is not supported; use tools", ([],)),
    "function_call": Unsupported(
        "the legacy functions API is not supported; use tool_choice", ("none",)
    ),
    "echo": Unsupported("echo is offered by /v1/completions only", (False,)),
    "best_of": Unsupported("best_of is offered by /v1/completions only", (1,)),
    "suffix": Unsupported("suffix (fill-in-the-middle) is offered by /v1/completions only"),
    "use_beam_search": Unsupported("beam search is not offered by the server", (False,)),
    "length_penalty": Unsupported("length_penalty applies to beam search only", (1.0, 1)),
    "truncate_prompt_tokens": Unsupported("prompt truncation is not supported"),
    "chat_template": Unsupported("a request's own chat template is not supported"),
    "chat_template_kwargs": Unsupported("chat_template_kwargs are not supported", ({},)),
    "add_generation_prompt": Unsupported("the assistant header is always added", (True,)),
    "continue_final_message": Unsupported("continue_final_message is not supported", (False,)),
    "add_special_tokens": Unsupported("add_special_tokens is not supported"),
    "documents": Unsupported("documents are not supported"),
    "logits_processors": Unsupported("custom logits processors are not supported"),
    "prediction": Unsupported("predicted outputs are not supported"),
    "modalities": Unsupported("only text output is supported", (["text"],)),
    "audio": Unsupported("audio output is not supported"),
    "web_search_options": Unsupported("web search is not supported"),
    "priority": Unsupported("request priority is not offered by the server", (0,)),
    "cache_salt": Unsupported("cache_salt is not offered by the server"),
    "return_tokens_as_token_ids": Unsupported("token ids as tokens are not supported", (False,)),
    "return_token_ids": Unsupported("returning token ids is not supported", (False,)),
    "skip_special_tokens": Unsupported("special tokens are always skipped", (True,)),
    "spaces_between_special_tokens": Unsupported(
        "spaces_between_special_tokens is not supported", (True,)
    ),
}


def check_fields(body: BaseModel) -> list[str]:
    """The names of the fields ``body`` ignores; a 400 for a refused one.

    ``body`` must allow extra fields; its declared fields are all used.
    """
    ignored: list[str] = []
    for name, value in (body.model_extra or {}).items():
        rule = UNSUPPORTED_FIELDS.get(name)
        if rule is not None and not rule.allows(value):
            raise APIError(
                400, f"'{name}' is not supported: {rule.reason}", param=name,
                code="unsupported_field",
            )  # fmt: skip
        if rule is None:
            ignored.append(name)
    stream_options = getattr(body, "stream_options", None)
    if isinstance(stream_options, BaseModel):
        ignored.extend(f"stream_options.{key}" for key in stream_options.model_extra or {})
    if ignored:
        logger.warning("request fields ignored: %s", _listed(ignored, repr))
    return ignored


def ignored_fields_headers(ignored: list[str]) -> dict[str, str]:
    """The response headers naming ``ignored`` (none when it is empty)."""
    if not ignored:
        return {}
    return {IGNORED_FIELDS_HEADER: _listed(ignored, lambda name: quote(name, safe=""))}


def _listed(names: list[str], show) -> str:
    shown = ", ".join(show(name) for name in names[:MAX_NAMED_FIELDS])
    rest = len(names) - MAX_NAMED_FIELDS
    return f"{shown}, and {rest} more" if rest > 0 else shown
