"""One engine server behind the router, as the router follows it.

A :class:`Replica` is an ordinary ``pagedllm serve`` reached over HTTP. The router
keeps, per replica, what it needs to route: whether it answers, what its prefix cache
holds (its ``/kv_events`` stream, applied to a :class:`PrefixIndex`), how its blocks
are keyed (``/kv_cache_config``), and the requests it sent there and their tokens.

Health: a replica is healthy while its event stream is open and ``/health`` answers
200 within :data:`HEALTH_TIMEOUT_S`, probed every :data:`HEALTH_INTERVAL_S`. When it
is not, its index is forgotten and the router retries every
:data:`RECONNECT_INTERVAL_S`; a restarted replica is taken back as soon as its stream
opens again (with an empty cache, which its events then fill).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field

import httpx

from pagedllm.router.prefix_index import PrefixIndex, prompt_block_hashes

logger = logging.getLogger("pagedllm.router")

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 5.0
RECONNECT_INTERVAL_S = 0.5


@dataclass
class Replica:
    """``index``: its place in the router's list; ``in_flight``/``pending_tokens``:
    the requests routed here and not finished, and their tokens."""

    index: int
    base_url: str
    healthy: bool = False
    in_flight: int = 0
    pending_tokens: int = 0
    block_size: int = 0
    extra_keys: tuple[str, ...] = ()
    prefix: PrefixIndex = field(default_factory=PrefixIndex)

    def block_hashes(self, token_ids: list[int], salt: str | None) -> list[str]:
        """The keys ``token_ids``' cacheable blocks have on this replica."""
        if not self.block_size:
            return []
        extra = self.extra_keys if salt is None else (*self.extra_keys, salt)
        return prompt_block_hashes(token_ids, self.block_size, extra)

    def hit_tokens(self, block_hashes: list[str]) -> int:
        """Prompt tokens of a prompt with these keys this replica holds now."""
        if not self.healthy:
            return 0
        return self.prefix.matched_blocks(block_hashes) * self.block_size

    def lost(self) -> None:
        if self.healthy:
            logger.warning("replica %d (%s) is unreachable", self.index, self.base_url)
        self.healthy = False
        self.prefix.clear()

    async def follow(self, http: httpx.AsyncClient) -> None:
        """Keep this replica's health and prefix index current, forever (a task)."""
        while True:
            try:
                await self._follow_once(http)
            except (httpx.HTTPError, ValueError, KeyError) as error:
                logger.debug("replica %d: %s", self.index, error)
            self.lost()
            await asyncio.sleep(RECONNECT_INTERVAL_S)

    async def _follow_once(self, http: httpx.AsyncClient) -> None:
        config = (await http.get(f"{self.base_url}/kv_cache_config")).raise_for_status().json()
        self.block_size = int(config["block_size"])
        self.extra_keys = tuple(config["extra_keys"])
        async with http.stream("GET", f"{self.base_url}/kv_events") as response:
            response.raise_for_status()
            lines = response.aiter_lines()
            first = await anext(lines)
            self.prefix.clear()
            self.prefix.apply(json.loads(first)["events"])
            if not self.healthy:
                logger.info("replica %d (%s) is serving", self.index, self.base_url)
            self.healthy = True
            reader = asyncio.create_task(self._read_events(lines))
            health = asyncio.create_task(self._probe_health(http))
            done, pending = await asyncio.wait(
                {reader, health}, return_when=asyncio.FIRST_COMPLETED
            )
            for task in pending:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task
            for task in done:
                task.result()

    async def _read_events(self, lines) -> None:
        async for line in lines:
            self.prefix.apply(json.loads(line)["events"])

    async def _probe_health(self, http: httpx.AsyncClient) -> None:
        """Return (ending the stream) once ``/health`` fails."""
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                answer = await http.get(f"{self.base_url}/health", timeout=HEALTH_TIMEOUT_S)
            except httpx.HTTPError:
                return
            if answer.status_code != 200:
                return
