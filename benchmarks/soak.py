"""Soak test: a bounded number of minutes of mixed good and bad traffic against a live
``pagedllm serve``, with clients that disconnect mid-stream at a fixed rate. Prints one
JSON line.

Traffic: ``--clients`` concurrent clients each send requests back to back until the
time is up. Every ``--bad-every``-th request of a client is a bad one (a lone
surrogate, a huge ``n``, deep nesting, a wrong content type, a non-finite float, an
integer of 5,000 digits, an out-of-vocabulary stop id, an unknown field, broken JSON,
an oversized body, a wrong route or method, a reply past the logprob limit), every
``--disconnect-every``-th is a stream the client leaves after its first chunk, every
``--timeout-every``-th a non-streamed request the client gives up on after 0.3 s; the
rest are good chat and completion requests, streamed or not, greedy or sampled, some
with ``n = 2``. ``/health`` is polled every second.

Reported: ``served`` (good requests answered 200 in full), ``errors_by_class`` (HTTP
status of every non-200 answer, or ``transport``), ``unexpected`` (good requests not
served, bad ones not answered 4xx, the RSS growing past its bound), latency
percentiles of the good non-streamed requests in seconds, the server's aborts against
the clients that left (``aborted`` = ``disconnects`` + ``timeouts`` when every orphan
is stopped), the server's RSS in MiB every ``--rss-every`` seconds from the end of a
warm-up (``rss_mib``) and its growth from the first sample to the end, KV blocks still
held once idle (must be 0), engine restarts (steps that failed every request in
flight, plus a server that stopped; must be 0) and ``/health`` failures. The exit
status is 1 when anything was unexpected.

Examples:
    python benchmarks/soak.py --minutes 3
    python benchmarks/soak.py --minutes 10 --max-rss-growth-mib 64
    python benchmarks/soak.py --minutes 1 --model path/to/hf-folder --clients 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psutil

from pagedllm.server.launcher import ServerProcess

MAX_BODY = 64 * 1024
PHRASE = "paged blocks share memory while many clients wait for their tokens"
WORDS = PHRASE.split()


@dataclass
class Tally:
    """What the clients saw; latencies in seconds."""

    served: int = 0
    disconnects: int = 0
    timeouts: int = 0
    bad_sent: int = 0
    errors: Counter = field(default_factory=Counter)
    unexpected: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    health_failures: int = 0
    rss_mib: list[float] = field(default_factory=list)


def bad_request(rng: random.Random) -> tuple[str, str, dict[str, str], bytes]:
    """(method, path, headers, body) of one request the server must refuse with a 4xx."""
    json_type = {"Content-Type": "application/json"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def body(**fields: object) -> bytes:
        return json.dumps({**chat, **fields}).encode()

    cases = [
        ("POST", "/v1/chat/completions", json_type,
         b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
        ("POST", "/v1/completions", json_type, b'{"prompt": "x", "n": 1000000, "max_tokens": 1}'),
        ("POST", "/v1/completions", json_type, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
        ("POST", "/v1/chat/completions", {"Content-Type": "text/plain"}, body()),
        ("POST", "/v1/chat/completions", json_type, body()[:-1] + b', "temperature": NaN}'),
        ("POST", "/v1/chat/completions", json_type, body(stop_token_ids=[10**9])),
        ("POST", "/v1/chat/completions", json_type, body(best_of=3)),
        ("POST", "/v1/chat/completions", json_type, b'{"messages": ['),
        ("POST", "/v1/completions", json_type, json.dumps({"prompt": "a" * MAX_BODY}).encode()),
        ("GET", "/v1/chat/completions", {}, b""),
        ("POST", "/v1/nowhere", json_type, body()),
        ("POST", "/v1/chat/completions", json_type, body(seed=2**64, top_logprobs=2)),
        ("POST", "/v1/completions", json_type, b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}"),
        ("POST", "/v1/chat/completions", json_type, body(
            max_tokens=None, logprobs=True, top_logprobs=20, n=128)),
    ]  # fmt: skip
    return rng.choice(cases)


def good_body(rng: random.Random) -> tuple[str, dict[str, object]]:
    """A request the server must serve: chat or completion, greedy or sampled."""
    words = " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))
    fields: dict[str, object] = {
        "max_tokens": rng.randint(4, 32),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "n": rng.choice([1, 1, 1, 2]),
    }
    if rng.random() < 0.5:
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": words}], **fields}
    return "/v1/completions", {"prompt": words, **fields}


async def send_good(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    path, body = good_body(rng)
    start = time.perf_counter()
    if rng.random() < 0.5:
        response = await http.post(path, json=body)
        if response.status_code == 200 and response.json()["choices"]:
            tally.served += 1
            tally.latencies.append(time.perf_counter() - start)
            return
        tally.errors[str(response.status_code)] += 1
        tally.unexpected["good not served"] += 1
        return
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
    complete = bool(events) and events[-1] == "data: [DONE]"
    if response.status_code == 200 and complete and not any('"error"' in e for e in events):
        tally.served += 1
        return
    tally.errors[str(response.status_code)] += 1
    tally.unexpected["good stream not served"] += 1


async def send_and_leave(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    path, body = good_body(rng)
    body = {**body, "max_tokens": 200, "stream": True}
    async with http.stream("POST", path, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                break  # leaving the block closes the connection mid-stream
    tally.disconnects += 1


async def send_and_time_out(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    path, body = good_body(rng)
    with contextlib.suppress(httpx.TimeoutException):
        await http.post(path, json={**body, "max_tokens": 200}, timeout=0.3)
    tally.timeouts += 1


async def send_bad(http: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    method, path, headers, data = bad_request(rng)
    tally.bad_sent += 1
    response = await http.request(method, path, headers=headers, content=data)
    tally.errors[str(response.status_code)] += 1
    try:
        shaped = set(response.json()["error"]) == {"message", "type", "param", "code"}
    except (ValueError, KeyError, TypeError):
        shaped = False
    if not (400 <= response.status_code < 500 and shaped):
        tally.unexpected[f"bad answered {response.status_code}"] += 1


async def client(base_url: str, seed: int, deadline: float, args, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as http:
        number = 0
        while time.monotonic() < deadline:
            number += 1
            try:
                if number % args.bad_every == 0:
                    await send_bad(http, rng, tally)
                elif number % args.disconnect_every == 0:
                    await send_and_leave(http, rng, tally)
                elif number % args.timeout_every == 0:
                    await send_and_time_out(http, rng, tally)
                else:
                    await send_good(http, rng, tally)
            except httpx.TransportError as error:
                tally.errors["transport"] += 1
                tally.unexpected[type(error).__name__] += 1
            except (ValueError, KeyError, IndexError) as error:  # a malformed answer
                tally.unexpected[type(error).__name__] += 1


async def watch_health(base_url: str, deadline: float, tally: Tally) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        while time.monotonic() < deadline:
            try:
                healthy = (await http.get("/health")).status_code == 200
            except httpx.TransportError:
                healthy = False
            tally.health_failures += not healthy
            await asyncio.sleep(1.0)


async def watch_rss(pid: int, every_s: float, deadline: float, tally: Tally) -> None:
    process = psutil.Process(pid)
    while time.monotonic() < deadline:
        tally.rss_mib.append(round(process.memory_info().rss / (1 << 20), 1))
        await asyncio.sleep(every_s)


def metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` samples by name, labels dropped (one model, one series)."""
    values = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#") and "finished_reason" not in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{", 1)[0]] = float(value)
    return values


