// The formats a K/V cache row is stored in, as the attention kernel reads them: 16
// elements at a time widened to float32, and for int8 / fp8 rows the bfloat16 scale that
// follows the head_dim codes.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "vector_math.h"

namespace pagedllm::kv_rows {

using vec::kLanes;
using vec::load;
using vec::vfloat;
using vec::vint;

typedef _Float16 vfloat16 __attribute__((vector_size(32)));
typedef int8_t vint8 __attribute__((vector_size(16)));

// A cache row format: Elem is the stored element, widen turns 16 of them into float32,
// and a scaled format keeps the row's bfloat16 multiplier right after head_dim codes.
template <typename E>
struct LoadedRows {  // float32 or bfloat16, widened by load()
  using Elem = E;
  static constexpr bool kScaled = false;
  static vfloat widen(const Elem* p) { return load(p); }
};

#ifdef __AVX512F__
inline vfloat as_vfloat(__m512 v) {
  vfloat out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}
#endif

template <typename E, typename Narrow, bool kScaledRows>
struct ConvertedRows {  // 16 elements of Narrow converted lane by lane
  using Elem = E;
  static constexpr bool kScaled = kScaledRows;
  static vfloat widen(const Elem* p) {
#ifdef __AVX512F__
    // GCC 12 turned __builtin_convertvector from 16 int8 into scalar code, one element
    // at a time (int8 decode attention ran at 0.2x of bfloat16 over 4x fewer bytes); the
    // intrinsics convert the 16 lanes in two instructions, to the same values.
    if constexpr (std::is_same_v<Narrow, vint8>) {
      const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return as_vfloat(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes)));
    } else if constexpr (std::is_same_v<Narrow, vfloat16>) {
      return as_vfloat(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
    }
#endif
    Narrow n;
    std::memcpy(&n, p, sizeof n);
    return __builtin_convertvector(n, vfloat);
  }
};

using Float32Rows = LoadedRows<float>;
using BFloat16Rows = LoadedRows<uint16_t>;
using Float16Rows = ConvertedRows<uint16_t, vfloat16, false>;
using Int8Rows = ConvertedRows<int8_t, vint8, true>;

// The float value of each of the 256 codes of an 8-bit float with `exp_bits` exponent
// bits (sign, exponent, mantissa; bias 2^(exp_bits-1) - 1; subnormals). E4M3 is the
// "fn" variant (no infinities, only S.1111.111 is NaN); E5M2 follows IEEE.
struct Fp8Table {
  float value[256];
  explicit Fp8Table(int exp_bits) {
    const int mant_bits = 7 - exp_bits, bias = (1 << (exp_bits - 1)) - 1;
    const int exp_max = (1 << exp_bits) - 1, mant_max = (1 << mant_bits) - 1;
    for (int code = 0; code < 256; ++code) {
      const int exp = (code >> mant_bits) & exp_max, mant = code & mant_max;
      float x;
      if (exp == exp_max && (exp_bits == 5 || mant == mant_max)) {
        x = exp_bits == 5 && mant == 0 ? std::numeric_limits<float>::infinity()
                                       : std::numeric_limits<float>::quiet_NaN();
      } else if (exp == 0) {
        x = std::ldexp(static_cast<float>(mant), 1 - bias - mant_bits);
      } else {
        x = std::ldexp(static_cast<float>(mant + (1 << mant_bits)), exp - bias - mant_bits);
      }
      value[code] = code & 0x80 ? -x : x;
    }
  }
};

inline const Fp8Table kE4M3(4), kE5M2(5);

template <const Fp8Table& kTable>
struct Fp8Rows {
  using Elem = uint8_t;
  static constexpr bool kScaled = true;
  // With AVX-512 BW/VL the codes become float16 bit patterns, converted exactly in one
  // instruction: an E5M2 code is a float16's high byte; an E4M3 code's exponent and
  // mantissa, put 3 bits lower, make a float16 worth 2^-8 of the code (subnormals
  // included), and its S.1111.111 is NaN. A gather from the table measured ~2x slower.
  static vfloat widen(const Elem* p) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m256i bytes =
        _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    if constexpr (&kTable == &kE5M2) {
      return as_vfloat(_mm512_cvtph_ps(_mm256_slli_epi16(bytes, 8)));
    } else {
      const __m256i magnitude = _mm256_and_si256(bytes, _mm256_set1_epi16(0x7F));
      const __m256i half =
          _mm256_or_si256(_mm256_slli_epi16(_mm256_xor_si256(bytes, magnitude), 8),
                          _mm256_slli_epi16(magnitude, 7));
      const __m512 x = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.f));
      const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
      return as_vfloat(
          _mm512_mask_mov_ps(x, nan, _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN())));
    }
#elif defined(__AVX512F__)
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return as_vfloat(_mm512_i32gather_ps(idx, kTable.value, 4));
#else
    typedef uint8_t vbyte __attribute__((vector_size(16)));
    vbyte b;
    std::memcpy(&b, p, sizeof b);
    const vint index = __builtin_convertvector(b, vint);
    vfloat out;
    for (int i = 0; i < kLanes; ++i) out[i] = kTable.value[index[i]];
    return out;
#endif
  }
};

// The bfloat16 scale stored after the head_dim codes of a scaled row.
template <typename Rows>
inline float row_scale(const typename Rows::Elem* row, int64_t head_dim) {
  if constexpr (!Rows::kScaled) {
    return 1.f;
  } else {
    uint16_t half;
    std::memcpy(&half, row + head_dim, sizeof half);
    const uint32_t bits = static_cast<uint32_t>(half) << 16;
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  }
}

}  // namespace pagedllm::kv_rows
