"""The engine side of the dashboard and kv-events feeds: watch the pool while someone
looks, and publish what changed at a bounded rate.

Every method runs in the engine loop thread (the pool's owner). The loop calls
:meth:`PoolFeed.after_pass` after each pass (a step or an idle wake-up) and waits at
most :meth:`PoolFeed.wait_timeout` when idle, so a change made by the last step reaches
the page within one interval. Messages go to ``publish(kind, payload)``, which hands
them to the event loop:

- ``"snapshot"``: the whole pool, when a page connects;
- ``"delta"``: blocks changed since the last message, the live tables, the reserve and
  the figures; at most one per ``interval_s``, only when a step ran or blocks changed;
- ``"kv_snapshot"``: every cached block as ``BlockStored`` events (parents first),
  when a kv-events client connects;
- ``"kv_events"``: block events since the last pass, at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pagedllm.kv.block_events import block_stored, parents_first
from pagedllm.server.dashboard import payload
from pagedllm.server.dashboard.recorder import PoolRecorder

Publish = Callable[[str, dict], None]

DEFAULT_INTERVAL_S = 0.25
"""Seconds between two dashboard messages at most (4 per second)."""


class PoolFeed:
    """Follows ``engine``'s pool for ``dashboards`` pages and ``kv_watchers`` tools."""

    def __init__(
        self, engine, model_name: str, publish: Publish, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        self._engine = engine
        self._pool = engine.block_manager.pool
        self._model_name = model_name
        self._publish = publish
        self.interval_s = interval_s
        self._medium = "GPU" if str(engine.device).startswith("cuda") else "CPU"
        self._recorder: PoolRecorder | None = None
        self._dashboards = 0
        self._snapshot_due = False
        self._stepped = False  # a step ran since the last dashboard message
        self._last_sent = float("-inf")

    def watch(self, dashboards: int, kv_watchers: int, snapshot: bool, kv_snapshot: bool) -> None:
        """Follow the pool for this many watchers (listening only while there are
        some); ``snapshot``/``kv_snapshot``: someone just joined and needs the whole
        picture first."""
        watching = dashboards > 0 or kv_watchers > 0
        if watching and self._recorder is None:
            self._recorder = PoolRecorder(self._pool, self._medium)
            self._pool.add_listener(self._recorder)
        elif not watching and self._recorder is not None:
            self._pool.remove_listener(self._recorder)
            self._recorder = None
        self._dashboards = dashboards
        self._snapshot_due = dashboards > 0 and (snapshot or self._snapshot_due)
        if self._recorder is not None:
            self._recorder.kv_events = kv_watchers > 0
            if kv_snapshot and kv_watchers > 0:
                self._publish_kv_snapshot()

    def after_pass(self, stepped: bool) -> None:
        """Publish what is due after one pass of the loop (``stepped``: it ran a step)."""
        recorder = self._recorder
        if recorder is None:
            return
        if recorder.kv_events:
            events = recorder.take_kv_events()
            if events:
                self._publish("kv_events", {"ts": time.time(), "events": events})
        if not self._dashboards:
            recorder.take_changed()
            return
        self._stepped |= stepped
        now = time.monotonic()
        if self._snapshot_due:
            self._send("snapshot", now)
        elif (self._stepped or recorder.has_changes) and now - self._last_sent >= self.interval_s:
            self._send("delta", now)

    def wait_timeout(self) -> float | None:
        """Seconds an idle loop may wait for a command before a message is due; None
        when nothing is pending."""
        recorder = self._recorder
        if not self._dashboards or recorder is None:
            return None
        if not (self._snapshot_due or self._stepped or recorder.has_changes):
            return None
        return max(0.0, self._last_sent + self.interval_s - time.monotonic())

    def _send(self, kind: str, now: float) -> None:
        engine, pool, recorder = self._engine, self._pool, self._recorder
        scheduler = engine.scheduler
        if kind == "snapshot":
            recorder.take_changed()
            message = {
                "model": self._model_name,
                "pool": {
                    "num_blocks": pool.num_blocks,
                    "block_size": pool.block_size,
                    "num_reserved": pool.num_reserved,
                    "medium": self._medium,
                },
                "blocks": payload.all_blocks(pool, recorder),
            }
        else:
            message = {"blocks": payload.changed_blocks(pool, recorder, recorder.take_changed())}
        listed, hidden = payload.sequences(scheduler)
        slowest = engine.block_manager.take_slowest_allocation()
        message.update(
            ts=time.time(),
            reserved=pool.reserved_block_ids(),
            swap=payload.swap_view(scheduler),
            requests=listed,
            num_requests_hidden=hidden,
            stats=payload.stats_view(engine.get_stats(), pool.block_size, slowest),
        )
        self._publish(kind, message)
        self._snapshot_due = self._stepped = False
        self._last_sent = now

    def _publish_kv_snapshot(self) -> None:
        pool = self._pool
        keys = (pool.block_key(block_id) for block_id in range(pool.num_blocks))
        cached = parents_first(key for key in keys if key is not None)
        events = [block_stored(key, pool.block_size, self._medium) for key in cached]
        self._publish("kv_snapshot", {"ts": time.time(), "events": events})
