"""The prefix cache below the pool: evicted cached blocks kept in host memory and on
disk, found again by their content keys, loaded back ahead of need.

Flow of one block (its SHA-256 content digest names it in every tier; the digest
chains every token before the block and the request's extra keys, so a tenant's
``cache_salt`` separates its blocks in every tier as in the pool):

1. The pool evicts a cached block to reuse it: :meth:`TieredCache.block_removed` (a pool
   listener) plans a *spill* into a host slot; the slot's least recently used block, if
   any, is *demoted* to disk first (when there is a disk tier and it lacks the block).
2. A request arrives: :meth:`TieredCache.prefetch` walks its prompt's block keys past
   what the pool and the host tier hold and starts loading the blocks the disk tier has,
   on a background reader, into host slots, while the request waits in the queue.
3. The request is admitted: :meth:`TieredCache.host_run` finds the ready host blocks
   that continue the pool's hit, and :meth:`TieredCache.fill` plans their copies into
   the pool blocks allocated for them; those tokens count as computed.
4. At shutdown :meth:`TieredCache.persist` writes the pool's cached blocks and the host
   tier's to disk, so a restarted engine with the same model and settings finds them.

Policy for a request whose prefix is on disk: it waits for its loads (other requests
are admitted past it) until they end or ``wait_limit`` seconds pass, then takes what
has arrived and computes the rest. Loads start only when the tier reads faster than the
model prefills: both rates are measured as the engine runs (:meth:`note_prefill`,
the reader's own timings), and loading is assumed faster until both are known.

The bookkeeping runs on the scheduler's thread; :meth:`apply` (the executor) and the
reader thread move bytes. The plan's moves run in planned order (:mod:`tier_moves`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagedllm.kv.block_events import PoolListener
from pagedllm.kv.prefix_hash import BlockKey
from pagedllm.kv_tiers.host_tier import HostTier
from pagedllm.kv_tiers.tier_moves import MoveKind, TierMove

if TYPE_CHECKING:
    from pagedllm.kv_tiers.disk_tier import DiskTier


@dataclass(frozen=True)
class TierStats:
    """Counters since start-up. Blocks restored into the pool by the tier they came
    from (``host_hits``: spilled and found in host memory; ``disk_hits``: loaded from
    disk first); bytes moved each way; prefetch timing: ``prefetch_lead_s`` sums, over
    loaded blocks a fill used (``disk_hits`` of them), how long they were ready before
    it, ``prefetch_wait_s`` how long the ``requests_waited`` requests that asked for
    loads waited for them before admission."""

    host_slots: int
    host_blocks: int
    host_loading: int
    disk_entries: int
    disk_capacity_entries: int
    host_hits: int
    disk_hits: int
    spilled_blocks: int
    demoted_blocks: int
    loaded_blocks: int
    failed_loads: int
    bytes_spilled: int
    bytes_filled: int
    bytes_demoted: int
    bytes_loaded: int
    prefetch_lead_s: float
    prefetch_wait_s: float
    requests_waited: int
    disk_read_bytes_per_s: float | None
    prefill_tokens_per_s: float | None


class TieredCache(PoolListener):
    """A host tier of ``host`` slots (and a ``disk`` tier, optional) under the pool
    ``cache`` of ``block_size``-token blocks; :meth:`close` stops the reader."""

    def __init__(
        self,
        cache_tensor: torch.Tensor,
        block_size: int,
        host: HostTier,
        disk: DiskTier | None = None,
        wait_limit: float = 1.0,
    ) -> None:
        self.cache_tensor = cache_tensor
        self.block_size = block_size
        self.host = host
        self.disk = disk
        self.wait_limit = wait_limit
        self._moves: list[TierMove] = []
        self._planned = 0  # moves planned since start-up
        # request -> (since, [(digest, host slot, whether loaded for it)])
        self._waiting: dict[object, tuple[float, list[tuple[bytes, int, bool]]]] = {}
        self._num_held_loads = 0  # slots loaded for queued requests and held for them
        self._loaded_at: dict[bytes, float] = {}
        self._dropped: set[bytes] = set()  # loads in flight when the cache was reset
        self._reader = None if disk is None else _DiskReader(disk, host)
        self._counts = dict.fromkeys(
            ("host_hits", "disk_hits", "spilled", "demoted", "filled", "loaded", "failed"), 0
        )
        self._lead = 0.0
        self._wait = 0.0
        self._num_waited = 0
        self._read_seconds = 0.0
        self._read_bytes = 0
        self._prefill_tokens = 0
        self._prefill_seconds = 0.0

    # -- the pool's listener (its other callbacks: the protocol's, doing nothing) -------

    def cache_cleared(self, block_ids: Sequence[int]) -> None:
        """The prefix cache was reset: every tier forgets its blocks too (loads in
        flight are dropped when they end)."""
        self.poll()
        self._waiting.clear()
        self._num_held_loads = 0
        self.host.clear()
        self._loaded_at.clear()
        self._dropped.update(self.host.loading_digests())
        if self.disk is not None:
            self.disk.clear()

    def block_removed(self, block_id: int, key: BlockKey) -> None:
        """Plan the evicted ``block_id``'s spill into a host slot (nothing when the host
        tier has it already or every slot is taken by a fill or a load)."""
        digest = key.digest
        if digest in self.host:
            return
        reserved = self.host.reserve(digest)
        if reserved is None:
            return
        slot, victim = reserved
        if victim is not None:
            self._demote(slot, victim)
        self._plan(TierMove(MoveKind.SPILL, slot, block_id, digest))
        self._counts["spilled"] += 1

    def _demote(self, slot: int, digest: bytes) -> None:
        self._loaded_at.pop(digest, None)
        if self.disk is not None and digest not in self.disk:
            self._plan(TierMove(MoveKind.DEMOTE, slot, -1, digest))
            self._counts["demoted"] += 1

    def _plan(self, move: TierMove) -> None:
        self._moves.append(move)
        self._planned += 1

    # -- requests ---------------------------------------------------------------------

    def prefetch(
        self, request: object, keys: Iterable[BlockKey], in_pool: Callable[[BlockKey], bool]
    ) -> None:
        """Start loading the disk blocks of ``keys`` (a prompt's block keys in order,
        read no further than needed) that continue what the pool (``in_pool(key)``) and
        the host tier hold; the request then waits for them (:meth:`admissible`), and
        the host slots it waits for are held from eviction until then. At most half the
        host tier (one slot at least) is loaded for queued requests: past that, a
        request's later blocks are not loaded, and it computes them."""
        if self._reader is None:
            return
        held = []
        for key in keys:
            digest = key.digest
            if in_pool(key):
                continue
            slot = self._host_slot(digest)
            loads = slot is None
            if loads:
                if digest not in self.disk or not self._loading_pays():
                    break
                if self._num_held_loads >= max(1, self.host.num_slots // 2):
                    break
                slot = self._load(digest)
                if slot is None:
                    break
                self._num_held_loads += 1
            self.host.hold(slot)
            held.append((digest, slot, loads))
        if held:
            self._waiting[request] = (time.perf_counter(), held)

    def _host_slot(self, digest: bytes) -> int | None:
        """The slot of ``digest``'s block in the host tier, ready or loading."""
        slot = self.host.find(digest)
        return self.host.loading_slot(digest) if slot is None else slot

    def _load(self, digest: bytes) -> int | None:
        """Reserve a host slot for ``digest`` and ask the reader for it (None: no slot)."""
        reserved = self.host.reserve(digest, loading=True)
        if reserved is None:
            return None
        slot, victim = reserved
        if victim is not None:
            self._loaded_at.pop(victim, None)
            if victim in self.disk:
                victim = None
            else:
                self._counts["demoted"] += 1
        self._reader.submit(digest, slot, victim, after=self._planned)
        return slot

    def admissible(self, request: object) -> bool:
        """Whether ``request`` may be admitted now: none of its loads is in flight, or
        it has waited ``wait_limit`` seconds. Admission forgets its wait and releases
        its holds (its fill pins what it takes)."""
        self.poll()
        entry = self._waiting.get(request)
        if entry is None:
            return True
        since, held = entry
        now = time.perf_counter()
        loading = any(self.host.is_loading(digest) for digest, _, _ in held)
        if loading and now - since < self.wait_limit:
            return False
        self.forget(request)
        self._wait += now - since
        self._num_waited += 1
        return True

    def forget(self, request: object) -> None:
        """``request`` no longer waits (admitted, or aborted): its holds end."""
        entry = self._waiting.pop(request, None)
        if entry is not None:
            for _, slot, loaded in entry[1]:
                self.host.release(slot)
                self._num_held_loads -= loaded

    def host_run(self, keys: Iterable[BlockKey]) -> list[tuple[int, BlockKey]]:
        """``(slot, key)`` of the ready host blocks of ``keys``, from the first on, as
        long as they are ready (``keys`` is read no further); their slots are pinned
        until :meth:`fill` or :meth:`unpin`."""
        self.poll()
        run = []
        for key in keys:
            slot = self.host.find(key.digest)
            if slot is None:
                break
            run.append((slot, key))
        self.host.pin([slot for slot, _ in run])
        return run

    def unpin(self, run: list[tuple[int, BlockKey]]) -> None:
        self.host.unpin([slot for slot, _ in run])

    def fill(self, run: list[tuple[int, BlockKey]], block_ids: Sequence[int]) -> None:
        """Plan copying the host blocks of ``run`` (from :meth:`host_run`) into the pool
        blocks ``block_ids``, and unpin them."""
        now = time.perf_counter()
        for (slot, key), block_id in zip(run, block_ids, strict=True):
            self._plan(TierMove(MoveKind.FILL, slot, block_id, key.digest))
            loaded_at = self._loaded_at.pop(key.digest, None)
            if loaded_at is None:
                self._counts["host_hits"] += 1
            else:
                self._counts["disk_hits"] += 1
                self._lead += now - loaded_at
        self._counts["filled"] += len(run)
        self.unpin(run)

    def take_moves(self) -> list[TierMove]:
        """The moves planned since the last call, in order (the plan's)."""
        moves, self._moves = self._moves, []
        return moves

    @property
    def loads_in_flight(self) -> bool:
        return self.host.num_loading > 0

    def wait_for_loads(self, timeout: float) -> None:
        """Block (holding no lock the reader needs) until a load ends or ``timeout``
        seconds pass: what an engine with nothing else to run does while its requests
        wait for their blocks, rather than spin against the reader."""
        if self._reader is not None:
            self._reader.wait(timeout)

    def poll(self) -> None:
        """Take the reader's finished loads: each block is ready, or its slot free."""
        if self._reader is None:
            return
        for digest, ok, seconds, nbytes in self._reader.finished():
            if digest in self._dropped:
                self._dropped.discard(digest)
                self.host.loaded(digest, ok=False)
                continue
            self.host.loaded(digest, ok)
            if ok:
                self._loaded_at[digest] = time.perf_counter()
                self._counts["loaded"] += 1
                self._read_seconds += seconds
                self._read_bytes += nbytes
            else:
                self._counts["failed"] += 1

    # -- the policy's inputs ----------------------------------------------------------

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        """A forward pass computed ``num_tokens`` tokens in ``seconds``."""
        self._prefill_tokens += num_tokens
        self._prefill_seconds += seconds

    def _rates(self) -> tuple[float | None, float | None]:
        read = self._read_bytes / self._read_seconds if self._read_seconds > 0 else None
        prefill = (
            self._prefill_tokens / self._prefill_seconds if self._prefill_seconds > 0 else None
        )
        return read, prefill

    def _loading_pays(self) -> bool:
        """Whether reading a block from disk is faster than computing its tokens
        (assumed until both rates are measured)."""
        read, prefill = self._rates()
        if read is None or prefill is None:
            return True
        return self.host.block_bytes / read < self.block_size / prefill

    # -- bytes (the executor) ---------------------------------------------------------

    def apply(self, moves: Sequence[TierMove]) -> None:
        """Run ``moves`` in order on the pool and the tiers' memory."""
        host = self.host
        for move in moves:
            if move.kind is MoveKind.SPILL:
                host.block(move.slot).copy_(self.cache_tensor[:, :, move.block_id])
            elif move.kind is MoveKind.FILL:
                self.cache_tensor[:, :, move.block_id].copy_(host.block(move.slot))
            else:
                self.disk.put(move.digest, _as_bytes(host.block(move.slot)))
        if self._reader is not None:
            self._reader.moves_applied(len(moves))

    def stats(self) -> TierStats:
        self.poll()
        read, prefill = self._rates()
        block_bytes = self.host.block_bytes
        counts = self._counts
        disk = None if self.disk is None else self.disk.stats()
        return TierStats(
            host_slots=self.host.num_slots,
            host_blocks=len(self.host),
            host_loading=self.host.num_loading,
            disk_entries=0 if disk is None else disk.entries,
            disk_capacity_entries=0 if disk is None else disk.capacity_entries,
            host_hits=counts["host_hits"],
            disk_hits=counts["disk_hits"],
            spilled_blocks=counts["spilled"],
            demoted_blocks=counts["demoted"],
            loaded_blocks=counts["loaded"],
            failed_loads=counts["failed"],
            bytes_spilled=counts["spilled"] * block_bytes,
            bytes_filled=counts["filled"] * block_bytes,
            bytes_demoted=counts["demoted"] * block_bytes,
            bytes_loaded=self._read_bytes,
            prefetch_lead_s=self._lead,
            prefetch_wait_s=self._wait,
            requests_waited=self._num_waited,
            disk_read_bytes_per_s=read,
            prefill_tokens_per_s=prefill,
        )

    # -- shutdown ---------------------------------------------------------------------

    def persist(self, cached_blocks: Sequence[tuple[bytes, int]]) -> int:
        """Write the host tier's ready blocks and the pool's ``cached_blocks``
        (``(digest, block_id)``) to disk, those it lacks; the blocks written."""
        if self.disk is None:
            return 0
        written = 0
        for digest, slot in self.host.ready_items():
            if digest not in self.disk:
                self.disk.put(digest, _as_bytes(self.host.block(slot)))
                written += 1
        staging = torch.empty_like(self.host.block(0), device="cpu")
        for digest, block_id in cached_blocks:
            if digest not in self.disk:
                staging.copy_(self.cache_tensor[:, :, block_id])
                self.disk.put(digest, _as_bytes(staging))
                written += 1
        return written

    def close(self) -> None:
        if self._reader is not None:
            self._reader.stop()
        if self.disk is not None:
            self.disk.close()


def _as_bytes(block: torch.Tensor) -> torch.Tensor:
    """A contiguous block's bytes as a flat uint8 view."""
    return block.reshape(-1).view(torch.uint8)


class _DiskReader:
    """One background thread loading disk entries into loading host slots, in the order
    asked. A load may reuse a slot whose ready block it evicted: it writes that block to
    disk first (when the disk lacks it), and starts only once the executor has run every
    move planned before the slot was reserved (a spill into the slot among them)."""

    def __init__(self, disk: DiskTier, host: HostTier) -> None:
        self._disk = disk
        self._host = host
        self._todo: queue.Queue[tuple[bytes, int, bytes | None, int] | None] = queue.Queue()
        self._done: queue.Queue[tuple[bytes, bool, float, int]] = queue.Queue()
        self._applied = 0  # moves the executor has run since start-up
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kv-disk-reader", daemon=True)
        self._thread.start()

    def submit(self, digest: bytes, slot: int, victim: bytes | None, after: int) -> None:
        """Load ``digest`` into ``slot`` once ``after`` moves ran, writing ``victim``
        (the slot's previous block) to disk first."""
        self._todo.put((digest, slot, victim, after))

    def moves_applied(self, count: int) -> None:
        with self._progress:
            self._applied += count
            self._progress.notify_all()

    def wait(self, timeout: float) -> None:
        """Block until a load has ended (kept for :meth:`finished`) or ``timeout``."""
        with contextlib.suppress(queue.Empty):
            self._done.put(self._done.get(timeout=timeout))

    def finished(self) -> list[tuple[bytes, bool, float, int]]:
        """``(digest, ok, seconds, bytes)`` of the loads ended since the last call."""
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            digest, slot, victim, after = item
            with self._progress:
                self._progress.wait_for(lambda after=after: self._applied >= after)
            block = _as_bytes(self._host.block(slot))
            if victim is not None:
                self._disk.put(victim, block)
            start = time.perf_counter()
            ok = self._disk.read_into(digest, block)
            seconds = time.perf_counter() - start
            self._done.put((digest, ok, seconds, block.numel() if ok else 0))

    def stop(self) -> None:
        self._todo.put(None)
        with self._progress:
            self._applied = 1 << 62  # nothing more will run: let a waiting load go
            self._progress.notify_all()
        self._thread.join()
