"""Reads a live feed of the server in a thread: the dashboard's server-sent events or
the kv-events JSON lines, as a page or a router would, keeping a view of the pool."""

from __future__ import annotations

import json
import threading
import time

import httpx


class FeedReader:
    """Messages of ``url`` as ``(kind, message, received_at)``; for the dashboard feed
    also ``blocks`` (block id -> [ref_count, key_prefix, flags], free blocks absent)."""

    def __init__(self, url: str, sse: bool = True, headers: dict | None = None) -> None:
        self.url, self.sse, self.headers = url, sse, headers or {}
        self.messages: list[tuple[str, dict, float]] = []
        self.blocks: dict[int, list] = {}
        self.status_code: int | None = None
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(10.0, read=None))
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> FeedReader:
        self._thread.start()
        self.wait_for(lambda: self.messages or self.status_code not in (None, 200))
        return self

    def __exit__(self, *exc) -> None:
        self._client.close()

    def _read(self) -> None:
        try:
            with self._client.stream("GET", self.url, headers=self.headers) as response:
                self.status_code = response.status_code
                kind = "kv"
                for line in response.iter_lines():
                    if self.sse and line.startswith("event: "):
                        kind = line[len("event: ") :]
                    elif self.sse and line.startswith("data: "):
                        self._keep(kind, json.loads(line[len("data: ") :]))
                    elif not self.sse and line:
                        self._keep("kv", json.loads(line))
        except (httpx.HTTPError, RuntimeError):
            pass  # closed by __exit__

    def _keep(self, kind: str, message: dict) -> None:
        with self._lock:
            if kind == "snapshot":
                self.blocks = {}
            for block_id, *state in message.get("blocks", ()) if kind != "kv" else ():
                if state == [0, None, 0]:
                    self.blocks.pop(block_id, None)
                else:
                    self.blocks[block_id] = state
            self.messages.append((kind, message, time.time()))

    def last(self, kind: str = "delta") -> dict | None:
        with self._lock:
            for found, message, _ in reversed(self.messages):
                if found == kind:
                    return message
        return None

    def count(self, state: str) -> int:
        """Blocks the view holds in ``state``: held, shared, evictable or window."""
        with self._lock:
            states = list(self.blocks.values())
        if state == "held":
            return sum(ref == 1 for ref, _, _ in states)
        if state == "shared":
            return sum(ref > 1 for ref, _, _ in states)
        if state == "evictable":
            return sum(ref == 0 and key is not None for ref, key, _ in states)
        return sum(ref == 0 and flags & 1 for ref, _, flags in states)

    def wait_for(self, condition, timeout: float = 60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = condition()
            if result:
                return result
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting on {self.url}")
