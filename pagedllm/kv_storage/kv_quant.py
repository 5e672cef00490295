"""KV cache element formats: plain float storage, or 8-bit codes with a scale per row.

A *row* is one token's K (or V) for one KV head. Quantized formats (``int8``,
``fp8_e4m3``, ``fp8_e5m2``) store a row as ``head_dim`` one-byte codes followed by its
scale, a bfloat16 in ``SCALE_BYTES`` bytes, so a row is ``head_dim + 2`` bytes and the
scales live inside the blocks (copy-on-write, prefix caching and swapping move them with
the codes). The value of code ``c`` is ``decode(c) * scale`` where ``decode`` is the
integer for int8 (symmetric, -127..127) and torch's float8 conversion for fp8; the scale
is ``amax(|row|) / max_code`` rounded up to bfloat16, so the largest element of each row
maps to (about) the largest code and none clips.

Why per token: a block-wide scale would have to be fixed when the block's first token is
written (later tokens are unknown during decoding) or re-quantized as they arrive; a
per-row scale is final at write time and tracks outlier tokens, at 2 bytes per
``head_dim`` bytes (3 % at head_dim 64).

int8 stores keys rotated (``KVFormat.rotates_keys``): the rows hold ``k @ R``, and the
attention backends rotate queries alike (:mod:`pagedllm.kv_storage.key_rotation`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.choice import Choice, parse_choice

SCALE_BYTES = 2  # one bfloat16 scale per row


class KVCacheDtype(Choice):
    """``kv_cache_dtype`` values: the model's dtype, a 16-bit float, or 8 bits with a
    scale per token and KV head."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"
    INT4 = "int4"

    @property
    def by_age(self) -> bool:
        """Whether blocks change format with age: ``int4`` keeps recent tokens in the
        model's dtype and re-encodes older blocks into compact 4-bit ones
        (:mod:`pagedllm.kv_storage.compact_blocks`)."""
        return self is KVCacheDtype.INT4


@dataclass(frozen=True)
class KVFormat:
    """How K/V rows are stored.

    ``dtype`` is the element type the attention kernel sees (a view of the cache);
    ``storage_dtype`` the type the cache tensor is allocated with (``uint8`` for the
    quantized formats, so that any byte copy works on it); ``max_code`` the largest
    code magnitude (0 when not quantized); ``rotates_keys`` whether keys are stored
    rotated (:mod:`pagedllm.kv_storage.key_rotation`, queries rotated alike).
    """

    name: str
    dtype: torch.dtype
    max_code: float = 0.0
    rotates_keys: bool = False

    @property
    def quantized(self) -> bool:
        return self.max_code > 0

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    def row_width(self, head_dim: int) -> int:
        """Elements of ``storage_dtype`` in one row (codes and scale)."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def row_bytes(self, head_dim: int) -> int:
        return self.row_width(head_dim) * self.storage_dtype.itemsize


_QUANTIZED = {
    "int8": KVFormat("int8", torch.int8, 127.0, rotates_keys=True),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
}
_FLOATS = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_kv_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
    """The format of full-size blocks for a ``kv_cache_dtype`` option: ``"auto"`` and
    ``"int4"`` (whose recent blocks are full-size) are the model's dtype."""
    kv_cache_dtype = parse_choice(KVCacheDtype, kv_cache_dtype, "kv_cache_dtype")
    if kv_cache_dtype in (KVCacheDtype.AUTO, KVCacheDtype.INT4):
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype)
    if kv_cache_dtype in _QUANTIZED:
        return _QUANTIZED[kv_cache_dtype]
    return KVFormat(kv_cache_dtype.value, _FLOATS[kv_cache_dtype.value])


def encode_rows(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """``x`` ``[..., head_dim]`` (any float dtype) as cache rows ``[..., row_width]`` of
    ``fmt.storage_dtype``. Quantized rows round to nearest; an all-zero row gets the
    smallest scale and zero codes."""
    if not fmt.quantized:
        return x.to(fmt.dtype)
    x = x.float()
    exact = (x.abs().amax(dim=-1, keepdim=True) / fmt.max_code).clamp_min(1e-30)
    scale = exact.to(torch.bfloat16)
    # round up, so that no element clips: the next bfloat16 of a positive one is bits + 1
    scale = torch.where(
        scale.float() < exact, (scale.view(torch.int16) + 1).view(scale.dtype), scale
    )
    scaled = (x / scale.float()).clamp(-fmt.max_code, fmt.max_code)
    codes = scaled.round().to(torch.int8) if fmt.dtype == torch.int8 else scaled.to(fmt.dtype)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def decode_rows(rows: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Cache rows ``[..., row_width]`` (``storage_dtype`` or ``dtype``) back to float32
    ``[..., head_dim]``: the values the attention kernel computes with."""
    if not fmt.quantized:
        return rows.float()
    rows = rows.view(torch.uint8)
    head_dim = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :head_dim].view(fmt.dtype).float()
    scale = rows[..., head_dim:].contiguous().view(torch.bfloat16).float()
    return codes * scale
