"""``pagedllm router`` (a router in front of replicas given by URL) and the router side
of ``pagedllm serve --data-parallel-size N`` (replicas started on this machine)."""

from __future__ import annotations

import argparse
import sys

from pagedllm.router.policy import DEFAULT_MAX_SHARE, RoutingPolicy


def add_routing_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--routing-policy",
        default=RoutingPolicy.PREFIX_AWARE.value,
        choices=[policy.value for policy in RoutingPolicy],
        help="where requests go: the replica holding most of the prompt's blocks, "
        "weighed against its load (default); the least loaded; or in turn",
    )
    parser.add_argument(
        "--max-share",
        type=float,
        default=DEFAULT_MAX_SHARE,
        help="the most requests in flight a replica may hold, as a multiple of the "
        "mean over healthy replicas (default 1.5)",
    )


def add_router_parser(subparsers: argparse._SubParsersAction) -> None:
    router = subparsers.add_parser(
        "router", help="an OpenAI-compatible router in front of pagedllm servers"
    )
    router.add_argument(
        "--replica", action="append", required=True, metavar="URL",
        help="a replica's base URL (repeat the option for each)",
    )  # fmt: skip
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument(
        "--api-key", default=None,
        help="required of clients as 'Authorization: Bearer KEY', and sent to the replicas",
    )  # fmt: skip
    add_routing_options(router)
    router.set_defaults(func=run_router)


def serve_router(urls: list[str], args: argparse.Namespace) -> int:
    """Run the router on ``args.host:args.port`` until interrupted."""
    import uvicorn

    from pagedllm.router.app import build_router_app
    from pagedllm.router.router import Router
    from pagedllm.server.middleware import Gate

    if not args.max_share >= 1.0:
        raise ValueError(f"--max-share must be >= 1, got {args.max_share}")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    router = Router(urls, RoutingPolicy(args.routing_policy), args.max_share, headers)
    app = build_router_app(router)
    app.add_middleware(Gate, api_key=args.api_key, is_draining=lambda: False)
    print(
        f"Routing on http://{args.host}:{args.port} to {len(urls)} replicas "
        f"({args.routing_policy})",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def run_router(args: argparse.Namespace) -> int:
    return serve_router(args.replica, args)


def run_data_parallel(args: argparse.Namespace) -> int:
    """``serve --data-parallel-size N``: start N local replicas with the same options,
    then route to them."""
    from pagedllm.router.local_replicas import LocalReplicas, replica_argv

    argv = args.argv
    at = argv.index("serve")
    with LocalReplicas(replica_argv(argv[at + 1 :]), args.data_parallel_size, argv[:at]) as local:
        return serve_router(local.urls, args)
