"""The attention backend over a paged :class:`~pagedllm.kv_storage.kv_cache.KVCache` on CUDA,
with Triton kernels (:mod:`pagedllm.gpu`)."""

from __future__ import annotations

import os

import torch

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.gpu.compact_tiles import CompactOperands
from pagedllm.gpu.kernel_dtypes import QUERY_DTYPES
from pagedllm.gpu.triton_decode import decode_attention
from pagedllm.gpu.triton_kv_write import write_kv
from pagedllm.gpu.triton_prefill import prefill_attention
from pagedllm.kv_storage.int4_codec import hadamard
from pagedllm.kv_storage.kv_cache import KVCache


class TritonAttentionBackend:
    """Stores each layer's new K/V in the cache (converted or quantized to its format,
    by :func:`~pagedllm.gpu.triton_kv_write.write_kv`: the one K/V write on CUDA; the
    cache only holds the memory), then attends through the block tables: a decode-only
    batch with the split-K decode kernel, any other batch (prefills, chunks, decodes
    mixed) with the prefill kernel.

    The decode path makes no host synchronisation and sizes every launch from tensor
    shapes and ``metadata.max_seq_len``, so it can be captured in a CUDA graph (replays
    must keep ``max_seq_len`` at the captured bound). Metadata tensors must be on the
    cache's device: ``slot_mapping`` int64, the others int32. The cache lives on a CUDA
    device, or on the CPU under Triton's interpreter. ``head_dim`` must be a power of
    two from 16 to 256.

    Over a cache with compact blocks (``kv_cache_dtype="int4"``) the kernels read both
    kinds through the same tables, compact keys against the query rotated like them
    (:mod:`pagedllm.gpu.compact_tiles`), one block per tile.
    """

    def __init__(self, kv_cache: KVCache) -> None:
        head_dim = kv_cache.head_dim
        if head_dim < 16 or head_dim > 256 or head_dim & (head_dim - 1):
            raise ValueError(
                f"the Triton kernels take head_dim 16..256, a power of two: {head_dim}"
            )
        device = kv_cache.tensor.device
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the Triton backend needs a CUDA cache, got one on {device}")
        self.kv_cache = kv_cache
        # H of order head_dim on the cache's device (float32), made once
        self._hadamard = None if kv_cache.compact is None else hadamard(head_dim).to(device)

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor:
        """See :class:`~pagedllm.attention.backend.AttentionBackend`; ``k``, ``v`` are
        stored in the cache's format, the output has ``q``'s dtype."""
        cache = self.kv_cache
        num_tokens, num_q_heads, head_dim = q.shape
        if head_dim != cache.head_dim or num_q_heads % cache.num_kv_heads:
            raise ValueError(
                f"q {tuple(q.shape)} does not fit the cache's {cache.num_kv_heads} kv heads "
                f"of head_dim {cache.head_dim}"
            )
        if k.shape != (num_tokens, cache.num_kv_heads, head_dim) or v.shape != k.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must match q's tokens")
        if q.dtype not in QUERY_DTYPES:
            raise ValueError(f"query dtype must be one of {QUERY_DTYPES}, got {q.dtype}")
        if metadata.num_tokens != num_tokens:
            raise ValueError(f"slot_mapping has {metadata.num_tokens} rows, q {num_tokens}")
        keys, values = cache.stored_key(layer_idx), cache.stored_value(layer_idx)
        if cache.key_rotation is not None:  # keys stored rotated, queries rotated alike
            k = k.float() @ cache.key_rotation
        write_kv(k.contiguous(), v.contiguous(), keys, values, metadata.slot_mapping, cache.format)
        out_dtype = q.dtype
        q = q.contiguous()
        compact = None
        if cache.compact is not None:
            # float32, contiguous like q: the kernels read it with q's strides
            rotated = q.float() @ self._hadamard
            compact = CompactOperands(cache.compact.tiles(layer_idx), cache.compact_offset, rotated)
        if cache.key_rotation is not None:
            q = compact.rotated_q if compact is not None else q.float() @ cache.key_rotation
        if metadata.is_decode_only:
            if num_tokens != metadata.num_seqs:
                raise ValueError("a decode-only batch has one query row per sequence")
            out = decode_attention(
                q, keys, values, metadata.block_tables, metadata.seq_lens,
                metadata.max_seq_len, options.scale, cache.format,
                sliding_window=options.sliding_window, logit_softcap=options.logit_softcap,
                compact=compact,
            )  # fmt: skip
            return out.to(out_dtype)
        out = prefill_attention(
            q, keys, values, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, metadata.max_query_len, options.scale, cache.format,
            sliding_window=options.sliding_window, logit_softcap=options.logit_softcap,
            compact=compact,
        )  # fmt: skip
        return out.to(out_dtype)
