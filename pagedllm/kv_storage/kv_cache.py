"""The physical K/V tensors of every layer, and their sizing from a memory budget
(the arithmetic: :mod:`pagedllm.kv.capacity`).

Layout: one tensor ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]``
(index 0 of the second axis is K, 1 is V). Within a block, each kv head's
``block_size x head_dim`` tile is contiguous, so the attention kernel, which works on
one (sequence, kv head) pair at a time, streams whole tiles. The token-major
alternative ``[num_blocks, block_size, num_kv_heads, head_dim]`` interleaves the heads;
with the same kernel it decoded as fast or up to 20-30% slower, never clearly faster
(``benchmarks/attention.py`` times both). A flat cache *slot* is
``block_id * block_size + offset``.

``kv_cache_dtype`` picks the element format (:mod:`pagedllm.kv_storage.kv_quant`): quantized
formats store a ``uint8`` tensor whose last axis is ``head_dim`` codes plus the row's
scale, so every byte copy of whole blocks (copy-on-write, swapping) carries the scales.

With ``kv_cache_dtype="int4"`` the cache also holds compact blocks
(:class:`~pagedllm.kv_storage.compact_blocks.CompactKVCache`, :attr:`KVCache.compact`):
block ids from :attr:`KVCache.compact_offset` on name them (the cache's own block count:
its last full-size block is the null block, one past the pool's, never written),
and :meth:`KVCache.encode_blocks` re-encodes full blocks into them.

With KV layer groups (:mod:`pagedllm.kv.layer_groups`, ``layer_slots``), the first axis
holds the groups' *slots*, not the layers: a block holds the K/V of one group's layers,
layer ``l`` at slot ``layer_slots[l]``, and each group's table names its own blocks.

The cache holds memory, its layout and its format, and never writes a token: new K/V
is written by the attention backend that reads it (docs/engine.md, "K/V storage and
its writes"), into the per-layer views :meth:`KVCache.stored_key` and
:meth:`KVCache.stored_value`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.cpu.allocator import zeroed_pool
from pagedllm.kv.capacity import block_bytes, pool_blocks
from pagedllm.kv_storage.compact_blocks import CompactKVCache, encode_tiles
from pagedllm.kv_storage.key_rotation import key_rotation
from pagedllm.kv_storage.kv_quant import KVCacheDtype, KVFormat, decode_rows, resolve_kv_format


def bytes_per_block(
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO,
) -> int:
    """Bytes one block takes across all layers, scales included
    (:func:`~pagedllm.kv.capacity.block_bytes` of this format's rows). ``dtype`` is the
    model's; ``kv_cache_dtype`` the cache format."""
    row_bytes = resolve_kv_format(kv_cache_dtype, dtype).row_bytes(head_dim)
    return block_bytes(num_layers, block_size, num_kv_heads, row_bytes)


class KVCache:
    """Preallocated K/V storage for ``num_blocks`` blocks of ``block_size`` tokens.

    Holds no bookkeeping: which blocks are free or shared is the block pool's business.
    ``dtype`` is the tensor's element type (``uint8`` for quantized formats), ``format``
    what the elements mean.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO,
        num_compact_blocks: int = 0,
        layer_slots: Sequence[int] | None = None,
    ) -> None:
        """``num_layers`` layers of K/V per block, or with ``layer_slots`` (each model
        layer's slot, :attr:`KVLayerGroups.layer_slot`) ``num_layers`` slots that the
        layers of each group share block by block."""
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if layer_slots is not None and (
            num_compact_blocks or not all(0 <= slot < num_layers for slot in layer_slots)
        ):
            raise ValueError(
                f"layer slots must lie in 0..{num_layers - 1}, without compact blocks, got "
                f"{layer_slots} and {num_compact_blocks} compact blocks"
            )
        self.layer_slots = tuple(range(num_layers) if layer_slots is None else layer_slots)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.format: KVFormat = resolve_kv_format(kv_cache_dtype, dtype)
        self.dtype = self.format.storage_dtype
        row = self.format.row_width(head_dim)
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, row)
        self.tensor = zeroed_pool(shape, self.dtype, torch.device(device))
        # Per-layer views made once: a view per layer per step costs a few microseconds.
        self._stored_keys = [self.tensor[slot, 0] for slot in self.layer_slots]
        self._stored_values = [self.tensor[slot, 1] for slot in self.layer_slots]
        self._keys = [t.view(self.format.dtype) for t in self._stored_keys]
        self._values = [t.view(self.format.dtype) for t in self._stored_values]
        # keys stored rotated (queries rotated alike), float32 on the cache's device
        self.key_rotation: torch.Tensor | None = None
        if self.format.rotates_keys:
            self.key_rotation = key_rotation(head_dim).to(self.tensor.device)
        self.compact_offset = num_blocks
        self.compact: CompactKVCache | None = None
        if num_compact_blocks:
            self.compact = CompactKVCache(
                num_layers, num_compact_blocks, block_size, num_kv_heads, head_dim, device
            )

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_cache_dtype: KVCacheDtype | str = KVCacheDtype.AUTO,
    ) -> KVCache:
        """The largest cache whose tensor fits in ``budget_bytes``."""
        per_block = bytes_per_block(
            num_layers, block_size, num_kv_heads, head_dim, dtype, kv_cache_dtype
        )
        num_blocks = pool_blocks(budget_bytes, per_block)
        return cls(
            num_layers,
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype,
            device,
            kv_cache_dtype,
        )

    @property
    def num_slots(self) -> int:
        """Token positions across all blocks."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of the full-size blocks and the compact ones."""
        compact = 0 if self.compact is None else self.compact.nbytes
        return self.tensor.numel() * self.tensor.element_size() + compact

    def key(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s K, a view ``[num_blocks, num_kv_heads, block_size, row]`` of
        ``format.dtype`` (``row`` is ``head_dim``, plus the scale's bytes if quantized)."""
        return self._keys[layer_idx]

    def value(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s V, shaped like :meth:`key`."""
        return self._values[layer_idx]

    def stored_key(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s K as allocated, ``storage_dtype`` (``uint8`` codes and
        scale bytes when quantized) ``[num_blocks, num_kv_heads, block_size, row]``: what
        the K/V writes and the Triton kernels take."""
        return self._stored_keys[layer_idx]

    def stored_value(self, layer_idx: int) -> torch.Tensor:
        """Layer ``layer_idx``'s V as allocated, shaped like :meth:`stored_key`."""
        return self._stored_values[layer_idx]

    def encode_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Re-encodes full block ``src`` into compact block ``dst`` (an id from
        :attr:`compact_offset` on) for every ``(src, dst)`` pair, every layer at once."""
        if not pairs:
            return
        src, dst = torch.tensor(pairs, dtype=torch.long, device=self.tensor.device).unbind(1)
        self._encode(self.tensor.index_select(2, src), dst)

    def encode_full(self, blocks: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Encodes full blocks given as stored, ``[num_layers, 2, n, num_kv_heads,
        block_size, row]`` on the cache's device (blocks parked in a swap space), into
        the compact blocks ``block_ids`` (ids from :attr:`compact_offset` on): the same
        bits :meth:`encode_blocks` gives the same bytes in a pool block."""
        dst = torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)
        self._encode(blocks, dst)

    def _encode(self, blocks: torch.Tensor, dst: torch.Tensor) -> None:
        """Stored full ``blocks`` ``[num_layers, 2, n, ...]`` into compact ids ``dst``."""
        fmt = self.format
        keys = decode_rows(blocks[:, 0].view(fmt.dtype), fmt)
        values = decode_rows(blocks[:, 1].view(fmt.dtype), fmt)
        tiles = encode_tiles(keys, values, keys_rotated=self.key_rotation is not None)
        self.compact.tensor.index_copy_(1, dst - self.compact_offset, tiles)

    def copy_blocks(self, pairs: Sequence[tuple[int, int]] | torch.Tensor) -> None:
        """Copies block ``src`` onto block ``dst`` for every ``(src, dst)`` pair, K and V of
        every layer in one indexed copy (copy-on-write). Destinations must be distinct
        and must not appear as sources."""
        pairs = torch.as_tensor(pairs, dtype=torch.long, device=self.tensor.device)
        if pairs.numel() == 0:
            return
        src, dst = pairs.reshape(-1, 2).unbind(1)
        self.tensor.index_copy_(2, dst, self.tensor.index_select(2, src))
