"""Host-side choices shared by the attention launchers: the dtype of the dot products and
the Triton type of a torch dtype."""

from __future__ import annotations

import os

import torch
import triton.language as tl

from pagedllm.kv_storage.kv_quant import KVFormat

QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def dot_dtype(query_dtype: torch.dtype, fmt: KVFormat) -> torch.dtype:
    """The operand dtype of the attention's dot products (accumulation is always float32).

    8-bit codes are exact in every query dtype, so they meet the query in its own dtype;
    so does a float cache of the query's dtype. A float cache of another dtype (e.g. a
    float16 cache under a bfloat16 model) would lose bits in either direction, so both
    sides go to float32. Triton's interpreter multiplies bfloat16 operands as their raw
    bits, so under it bfloat16 products run in float32 (a GPU rounds the probabilities to
    bfloat16 before the second product; the interpreter does not).
    """
    if query_dtype not in QUERY_DTYPES:
        raise ValueError(f"query dtype must be one of {QUERY_DTYPES}, got {query_dtype}")
    if query_dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return torch.float32
    if fmt.quantized or fmt.dtype == query_dtype:
        return query_dtype
    return torch.float32


def triton_dtype(dtype: torch.dtype) -> tl.dtype:
    return _TRITON_DTYPES[dtype]


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: exact float32 products (no TF32) for float32."""
    return "ieee" if dtype == torch.float32 else "tf32"
