"""Fast CPU paged attention: a C++ extension compiled on first use and cached."""

from pagedllm.attention.cpu.extension import paged_attention, write_kv

__all__ = ["paged_attention", "write_kv"]
