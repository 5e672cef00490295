"""One streamed chat choice under ``tools``: its text so far becomes content deltas
and tool-call deltas in OpenAI's shape (``{"index", "id", "type", "function":
{"name", "arguments"}}`` first, then ``{"index", "function": {"arguments"}}``).

- named function: the arguments stream as the model writes them;
- ``auto``: content streams until a ``<tool_call>`` tag may begin (a partial tag is
  held back); the calls after it are sent whole when the choice finishes;
- ``required``: the calls are sent whole when the choice finishes (the grammar has
  then closed the JSON array).
"""

from __future__ import annotations

from pagedllm.server.tool_call_format import OPEN_TAG, ParsedToolCall, new_call_id
from pagedllm.server.tools import ToolPlan


def call_json(call: ParsedToolCall, index: int | None = None) -> dict[str, object]:
    """A whole call as a message's ``tool_calls`` entry, or with ``index`` as a
    stream's first delta of it."""
    entry: dict[str, object] = {} if index is None else {"index": index}
    entry.update(
        id=new_call_id(),
        type="function",
        function={"name": call.name, "arguments": call.arguments},
    )
    return entry


class ToolCallStream:
    """Deltas of one choice; feed it the choice's cumulative text after each step."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.content_sent = 0
        self.calls: list[ParsedToolCall] = []

    def update(self, text: str, finished: bool) -> tuple[str, list[dict[str, object]]]:
        """The content delta and tool-call deltas that ``text`` (all of the choice's
        text so far) adds."""
        named = self.plan.named
        if named is not None:
            return "", self._arguments_delta(named.name, text)
        if self.plan.choice == "required":
            if not finished:
                return "", []
            content, self.calls = self.plan.parse(text)
            if not self.calls:  # cut short by max_tokens: what there is, as content
                return content or "", []
            return "", [call_json(call, i) for i, call in enumerate(self.calls)]
        return self._auto(text, finished)

    def _arguments_delta(self, name: str, text: str) -> list[dict[str, object]]:
        first = not self.calls
        delta = text if first else text[len(self.calls[0].arguments) :]
        self.calls = [ParsedToolCall(name, text)]
        if first:
            return [call_json(self.calls[0], 0)]
        return [{"index": 0, "function": {"arguments": delta}}] if delta else []

    def _auto(self, text: str, finished: bool) -> tuple[str, list[dict[str, object]]]:
        calls: list[dict[str, object]] = []
        if finished:
            content, self.calls = self.plan.parse(text)
            visible = text if not self.calls else text[: text.find(OPEN_TAG)].rstrip()
            calls = [call_json(call, i) for i, call in enumerate(self.calls)]
        elif OPEN_TAG in text:
            visible = text[: text.find(OPEN_TAG)].rstrip()
        else:
            visible = text[: len(text) - _partial_tag_length(text)]
        delta = visible[self.content_sent :]
        self.content_sent = max(self.content_sent, len(visible))
        return delta, calls


def _partial_tag_length(text: str) -> int:
    """Length of the longest end of ``text`` that could begin ``<tool_call>``."""
    for length in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0
