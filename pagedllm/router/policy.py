"""Where a request goes: the routing policies, as pure functions of what the router
knows about each replica when the request arrives.

Loads are in tokens: a replica's ``pending_tokens`` are the prompt tokens it still has
to compute plus the output tokens it may still generate (``max_tokens``) for the
requests routed to it and not finished, as the router counts them.

- ``round_robin``: the next healthy replica in turn.
- ``least_load``: the healthy replica with the least pending tokens.
- ``prefix_aware``: the healthy replica with the lowest cost, where cost = the prompt
  tokens it would compute (the prompt less what its prefix cache holds) + its pending
  tokens. A cache hit wins unless the replica is busier by more than the hit.

Every policy is bounded by a guard: a replica may hold at most ``max_share`` times the
mean number of requests in flight per healthy replica (counting this one; at least
one more than the mean rounds to), so that no routing, however many requests share one
prompt, can pile onto a single replica. Ties go to the replica after the last one
chosen, so a miss never keeps landing on the same replica.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_MAX_SHARE = 1.5


class RoutingPolicy(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    PREFIX_AWARE = "prefix_aware"


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router sees it for one request. ``hit_tokens``: prompt tokens
    its prefix cache holds for this request's prompt."""

    healthy: bool
    in_flight: int
    pending_tokens: int
    hit_tokens: int = 0


class NoReplicaError(RuntimeError):
    """No healthy replica can take the request."""


def admissible(replicas: Sequence[ReplicaView], max_share: float) -> list[int]:
    """Indices of the healthy replicas the guard lets take one more request."""
    healthy = [i for i, replica in enumerate(replicas) if replica.healthy]
    if not healthy:
        raise NoReplicaError("no healthy replica")
    in_flight = sum(replicas[i].in_flight for i in healthy) + 1
    cap = max(math.ceil(max_share * in_flight / len(healthy)), 1)
    allowed = [i for i in healthy if replicas[i].in_flight < cap]
    return allowed or healthy


def choose(
    policy: RoutingPolicy,
    replicas: Sequence[ReplicaView],
    prompt_tokens: int,
    last_choice: int,
    max_share: float = DEFAULT_MAX_SHARE,
) -> int:
    """The index of the replica a request of ``prompt_tokens`` goes to; ``last_choice``:
    the index chosen before (-1 at first), from which turns and ties rotate."""
    allowed = admissible(replicas, max_share)
    count = len(replicas)
    # the candidates in turn after the last choice: round robin takes the first,
    # the others break ties by it
    in_turn = sorted(allowed, key=lambda i: (i - last_choice - 1) % count)
    if policy is RoutingPolicy.ROUND_ROBIN:
        return in_turn[0]
    if policy is RoutingPolicy.LEAST_LOAD:
        return min(in_turn, key=lambda i: replicas[i].pending_tokens)

    def cost(i: int) -> int:
        replica = replicas[i]
        return prompt_tokens - replica.hit_tokens + replica.pending_tokens

    return min(in_turn, key=cost)
