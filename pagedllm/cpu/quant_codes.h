// GGUF blocks as exact bfloat16 codes with float32 factors, for products with bfloat16
// activations (quant_linear_bf16.cpp).
//
// Every format of quant_blocks.h writes a weight as w = scale * code + offset, where the
// code is a small integer (|code| <= 128, so exact in bfloat16), the scale is shared by
// a group of kGroupPairs pairs of consecutive weights and the offset by a chunk of 32
// weights (zero for formats without one). scale and offset are the float32 factors the
// numpy dequantizer multiplies and adds (d, d * scale, -dmin * min), so that
// sum_k x_k w_k = scale * sum_k x_k code_k + offset * sum_k x_k equals the product over
// the dequantized weights up to float32 rounding.
//
// Codes<B>: kChunks (32-weight chunks per block), kGroupPairs (16: one scale per chunk;
// 8: two, Q6_K's 16-weight sub-blocks), kOffset, kBias (code = table index - kBias),
// kSplitPairs, factors(block, scale[kChunks * 16 / kGroupPairs], offset[kChunks]) and
// codes(block, chunk, table): the chunk's 32 codes as bfloat16, as 16 pairs of weights
// (2t, 2t + 1), or (t, t + 16) when kSplitPairs (the 4- and 5-bit formats keep weights t
// and t + 16 in one byte: that order costs one instruction less per block; x is then
// permuted to match).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

#if defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__BMI2__)
#define PAGEDLLM_QUANT_BF16 1

namespace pagedllm::quant {

// Word i (0..63) of the two registers is bfloat16(i - bias); small integers are exact.
struct CodeTable {
  __m512i low, high;
  explicit CodeTable(int bias) {
    alignas(64) uint16_t words[64];
    for (int i = 0; i < 64; ++i) {
      const float value = static_cast<float>(i - bias);
      uint32_t bits;
      std::memcpy(&bits, &value, sizeof bits);
      words[i] = static_cast<uint16_t>(bits >> 16);
    }
    low = _mm512_load_si512(words);
    high = _mm512_load_si512(words + 32);
  }
  __m512i lookup32(__m512i index) const { return _mm512_permutexvar_epi16(index, low); }
  __m512i lookup64(__m512i index) const {
    return _mm512_permutex2var_epi16(low, index, high);
  }
};

// The 16 half-precision values at p as float32 lanes (a block column's 16 scales in the
// interleaved layouts).
inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 pairs of words: byte t's low nibble (weight t), then its high nibble (weight t + 16).
inline __m512i nibble_pairs(const uint8_t* qs) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  constexpr int kOrThenAnd = 0xa8;  // (a | b) & c
  return _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12),
                                   _mm512_set1_epi32(0x000f000f), kOrThenAnd);
}

// The Q5 fifth bits (bit t for weight t) in split-pair order: bit 2t for weight t, bit
// 2t + 1 for weight t + 16.
inline uint32_t split_pair_bits(uint32_t bits) {
  return _pdep_u32(bits & 0xffffu, 0x55555555u) | _pdep_u32(bits >> 16, 0xaaaaaaaau);
}

// 32 words: bits [shift, shift + 4) of each of 32 bytes.
inline __m512i nibbles_of_32(const uint8_t* qs, int shift) {
  const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs)));
  return _mm512_and_si512(_mm512_srli_epi16(bytes, static_cast<unsigned>(shift)),
                          _mm512_set1_epi16(0x0f));
}

// index + 16 where bit i of `bits` is set: a Q5 weight's fifth bit.
inline __m512i add_fifth_bits(__m512i index, uint32_t bits) {
  return _mm512_mask_add_epi16(index, static_cast<__mmask32>(bits), index,
                               _mm512_set1_epi16(16));
}

template <typename B>
struct Codes;

template <>
struct Codes<Q8_0> {
  static constexpr int kChunks = 1, kGroupPairs = 16, kBias = 0;
  static constexpr bool kOffset = false, kSplitPairs = false;
  static void factors(const uint8_t* b, float* scale, float*) { scale[0] = half_to_float(b); }
  // Integers below 2^8 in magnitude are exact in float32 with zero low halves: their
  // bfloat16 is the float's high half, picked from both vectors in one permutation.
  static __m512i codes(const uint8_t* b, int, const CodeTable&) {
    const __m128i* q = reinterpret_cast<const __m128i*>(b + 2);
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    const __m512i odd_words = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(low), odd_words,
                                     _mm512_castps_si512(high));
  }
};

