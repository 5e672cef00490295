"""The router's decisions and bookkeeping: which replica a request goes to, what it
is charged there, and what was routed (its metrics).

A request's prompt is tokenized by a replica (``/tokenize``: the very ids and chat
template the replica would use), its blocks' keys are computed per replica, and the
policy (:mod:`pagedllm.router.policy`) chooses among the replicas' views. The chosen
replica is charged the request's tokens until the request ends
(:meth:`Router.release`).
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from pagedllm.router.policy import DEFAULT_MAX_SHARE, ReplicaView, RoutingPolicy, choose
from pagedllm.router.rendezvous import POLL_INTERVAL_S, RendezvousHost
from pagedllm.router.replica import Replica, logger

DEFAULT_OUTPUT_ESTIMATE = 256
"""Output tokens charged for a request that sets no ``max_tokens``."""


class RouterMetrics:
    """The router's own collectors (per-replica load, routed hit tokens, re-sends)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        by_replica = ["replica"]
        self.requests = Counter(
            "pagedllm_router:requests", "Requests routed, by replica.", by_replica,
            registry=self.registry,
        )  # fmt: skip
        self.healthy = Gauge(
            "pagedllm_router:replica_healthy", "1 while the replica serves.", by_replica,
            registry=self.registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "pagedllm_router:replica_in_flight", "Requests routed and unfinished.", by_replica,
            registry=self.registry,
        )  # fmt: skip
        self.pending = Gauge(
            "pagedllm_router:replica_pending_tokens",
            "Prompt tokens to compute plus output tokens allowed, of unfinished requests.",
            by_replica, registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "pagedllm_router:routed_prompt_tokens", "Prompt tokens of routed requests.",
            registry=self.registry,
        )  # fmt: skip
        self.hit_tokens = Counter(
            "pagedllm_router:routed_hit_tokens",
            "Prompt tokens the chosen replica's prefix cache held when routed.",
            registry=self.registry,
        )  # fmt: skip
        self.resends = Counter(
            "pagedllm_router:resends", "Requests sent again after their replica failed.",
            registry=self.registry,
        )  # fmt: skip
        self.broken_streams = Counter(
            "pagedllm_router:broken_streams", "Streams ended by their replica failing.",
            registry=self.registry,
        )  # fmt: skip
        self.usage_prompt = Counter(
            "pagedllm_router:prompt_tokens", "Prompt tokens of the replies' usage.",
            registry=self.registry,
        )  # fmt: skip
        self.usage_generation = Counter(
            "pagedllm_router:generation_tokens", "Completion tokens of the replies' usage.",
            registry=self.registry,
        )  # fmt: skip

    def follow(self, replicas: list[Replica]) -> None:
        """Set the per-replica gauges (at scrape time)."""
        for replica in replicas:
            label = str(replica.index)
            self.healthy.labels(label).set(int(replica.healthy))
            self.in_flight.labels(label).set(replica.in_flight)
            self.pending.labels(label).set(replica.pending_tokens)


