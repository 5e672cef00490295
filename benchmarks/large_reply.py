"""The largest reply one request may ask for, and what it does to everyone else.

Starts ``pagedllm serve`` (default model unless ``--model``), then sends one completions
request that echoes a long prompt with 20 alternatives per position to as many samples
as ``--max-logprob-entries`` allows (``--repeat`` times, to tell memory kept for reuse
from memory lost), while ``/health`` is polled every 20 ms. Prints
one JSON line per request: its status, reply size in MB, seconds to answer, the
slowest ``/health`` answer meanwhile, and the server's RSS before and after in MiB.
A request one sample larger is sent too: it must be refused up front (400).

Example:
    python benchmarks/large_reply.py --prompt-tokens 4000
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import psutil

from pagedllm.server.launcher import ServerProcess
from pagedllm.server.reply_size import DEFAULT_MAX_LOGPROB_ENTRIES

TOP_LOGPROBS = 20


def poll_health(base_url: str, stop: threading.Event, worst: list[float]) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as http:
        while not stop.is_set():
            start = time.perf_counter()
            http.get("/health")
            worst[0] = max(worst[0], time.perf_counter() - start)
            time.sleep(0.02)


def measure(server: ServerProcess, body: dict[str, object]) -> dict[str, object]:
    process = psutil.Process(server.process.pid)
    rss_before = process.memory_info().rss
    stop, worst = threading.Event(), [0.0]
    poller = threading.Thread(target=poll_health, args=(server.base_url, stop, worst))
    poller.start()
    start = time.perf_counter()
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    stop.set()
    poller.join()
    mib = 1 << 20
    return {
        "benchmark": "large_reply",
        "n": body["n"],
        "status": reply.status_code,
        "reply_mb": round(len(reply.content) / 1e6, 1),
        "seconds": round(elapsed, 2),
        "health_worst_s": round(worst[0], 3),
        "rss_before_mib": round(rss_before / mib),
        "rss_after_mib": round(process.memory_info().rss / mib),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--max-logprob-entries", type=int, default=DEFAULT_MAX_LOGPROB_ENTRIES)
    parser.add_argument("--repeat", type=int, default=3, help="times the largest is sent")
    args = parser.parse_args()
    serve_args = ["--max-logprob-entries", str(args.max_logprob_entries)]
    serve_args += ["--max-model-len", str(args.prompt_tokens + 64), "--log-stats-interval", "0"]
    if args.model:
        serve_args += ["--model", args.model]
    with ServerProcess(serve_args) as server:
        ids = list(range(1000, 1000 + args.prompt_tokens))
        per_sample = (args.prompt_tokens + 1) * (TOP_LOGPROBS + 1)
        largest = args.max_logprob_entries // per_sample
        body = {"prompt": ids, "echo": True, "logprobs": TOP_LOGPROBS, "max_tokens": 1}
        for n in [largest] * args.repeat + [largest + 1]:
            print(json.dumps(measure(server, {**body, "n": n})), flush=True)


if __name__ == "__main__":
    main()