// Q4_0 and Q5_0 (w = d * (q - bias)), Q4_1 and Q5_1 (w = d * q + m): one chunk.
template <typename B, int kBiasValue, bool kWithMin, bool kFifthBit>
struct LegacyCodes {
  static constexpr int kChunks = 1, kGroupPairs = 16, kBias = kBiasValue;
  static constexpr bool kOffset = kWithMin, kSplitPairs = true;
  static constexpr int kNibbles = 2 + (kWithMin ? 2 : 0) + (kFifthBit ? 4 : 0);
  static void factors(const uint8_t* b, float* scale, float* offset) {
    scale[0] = half_to_float(b);
    if constexpr (kWithMin) offset[0] = half_to_float(b + 2);
  }
  static __m512i codes(const uint8_t* b, int, const CodeTable& table) {
    __m512i index = nibble_pairs(b + kNibbles);
    if constexpr (kFifthBit)
      index = add_fifth_bits(index, split_pair_bits(load_u32(b + kNibbles - 4)));
    return table.lookup32(index);
  }
};

template <> struct Codes<Q4_0> : LegacyCodes<Q4_0, 8, false, false> {};
template <> struct Codes<Q4_1> : LegacyCodes<Q4_1, 0, true, false> {};
template <> struct Codes<Q5_0> : LegacyCodes<Q5_0, 16, false, true> {};
template <> struct Codes<Q5_1> : LegacyCodes<Q5_1, 0, true, true> {};

// Q4_K and Q5_K: 8 chunks of 32, each with scale d * scale_j and offset -dmin * min_j.
template <bool kFifthBit>
struct KCodes {
  static constexpr int kChunks = 8, kGroupPairs = 16, kBias = 0;
  static constexpr bool kOffset = true, kSplitPairs = false;
  static constexpr int kNibbles = kFifthBit ? 48 : 16;
  static void factors(const uint8_t* b, float* scale, float* offset) {
    float mins[8];
    k_factors(b, scale, mins);
    for (int j = 0; j < 8; ++j) offset[j] = -mins[j];
  }
  static __m512i codes(const uint8_t* b, int chunk, const CodeTable& table) {
    __m512i index = nibbles_of_32(b + kNibbles + 32 * (chunk / 2), 4 * (chunk % 2));
    if constexpr (kFifthBit) {  // bit `chunk` of each of the 32 high-bit bytes
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
      const auto bits = static_cast<uint32_t>(
          _mm256_movemask_epi8(_mm256_slli_epi16(high, 7 - chunk)));
      index = add_fifth_bits(index, bits);
    }
    return table.lookup32(index);
  }
};

template <> struct Codes<Q4_K> : KCodes<false> {};
template <> struct Codes<Q5_K> : KCodes<true> {};

// Q6_K: 8 chunks of 32 (chunk c of half c / 4), each two sub-blocks of 16 with scale
// d * scale_j; code = q - 32.
template <>
struct Codes<Q6_K> {
  static constexpr int kChunks = 8, kGroupPairs = 8, kBias = 32;
  static constexpr bool kOffset = false, kSplitPairs = false;
  static void factors(const uint8_t* b, float* scale, float*) {
    const float d = half_to_float(b + 208);
    for (int j = 0; j < 16; ++j) scale[j] = d * static_cast<float>(static_cast<int8_t>(b[192 + j]));
  }
  static __m512i codes(const uint8_t* b, int chunk, const CodeTable& table) {
    const int half = chunk / 4, c = chunk % 4;
    const __m512i low = nibbles_of_32(b + 64 * half + 32 * (c & 1), 4 * (c >> 1));
    const __m512i bytes = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half)));
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, static_cast<unsigned>(2 * c)),
                                          _mm512_set1_epi16(3));
    return table.lookup64(_mm512_or_si512(low, _mm512_slli_epi16(high, 4)));
  }
};

}  // namespace pagedllm::quant

#endif  // __AVX512BW__ && __AVX512BF16__ && __BMI2__