class Router:
    """Replicas at ``urls``, followed from :meth:`start` to :meth:`stop`.
    ``replica_headers``: sent with the router's own calls (an API key)."""

    def __init__(
        self,
        urls: list[str],
        policy: RoutingPolicy,
        max_share: float = DEFAULT_MAX_SHARE,
        replica_headers: dict[str, str] | None = None,
        rendezvous: RendezvousHost | None = None,
    ) -> None:
        """``rendezvous``: where replicas on other machines register (they join the
        list as they do)."""
        self.replicas: list[Replica] = []
        for url in urls:
            self.add_replica(url)
        self._rendezvous = rendezvous
        self.policy = policy
        self.max_share = max_share
        self.metrics = RouterMetrics()
        self._replica_headers = replica_headers or {}
        self._last_choice = -1
        self._tasks: list[asyncio.Task] = []
        self.http: httpx.AsyncClient | None = None  # requests passed through
        self._own_http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=None), limits=limits)
        # the router's own calls: events, health, tokenization
        self._own_http = httpx.AsyncClient(
            timeout=httpx.Timeout(10.0, read=None), headers=self._replica_headers
        )
        self._tasks = [
            asyncio.create_task(replica.follow(self._own_http)) for replica in self.replicas
        ]
        if self._rendezvous is not None:
            self._tasks.append(asyncio.create_task(self._watch_rendezvous()))

    def add_replica(self, url: str) -> Replica | None:
        """Follow the replica at ``url`` (from :meth:`start` on); None if known already."""
        url = url.rstrip("/")
        if any(replica.base_url == url for replica in self.replicas):
            return None
        replica = Replica(len(self.replicas), url)
        self.replicas.append(replica)
        return replica

    async def _watch_rendezvous(self) -> None:
        while True:
            for url in await asyncio.to_thread(self._rendezvous.new_urls):
                replica = self.add_replica(url)
                if replica is not None:
                    logger.info("replica %d joined at %s", replica.index, url)
                    self._tasks.append(asyncio.create_task(replica.follow(self._own_http)))
            await asyncio.sleep(POLL_INTERVAL_S)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._own_http.aclose()
        await self.http.aclose()

    def healthy(self) -> list[Replica]:
        return [replica for replica in self.replicas if replica.healthy]

    async def prompt_ids(self, path: str, body: dict) -> list[int] | None:
        """The token ids a replica would run for ``body``'s prompt (the first prompt of
        a batch); None when they cannot be known (the request then routes by load)."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch routes by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if path.endswith("/chat/completions"):
            query = {"messages": body.get("messages"), "tools": body.get("tools")}
        elif isinstance(prompt, str):
            query = {"prompt": prompt}
        else:
            return None
        for replica in self.healthy():
            try:
                answer = await self._own_http.post(
                    f"{replica.base_url}/tokenize", json={k: v for k, v in query.items() if v}
                )
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                return answer.json()["tokens"]
            return None  # the request itself is malformed: its replica will say so
        return None

    def choose(
        self, token_ids: list[int] | None, body: dict, exclude: set[int]
    ) -> tuple[Replica, int]:
        """The replica for a request and the tokens it is charged there."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        num_prompt = len(token_ids) if token_ids else 0
        views, hashes = [], []
        for replica in self.replicas:
            hashes.append(replica.block_hashes(token_ids, salt) if token_ids else [])
            hit = replica.hit_tokens(hashes[-1])
            views.append(
                ReplicaView(
                    healthy=replica.healthy and replica.index not in exclude,
                    in_flight=replica.in_flight,
                    pending_tokens=replica.pending_tokens,
                    hit_tokens=hit,
                )
            )
        index = choose(self.policy, views, num_prompt, self._last_choice, self.max_share)
        self._last_choice = index
        replica = self.replicas[index]
        replica.prefix.expect(hashes[index])
        hit = views[index].hit_tokens
        samples = body.get("n") if isinstance(body.get("n"), int) else 1
        output = body.get("max_tokens") or body.get("max_completion_tokens")
        output = output if isinstance(output, int) else DEFAULT_OUTPUT_ESTIMATE
        charge = num_prompt - hit + output * max(samples, 1)
        replica.in_flight += 1
        replica.pending_tokens += charge
        self.metrics.requests.labels(str(index)).inc()
        self.metrics.prompt_tokens.inc(num_prompt)
        self.metrics.hit_tokens.inc(hit)
        return replica, charge

    @staticmethod
    def release(replica: Replica, charge: int) -> None:
        replica.in_flight -= 1
        replica.pending_tokens -= charge

    def count_usage(self, usage: dict | None) -> None:
        if isinstance(usage, dict):
            self.metrics.usage_prompt.inc(usage.get("prompt_tokens") or 0)
            self.metrics.usage_generation.inc(usage.get("completion_tokens") or 0)
