"""Serving benchmark: Poisson arrivals of the synthetic workload at several request
rates against ``pagedllm serve``; one JSON line per rate, and a plot of latency
against throughput.

Each request is a streamed ``/v1/completions`` call whose prompt is the workload's
token ids, greedy with ``ignore_eos`` so it generates exactly its output length.
Per request: TTFT (send to the first chunk with text), TPOT ((e2e - TTFT) / (output tokens - 1)),
e2e latency; all in seconds, measured by the client.

Examples:
    python benchmarks/serving.py --base-url http://127.0.0.1:8000
    python benchmarks/serving.py --start-server --num-requests 24 \\
        --prompt-len 16,96 --output-len 8,32 --request-rates 0.5,1,2,inf \\
        --trace-pool benchmarks/out/serving_pool.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagedllm.bench.workload import BenchRequest, length_range, synthetic_workload
from pagedllm.server.launcher import ServerProcess

DEFAULT_PLOT = Path(__file__).parent / "out" / "serving_latency_vs_throughput.png"


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds."""

    ok: bool
    ttft: float = math.nan
    e2e: float = math.nan
    output_tokens: int = 0

    @property
    def tpot(self) -> float:
        if self.output_tokens < 2:
            return math.nan
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send(http: httpx.AsyncClient, model: str, request: BenchRequest) -> RequestResult:
    body = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, tokens = math.nan, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return RequestResult(ok=False)
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"] and math.isnan(ttft):
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return RequestResult(True, ttft, time.perf_counter() - start, tokens)


async def run_rate(
    base_url: str, model: str, requests: list[BenchRequest], rate: float, seed: int
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` with exponential gaps of mean ``1 / rate`` seconds (all at
    once for an infinite rate); the results and the wall time in seconds."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:
        start = time.perf_counter()
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(send(http, model, request)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summary(rate: float, results: list[RequestResult], duration: float) -> dict[str, object]:
    ok = [r for r in results if r.ok]
    record: dict[str, object] = {
        "request_rate": rate if math.isfinite(rate) else "inf",
        "num_requests": len(results),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
    }
    for name in ("ttft", "tpot", "e2e"):
        values = sorted(v for v in (getattr(r, name) for r in ok) if not math.isnan(v))
        if values:
            record[f"mean_{name}_s"] = statistics.fmean(values)
            record[f"median_{name}_s"] = statistics.median(values)
            record[f"p99_{name}_s"] = values[
                min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)
            ]
    return record


def plot(records: list[dict[str, object]], path: Path) -> None:
    """Median and p99 latencies (TTFT, e2e) against output tokens per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = [r["output_tokens_per_s"] for r in records]
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for key, label in (
        ("median_e2e_s", "median e2e"),
        ("p99_e2e_s", "p99 e2e"),
        ("median_ttft_s", "median TTFT"),
        ("p99_ttft_s", "p99 TTFT"),
    ):
        axis.plot(throughput, [r.get(key, math.nan) for r in records], marker="o", label=label)
    for record, x in zip(records, throughput, strict=True):
        axis.annotate(f"{record['request_rate']} req/s", (x, record.get("median_e2e_s", 0)))
    axis.set_xlabel("output tokens/s")
    axis.set_ylabel("latency (s)")
    axis.set_title("pagedllm serve: latency against throughput (Poisson arrivals)")
    axis.grid(True, alpha=0.3)
    axis.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="a running server")
    parser.add_argument(
        "--start-server", action="store_true", help="start 'pagedllm serve' on a free port"
    )
    parser.add_argument(
        "--serve-args", default="", help="options for the started server, e.g. '--max-num-seqs 32'"
    )
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name")
    parser.add_argument("--request-rates", default="0.5,1,2,4,inf", help="requests/s, comma list")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per rate")
    parser.add_argument("--prompt-len", type=length_range, default=(32, 512), help="min,max")
    parser.add_argument("--output-len", type=length_range, default=(16, 256), help="min,max")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=DEFAULT_PLOT, help="PNG to write")
    parser.add_argument(
        "--trace-pool",
        type=Path,
        default=None,
        metavar="PNG",
        help="with --start-server: the server draws its block pool over all rates to PNG",
    )
    args = parser.parse_args(argv)
    if args.trace_pool and not args.start_server:
        parser.error("--trace-pool needs --start-server (the server draws the trace)")

    requests = synthetic_workload(args.num_requests, args.seed, args.prompt_len, args.output_len)
    rates = [float(rate) for rate in args.request_rates.split(",")]
    records = []
    with contextlib.ExitStack() as stack:
        base_url = args.base_url
        if args.start_server:
            serve_args = args.serve_args.split()
            if args.trace_pool:
                args.trace_pool.parent.mkdir(parents=True, exist_ok=True)
                serve_args += ["--trace-pool", str(args.trace_pool)]
            base_url = stack.enter_context(ServerProcess(serve_args)).base_url
        for rate in rates:
            results, duration = asyncio.run(
                run_rate(base_url, args.model, requests, rate, args.seed)
            )
            record = summary(rate, results, duration)
            print(json.dumps(record), flush=True)
            records.append(record)
    plot(records, args.plot)
    print(json.dumps({"plot": str(args.plot)}), flush=True)
    if args.trace_pool:
        print(json.dumps({"pool_trace": str(args.trace_pool)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
