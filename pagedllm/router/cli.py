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
        "--rendezvous", default=None, metavar="HOST:PORT",
        help="host a torch.distributed TCPStore there, where replicas on other machines "
        "register (pagedllm serve --join-router HOST:PORT)",
    )  # fmt: skip
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
        "--replica", action="append", default=[], metavar="URL",
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


def add_join_options(serve: argparse.ArgumentParser) -> None:
    """``serve``'s options for a replica on another machine."""
    serve.add_argument(
        "--join-router", default=None, metavar="HOST:PORT",
        help="register this server with the router whose --rendezvous is HOST:PORT",
    )  # fmt: skip
    serve.add_argument(
        "--advertise-url", default=None, metavar="URL",
        help="the URL the router reaches this server at (default: http://HOST:PORT of "
        "--host and --port, with this machine's name for 0.0.0.0)",
    )  # fmt: skip


def serve_router(urls: list[str], args: argparse.Namespace) -> int:
    """Run the router on ``args.host:args.port`` until interrupted."""
    import uvicorn

    from pagedllm.router.app import build_router_app
    from pagedllm.router.router import Router
    from pagedllm.server.middleware import Gate

    if not args.max_share >= 1.0:
        raise ValueError(f"--max-share must be >= 1, got {args.max_share}")
    from pagedllm.router.rendezvous import RendezvousHost

    if not urls and args.rendezvous is None:
        raise ValueError("a router needs --replica URLs or a --rendezvous for replicas to join")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rendezvous = None if args.rendezvous is None else RendezvousHost(args.rendezvous)
    policy = RoutingPolicy(args.routing_policy)
    router = Router(urls, policy, args.max_share, headers, rendezvous)
    app = build_router_app(router)
    app.add_middleware(Gate, api_key=args.api_key, is_draining=lambda: False)
    print(
        f"Routing on http://{args.host}:{args.port} to {len(urls)} replicas "
        f"({args.routing_policy})"
        + (f"; replicas join at {args.rendezvous}" if args.rendezvous else ""),
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


def join_router(args: argparse.Namespace) -> None:
    """Register this server with its router (``serve --join-router``), if asked."""
    if args.join_router is None:
        return
    import socket

    from pagedllm.router.rendezvous import register_replica

    host = socket.gethostname() if args.host in ("0.0.0.0", "::") else args.host
    url = args.advertise_url or f"http://{host}:{args.port}"
    index = register_replica(args.join_router, url)
    print(f"Joined the router at {args.join_router} as {url} (#{index})", file=sys.stderr)
