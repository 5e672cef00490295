"""How replicas on other machines join a router: torch.distributed's ``TCPStore``.

The router hosts the store (``--rendezvous HOST:PORT``); a replica started with
``pagedllm serve --join-router HOST:PORT --advertise-url URL`` adds its URL under the
next index (``replicas/<i>``, the count in ``replicas/count``). The router reads new
entries every :data:`POLL_INTERVAL_S` and follows each URL as it follows the replicas
it was given (a replica registering a URL the router already knows, after a restart,
is simply that replica coming back). The store is the key-value rendezvous
torch.distributed uses to start process groups, the runtime the project already uses
for tensor parallelism; nothing here is a transport of its own: requests and block
events travel over the replicas' HTTP API.
"""

from __future__ import annotations

import datetime

from torch.distributed import TCPStore

POLL_INTERVAL_S = 1.0
COUNT_KEY = "replicas/count"
JOIN_TIMEOUT_S = 60.0


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` as a pair; raises ValueError otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


class RendezvousHost:
    """The router's end: the store, and the URLs registered since the last look."""

    def __init__(self, address: str) -> None:
        host, port = parse_address(address)
        self._store = TCPStore(
            host, port, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
        )  # fmt: skip
        self._seen = 0

    def new_urls(self) -> list[str]:
        """URLs registered since the last call (blocking: call it off the event loop)."""
        count = self._store.add(COUNT_KEY, 0)
        urls = [self._store.get(f"replicas/{i}").decode() for i in range(self._seen, count)]
        self._seen = count
        return urls


def register_replica(address: str, url: str) -> int:
    """Tell the router at ``address`` that a replica serves at ``url``; its index."""
    host, port = parse_address(address)
    store = TCPStore(
        host, port, is_master=False, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S)
    )
    # the URL first, then the count that makes it visible
    index = store.add("replicas/next", 1) - 1
    store.set(f"replicas/{index}", url)
    store.add(COUNT_KEY, 1)
    return index
