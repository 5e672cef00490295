"""C++ CPU kernels (paged attention, the K/V cache write, packed matrix products,
RMSNorm / RoPE / SiLU·mul): a torch extension compiled on first use and cached."""

from pagedllm.cpu.extension import (
    packed_linear,
    paged_attention,
    paged_attention_compact,
    write_kv,
    write_kv_int8,
)

__all__ = [
    "packed_linear",
    "paged_attention",
    "paged_attention_compact",
    "write_kv",
    "write_kv_int8",
]
