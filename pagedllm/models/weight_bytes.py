"""What a loaded model's weights hold in memory, by storage format (the start-up log's
figures)."""

from __future__ import annotations

from torch import nn

from pagedllm.models.block_expansion import ExpandedBlocks
from pagedllm.models.interleaved_weight import BlockWeight
from pagedllm.models.linear import expanded_storage


def weight_bytes_by_format(model: nn.Module) -> dict[str, int]:
    """Bytes of every tensor ``model.weights()`` returns, keyed by storage format: a GGUF
    block format's name (``"Q4_1"``) for a quantized matrix, ``"bfloat16 expanded copies"``
    for the expanded copies of block weights, else the dtype's name
    (``"float32"``); largest first."""
    values = [value for module in model.modules() for value in vars(module).values()]
    blocks = [v.blocks if isinstance(v, ExpandedBlocks) else v for v in values]
    formats = {
        id(value.blocks): value.ggml_type.name for value in blocks if isinstance(value, BlockWeight)
    }
    for value in values:
        if isinstance(value, ExpandedBlocks):
            (copy,) = expanded_storage(value)
            formats[id(copy)] = str(copy.dtype).removeprefix("torch.") + " expanded copies"
    totals: dict[str, int] = {}
    for tensor in model.weights():
        name = formats.get(id(tensor), str(tensor.dtype).removeprefix("torch."))
        totals[name] = totals.get(name, 0) + tensor.numel() * tensor.element_size()
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def describe_weight_bytes(model: nn.Module) -> str:
    """``"96.6 MB (Q4_1 66.4 MB, Q8_0 28.3 MB, float32 1.9 MB)"``: decimal megabytes."""
    totals = weight_bytes_by_format(model)
    parts = ", ".join(f"{name} {size / 1e6:.1f} MB" for name, size in totals.items())
    return f"{sum(totals.values()) / 1e6:.1f} MB ({parts})"
