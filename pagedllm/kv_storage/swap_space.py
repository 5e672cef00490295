"""The second KV tier: blocks of preempted sequences parked outside the KV pool.

Two partitions, one per kind of pool block. Full-size blocks are laid out block-major,
``[num_blocks, num_layers, 2, num_kv_heads, block_size, row]``, and compact blocks
(``kv_cache_dtype="int4"``) likewise, ``[num_compact_blocks, num_layers, num_kv_heads,
tile_bytes]``, so that one parked block (every layer's K and V) is one contiguous run
of bytes: in host memory, or in a memory-mapped file when a path is given (the full
partition first, then the compact one), so that spill can go beyond RAM. For a pool on
a GPU the host memory is pinned and every copy is asynchronous, queued on the current
stream: a block freed in the pool by a swap-out is reused only by kernels queued after
the copy, and a parked block read by a swap-in is overwritten only by copies queued
after it. Its blocks are bookkept by a plain :class:`~pagedllm.kv.block_pool.BlockPool`
(no reserve, never cached) with the pool's id layout: full ids ``0 .. num_blocks - 1``,
compact ids from ``num_blocks + 1`` on (:attr:`BlockPool.compact_offset`).

A block keeps its kind and its bytes: a compact block parks in the compact partition
and comes back into a compact pool block bit for bit (never decoded), a full block parks
full. The one change of kind is the re-encoding by age a sequence's reservation would
have made anyway: a parked full block that has fallen behind the recent window of the
returning sequence may come back into a compact pool block, encoded from its parked
bytes exactly as :meth:`~pagedllm.kv_storage.kv_cache.KVCache.encode_blocks` encodes
a pool block. Under tensor parallelism each rank parks the tiles of its own heads under
the same ids.

The engine sizes the two partitions in the proportion of the pool's own bytes
(:func:`~pagedllm.kv.capacity.swap_split`): a byte budget that parks the pool's mix of
recent full-size and older compact blocks.

One object holds both the bookkeeping (the pool) and the data (the tensors), and
each has its own caller at its own time: the scheduler parks a preempted sequence's
blocks (:meth:`park` allocates swap blocks) and unparks them when it comes back
(:meth:`unpark`), touching no tensor; the plan carries the ``(src, dst)`` pairs that
the step's executor hands to :meth:`copy_out` and :meth:`copy_in` before the forward
pass, touching no bookkeeping. A plan never both parks
and unparks, so a swap block freed by an unpark is not overwritten before it is read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedllm.kv.block_pool import BlockPool, OutOfBlocksError
from pagedllm.kv_storage.kv_cache import KVCache

Pairs = list[tuple[int, int]]

# (source compact, destination compact): the kinds of a copy's two blocks
_FULL = (False, False)
_COMPACT = (True, True)
_ENCODED = (False, True)  # a parked full block re-encoded into a compact pool block


@dataclass(frozen=True)
class SwapStats:
    """Counters since start-up: blocks, sequences and bytes moved each way (a compact
    block counts its own bytes; a full block re-encoded on its way in, the parked full
    bytes read). ``num_blocks``/``used_blocks`` are full-size blocks,
    ``num_compact_blocks``/``compact_used`` compact ones; ``compact_swapped_out``:
    compact blocks parked, ``compact_swapped_in``: compact pool blocks swap-ins filled
    (copied, or re-encoded from a parked full block). ``read_ahead_blocks``: parked
    full blocks copied back ahead of their sequence's resume, beside a step's forward
    pass (:meth:`SwapSpace.start_read_ahead`); ``read_ahead_wait_seconds``: how long
    steps waited for such copies to end (0 when each ended within its step).
    ``copy_out_seconds``/``copy_in_seconds``: time steps spent in swap-outs and
    swap-ins, before their forward passes (on a GPU, the time to queue the copies)."""

    num_blocks: int
    used_blocks: int
    swap_outs: int
    swap_ins: int
    bytes_swapped_out: int
    bytes_swapped_in: int
    num_compact_blocks: int = 0
    compact_used: int = 0
    compact_swapped_out: int = 0
    compact_swapped_in: int = 0
    read_ahead_blocks: int = 0
    read_ahead_wait_seconds: float = 0.0
    copy_out_seconds: float = 0.0
    copy_in_seconds: float = 0.0


class SwapSpace:
    """``num_blocks`` blocks shaped like the full-size blocks of ``cache`` and
    ``num_compact_blocks`` shaped like its compact ones (none without them)."""

    def __init__(
        self,
        cache: KVCache,
        num_blocks: int,
        path: str | Path | None = None,
        num_compact_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"a swap space needs at least one block, got {num_blocks}")
        if num_compact_blocks and cache.compact is None:
            raise ValueError("compact swap blocks need a cache with compact blocks")
        self.cache = cache
        layers, kv, _, heads, block_size, row = cache.tensor.shape
        full_shape = (num_blocks, layers, kv, heads, block_size, row)
        tile_bytes = 0 if cache.compact is None else cache.compact.layout.tile_bytes
        compact_shape = (num_compact_blocks, layers, heads, tile_bytes)
        self._on_gpu = cache.tensor.device.type == "cuda"
        self.tensor, self.compact = self._allocate(full_shape, compact_shape, path)
        self.pool = BlockPool(num_blocks, cache.block_size, 0.0, num_compact_blocks)
        self._block_bytes = math.prod(full_shape[1:]) * cache.tensor.element_size()
        self._compact_block_bytes = math.prod(compact_shape[1:])
        self._swap_outs = 0
        self._swap_ins = 0
        self._bytes_out = 0
        self._bytes_in = 0
        self._compact_out = 0
        self._compact_in = 0
        self._read_ahead_blocks = 0
        self._read_ahead_wait = 0.0
        self._copy_out_seconds = 0.0
        self._copy_in_seconds = 0.0
        self._copier: ThreadPoolExecutor | None = None
        self._read_ahead: Future | None = None

    def _allocate(
        self, full_shape: tuple[int, ...], compact_shape: tuple[int, ...], path: str | Path | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The two partitions: pinned host memory for a GPU pool, plain host memory, or
        one file mapped as the full partition's bytes followed by the compact one's."""
        dtype = self.cache.dtype
        if path is None:
            full = torch.empty(full_shape, dtype=dtype, pin_memory=self._on_gpu)
            compact = torch.empty(compact_shape, dtype=torch.uint8, pin_memory=self._on_gpu)
            return full, compact
        full_bytes = math.prod(full_shape) * dtype.itemsize
        size = full_bytes + math.prod(compact_shape)
        flat = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        full = flat[:full_bytes].view(dtype).view(full_shape)
        return full, flat[full_bytes:].view(compact_shape)

    def is_compact(self, swap_id: int) -> bool:
        return self.pool.is_compact(swap_id)

    def can_hold(self, num_blocks: int, num_compact: int = 0) -> bool:
        """Whether ``num_blocks`` full-size and ``num_compact`` compact blocks fit now."""
        return self.pool.can_allocate(num_blocks) and num_compact <= self.pool.num_compact_free

    def park(self, num_blocks: int, num_compact: int = 0) -> list[int]:
        """Swap blocks for one preempted sequence's ``num_compact`` compact and then
        ``num_blocks`` full-size pool blocks, in that order (a table's compact entries
        come first). All or nothing: raises :class:`OutOfBlocksError` when they do not
        fit (:meth:`can_hold`)."""
        if not self.can_hold(num_blocks, num_compact):
            raise OutOfBlocksError(num_blocks + num_compact, self.pool.num_free)
        self._swap_outs += 1
        return self.pool.allocate_compact(num_compact) + self.pool.allocate(num_blocks)

    def unpark(self, swap_ids: list[int]) -> None:
        """Free a returning sequence's swap blocks (their copy-in is in the same plan)."""
        self._swap_ins += 1
        self.pool.free(swap_ids)

    def copy_out(self, pairs: Pairs) -> None:
        """Copy pool block ``src`` into swap block ``dst`` for every ``(src, dst)`` pair,
        both of one kind."""
        start = time.perf_counter()
        groups = _by_kind(pairs, self._pool_compact, self.is_compact)
        if groups.keys() - {_FULL, _COMPACT}:
            raise ValueError(f"a block parks in a swap block of its own kind: {pairs}")
        if _FULL in groups:
            src, dst = _split(groups[_FULL])
            if self._on_gpu:
                self._park_rows(self.tensor, dst, _gather(self.cache.tensor, 2, src))
            else:
                _copy_blocks(_bytes_of(self.cache.tensor), 2, _bytes_of(self.tensor), 0, src, dst)
        if _COMPACT in groups:
            src, dst = _split(groups[_COMPACT])
            src, dst = self._compact_ids(src), self._swap_rows(dst)
            if self._on_gpu:
                self._park_rows(self.compact, dst, _gather(self.cache.compact.tensor, 1, src))
            else:
                pool = _bytes_of(self.cache.compact.tensor)
                _copy_blocks(pool, 1, _bytes_of(self.compact), 0, src, dst)
        self._bytes_out += self._bytes(groups)
        self._compact_out += len(groups.get(_COMPACT, []))
        self._copy_out_seconds += time.perf_counter() - start

    def copy_in(self, pairs: Pairs) -> None:
        """Copy swap block ``src`` into pool block ``dst`` for every ``(src, dst)`` pair:
        compact into compact and full into full, byte for byte, or full into compact,
        re-encoded from the parked bytes. A compact block never comes back full."""
        start = time.perf_counter()
        groups = _by_kind(pairs, self.is_compact, self._pool_compact)
        if groups.keys() - {_FULL, _COMPACT, _ENCODED}:
            raise ValueError(f"a compact swap block comes back compact: {pairs}")
        device = self.cache.tensor.device
        if _FULL in groups:
            self._copy_in_full(groups[_FULL])
        if _ENCODED in groups:
            src, dst = _split(groups[_ENCODED])
            self.cache.encode_full(self._load_rows(self.tensor, src, device).movedim(0, 2), dst)
        if _COMPACT in groups:
            src, dst = _split(groups[_COMPACT])
            src, dst = self._swap_rows(src), self._compact_ids(dst)
            if self._on_gpu:
                tiles = self._load_rows(self.compact, src, device)
                _scatter(self.cache.compact.tensor, 1, dst, tiles)
            else:
                pool = _bytes_of(self.cache.compact.tensor)
                _copy_blocks(_bytes_of(self.compact), 0, pool, 1, src, dst)
        self._bytes_in += self._bytes(groups)
        self._compact_in += len(groups.get(_COMPACT, [])) + len(groups.get(_ENCODED, []))
        self._copy_in_seconds += time.perf_counter() - start

    def _copy_in_full(self, pairs: Pairs) -> None:
        """Full swap blocks into full pool blocks, byte for byte."""
        src, dst = _split(pairs)
        if self._on_gpu:
            rows = self._load_rows(self.tensor, src, self.cache.tensor.device)
            _scatter(self.cache.tensor, 2, dst, rows)
        else:
            _copy_blocks(_bytes_of(self.tensor), 0, _bytes_of(self.cache.tensor), 2, src, dst)

    # -- read-ahead: parked blocks copied back beside a step -------------------------------

    def start_read_ahead(self, pairs: Pairs) -> None:
        """Start copying full swap block ``src`` into pool block ``dst`` for every pair,
        beside the step about to run: the pool blocks are free and cached under their
        content (:meth:`~pagedllm.kv.block_manager.BlockManager.restore_cached`), so no
        sequence of this step reads or writes them. On the CPU the copy runs on a
        thread of its own (byte copies that release the GIL, one core's worth); on a GPU
        it is queued on the current stream like a swap-in. The next step's moves
        (:meth:`finish_read_ahead`) wait for it before anything touches the pool."""
        self.finish_read_ahead()
        if not pairs:
            return
        if any(self.is_compact(src) or self._pool_compact(dst) for src, dst in pairs):
            raise ValueError(f"only full blocks are read ahead: {pairs}")
        self._read_ahead_blocks += len(pairs)
        if self._on_gpu:
            self._copy_in_full(pairs)
            return
        if self._copier is None:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="swap-read-ahead")
        self._read_ahead = self._copier.submit(self._copy_in_full, pairs)

    def finish_read_ahead(self) -> None:
        """Wait for the read-ahead copy started last, if it is still running (its time
        counts as ``read_ahead_wait_seconds``); raises what the copy raised."""
        future, self._read_ahead = self._read_ahead, None
        if future is None:
            return
        running, start = not future.done(), time.perf_counter()
        try:
            future.result()
        finally:
            if running:
                self._read_ahead_wait += time.perf_counter() - start

    def _bytes(self, groups: dict[tuple[bool, bool], Pairs]) -> int:
        """Bytes a copy moves between the tiers: each pair's parked block."""
        compact = len(groups.get(_COMPACT, []))
        full = sum(len(group) for kind, group in groups.items() if kind != _COMPACT)
        return full * self._block_bytes + compact * self._compact_block_bytes

    def _pool_compact(self, block_id: int) -> bool:
        return block_id >= self.cache.compact_offset

    def _compact_ids(self, block_ids: list[int]) -> list[int]:
        """Pool compact ids as rows of the cache's compact tensor."""
        return [block_id - self.cache.compact_offset for block_id in block_ids]

    def _swap_rows(self, swap_ids: list[int]) -> list[int]:
        """Compact swap ids as rows of the compact partition."""
        return [swap_id - self.pool.compact_offset for swap_id in swap_ids]

    def _park_rows(self, swap: torch.Tensor, rows: list[int], blocks: torch.Tensor) -> None:
        """Store block-major ``blocks`` (on the GPU) in rows ``rows`` of the pinned
        partition ``swap``, asynchronously."""
        blocks = blocks.contiguous()
        for i, row in enumerate(rows):
            swap[row].copy_(blocks[i], non_blocking=True)

    def _load_rows(self, swap: torch.Tensor, rows: list[int], device: torch.device) -> torch.Tensor:
        """Rows ``rows`` of the partition ``swap``, block-major, on ``device``."""
        if not self._on_gpu:
            return swap.index_select(0, torch.tensor(rows, dtype=torch.int64))
        blocks = torch.empty((len(rows), *swap.shape[1:]), dtype=swap.dtype, device=device)
        for i, row in enumerate(rows):
            blocks[i].copy_(swap[row], non_blocking=True)
        return blocks

    def free(self, swap_ids: list[int]) -> None:
        """Drop parked blocks without copying them back (the sequence was aborted)."""
        self.pool.free(swap_ids)

    def stats(self) -> SwapStats:
        return SwapStats(
            num_blocks=self.pool.num_blocks,
            used_blocks=self.pool.num_used,
            swap_outs=self._swap_outs,
            swap_ins=self._swap_ins,
            bytes_swapped_out=self._bytes_out,
            bytes_swapped_in=self._bytes_in,
            num_compact_blocks=self.pool.num_compact_blocks,
            compact_used=self.pool.num_compact_used,
            compact_swapped_out=self._compact_out,
            compact_swapped_in=self._compact_in,
            read_ahead_blocks=self._read_ahead_blocks,
            read_ahead_wait_seconds=self._read_ahead_wait,
            copy_out_seconds=self._copy_out_seconds,
            copy_in_seconds=self._copy_in_seconds,
        )


