"""What watching the pool costs: 64 requests with no dashboard, with a feed reader
connected, and with the dashboard open in a headless browser; and how far the page
lags the pool.

Starts ``pagedllm serve`` once (default model unless ``--model``), then runs rounds;
each round sends the synthetic workload (64 requests, prompts 32-512 tokens, outputs
16-256, all at once, greedy with ``ignore_eos``) once per mode, in an order that
rotates from round to round:

- ``none``: nobody watches (the pool has no listener);
- ``feed``: a client reads ``/dashboard/events`` (the server's whole cost: listening,
  building and sending the messages);
- ``page``: ``/dashboard`` open in Debian's chromium driven by Playwright (the
  server's cost plus the browser's drawing, on the same cores).

The whole workload runs once first, uncounted (the server's first pass over its
shapes times kernel choices). Prints one JSON line per run (output tokens/s; for
``page``, the page's worst
staleness while the requests ran: seconds since the last message it drew, sampled
every 0.1 s, the most a change of the pool waits to be shown; the CPU seconds the
server and the browser used), then a summary: the
median of each mode, its ratio to ``none``'s median and the median of the ratios within
a round (the runs closest in time), and the lag on an idle server (``--probes``
streamed requests): from a request's first token to the page showing its blocks in
use, and from the client leaving to the page showing them free.

``--in-process`` measures the server's own share without HTTP, clients or browser on
the cores: the same workload through one ``LLMEngine``, stepped with and without the
feed following its pool (messages built and JSON-encoded at the same bounded rate),
alternating, in one process.

Example:
    python benchmarks/dashboard_cost.py --rounds 3
    python benchmarks/dashboard_cost.py --in-process --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

from pagedllm.bench.workload import synthetic_workload
from pagedllm.server.launcher import ServerProcess

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
from browser import CHROMIUM_ARGS, chromium_path  # noqa: E402
from feed_reader import FeedReader  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
MODES = ("none", "feed", "page")


async def send_all(base_url: str, model: str, requests) -> int:
    """Send every request at once; the output tokens generated."""
    limits = httpx.Limits(max_connections=len(requests), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as http:

        async def send(request) -> int:
            body = {
                "model": model,
                "prompt": request.prompt_token_ids,
                "max_tokens": request.output_len,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            reply = await http.post("/v1/completions", json=body)
            reply.raise_for_status()
            return reply.json()["usage"]["completion_tokens"]

        return sum(await asyncio.gather(*(send(request) for request in requests)))


def send_all_blocking(base_url: str, model: str, requests) -> int:
    """:func:`send_all` on a thread of its own (Playwright's sync API holds an event
    loop in this one)."""
    result = []
    thread = threading.Thread(
        target=lambda: result.append(asyncio.run(send_all(base_url, model, requests)))
    )
    thread.start()
    thread.join()
    if not result:
        raise RuntimeError("the requests failed (see the traceback above)")
    return result[0]


STALENESS_SAMPLER = """() => {
  window.benchStaleness = [];
  window.benchTimer = setInterval(() => {
    const d = window.pagedllmDashboard;
    window.benchStaleness.push(Date.now() / 1000 - d.lastServerTs);
  }, 100);
}"""


def cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def browser_processes() -> list[psutil.Process]:
    """Chromium's processes, started by Playwright under this one."""
    children = psutil.Process().children(recursive=True)
    return [child for child in children if "chrom" in child.name()]


def run_once(server, browser, mode: str, requests, model: str) -> dict:
    with contextlib.ExitStack() as watching:
        reader = page = None
        if mode == "feed":
            reader = watching.enter_context(FeedReader(f"{server.base_url}/dashboard/events"))
        elif mode == "page":
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            watching.callback(page.close)
            page.goto(f"{server.base_url}/dashboard")
            page.wait_for_function(
                "window.pagedllmDashboard && window.pagedllmDashboard.connected"
            )
            page.evaluate(STALENESS_SAMPLER)
        server_process = [psutil.Process(server.process.pid)]
        watchers = browser_processes() if page is not None else []
        server_cpu, browser_cpu = cpu_seconds(server_process), cpu_seconds(watchers)
        start = time.perf_counter()
        tokens = send_all_blocking(server.base_url, model, requests)
        elapsed = time.perf_counter() - start
        record = {"mode": mode, "output_tokens": tokens, "seconds": round(elapsed, 2)}
        record["output_tokens_per_s"] = round(tokens / elapsed, 1)
        record["server_cpu_s"] = round(cpu_seconds(server_process) - server_cpu, 2)
        if reader is not None:
            record["messages"] = len(reader.messages)
        if page is not None:
            record["browser_cpu_s"] = round(cpu_seconds(watchers) - browser_cpu, 2)
            staleness = page.evaluate("clearInterval(window.benchTimer) || window.benchStaleness")
            record["page_messages"] = page.evaluate("window.pagedllmDashboard.messages")
            record["page_staleness_max_s"] = round(max(staleness), 3)
            record["page_staleness_median_s"] = round(statistics.median(staleness), 3)
        return record


