"""Which of a model's matrix products are batch invariant: a row's result is the same
whatever other rows share the call.

Speculative decoding promises greedy output token for token the output without it, and
keeps the promise only where every product the target runs is batch invariant: its
verification pass multiplies a sequence's k + 1 rows in one call where plain decoding
multiplied one. Batch invariant: the packed float32 and bfloat16 kernels and the kernels
over GGUF blocks, interleaved by 16 rows or row by row, with float32 or bfloat16
activations (each kernel's register path and panels add a row's products in one order).
Not: torch's own products (``F.linear``, also on a GPU, and a mixture of experts' expert
products), oneDNN's, and GGUF blocks kept beside an expanded copy (the copy multiplies
the calls of many rows). There a row's logits can move by float32 rounding with the
batch, enough to flip a near tie between two tokens now and then.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.models.block_expansion import ExpandedBlocks
from pagedllm.models.interleaved_weight import InterleavedWeight
from pagedllm.models.linear import OneDNNWeight, PackedWeight, Weight
from pagedllm.models.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from pagedllm.models.decoder import CausalDecoder


def variant_products(model: CausalDecoder) -> list[str]:
    """Each kind of ``model``'s matrix products whose rows' results may depend on the
    other rows in the call, named once, in the order the model first runs them; empty
    when every product is batch invariant."""
    kinds: dict[str, None] = {}
    for layer in model.layers:
        for weight in layer.matrices():
            kinds.update(dict.fromkeys(_variant_kind(weight)))
        if layer.moe is not None:
            kinds["torch's products for the experts of a mixture of experts"] = None
    kinds.update(dict.fromkeys(_variant_kind(model.lm_head)))
    return list(kinds)


def _variant_kind(weight: Weight) -> list[str]:
    if isinstance(weight, ExpandedBlocks):
        return ["GGUF blocks with an expanded copy for calls of many rows"]
    if isinstance(weight, PackedWeight | InterleavedWeight | QuantizedWeight):
        return []
    if isinstance(weight, OneDNNWeight):
        return ["oneDNN's products"]
    return [f"torch's products on {weight.device.type}"]