def _by_kind(
    pairs: Pairs, src_compact: Callable[[int], bool], dst_compact: Callable[[int], bool]
) -> dict[tuple[bool, bool], Pairs]:
    """``pairs`` grouped by the kinds of their blocks, ``(src compact, dst compact)``."""
    groups: dict[tuple[bool, bool], Pairs] = {}
    for src, dst in pairs:
        groups.setdefault((src_compact(src), dst_compact(dst)), []).append((src, dst))
    return groups


def _split(pairs: Pairs) -> tuple[list[int], list[int]]:
    """``(src, dst)`` pairs as the list of sources and the list of destinations."""
    src, dst = zip(*pairs, strict=True)
    return list(src), list(dst)


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The bytes of a CPU tensor as a numpy array sharing its memory (its last axis in
    bytes)."""
    return tensor.view(torch.uint8).numpy()


def _copy_blocks(
    src: np.ndarray,
    src_axis: int,
    dst: np.ndarray,
    dst_axis: int,
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    """Copy block ``src_ids[i]`` of ``src`` (its block axis ``src_axis``) into block
    ``dst_ids[i]`` of ``dst``, one block at a time: numpy's strided byte copies run on
    the calling thread without the GIL, and need no gathered copy of the blocks."""
    src_lead = (slice(None),) * src_axis
    dst_lead = (slice(None),) * dst_axis
    for src_id, dst_id in zip(src_ids, dst_ids, strict=True):
        dst[(*dst_lead, dst_id)] = src[(*src_lead, src_id)]


def _gather(pool: torch.Tensor, axis: int, block_ids: list[int]) -> torch.Tensor:
    """Blocks ``block_ids`` of a pool tensor whose block axis is ``axis``, block-major."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    return pool.index_select(axis, index).movedim(axis, 0)


def _scatter(pool: torch.Tensor, axis: int, block_ids: list[int], blocks: torch.Tensor) -> None:
    """Write block-major ``blocks`` into blocks ``block_ids`` of a pool tensor whose
    block axis is ``axis``."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=pool.device)
    pool.index_copy_(axis, index, blocks.movedim(0, axis))
