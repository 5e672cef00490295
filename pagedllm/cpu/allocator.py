"""CPU memory: freed activation memory kept in the process, and regions in huge pages.

glibc serves an allocation above its mmap threshold (128 KiB at start, raised to at most
32 MiB as large blocks are freed) from freshly mapped pages, and gives the top of its
heap back whenever more than twice that threshold is free there. A forward pass over
1,024 tokens allocates and frees tens of MB of activations per layer, so without this
every step maps, faults in and zeroes about a gigabyte of new pages: 15-20 % of a
prefill step of the default model on this project's benchmark machine. With the mmap
threshold pinned at its maximum and trimming off, the freed activations are reused
from the heap. The cost: the heap keeps its high-water mark (the largest step's
activations, bounded by ``max_num_batched_tokens``), as with jemalloc or tcmalloc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch

from pagedllm.kv.capacity import cdiv

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest allowed value on 64-bit
TRIM_THRESHOLD_BYTES = 2**31 - 1  # mallopt takes an int: trim only above 2 GiB free


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, on Linux; None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    return None if name is None else ctypes.CDLL(name)


@functools.cache
def keep_freed_memory() -> bool:
    """Configure glibc's malloc as described above (once per process); whether it applied
    (False off Linux/glibc, where the platform allocator is left alone)."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def release_free_memory() -> bool:
    """Give the heap's free pages back to the OS now, wherever they lie in the heap
    (glibc's ``malloc_trim(0)``): for memory freed once for good, such as the tensors a
    loader built before the weights moved into their arena, which the settings above
    would otherwise keep. Whether anything was released."""
    libc = _libc()
    return libc is not None and hasattr(libc, "malloc_trim") and bool(libc.malloc_trim(0))


HUGE_PAGE = 2 << 20  # bytes


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed, committed tensor of ``shape`` for a pool read all over (the KV cache),
    on the CPU in a region advised for 2 MiB pages (:func:`huge_page_region`): decode
    reads one block of 16 rows per (block, head) from all over the pool, and in 4 KiB
    pages nearly every block missed the TLB (bfloat16 decode attention 1.09-1.16x faster
    in huge pages, float32 1.00-1.04x, on a 2-core Zen 4)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return huge_page_region(nbytes, commit=True)[:nbytes].view(dtype).view(shape)


def huge_page_region(nbytes: int, huge_pages: bool = True, commit: bool = False) -> torch.Tensor:
    """``nbytes`` (rounded up to whole 2 MiB pages) of zeroed uint8 in a private anonymous
    mapping, advised for transparent huge pages unless ``huge_pages`` is False (a kernel
    that ignores the advice gives plain pages). Scattered reads over a large region (the
    weights, the KV pool) then miss the TLB far less often.

    Pages are committed when first touched; with ``commit`` every page is touched here,
    so that the region's memory is taken now (a region that does not fit fails now, not
    midway through serving) and no later write pays for the page faults (a first touch
    of fresh memory measured 0.1-2 s per GiB on a virtual machine)."""
    size = max(HUGE_PAGE, cdiv(nbytes, HUGE_PAGE) * HUGE_PAGE)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    tensor = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    if commit:
        tensor.zero_()
    return tensor
