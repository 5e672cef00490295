"""The host tier and the tiered cache's moves, over a real pool and cache tensor."""

from __future__ import annotations

import time

import pytest
import torch

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv.prefix_hash import BlockKey
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_tiers.disk_tier import DiskTier
from pagedllm.kv_tiers.host_tier import HostTier
from pagedllm.kv_tiers.tier_moves import MoveKind
from pagedllm.kv_tiers.tiered_cache import TieredCache

BLOCK_SIZE = 4


def key(n: int, salt: str = "") -> BlockKey:
    return BlockKey(None, tuple(range(n, n + BLOCK_SIZE)), ("model", salt) if salt else ("model",))


def digest(n: int) -> bytes:
    return key(n).digest


def host_tier(num_slots: int) -> HostTier:
    return HostTier(num_slots, (2, 2, 1, BLOCK_SIZE, 8), torch.float32)


def test_host_tier_evicts_least_recently_used_unpinned():
    host = host_tier(2)
    assert host.reserve(digest(0)) == (0, None)
    assert host.reserve(digest(1)) == (1, None)
    host.find(digest(0))  # 1 is now the least recently used
    assert host.reserve(digest(2)) == (1, digest(1))
    host.pin([0])
    assert host.reserve(digest(3)) == (1, digest(2))  # 0 pinned
    host.pin([1])
    assert host.reserve(digest(4)) is None
    assert digest(0) in host and digest(2) not in host


def test_host_tier_loading_slots_are_neither_found_nor_evicted():
    host = host_tier(1)
    slot, _ = host.reserve(digest(0), loading=True)
    assert digest(0) in host and host.find(digest(0)) is None and host.is_loading(digest(0))
    assert host.reserve(digest(1)) is None
    host.loaded(digest(0), ok=True)
    assert host.find(digest(0)) == slot
    slot, victim = host.reserve(digest(1), loading=True)
    assert victim == digest(0)
    host.loaded(digest(1), ok=False)
    assert digest(1) not in host and host.reserve(digest(2)) == (slot, None)


class Setup:
    """A pool of 3 blocks, a cache tensor of random K/V, a 2-slot host tier listening."""

    def __init__(self, host_slots: int = 2) -> None:
        self.pool = BlockPool(3, BLOCK_SIZE, reserved_fraction=0.0)
        self.cache = KVCache(2, 3, BLOCK_SIZE, 1, 8)
        self.cache.tensor.copy_(torch.randn_like(self.cache.tensor))
        self.tiers = TieredCache(self.cache.tensor, BLOCK_SIZE, host_tier(host_slots))
        self.pool.add_listener(self.tiers)

    def cache_block(self, n: int) -> int:
        """A block holding key(n), cached and freed (evictable)."""
        (block_id,) = self.pool.allocate(1)
        self.pool.cache_block(block_id, key(n))
        self.pool.free([block_id])
        return block_id

    def block(self, block_id: int) -> torch.Tensor:
        return self.cache.tensor[:, :, block_id].clone()


def test_evicted_blocks_spill_and_fill_back_bit_for_bit():
    s = Setup()
    ids = [s.cache_block(n) for n in (0, 10, 20)]
    saved = {n: s.block(b) for n, b in zip((0, 10, 20), ids, strict=True)}
    taken = s.pool.allocate(2)  # evicts the two least recently freed: keys 0 and 10
    moves = s.tiers.take_moves()
    assert [(m.kind, m.block_id) for m in moves] == [(MoveKind.SPILL, b) for b in taken]
    s.tiers.apply(moves)
    for b in taken:  # the pool's blocks are then overwritten by new K/V
        s.cache.tensor[:, :, b] = 0.0
    run = s.tiers.host_run([key(0), key(10), key(20)])
    assert [k for _, k in run] == [key(0), key(10)]  # key 20 is still in the pool
    s.tiers.fill(run, taken)
    s.tiers.apply(s.tiers.take_moves())
    assert torch.equal(s.block(taken[0]), saved[0])
    assert torch.equal(s.block(taken[1]), saved[10])
    stats = s.tiers.stats()
    assert (stats.spilled_blocks, stats.host_hits, stats.disk_hits) == (2, 2, 0)