def wait_until_idle(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = metrics(base_url)
        busy = values["vllm:num_requests_running"] + values["vllm:num_requests_waiting"]
        if (busy == 0 and values["pagedllm:kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def run(args: argparse.Namespace) -> dict[str, object]:
    serve_args = [
        "--kv-cache-memory", args.kv_cache_memory,
        "--max-model-len", str(args.max_model_len),
        "--max-body-size", str(MAX_BODY),
        "--log-stats-interval", "0",
    ]  # fmt: skip
    if args.model:
        serve_args += ["--model", args.model]
    with ServerProcess(serve_args) as server:
        pid = server.process.pid
        process = psutil.Process(pid)
        tally = Tally()
        started = time.monotonic()
        deadline = started + args.minutes * 60
        warm_until = started + args.warmup_minutes * 60

        async def all_clients() -> None:
            tasks = [
                client(server.base_url, args.seed + index, deadline, args, tally)
                for index in range(args.clients)
            ]

            async def rss_after_warmup() -> None:
                await asyncio.sleep(max(warm_until - time.monotonic(), 0))
                await watch_rss(pid, args.rss_every, deadline, tally)

            watchers = [watch_health(server.base_url, deadline, tally), rss_after_warmup()]
            await asyncio.gather(*watchers, *tasks)

        asyncio.run(all_clients())
        elapsed = time.monotonic() - started
        alive = server.process.poll() is None
        values = wait_until_idle(server.base_url) if alive else {}
        rss_end = round(process.memory_info().rss / (1 << 20), 1) if alive else None
        step_failures = int(values.get("pagedllm:engine_step_failures_total", 0))
        failed_alone = int(values.get("pagedllm:num_requests_failed_total", 0))
        exit_code = server.stop()
    rss_growth = None
    if rss_end is not None and tally.rss_mib:
        rss_growth = round(rss_end - tally.rss_mib[0], 1)
        if args.max_rss_growth_mib is not None and rss_growth > args.max_rss_growth_mib:
            tally.unexpected["rss growth over bound"] += 1
    return {
        "benchmark": "soak",
        "model": args.model or "SmolLM2-135M-Instruct",
        "minutes": round(elapsed / 60, 2),
        "clients": args.clients,
        "served": tally.served,
        "bad_sent": tally.bad_sent,
        "disconnects": tally.disconnects,
        "timeouts": tally.timeouts,
        "aborted": int(values.get("pagedllm:num_requests_aborted_total", -1)),
        "errors_by_class": dict(sorted(tally.errors.items())),
        "unexpected": dict(tally.unexpected),
        "latency_p50_s": percentile(tally.latencies, 0.5),
        "latency_p99_s": percentile(tally.latencies, 0.99),
        "latency_mean_s": round(statistics.fmean(tally.latencies), 4) if tally.latencies else None,
        "rss_mib": tally.rss_mib,
        "rss_end_mib": rss_end,
        "rss_growth_mib": rss_growth,
        "kv_blocks_held_at_end": int(values.get("pagedllm:kv_blocks_used", -1)),
        "requests_failed_by_engine": failed_alone,
        "engine_restarts": step_failures + (0 if alive else 1),
        "health_failures": tally.health_failures,
        "server_exit_code": exit_code,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="how long traffic runs")
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--bad-every", type=int, default=3, help="every k-th request is bad")
    parser.add_argument(
        "--disconnect-every", type=int, default=5, help="every k-th request is left mid-stream"
    )
    parser.add_argument(
        "--timeout-every", type=int, default=7, help="every k-th request is given up after 0.3 s"
    )
    parser.add_argument(
        "--warmup-minutes", type=float, default=0.5, help="traffic before the first RSS sample"
    )
    parser.add_argument("--rss-every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=None,
        help="RSS growth from the first sample to the end beyond which the run fails",
    )
    parser.add_argument("--kv-cache-memory", default="128MiB")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    every = (args.bad_every, args.disconnect_every, args.timeout_every)
    if args.minutes <= args.warmup_minutes or args.clients < 1 or min(every) < 2:
        parser.error(
            "--minutes > --warmup-minutes, --clients >= 1, --bad-every, --disconnect-every "
            "and --timeout-every >= 2"
        )
    with contextlib.suppress(KeyboardInterrupt):
        result = run(args)
        print(json.dumps(result), flush=True)
        sys.exit(1 if result["unexpected"] else 0)


if __name__ == "__main__":
    main()
