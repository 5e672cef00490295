"""The event-loop side of the feeds: who is watching, and what each one is sent.

A :class:`Watcher` is one connected page (``kind="dashboard"``) or kv-events client
(``kind="kv"``), with a bounded queue of encoded messages. The hub tells the engine
loop how many watchers there are (through ``run_in_engine_loop``, which runs a function
in that thread), so the pool is followed only while someone looks. A new watcher skips
everything until its snapshot arrives; a watcher that falls
:data:`MAX_QUEUED_MESSAGES` behind is closed (a page reconnects and starts over from a
snapshot). Every method but :meth:`FeedHub.publish_threadsafe` runs on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.server.dashboard.feed import PoolFeed

MAX_QUEUED_MESSAGES = 64
CLOSED = None
"""What a watcher's queue holds after its last message."""

_SNAPSHOTS = {"dashboard": "snapshot", "kv": "kv_snapshot"}
_UPDATES = {"dashboard": "delta", "kv": "kv_events"}


@dataclass(eq=False)
class Watcher:
    kind: str  # "dashboard" or "kv"
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(MAX_QUEUED_MESSAGES))
    has_snapshot: bool = False


class FeedHub:
    """Fans the feed's messages out to watchers."""

    def __init__(self, run_in_engine_loop: Callable[[Callable[[], None]], None]) -> None:
        self._run_in_engine_loop = run_in_engine_loop
        self._watchers: set[Watcher] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.feed: PoolFeed | None = None  # set by whoever builds the feed
        self.last_dashboard_message: dict | None = None

    def subscribe(self, kind: str) -> Watcher:
        self._loop = asyncio.get_running_loop()
        watcher = Watcher(kind)
        self._watchers.add(watcher)
        self._tell_engine(snapshot=kind == "dashboard", kv_snapshot=kind == "kv")
        return watcher

    def unsubscribe(self, watcher: Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.discard(watcher)
            self._tell_engine(snapshot=False, kv_snapshot=False)

    def _tell_engine(self, snapshot: bool, kv_snapshot: bool) -> None:
        dashboards = sum(watcher.kind == "dashboard" for watcher in self._watchers)
        kv_watchers = len(self._watchers) - dashboards
        feed = self.feed
        if feed is not None:
            self._run_in_engine_loop(
                lambda: feed.watch(dashboards, kv_watchers, snapshot, kv_snapshot)
            )

    def publish_threadsafe(self, kind: str, message: dict) -> None:
        """Hand a feed message to the event loop (from the engine loop thread)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self.publish, kind, message)

    def publish(self, kind: str, message: dict) -> None:
        if kind in ("snapshot", "delta"):
            self.last_dashboard_message = message
        data = encode(kind, message)
        for watcher in list(self._watchers):
            if kind == _SNAPSHOTS[watcher.kind]:
                if watcher.has_snapshot and watcher.kind == "kv":
                    continue  # another client's start; this one follows the events
                watcher.has_snapshot = True
            elif kind != _UPDATES[watcher.kind] or not watcher.has_snapshot:
                continue
            self._put(watcher, data)

    def heartbeat(self) -> str | None:
        """A delta repeating the last figures with the time now and no block changes,
        for an idle page's charts; None before the first message."""
        last = self.last_dashboard_message
        if last is None:
            return None
        message = {key: last[key] for key in ("reserved", "swap", "requests")}
        message.update(
            ts=time.time(),
            blocks=[],
            num_requests_hidden=last["num_requests_hidden"],
            stats={**last["stats"], "allocation_seconds_max": 0.0},
        )
        return encode("delta", message)

    def _put(self, watcher: Watcher, data: str) -> None:
        try:
            watcher.queue.put_nowait(data)
        except asyncio.QueueFull:
            self._watchers.discard(watcher)
            self._tell_engine(snapshot=False, kv_snapshot=False)
            watcher.queue.get_nowait()
            watcher.queue.put_nowait(CLOSED)


def encode(kind: str, message: dict) -> str:
    """A server-sent event for a page; one JSON line for a kv-events client."""
    data = json.dumps(message, separators=(",", ":"))
    if kind in ("kv_snapshot", "kv_events"):
        return data + "\n"
    return f"event: {kind}\ndata: {data}\n\n"
