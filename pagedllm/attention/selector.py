"""Which attention backend runs over a KV cache: chosen by the cache's device."""

from __future__ import annotations

from pagedllm.attention.backend import AttentionBackend
from pagedllm.kv_storage.kv_cache import KVCache


def attention_backend_for(
    kv_cache: KVCache, sdpa_min_rows: int | None = None
) -> AttentionBackend:
    """The C++ paged backend for a CPU cache (chunks of ``sdpa_min_rows`` query rows or
    more through SDPA; ``None``: none), the Triton one for a CUDA cache."""
    device = kv_cache.tensor.device
    if device.type == "cpu":
        from pagedllm.attention.paged_backend import PagedAttentionBackend

        return PagedAttentionBackend(kv_cache, sdpa_min_rows)
    if device.type == "cuda":
        from pagedllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(kv_cache)
    raise ValueError(f"no attention backend for a KV cache on {device}")
