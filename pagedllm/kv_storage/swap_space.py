"""The second KV tier: blocks of preempted sequences parked outside the KV pool.

Laid out block-major, ``[num_blocks, num_layers, 2, num_kv_heads, block_size, row]``,
so that one parked block (every layer's K and V) is one contiguous run of bytes: in
host memory, or in a memory-mapped file when a path is given, so that spill can go
beyond RAM. For a pool on a GPU the host memory is pinned and every copy is
asynchronous, queued on the current stream: a block freed in the pool by a swap-out
is reused only by kernels queued after the copy, and a parked block read by a
swap-in is overwritten only by copies queued after it. Its blocks are bookkept by a
plain :class:`~pagedllm.kv.block_pool.BlockPool` (no reserve, never cached).

One object holds both the bookkeeping (the pool) and the data (the tensor), and
each has its own caller at its own time: the scheduler parks a preempted sequence's
blocks (:meth:`park` allocates swap blocks) and unparks them when it comes back
(:meth:`unpark`), touching no tensor; the plan carries the ``(src, dst)`` pairs that
the step's executor hands to :meth:`copy_out` and :meth:`copy_in` before the forward
pass, touching no bookkeeping. A plan never both parks
and unparks, so a swap block freed by an unpark is not overwritten before it is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm.kv.block_pool import BlockPool
from pagedllm.kv_storage.kv_cache import KVCache


@dataclass(frozen=True)
class SwapStats:
    """Counters since start-up: blocks, sequences and bytes moved each way."""

    num_blocks: int
    used_blocks: int
    swap_outs: int
    swap_ins: int
    bytes_swapped_out: int
    bytes_swapped_in: int


class SwapSpace:
    """``num_blocks`` blocks shaped like the blocks of ``cache``."""

    def __init__(self, cache: KVCache, num_blocks: int, path: str | Path | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"a swap space needs at least one block, got {num_blocks}")
        self.cache = cache
        layers, kv, _, heads, block_size, row = cache.tensor.shape
        shape = (num_blocks, layers, kv, heads, block_size, row)
        self._on_gpu = cache.tensor.device.type == "cuda"
        if path is None:
            self.tensor = torch.empty(shape, dtype=cache.dtype, pin_memory=self._on_gpu)
        else:
            numel = num_blocks * layers * kv * heads * block_size * row
            flat = torch.from_file(str(path), shared=True, size=numel, dtype=cache.dtype)
            self.tensor = flat.view(shape)
        self.pool = BlockPool(num_blocks, cache.block_size, reserved_fraction=0.0)
        self._block_bytes = cache.nbytes // max(cache.num_blocks, 1)
        self._swap_outs = 0
        self._swap_ins = 0
        self._bytes_out = 0
        self._bytes_in = 0

    def can_hold(self, num_blocks: int) -> bool:
        return self.pool.can_allocate(num_blocks)

    def park(self, num_blocks: int) -> list[int]:
        """Swap blocks for one preempted sequence's ``num_blocks`` pool blocks."""
        self._swap_outs += 1
        return self.pool.allocate(num_blocks)

    def unpark(self, swap_ids: list[int]) -> None:
        """Free a returning sequence's swap blocks (their copy-in is in the same plan)."""
        self._swap_ins += 1
        self.pool.free(swap_ids)

    def copy_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy pool block ``src`` into swap block ``dst`` for every ``(src, dst)`` pair."""
        if not pairs:
            return
        block_ids, swap_ids = (list(ids) for ids in zip(*pairs, strict=True))
        src = torch.tensor(block_ids, dtype=torch.int64, device=self.cache.tensor.device)
        blocks = self.cache.tensor.index_select(2, src).movedim(2, 0)
        if self._on_gpu:
            blocks = blocks.contiguous()
            for row, swap_id in enumerate(swap_ids):
                self.tensor[swap_id].copy_(blocks[row], non_blocking=True)
        else:
            self.tensor.index_copy_(0, torch.tensor(swap_ids, dtype=torch.int64), blocks)
        self._bytes_out += len(pairs) * self._block_bytes

    def copy_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy swap block ``src`` into pool block ``dst`` for every ``(src, dst)`` pair."""
        if not pairs:
            return
        swap_ids, block_ids = (list(ids) for ids in zip(*pairs, strict=True))
        device = self.cache.tensor.device
        if self._on_gpu:
            blocks = torch.empty(
                (len(swap_ids), *self.tensor.shape[1:]), dtype=self.tensor.dtype, device=device
            )
            for row, swap_id in enumerate(swap_ids):
                blocks[row].copy_(self.tensor[swap_id], non_blocking=True)
        else:
            blocks = self.tensor.index_select(0, torch.tensor(swap_ids, dtype=torch.int64))
        dst = torch.tensor(block_ids, dtype=torch.int64, device=device)
        self.cache.tensor.index_copy_(2, dst, blocks.movedim(0, 2))
        self._bytes_in += len(pairs) * self._block_bytes

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
        )
