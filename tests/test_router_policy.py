"""The routing policies against a fake set of replicas: turns, load, prefix hits, the
guard that bounds any replica's share, and the death spiral (a miss that keeps landing
on the same replica)."""

import pytest

from pagedllm.router.policy import (
    NoReplicaError,
    ReplicaView,
    RoutingPolicy,
    admissible,
    choose,
)
from pagedllm.router.prefix_index import PrefixIndex, prompt_block_hashes

PREFIX = RoutingPolicy.PREFIX_AWARE


def idle(count, **fields):
    return [ReplicaView(healthy=True, in_flight=0, pending_tokens=0, **fields)] * count


class FakeCluster:
    """Replicas whose in-flight counts and loads grow as requests are routed to them;
    ``cached[i]``: the prompts replica i holds (a hit covers the whole prompt)."""

    def __init__(self, count):
        self.in_flight = [0] * count
        self.pending = [0] * count
        self.cached = [set() for _ in range(count)]
        self.healthy = [True] * count
        self.last = -1

    def route(self, policy, prompt, prompt_tokens, output_tokens=100):
        views = [
            ReplicaView(
                healthy=self.healthy[i],
                in_flight=self.in_flight[i],
                pending_tokens=self.pending[i],
                hit_tokens=prompt_tokens if prompt in self.cached[i] else 0,
            )
            for i in range(len(self.in_flight))
        ]
        index = choose(policy, views, prompt_tokens, self.last)
        hit = views[index].hit_tokens
        self.in_flight[index] += 1
        self.pending[index] += prompt_tokens - hit + output_tokens
        self.cached[index].add(prompt)
        self.last = index
        return index


def test_round_robin_takes_turns_and_skips_unhealthy_replicas():
    cluster = FakeCluster(3)
    cluster.healthy[1] = False
    picks = [cluster.route(RoutingPolicy.ROUND_ROBIN, f"p{i}", 10) for i in range(4)]
    assert picks == [0, 2, 0, 2]


def test_least_load_picks_the_replica_with_the_fewest_pending_tokens():
    replicas = [
        ReplicaView(True, 2, 500),
        ReplicaView(True, 2, 120),
        ReplicaView(True, 2, 300),
    ]
    assert choose(RoutingPolicy.LEAST_LOAD, replicas, 10, last_choice=-1) == 1


def test_prefix_aware_follows_the_cache_unless_the_replica_is_busier_than_the_hit():
    views = [
        ReplicaView(True, 1, 400, hit_tokens=1000),
        ReplicaView(True, 1, 0),
    ]
    assert choose(PREFIX, views, 1100, last_choice=-1) == 0  # 100 + 400 < 1100 + 0
    views[0] = ReplicaView(True, 1, 1500, hit_tokens=1000)
    assert choose(PREFIX, views, 1100, last_choice=-1) == 1  # 100 + 1500 > 1100


def test_sixteen_tenants_stay_on_their_replicas():
    cluster = FakeCluster(4)
    homes = {}
    for _ in range(8):
        for tenant in range(16):
            index = cluster.route(PREFIX, f"system-{tenant}", 1000)
            homes.setdefault(tenant, set()).add(index)
        for i in range(4):  # the round finishes
            cluster.in_flight[i] = cluster.pending[i] = 0
    # after its first request a tenant returns to the replica that cached it
    assert all(len(replicas) == 1 for replicas in homes.values())
    assert sorted(len([t for t, r in homes.items() if i in r]) for i in range(4)) == [4] * 4


def test_one_shared_prompt_cannot_pile_onto_one_replica():
    """Every request hits replica 0's cache; the guard spreads them anyway."""
    cluster = FakeCluster(4)
    cluster.cached[0].add("shared")
    for _ in range(40):
        cluster.route(PREFIX, "shared", 1000)
    mean = sum(cluster.in_flight) / 4
    assert max(cluster.in_flight) <= 1.5 * mean + 1
    assert min(cluster.in_flight) > 0


def test_misses_do_not_spiral_onto_one_replica():
    """With nothing cached anywhere and equal loads, consecutive misses go round."""
    replicas = idle(4)
    picks, last = [], -1
    for _ in range(8):
        last = choose(PREFIX, replicas, 100, last)
        picks.append(last)
    assert picks == [0, 1, 2, 3, 0, 1, 2, 3]


def test_the_guard_allows_at_least_one_request_and_never_nothing():
    assert admissible(idle(3), 1.5) == [0, 1, 2]
    full = [ReplicaView(True, 9, 0), ReplicaView(True, 0, 0)]
    assert admissible(full, 1.5) == [1]
    with pytest.raises(NoReplicaError):
        admissible([ReplicaView(False, 0, 0)], 1.5)


def test_the_prefix_index_follows_block_events_and_matches_leading_blocks():
    hashes = prompt_block_hashes(list(range(50)), 16, ("model:bfloat16",))
    assert len(hashes) == 3  # 49 cacheable tokens: three full blocks
    assert hashes != prompt_block_hashes(list(range(50)), 16, ("other-model",))
    index = PrefixIndex()
    index.apply([{"type": "BlockStored", "block_hashes": hashes[:2]}])
    assert index.matched_blocks(hashes) == 2
    index.apply([{"type": "BlockRemoved", "block_hashes": [hashes[0]]}])
    assert index.matched_blocks(hashes) == 0  # a chain is only as good as its start
    index.apply([{"type": "AllBlocksCleared"}])
    assert len(index) == 0
    with pytest.raises(ValueError, match="unknown block event"):
        index.apply([{"type": "BlockMoved"}])


def test_a_routed_prompt_counts_as_held_until_its_events_come_or_it_lapses():
    now = [0.0]
    index = PrefixIndex(clock=lambda: now[0])
    hashes = prompt_block_hashes(list(range(40)), 16, ())
    index.expect(hashes)
    assert index.matched_blocks(hashes) == 2  # before the replica's events say so
    now[0] = 11.0
    assert index.matched_blocks(hashes) == 0  # the expectation lapsed
    index.expect(hashes)
    index.apply([{"type": "BlockStored", "block_hashes": hashes}])
    now[0] = 100.0
    assert index.matched_blocks(hashes) == 2  # confirmed: held until removed
