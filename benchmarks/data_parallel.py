"""Replicas behind the router, by routing policy, on a multi-tenant workload.

For each policy (``round_robin``, ``least_load``, ``prefix_aware``) starts ``pagedllm
serve --data-parallel-size R`` afresh (cold caches), then sends requests at a fixed
rate: tenant ``t`` of ``--tenants`` has a system prompt of ``--system-tokens`` token
ids, and each request is a random tenant's system prompt plus ``--user-tokens`` new
ids, streamed, greedy, ``--output-tokens`` tokens with ``ignore_eos``.

One JSON line per policy:
- ``prompt_tokens_computed``: prompt tokens the replicas computed (their
  ``vllm:prompt_tokens`` less ``vllm:prefix_cache_hits``, summed);
- ``prefix_cache_hit_rate``: hits / queries over all replicas;
- ``ttft_p50_s``, ``ttft_p99_s``: time to first token as the client saw it;
- ``output_tokens_per_s``: output tokens over the wall time;
- ``requests_per_replica`` and ``max_over_mean_load``: how the router spread them.

On one small machine replicas add no compute: the prompt tokens computed and the hit
rate are the figures that carry over to larger machines. ``--kv-cache-memory`` sizes
each replica's pool: one that holds every tenant's prompt lets even round robin hit
once each replica has seen each tenant; one that holds a quarter of them is where
routing decides. Example (scaled down):
    python benchmarks/data_parallel.py --replicas 4 --tenants 8 --system-tokens 512 \\
        --requests 96 --rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.server.launcher import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("round_robin", "least_load", "prefix_aware")


def workload(args) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [
        [rng.randrange(16, 49152) for _ in range(args.system_tokens)] for _ in range(args.tenants)
    ]
    return [
        rng.choice(systems) + [rng.randrange(16, 49152) for _ in range(args.user_tokens)]
        for _ in range(args.requests)
    ]


async def send(http: httpx.AsyncClient, prompt: list[int], output_tokens: int) -> float:
    """Time to the first token, in seconds (NaN if the request failed)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_tokens, "stream": True}
    body.update(temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return math.nan
        ttft = math.nan
        async for line in response.aiter_lines():
            if line.startswith("data: {") and math.isnan(ttft):
                ttft = time.perf_counter() - start
        return ttft


async def run_load(base_url: str, prompts: list[list[int]], args) -> tuple[list[float], float]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(send(http, prompt, args.output_tokens)))
            await asyncio.sleep(1.0 / args.rate)
        ttfts = await asyncio.gather(*tasks)
        return ttfts, time.perf_counter() - start


def samples(url: str) -> dict[tuple[str, str], float]:
    values: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=30).text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("replica", ""))
            values[key] = values.get(key, 0.0) + sample.value
    return values


def replica_urls(router: ServerProcess) -> list[str]:
    """The replicas' URLs, from their processes' command lines."""
    import psutil

    urls = []
    for child in psutil.Process(router.process.pid).children():
        line = child.cmdline()
        if "serve" in line:
            urls.append(f"http://127.0.0.1:{line[line.index('--port') + 1]}")
    return urls


def healthy_replicas(router: ServerProcess) -> int:
    metrics = samples(f"{router.base_url}/metrics")
    return int(sum(v for (name, _), v in metrics.items() if name.endswith("replica_healthy")))


def run_policy(policy: str, prompts: list[list[int]], args) -> dict:
    serve_args = ["--data-parallel-size", str(args.replicas), "--routing-policy", policy]
    serve_args += ["--log-stats-interval", "0", "--max-model-len", str(args.max_model_len)]
    if args.kv_cache_memory:
        serve_args += ["--kv-cache-memory", args.kv_cache_memory]
    with ServerProcess(serve_args, startup_timeout_s=600) as router:
        urls = replica_urls(router)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and healthy_replicas(router) < len(urls):
            time.sleep(0.5)
        ttfts, wall = asyncio.run(run_load(router.base_url, prompts, args))
        replicas = [samples(f"{url}/metrics") for url in urls]
        routed = samples(f"{router.base_url}/metrics")
    prompt_total = sum(r[("vllm:prompt_tokens_total", "")] for r in replicas)
    hits = sum(r[("vllm:prefix_cache_hits_total", "")] for r in replicas)
    queries = sum(r[("vllm:prefix_cache_queries_total", "")] for r in replicas)
    generated = sum(r[("vllm:generation_tokens_total", "")] for r in replicas)
    ttfts = sorted(t for t in ttfts if not math.isnan(t))
    per_replica = [
        int(routed.get(("pagedllm_router:requests_total", str(i)), 0)) for i in range(len(urls))
    ]
    return {
        "benchmark": "data_parallel",
        "policy": policy,
        "replicas": args.replicas,
        "requests": len(prompts),
        "failed": len(prompts) - len(ttfts),
        "prompt_tokens_computed": int(prompt_total - hits),
        "prefix_cache_hit_rate": round(hits / queries, 4) if queries else 0.0,
        "ttft_p50_s": round(statistics.median(ttfts), 3),
        "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3),
        "output_tokens_per_s": round(generated / wall, 1),
        "requests_per_replica": per_replica,
        "max_over_mean_load": round(max(per_replica) / statistics.mean(per_replica), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=1024)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--kv-cache-memory", default=None,
        help="each replica's KV pool, e.g. 96MiB (default: the engine's); a pool that "
        "holds only some tenants' prompts is where routing decides the hit rate",
    )  # fmt: skip
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    prompts = workload(args)
    for policy in args.policies.split(","):
        print(json.dumps(run_policy(policy, prompts, args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
