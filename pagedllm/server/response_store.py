"""Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}``: in
memory, at most ``capacity`` of them, the least recently used dropped first.

A stored response holds its Response object, the messages of its own turn (its
input and its output, without ``instructions``, which OpenAI does not carry over)
and the response it continued, so its whole conversation is the chain of turns up to
it: stored once, shared by the responses that continue it. A response dropped from
the store stays reachable through the responses that continue it (it is part of
their conversation) but can no longer be named by id. Each chain was one prompt of
at most ``max_model_len`` tokens (a longer one is refused, and refused requests are
not stored), so memory is bounded by ``capacity`` such conversations.

Used from the event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class StoredResponse:
    """``response``: the Response object as served; ``turn``: the chat messages this
    response added (template dicts); ``previous``: the response it continued."""

    response: dict[str, object]
    turn: tuple[dict[str, object], ...]
    previous: StoredResponse | None

    def conversation(self) -> list[dict[str, object]]:
        """Every message from the first turn through this response's output."""
        turns = []
        node: StoredResponse | None = self
        while node is not None:
            turns.append(node.turn)
            node = node.previous
        return [message for turn in reversed(turns) for message in turn]


class ResponseStore:
    """Responses by id; lookups count as use."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        """Whether there was such a response."""
        return self._entries.pop(response_id, None) is not None