def test_a_salted_block_is_not_found_under_another_salt():
    s = Setup()
    (block_id,) = s.pool.allocate(1)
    s.pool.cache_block(block_id, key(0, salt="tenant-a"))
    s.pool.free([block_id])
    s.pool.allocate(3)
    s.tiers.apply(s.tiers.take_moves())
    assert s.tiers.host_run([key(0, salt="tenant-b")]) == []
    assert s.tiers.host_run([key(0)]) == []
    assert len(s.tiers.host_run([key(0, salt="tenant-a")])) == 1


def test_a_fill_planned_before_a_spill_reads_its_slot_first():
    """One plan fills from the only slot, then evicts a block whose spill reuses that
    slot: in planned order the fill reads the old bytes."""
    s = Setup(host_slots=1)
    saved = s.block(s.cache_block(0))
    s.pool.free(s.pool.allocate(3))  # evicts key 0 into the slot; all free, uncached
    s.tiers.apply(s.tiers.take_moves())
    s.cache.tensor.zero_()
    (block_id,) = s.pool.allocate(1)
    s.pool.cache_block(block_id, key(30))
    s.pool.free([block_id])  # evictable, behind the two uncached free blocks
    run = s.tiers.host_run([key(0)])
    (target,) = s.pool.allocate(1)
    s.tiers.fill(run, [target])
    s.pool.allocate(2)  # evicts key 30; its spill takes the slot the fill reads
    moves = s.tiers.take_moves()
    assert [m.kind for m in moves] == [MoveKind.FILL, MoveKind.SPILL]
    s.tiers.apply(moves)
    assert torch.equal(s.block(target), saved)


def test_pinned_slots_are_not_spilled_into():
    s = Setup(host_slots=1)
    s.cache_block(0)
    s.pool.free(s.pool.allocate(3))  # key 0 in the slot
    s.tiers.apply(s.tiers.take_moves())
    (block_id,) = s.pool.allocate(1)
    s.pool.cache_block(block_id, key(30))
    s.pool.free([block_id])
    run = s.tiers.host_run([key(0)])
    s.pool.allocate(3)  # evicts key 30: the only slot is pinned, so it is dropped
    assert s.tiers.take_moves() == []
    s.tiers.unpin(run)
    assert s.tiers.host_run([key(0)]) == run


@pytest.mark.parametrize("slots", [0, -1])
def test_a_host_tier_needs_a_slot(slots):
    with pytest.raises(ValueError, match="at least one slot"):
        host_tier(slots)


class DiskSetup(Setup):
    """:class:`Setup` over a disk tier in ``directory``."""

    def __init__(self, directory, host_slots: int = 1, wait_limit: float = 30.0) -> None:
        super().__init__(host_slots)
        self.pool.remove_listener(self.tiers)
        host = host_tier(host_slots)
        fingerprint = bytes(range(32))
        self.disk = DiskTier(directory, 1 << 20, host.block_bytes, fingerprint)
        self.tiers = TieredCache(self.cache.tensor, BLOCK_SIZE, host, self.disk, wait_limit)
        self.pool.add_listener(self.tiers)

    def evict_all(self) -> None:
        """Allocate the whole pool (evicting every cached block), apply, free."""
        taken = self.pool.allocate(self.pool.num_free)
        self.tiers.apply(self.tiers.take_moves())
        self.pool.free(taken)

    def wait_loads_without_admitting(self) -> None:
        deadline = time.monotonic() + 30
        while self.tiers.host.num_loading:
            assert time.monotonic() < deadline
            self.tiers.wait_for_loads(0.01)
            self.tiers.poll()

    def wait_loads(self, request) -> None:
        deadline = time.monotonic() + 30
        while not self.tiers.admissible(request):
            assert time.monotonic() < deadline
            time.sleep(0.001)


