"""The attention backend over a paged :class:`~pagedllm.kv.kv_cache.KVCache` on CPU."""

from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import reference_paged_attention
from pagedllm.cpu import paged_attention
from pagedllm.cpu.extension import kernels_built
from pagedllm.kv.kv_cache import KVCache
from pagedllm.kv.kv_quant import decode_rows


class PagedAttentionBackend:
    """Stores each layer's new K/V in the cache, then attends through the block tables.

    The engine calls :meth:`forward` once per layer with the same metadata; the int32 /
    int64 contiguous tensors the kernels need are made once per step and reused by
    every layer. Head dims the fast kernel does not take (not a multiple of 16, or above
    256) run through the slow reference instead. Over a cache in another format than the
    model's dtype (float16, int8, fp8, or bfloat16 under a float32 model) the kernel
    decodes K/V itself and takes a float32 query. The C++ kernels are built (or loaded
    from the extension cache) here, so a first step never pays for a compile.
    """

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.uses_fast_kernel = (
            kv_cache.head_dim % 16 == 0 and kv_cache.head_dim <= 256 and kernels_built()
        )
        self._source: tuple[torch.Tensor | None, ...] = (None,) * 4
        self._prepared: tuple[torch.Tensor, ...] = ()

    def kernel_metadata(self, metadata: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        """Kernel-ready metadata, converted once per step. A step's tensors are not
        modified in place between its layers."""
        source = (
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
        )
        if any(a is not b for a, b in zip(source, self._source, strict=True)):
            slot_mapping, block_tables, seq_lens, query_start_loc = source
            self._prepared = (
                slot_mapping.to(torch.int64).contiguous(),
                block_tables.to(torch.int32).contiguous(),
                seq_lens.to(torch.int32).contiguous(),
                query_start_loc.to(torch.int32).contiguous(),
            )
            self._source = source
        return self._prepared

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
        slot_mapping, block_tables, seq_lens, query_start_loc = self.kernel_metadata(metadata)
        self.kv_cache.write(layer_idx, k, v, slot_mapping)
        keys, values = self.kv_cache.key(layer_idx), self.kv_cache.value(layer_idx)
        if not self.uses_fast_kernel:
            fmt = self.kv_cache.format
            return reference_paged_attention(
                q, decode_rows(keys, fmt), decode_rows(values, fmt), metadata,
                options.scale, options.sliding_window, options.logit_softcap,
            )  # fmt: skip
        # The kernel takes a float32 query, or a bfloat16 one over a bfloat16 cache.
        same_bf16 = q.dtype == keys.dtype == torch.bfloat16
        query = q if q.dtype == torch.float32 or same_bf16 else q.float()
        query = query.contiguous()
        out = torch.empty_like(query)
        paged_attention(
            out, query, keys, values, block_tables, seq_lens, query_start_loc, options.scale,
            options.sliding_window or 0, options.logit_softcap or 0.0,
        )  # fmt: skip
        return out.to(q.dtype)
