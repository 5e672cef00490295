"""A CPU model's weights moved into one arena, in the order a step reads them.

A decode step of a few sequences streams every weight from memory once. Left where the
loader made them (hundreds of separate allocations in 4 KiB pages), the matrix products
of the default model's step measured 1.03-1.3x slower (four runs, never faster) than
from one region of 2 MiB pages holding them in forward order
(``benchmarks/weight_arena.py``): fewer TLB misses, and the hardware prefetcher runs on
from one matrix into the next. The arena is a private anonymous mapping advised for
transparent huge pages (``madvise``; on a kernel that ignores the advice it is plain
memory, still contiguous).

Each tensor keeps its identity, dtype, shape and values: only its storage moves
(``Tensor.set_``), so every holder of it (a layer, a packed or quantized weight, a tied
embedding) sees the arena; a view's base (which would keep the old storage alive) moves
with it. Tensors are moved one by one and each original is freed as
soon as nothing else holds it, so loading peaks at about the weights' size plus one
tensor, not twice the weights.
"""

from __future__ import annotations

import torch

from pagedllm.cpu.allocator import huge_page_region
from pagedllm.kv.capacity import cdiv

ALIGNMENT = 64  # bytes: each tensor starts on a cache line


def _offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offset of each tensor in the arena and the arena's size."""
    offsets, end = [], 0
    for tensor in tensors:
        offsets.append(end)
        end += cdiv(tensor.numel() * tensor.element_size(), ALIGNMENT) * ALIGNMENT
    return offsets, end


@torch.no_grad()
def move_into_arena(
    tensors: list[torch.Tensor], huge_pages: bool = True
) -> torch.Tensor | None:
    """Move the contiguous CPU tensors of ``tensors`` (each once) into one arena, in the
    given order; the others (and weights in oneDNN's layout, whose bytes torch cannot
    reach) stay where they are. Returns the arena (None when nothing moved)."""
    movable = [
        t
        for t in tensors
        if t.device.type == "cpu" and not t.is_mkldnn and t.is_contiguous() and t.numel()
    ]
    movable = list({id(t): t for t in movable}.values())
    if not movable:
        return None
    offsets, nbytes = _offsets(movable)
    arena = huge_page_region(nbytes, huge_pages)
    for tensor, offset in zip(movable, offsets, strict=True):
        region = arena[offset : offset + tensor.numel() * tensor.element_size()]
        region.view(tensor.dtype).view(tensor.shape).copy_(tensor)
        base = tensor._base
        tensor.set_(region.view(tensor.dtype).view(tensor.shape))
        # A view keeps its base tensor, hence the old storage, alive: move the base too
        # when the view spans all of it (a reshaped or reinterpreted whole tensor).
        if base is not None and base.is_contiguous() and base.nbytes == region.nbytes:
            base.set_(region.view(base.dtype).view(base.shape))
    return arena
