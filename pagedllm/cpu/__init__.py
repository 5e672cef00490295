"""C++ CPU kernels (paged attention, the K/V cache write, few-row matrix products): a
torch extension compiled on first use and cached."""

from pagedllm.cpu.extension import paged_attention, streaming_linear, write_kv

__all__ = ["paged_attention", "streaming_linear", "write_kv"]
