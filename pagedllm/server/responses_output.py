"""A response's ``output`` items, built from its completion's snapshots, with the
stream events that build them; and the Response object around them.

One state machine serves both a streamed response (fed every snapshot) and a whole
one (fed the final snapshot once), so both end with the same items: the text the
deltas add up to is the message's text.

Items, in order: a ``message`` with one ``output_text`` part when there is text (or
when there is nothing else: a reply with no text and no call is an empty message),
then one ``function_call`` item per call (:class:`ToolPlan` decides how the text is
read, :class:`ToolCallStream` when it is available, as on the chat route). Each item
is announced (``response.output_item.added``), grows by deltas, and is closed
(``...done`` events) before the next one starts. Items end ``completed``, or
``incomplete`` when the output was cut at ``max_output_tokens`` (status
``incomplete`` of the response, ``incomplete_details.reason`` ``max_output_tokens``).
"""

from __future__ import annotations

import copy
import uuid

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.server.responses import TokenTexts, chat_logprobs
from pagedllm.server.tool_stream import ToolCallStream
from pagedllm.server.tools import ToolPlan

Event = dict[str, object]
"""A stream event without its ``sequence_number``."""


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseOutput:
    """The output items of one response; :meth:`update` returns the events each
    snapshot of the completion adds. ``items`` holds every item announced so far, in
    its latest state."""

    def __init__(self, plan: ToolPlan, texts: TokenTexts, with_logprobs: bool) -> None:
        self.items: list[dict[str, object]] = []
        self._calls = ToolCallStream(plan) if plan.parses_calls else None
        self._texts = texts
        self._with_logprobs = with_logprobs
        self._text_sent = 0
        self._tokens_sent = 0
        self._message: dict[str, object] | None = None
        self._open_calls: dict[int, dict[str, object]] = {}

    def update(self, completion: CompletionOutput) -> list[Event]:
        """The events ``completion`` (the newest snapshot: its text is all of the
        output so far) adds; the last snapshot closes every item."""
        finished = completion.finish_reason is not None
        if self._calls is None:
            text, calls = completion.text[self._text_sent :], []
            self._text_sent = len(completion.text)
        else:
            text, calls = self._calls.update(completion.text, finished)
        logprobs = self._new_logprobs(completion)
        events = self._text_delta(text, logprobs) if text or logprobs else []
        for call in calls:
            events += self._call_delta(call)
        if finished:
            events += self._finish(completion)
        return events

    def _new_logprobs(self, completion: CompletionOutput) -> list[dict[str, object]]:
        """Logprobs of the tokens this snapshot added (a token that shows no text yet,
        such as part of a UTF-8 character, has its logprobs in a delta of no text)."""
        if not self._with_logprobs or completion.logprobs is None:
            return []
        entries = completion.logprobs[self._tokens_sent : len(completion.token_ids)]
        self._tokens_sent += len(entries)
        return chat_logprobs(entries, self._texts)["content"]

    def _text_delta(self, text: str, logprobs: list[dict[str, object]]) -> list[Event]:
        events = [] if self._message is not None else self._open_message()
        part = self._part
        part["text"] += text
        part["logprobs"] += logprobs
        events.append(self._text_event("response.output_text.delta", delta=text, logprobs=logprobs))
        return events

    def _open_message(self) -> list[Event]:
        self._message = {
            "id": new_item_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self.items.append(self._message)
        added = self._item_event("response.output_item.added", self._message)
        self._message["content"].append(
            {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        )
        return [added, self._part_event("response.content_part.added")]

    @property
    def _part(self) -> dict[str, object]:
        return self._message["content"][0]

    def _call_delta(self, delta: dict[str, object]) -> list[Event]:
        """One of :class:`ToolCallStream`'s chat-shaped deltas: a call's first (with
        its id and name) opens its item, the others extend its arguments."""
        function = delta["function"]
        events: list[Event] = []
        if "id" in delta:
            if self._message is not None:
                events += self._close_message("completed")
            item = {
                "id": new_item_id("fc"),
                "type": "function_call",
                "call_id": delta["id"],
                "name": function["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            self._open_calls[delta["index"]] = item
            events.append(self._item_event("response.output_item.added", item))
        item = self._open_calls[delta["index"]]
        if function["arguments"]:
            item["arguments"] += function["arguments"]
            events.append({
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": self.items.index(item),
                "delta": function["arguments"],
            })  # fmt: skip
        return events

    def _finish(self, completion: CompletionOutput) -> list[Event]:
        """Close every item, each ``incomplete`` if the output was cut short."""
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        events = []
        if not self.items:
            events += self._open_message()
        if self._message is not None:
            events += self._close_message(status)
        for item in self._open_calls.values():
            item["status"] = status
            events.append({
                "type": "response.function_call_arguments.done",
                "item_id": item["id"],
                "output_index": self.items.index(item),
                "arguments": item["arguments"],
            })  # fmt: skip
            events.append(self._item_event("response.output_item.done", item))
        self._open_calls = {}
        return events

    def _close_message(self, status: str) -> list[Event]:
        part = self._part
        done = self._text_event("response.output_text.done", text=part["text"],
                                logprobs=part["logprobs"])  # fmt: skip
        events = [done, self._part_event("response.content_part.done")]
        self._message["status"] = status
        events.append(self._item_event("response.output_item.done", self._message))
        self._message = None
        return events

    def _item_event(self, kind: str, item: dict[str, object]) -> Event:
        return {"type": kind, "output_index": self.items.index(item), "item": copy.deepcopy(item)}

    def _part_event(self, kind: str) -> Event:
        return {"type": kind, **self._message_place(), "part": copy.deepcopy(self._part)}

    def _text_event(self, kind: str, **fields: object) -> Event:
        return {"type": kind, **self._message_place(), **copy.deepcopy(fields)}

    def _message_place(self) -> dict[str, object]:
        return {
            "item_id": self._message["id"],
            "output_index": self.items.index(self._message),
            "content_index": 0,
        }


def response_object(
    head: dict[str, object],
    output: list[dict[str, object]] | None = None,
    final: RequestOutput | None = None,
) -> dict[str, object]:
    """The Response object: ``head`` (id, creation time, model and the echoed
    request parameters) with ``output`` and, once ``final`` (the finished request) is
    given, its status and usage; in progress without it."""
    if final is None:
        status, incomplete, usage = "in_progress", None, None
    else:
        completion = final.outputs[0]
        cut_short = completion.finish_reason == "length"
        status = "incomplete" if cut_short else "completed"
        incomplete = {"reason": "max_output_tokens"} if cut_short else None
        usage = usage_json(len(final.prompt_token_ids), len(completion.token_ids))
    return {
        "id": head["id"],
        "object": "response",
        "created_at": head["created_at"],
        "status": status,
        "error": None,
        "incomplete_details": incomplete,
        "output": copy.deepcopy(output or []),
        "usage": usage,
        **head,
    }


def usage_json(input_tokens: int, output_tokens: int) -> dict[str, object]:
    """The Responses API's usage. ``cached_tokens`` is 0: the engine does not report
    the prefix-cache hits of one request; there are never reasoning tokens."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }
