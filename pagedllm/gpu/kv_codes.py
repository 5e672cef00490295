"""Cache formats as the kernels see them, and the per-row 8-bit codes in Triton.

The formats and their exact rounding are defined by :mod:`pagedllm.kv_storage.kv_quant`; these
helpers reproduce :func:`~pagedllm.kv_storage.kv_quant.encode_rows` bit for bit (scale is
``amax / max_code`` rounded up to bfloat16, codes round half to even) using integer
arithmetic only, so they behave the same on a GPU and under the interpreter. A
quantized row is ``head_dim`` uint8 codes followed by the scale's two bytes (little
endian bfloat16).
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedllm.kv_storage.kv_quant import KVFormat

FLOAT = tl.constexpr(0)
INT8 = tl.constexpr(1)
FP8_E4M3 = tl.constexpr(2)
FP8_E5M2 = tl.constexpr(3)

_FORMAT_IDS = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}


def kernel_format(fmt: KVFormat) -> int:
    """The ``KV_FORMAT`` constant the kernels take for a cache format."""
    return _FORMAT_IDS[fmt.name] if fmt.quantized else 0


@triton.jit
def round_half_even(x):
    """float32 -> int32, ties to even (like ``torch.round``)."""
    low = tl.floor(x)
    frac = x - low
    low_int = low.to(tl.int32)
    up = (frac > 0.5) | ((frac == 0.5) & ((low_int & 1) == 1))
    return low_int + up.to(tl.int32)


@triton.jit
def fp8_magnitude_code(mag, MANTISSA_BITS: tl.constexpr, EXP_BIAS: tl.constexpr):
    """The 7-bit fp8 code of ``mag`` (float32, 0 <= mag <= the format's largest value),
    rounded to nearest even; normals by rounding the float32 bit pattern, subnormals as
    integer multiples of the smallest subnormal."""
    bits = mag.to(tl.int32, bitcast=True)
    shift: tl.constexpr = 23 - MANTISSA_BITS
    rounded = bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)
    normal = (rounded >> shift) - ((127 - EXP_BIAS) << MANTISSA_BITS)
    min_normal_bits: tl.constexpr = (128 - EXP_BIAS) << 23
    min_normal = tl.full([], min_normal_bits, tl.int32).to(tl.float32, bitcast=True)
    below_normal = tl.minimum(mag, min_normal)
    subnormal = round_half_even(below_normal * (1 << (EXP_BIAS - 1 + MANTISSA_BITS)))
    return tl.where(bits >= min_normal_bits, normal, subnormal)


@triton.jit
def to_bfloat16(x):
    """float32 -> bfloat16 rounding to nearest even, by integer arithmetic (the
    interpreter's own conversion truncates); NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def encode_tile(x, KV_FORMAT: tl.constexpr, MAX_CODE: tl.constexpr):
    """Rows ``x`` ``[R, D]`` (float32, padding columns zero) as uint8 codes ``[R, D]`` and
    the bfloat16 bit pattern of each row's scale ``[R]`` (int32 holding 16 bits)."""
    amax = tl.max(tl.abs(x), axis=1)
    exact = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, MAX_CODE, tl.float32)), 1e-30)
    exact_bits = exact.to(tl.int32, bitcast=True)
    scale_bits = (exact_bits >> 16) + ((exact_bits & 0xFFFF) != 0).to(tl.int32)  # round up
    scale = (scale_bits << 16).to(tl.float32, bitcast=True)
    scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    scaled = tl.minimum(tl.maximum(scaled, -MAX_CODE), MAX_CODE)
    if KV_FORMAT == INT8:
        codes = round_half_even(scaled) & 0xFF
    else:
        if KV_FORMAT == FP8_E4M3:
            magnitude = fp8_magnitude_code(tl.abs(scaled), 3, 7)
        else:
            magnitude = fp8_magnitude_code(tl.abs(scaled), 2, 15)
        sign = (scaled.to(tl.int32, bitcast=True) >> 31) & 1
        codes = (sign << 7) | magnitude
    return codes.to(tl.uint8), scale_bits


@triton.jit
def decode_codes(codes, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """uint8 codes as exact ``DOT_DTYPE`` values. For fp8_e4m3 the value is 1/256 of
    the code's: :func:`load_row_scales` folds the 256 into the row scale."""
    if KV_FORMAT == INT8:
        return codes.to(tl.int8, bitcast=True).to(DOT_DTYPE)
    else:
        wide = codes.to(tl.uint16)
        # e5m2 is the high byte of a float16; e4m3 / 256 is a float16 with the code's
        # sign, exponent and mantissa bits moved into place
        e4m3_bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
        half_bits = wide << 8 if KV_FORMAT == FP8_E5M2 else e4m3_bits
        return half_bits.to(tl.float16, bitcast=True).to(DOT_DTYPE)


@triton.jit
def load_row_scales(row_ptrs, mask, HEAD_DIM: tl.constexpr, KV_FORMAT: tl.constexpr):
    """float32 scale of each quantized row (times 256 for fp8_e4m3, see
    :func:`decode_codes`); ``row_ptrs`` point at the rows' first byte."""
    low = tl.load(row_ptrs + HEAD_DIM, mask=mask, other=0).to(tl.int32)
    high = tl.load(row_ptrs + HEAD_DIM + 1, mask=mask, other=0).to(tl.int32)
    scale = (((high << 8) | low) << 16).to(tl.float32, bitcast=True)
    if KV_FORMAT == FP8_E4M3:
        scale = scale * 256.0
    return scale