def test_host_evictions_demote_to_disk_and_prefetch_brings_them_back(tmp_path):
    s = DiskSetup(tmp_path / "tier")
    saved = {n: s.block(s.cache_block(n)) for n in (0, 10)}
    s.evict_all()  # keys 0 and 10 spill through the one host slot: 0 is demoted
    assert digest(0) in s.disk and digest(10) not in s.disk
    s.cache.tensor.zero_()
    s.tiers.prefetch("request", [key(0), key(10)], in_pool=lambda k: False)
    s.wait_loads("request")  # loading key 0 first writes key 10 (the slot's) to disk
    assert digest(10) in s.disk
    run = s.tiers.host_run([key(0), key(10)])
    assert len(run) == 1  # one slot: key 0 came back, key 10 went down
    (target,) = s.pool.allocate(1)
    s.tiers.fill(run, [target])
    s.tiers.apply(s.tiers.take_moves())
    assert torch.equal(s.block(target), saved[0])
    stats = s.tiers.stats()
    assert (stats.disk_hits, stats.host_hits, stats.loaded_blocks) == (1, 0, 1)
    assert stats.prefetch_lead_s >= 0 and stats.prefetch_wait_s > 0
    s.tiers.close()


def test_a_corrupted_entry_is_never_filled(tmp_path):
    s = DiskSetup(tmp_path / "tier")
    s.cache_block(0)
    s.cache_block(10)
    s.evict_all()  # key 0 on disk
    for extent in (tmp_path / "tier").glob("*.extent"):
        data = bytearray(extent.read_bytes())
        data[128 + 200] ^= 0xFF  # inside the first slot's payload (after its header)
        extent.write_bytes(bytes(data))
    s.tiers.prefetch("request", [key(0)], in_pool=lambda k: False)
    s.wait_loads("request")
    assert s.tiers.host_run([key(0)]) == []
    assert s.tiers.stats().failed_loads == 1 and digest(0) not in s.disk
    s.tiers.close()


def test_persisted_blocks_are_found_after_a_restart(tmp_path):
    s = DiskSetup(tmp_path / "tier")
    saved = {n: s.block(s.cache_block(n)) for n in (0, 10)}
    cached = [(key(n).digest, s.pool.lookup(key(n))) for n in (0, 10)]
    assert s.tiers.persist(cached) == 2
    s.tiers.close()
    again = DiskSetup(tmp_path / "tier")
    again.tiers.prefetch("request", [key(0)], in_pool=lambda k: False)
    again.wait_loads("request")
    run = again.tiers.host_run([key(0)])
    (target,) = again.pool.allocate(1)
    again.tiers.fill(run, [target])
    again.tiers.apply(again.tiers.take_moves())
    assert torch.equal(again.block(target), saved[0])
    again.tiers.close()


def test_a_request_waits_for_its_loads_at_most_the_wait_limit(tmp_path):
    s = DiskSetup(tmp_path / "tier", wait_limit=0.0)
    s.cache_block(0)
    s.cache_block(10)
    s.evict_all()
    s.tiers.prefetch("request", [key(0)], in_pool=lambda k: False)
    assert s.tiers.admissible("request")  # the limit passed: admitted with what arrived
    s.tiers.close()


def test_a_prefix_cache_reset_empties_every_tier(tmp_path):
    s = DiskSetup(tmp_path / "tier")
    s.cache_block(0)
    s.cache_block(10)
    s.evict_all()  # key 0 on disk, key 10 in the host slot
    assert s.pool.reset_prefix_cache()
    assert s.tiers.host_run([key(10)]) == [] and len(s.disk) == 0
    s.tiers.prefetch("request", [key(0)], in_pool=lambda k: False)
    assert s.tiers.admissible("request")  # nothing left to load
    s.tiers.close()


def test_blocks_a_queued_request_waits_for_are_held_from_eviction(tmp_path):
    s = DiskSetup(tmp_path / "tier", host_slots=2)
    for n in (0, 10, 20):
        s.cache_block(n)
    s.evict_all()  # key 0 demoted to disk; keys 10 and 20 in the host slots
    s.tiers.prefetch("request", [key(0)], in_pool=lambda k: False)
    s.wait_loads_without_admitting()
    s.pool.free(s.pool.allocate(3))  # no cached block: nothing evicted
    (block_id,) = s.pool.allocate(1)
    s.pool.cache_block(block_id, key(30))
    s.pool.free([block_id])
    s.pool.allocate(3)  # evicts key 30: its spill must not take key 0's held slot
    s.tiers.apply(s.tiers.take_moves())
    assert s.tiers.admissible("request")
    assert [k for _, k in s.tiers.host_run([key(0)])] == [key(0)]
    s.tiers.close()
