"""The dashboard's routes: the page, its event feed, the kv-events stream, how blocks
are keyed and the prefix-cache reset (docs/dashboard.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from functools import cache
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from pagedllm.server.async_engine import AsyncEngine
from pagedllm.server.dashboard.feed import PoolFeed
from pagedllm.server.dashboard.hub import CLOSED, FeedHub

HEARTBEAT_S = 1.0
"""Seconds an idle page waits for a message before it is sent the last figures again
(its charts keep moving) and its connection is checked."""

_STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@cache
def page_html() -> str:
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


def install_dashboard(
    app: FastAPI, async_engine: AsyncEngine, model_name: str, is_draining: Callable[[], bool]
) -> FeedHub:
    """Add the routes to ``app`` and make the engine loop follow its pool for them."""
    engine = async_engine.engine
    hub = FeedHub(async_engine.call)
    hub.feed = PoolFeed(engine, model_name, hub.publish_threadsafe)
    async_engine.observer = hub.feed

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page_html())

    @app.get("/dashboard/events")
    async def dashboard_events(request: Request) -> StreamingResponse:
        """Server-sent events: a ``snapshot`` of the pool, then ``delta`` messages."""
        stream = _watch(request, hub, "dashboard", is_draining)
        return StreamingResponse(stream, media_type="text/event-stream", headers=_STREAM_HEADERS)

    @app.get("/kv_events")
    async def kv_events(request: Request) -> StreamingResponse:
        """JSON lines of vLLM-shaped block events, the cached blocks first."""
        stream = _watch(request, hub, "kv", is_draining)
        return StreamingResponse(stream, media_type="application/x-ndjson", headers=_STREAM_HEADERS)

    @app.get("/kv_cache_config")
    async def kv_cache_config() -> JSONResponse:
        """How this server keys its cached blocks: a router computes a prompt's keys
        with it and matches them against ``/kv_events`` (docs/data_parallel.md)."""
        return JSONResponse(
            {
                "block_size": engine.block_manager.block_size,
                "num_blocks": engine.block_manager.pool.num_blocks,
                "extra_keys": [engine.scheduler.cache_key],
                "enable_prefix_caching": engine.block_manager.enable_prefix_caching,
            }
        )

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        """Forget every cached block, unless a running request holds one."""
        reset = await async_engine.call_and_wait(engine.block_manager.pool.reset_prefix_cache)
        return JSONResponse({"reset": reset})

    return hub


async def _watch(
    request: Request, hub: FeedHub, kind: str, is_draining: Callable[[], bool]
) -> AsyncIterator[str]:
    """One watcher's messages until it disconnects, falls behind or the server drains."""
    watcher = hub.subscribe(kind)
    try:
        while not is_draining():
            try:
                data = await asyncio.wait_for(watcher.queue.get(), HEARTBEAT_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                if kind != "dashboard" or not watcher.has_snapshot:
                    continue
                data = hub.heartbeat()
                if data is None:
                    continue
            if data is CLOSED:
                return
            yield data
    finally:
        hub.unsubscribe(watcher)
