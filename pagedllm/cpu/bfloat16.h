// bfloat16 in AVX-512 registers, shared by the kernels that read or write it: a bfloat16
// is the high half of a float32, so widening is a shift and narrowing a rounding.
#pragma once

#include <immintrin.h>

#include <cstdint>

#ifdef __AVX512F__

namespace pagedllm::bf16 {

// 16 bfloat16 values as float32 (exact).
inline __m512 widen(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// v rounded to the nearest bfloat16 (ties to even) and kept as float32; a NaN becomes
// the quiet NaN, so that dropping its low mantissa bits cannot turn it into infinity.
inline __m512 round(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(rounded);
}

// Stores the lanes of v selected by mask as bfloat16, rounded as by round().
inline void store(uint16_t* p, __m512 v, __mmask16 mask) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(round(v)), 16);
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(high));
}

}  // namespace pagedllm::bf16

#endif  // __AVX512F__
