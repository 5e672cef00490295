"""int8 activations for weights kept in Q8_0, Q4_0 or Q4_1 blocks (opt-in: llama.cpp's
arithmetic).

By default a quantized weight multiplies the activations as they are, and the product
equals the dequantized model's up to float32 rounding. With
``activation_quantization="int8"`` the activations meeting such a weight are rounded to
int8 per block of 32 values (scale: the block's largest magnitude / 127), as llama.cpp
rounds them for its Q8_0 and Q4 products, and the products run on the CPU's int8 quad
products (AVX-512 VNNI, 64 multiply-adds per instruction against the 32 of the bfloat16
pair products): batches of rows multiply faster, and results differ from the exact ones
by the activations' rounding (``quant_x16_int8.cpp`` states the arithmetic). The weights
are those of the bfloat16 kernels (:class:`~pagedllm.models.interleaved_weight.InterleavedWeight`,
the same bytes), so switching costs no memory.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter

import torch

from pagedllm.cpu.extension import quant_x16_supports
from pagedllm.models.errors import ModelLoadError
from pagedllm.models.interleaved_weight import InterleavedWeight
from pagedllm.models.quantized_weight import Q, QuantizedWeight

logger = logging.getLogger("pagedllm")


def quantize_activations(model: torch.nn.Module) -> int:
    """Switch every interleaved weight of ``model`` whose block format has int8 kernels on
    this CPU to int8 activations (a tied embedding and LM head stay one object); returns
    how many matrices switched and logs which quantized ones did not. Raises
    :class:`ModelLoadError` when none can."""
    if model.dtype != torch.bfloat16:
        raise ModelLoadError(
            f"activation_quantization='int8' runs bfloat16 models, not {model.dtype}"
        )
    if not quant_x16_supports(int(Q.Q8_0), int8_activations=True):
        raise ModelLoadError(
            "activation_quantization='int8' needs a CPU with AVX-512 VNNI and bfloat16 "
            "(and the C++ kernels built)"
        )
    switched: dict[int, InterleavedWeight] = {}
    exact: dict[int, str] = {}  # id -> block format of the weights left exact
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, InterleavedWeight) and quant_x16_supports(
                int(value.ggml_type), int8_activations=True
            ):
                if id(value) not in switched:
                    switched[id(value)] = dataclasses.replace(value, int8_activations=True)
                setattr(module, name, switched[id(value)])
            elif isinstance(value, InterleavedWeight | QuantizedWeight):
                exact[id(value)] = value.ggml_type.name
    if not switched:
        raise ModelLoadError(
            "activation_quantization='int8' multiplies weights kept in Q8_0, Q4_0 or Q4_1 "
            "blocks; this model "
            + (f"keeps {', '.join(sorted(set(exact.values())))} blocks" if exact else "has none")
        )
    kept = ", ".join(f"{n} {name}" for name, n in sorted(Counter(exact.values()).items()))
    logger.info(
        "int8 activations for %d quantized matrices%s",
        len(switched),
        f"; exact products for {kept}" if kept else "",
    )
    return len(switched)