def idle_lag(server, browser, probes: int) -> tuple[list[float], list[float]]:
    """On an idle server, per probe (a streamed request): seconds from its first token
    (its blocks were taken before) to the page showing blocks in use, and from the
    client closing the stream to the page showing them free again (the server's
    disconnect detection included)."""
    page = browser.new_page()
    page.goto(f"{server.base_url}/dashboard")
    page.wait_for_function("window.pagedllmDashboard && window.pagedllmDashboard.connected")
    shown, freed = [], []
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for index in range(probes):
            body = {"model": MODEL, "prompt": f"Probe {index}: tell a long story.", "stream": True}
            body.update(max_tokens=400, ignore_eos=True)
            with http.stream("POST", "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                first_token = time.time()
                page.wait_for_function("window.pagedllmDashboard.counts.used > 0", polling=5)
                shown.append(time.time() - first_token)
            closed = time.time()
            page.wait_for_function("window.pagedllmDashboard.counts.used === 0", polling=5)
            freed.append(time.time() - closed)
            time.sleep(0.3)
    page.close()
    return shown, freed


def engine_run(engine, requests, feed) -> float:
    """Seconds to run ``requests`` to completion on ``engine``, the feed (if any)
    following the pool after every step as the server's loop does."""
    from pagedllm import SamplingParams

    for index, request in enumerate(requests):
        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True, temperature=0)
        engine.add_request(f"r{index}", {"prompt_token_ids": request.prompt_token_ids}, params)
    start = time.perf_counter()
    if feed is not None:
        feed.watch(1, 0, True, False)
    while engine.has_unfinished_requests():
        engine.step()
        if feed is not None:
            feed.after_pass(True)
    if feed is not None:
        feed.watch(0, 0, False, False)
    return time.perf_counter() - start


def in_process(args) -> int:
    from pagedllm import LLM
    from pagedllm.server.dashboard.feed import PoolFeed
    from pagedllm.server.dashboard.hub import encode

    llm = LLM(model=args.model) if args.model else LLM()
    engine = llm.llm_engine
    requests = synthetic_workload(args.num_requests, seed=0)
    messages = []
    feed = PoolFeed(engine, MODEL, lambda kind, message: messages.append(encode(kind, message)))
    engine_run(engine, requests, None)  # warm-up
    tokens = sum(request.output_len for request in requests)
    ratios = []
    for round_index in range(args.rounds):
        order = (None, feed) if round_index % 2 == 0 else (feed, None)
        seconds = {}
        for watcher in order:
            messages.clear()
            mode = "none" if watcher is None else "feed"
            seconds[mode] = engine_run(engine, requests, watcher)
            record = {"benchmark": "dashboard_cost_in_process", "mode": mode, "round": round_index}
            record["output_tokens_per_s"] = round(tokens / seconds[mode], 1)
            if watcher is not None:
                record["messages"] = len(messages)
                record["message_bytes"] = sum(len(message) for message in messages)
            print(json.dumps(record), flush=True)
        ratios.append(seconds["none"] / seconds["feed"])
    summary = {"benchmark": "dashboard_cost_in_process_summary", "rounds": args.rounds}
    summary["feed_paired_ratio_median"] = round(statistics.median(ratios), 4)
    summary["feed_paired_ratios"] = [round(ratio, 4) for ratio in ratios]
    print(json.dumps(summary), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model path (default: the default model)")
    parser.add_argument("--rounds", type=int, default=3, help="at least 1")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--probes", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--in-process", action="store_true", help="the engine alone, no HTTP")
    args = parser.parse_args(argv)
    if args.in_process:
        return in_process(args)
    modes = args.modes.split(",")
    from playwright.sync_api import sync_playwright

    serve_args = ["--log-stats-interval", "0"]
    if args.model:
        serve_args += ["--model", args.model]
    model = MODEL if args.model is None else Path(args.model.rstrip("/")).stem
    requests = synthetic_workload(args.num_requests, seed=0)
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    rounds: list[dict[str, float]] = []
    with ServerProcess(serve_args) as server, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_ARGS)
        # warm-up: the whole workload once (kernel choices for its shapes are timed
        # at first use), not counted
        send_all_blocking(server.base_url, model, requests)
        for round_index in range(args.rounds):
            shift = round_index % len(modes)
            rounds.append({})
            for mode in modes[shift:] + modes[:shift]:
                record = run_once(server, browser, mode, requests, model)
                record["round"] = round_index
                print(json.dumps({"benchmark": "dashboard_cost", **record}), flush=True)
                rates[mode].append(record["output_tokens_per_s"])
                rounds[-1][mode] = record["output_tokens_per_s"]
        shown, freed = idle_lag(server, browser, args.probes) if args.probes else ([], [])
        browser.close()
    medians = {mode: statistics.median(values) for mode, values in rates.items()}
    summary = {"benchmark": "dashboard_cost_summary", "rounds": args.rounds}
    for mode, median in medians.items():
        summary[f"{mode}_tokens_per_s"] = median
        if "none" in medians and mode != "none":
            summary[f"{mode}_ratio"] = round(median / medians["none"], 4)
            # the same round's runs are closest in time: the median of their ratios
            paired = [r[mode] / r["none"] for r in rounds]
            summary[f"{mode}_paired_ratio_median"] = round(statistics.median(paired), 4)
    if shown:
        summary["idle_lag_median_s"] = round(statistics.median(shown), 3)
        summary["idle_lag_max_s"] = round(max(shown), 3)
        summary["disconnect_to_freed_median_s"] = round(statistics.median(freed), 3)
        summary["disconnect_to_freed_max_s"] = round(max(freed), 3)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
