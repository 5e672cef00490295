"""``pagedllm serve``: the OpenAI-compatible server on uvicorn.

SIGINT/SIGTERM start a graceful shutdown: the listening socket closes, requests that
arrive on open connections get 503, requests in flight may finish for
``--shutdown-timeout`` seconds, then the rest are aborted (a 503, or for a stream an
error event and ``[DONE]``) and the process exits 0. Uvicorn's own cut-off, which drops
connections without a word, comes ``SHUTDOWN_MARGIN_S`` later, as a backstop.

If the engine loop dies, ``/health`` and the generation routes answer 503 at once,
the same graceful shutdown starts, and the process exits with ``EXIT_ENGINE_DIED`` so
that a supervisor restarts it.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
from collections.abc import Iterator

from pagedllm.config import parse_bytes
from pagedllm.server.reply_size import DEFAULT_MAX_LOGPROB_ENTRIES
from pagedllm.server.response_store import DEFAULT_CAPACITY

SHUTDOWN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
SHUTDOWN_MARGIN_S = 5.0
"""Seconds between aborting the requests still in flight and uvicorn cancelling what
has not finished answering (the aborted requests' last bytes go out in between)."""
EXIT_ENGINE_DIED = 70
"""Exit status after the engine loop died (EX_SOFTWARE: an internal error)."""


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` with its HTTP options and the shared engine options."""
    from pagedllm.config_flags import add_config_flags
    from pagedllm.router.cli import add_join_options, add_routing_options

    serve = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: local)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    serve.add_argument(
        "--api-key-scope",
        default="v1",
        choices=["v1", "all"],
        help="what --api-key guards: the /v1/ routes (default), or every path but /health "
        "and the /dashboard page (/metrics, /dashboard/events, /kv_events, /docs and "
        "/openapi.json too)",
    )
    serve.add_argument(
        "--served-model-name", default=None, help="model name clients use (default: from path)"
    )
    serve.add_argument(
        "--max-body-size", default="1MiB", help="largest request body accepted, e.g. 1MiB"
    )
    serve.add_argument(
        "--max-pending-requests",
        type=int,
        default=1024,
        help="admitted, unfinished requests beyond which new ones get 503",
    )
    serve.add_argument(
        "--max-logprob-entries",
        type=int,
        default=DEFAULT_MAX_LOGPROB_ENTRIES,
        help="the most logprob entries one request may ask for (positions x (top logprobs + "
        "1) x samples, prompt and output); beyond it a 400",
    )
    serve.add_argument(
        "--max-stored-responses",
        type=int,
        default=DEFAULT_CAPACITY,
        help="responses kept for the Responses API's previous_response_id and GET (the least "
        "recently used dropped first)",
    )
    serve.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's line and headers, and again its "
        "body, before a 408 closes the connection",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may run after SIGINT/SIGTERM before being aborted",
    )
    serve.add_argument(
        "--trace-pool",
        default=None,
        metavar="PNG",
        help="record the KV block pool after every engine step and draw it to PNG at shutdown "
        "(costs 4 bytes per block per step)",
    )
    serve.add_argument(
        "--kv-cache-metrics",
        action="store_true",
        help="collect vLLM's sampled KV block lifetime histograms (lifetime, idle time before "
        "eviction, reuse gap) for /metrics",
    )
    serve.add_argument(
        "--kv-cache-metrics-sample",
        type=float,
        default=0.01,
        help="fraction of allocated blocks --kv-cache-metrics follows (default 0.01)",
    )
    serve.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="run this many replicas of the engine on this machine, each on its own CPUs, "
        "behind a router on --host/--port (docs/data_parallel.md)",
    )
    add_routing_options(serve)
    add_join_options(serve)
    add_config_flags(serve)
    serve.set_defaults(func=run_server)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from pagedllm.bench.pool_trace import PoolTracer, draw_trace
    from pagedllm.config_flags import config_from_flags
    from pagedllm.engine.frozen_gc import frozen_startup_objects
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.router.cli import join_router
    from pagedllm.server.app import ServerSettings, build_app, served_model_name
    from pagedllm.server.http_protocol import guarded_protocol

    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1:
        from pagedllm.router.cli import run_data_parallel

        return run_data_parallel(args)
    if args.max_logprob_entries < 0:
        raise ValueError(f"--max-logprob-entries must be >= 0, got {args.max_logprob_entries}")
    if args.max_stored_responses < 1:
        raise ValueError(f"--max-stored-responses must be >= 1, got {args.max_stored_responses}")
    if args.max_pending_requests < 1:
        raise ValueError(f"--max-pending-requests must be >= 1, got {args.max_pending_requests}")
    if not 0.0 < args.kv_cache_metrics_sample <= 1.0:
        raise ValueError(
            f"--kv-cache-metrics-sample must be in (0, 1], got {args.kv_cache_metrics_sample}"
        )
    timeouts = {"--read-timeout": args.read_timeout, "--shutdown-timeout": args.shutdown_timeout}
    for flag, value in timeouts.items():
        if not value >= 0:
            raise ValueError(f"{flag} must be >= 0 seconds, got {value}")
    settings = ServerSettings(
        model_name=args.served_model_name or served_model_name(args.model),
        api_key=args.api_key,
        max_body_bytes=parse_bytes(args.max_body_size),
        max_pending_requests=args.max_pending_requests,
        api_key_scope=args.api_key_scope,
        read_timeout_s=args.read_timeout,
        max_logprob_entries=args.max_logprob_entries,
        max_stored_responses=args.max_stored_responses,
        kv_cache_metrics_sample=args.kv_cache_metrics_sample if args.kv_cache_metrics else None,
    )
    engine = LLMEngine(config_from_flags(args))
    tracer = PoolTracer(engine).attach() if args.trace_pool else None
    app = build_app(engine, settings)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info" if args.verbose else "warning",
        http=guarded_protocol(args.read_timeout),
        timeout_graceful_shutdown=math.ceil(args.shutdown_timeout + SHUTDOWN_MARGIN_S),
    )
    lifecycle = app.state.lifecycle

    class DrainingServer(uvicorn.Server):
        """Marks the app draining as soon as a signal arrives and aborts what still
        runs ``--shutdown-timeout`` seconds later; exits 0 after a graceful shutdown
        (uvicorn would re-raise the signal and die by it)."""

        def handle_exit(self, sig, frame) -> None:
            if not lifecycle.draining:
                lifecycle.draining = True
                app.state.async_engine.stop_after(args.shutdown_timeout)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in SHUTDOWN_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    print(
        f"Serving {settings.model_name} on http://{args.host}:{args.port} "
        f"(max_model_len {engine.max_model_len})",
        file=sys.stderr,
        flush=True,
    )
    server = DrainingServer(config)

    def exit_after_engine_death() -> None:
        print("The engine loop died; shutting down", file=sys.stderr, flush=True)
        server.should_exit = True

    lifecycle.request_exit = exit_after_engine_death
    join_router(args)
    with frozen_startup_objects():
        server.run()
    if tracer is not None and tracer.trace.snapshots:
        draw_trace(tracer.trace, args.trace_pool, f"pagedllm serve, {settings.model_name}")
        print(f"Block-pool trace written to {args.trace_pool}", file=sys.stderr, flush=True)
    return EXIT_ENGINE_DIED if lifecycle.engine_failed else 0
