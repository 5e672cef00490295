// GGUF (ggml) quantized block formats: each format's block size in weights and bytes, and
// how one block decodes to float32. A row of K weights is K / kValues blocks laid end to
// end; scales are IEEE half precision. Each decode computes exactly what the gguf
// package's numpy dequantizer computes (d * q, or d * q + m, rounded once per operation),
// so that a matrix product over decoded blocks is a float32 product over the weights the
// file describes.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace pagedllm::quant {

// ggml's type ids (GGMLQuantizationType in the gguf package).
enum TypeId : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = mantissa;
    do { ++e; m <<= 1; } while ((m & 0x400) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// A decode step reads each weight once, from memory: the kernels ask for the block
// kPrefetchBytes (rounded to whole rows) ahead of the one being decoded, bypassing the
// caches. Measured on a 2-core AMD EPYC Zen 4, one row of x against a 30 MB Q8_0 weight:
// 2.6 ms without prefetching, 1.0-1.3 ms with it.
constexpr int64_t kPrefetchBytes = 8192;

// Quantized weights of fewer bytes are multiplied on one thread: waking the others
// costs more than they save.
constexpr int64_t kMinParallelBytes = 1 << 16;

// Rows ahead that are at least kPrefetchBytes, and at least `min_rows`.
inline int64_t prefetch_rows(int64_t row_bytes, int64_t min_rows) {
  const int64_t rows = kPrefetchBytes / row_bytes;
  return rows > min_rows ? rows : min_rows;
}

// Prefetches the `bytes` bytes at p + distance. They may lie past the weight's end: a
// prefetch never faults, and the address is formed as an integer, not a pointer past
// the array (no bounds test in the innermost loops).
inline void prefetch_ahead(const uint8_t* p, int64_t bytes, int64_t distance) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(distance);
  for (int64_t line = 0; line < bytes; line += 64)
    __builtin_prefetch(reinterpret_cast<const void*>(ahead + line), 0, 0);
}

// Prefetches the first kPrefetchBytes of `bytes` bytes at p at once: the start of a
// thread's share of a weight, before the per-block prefetching runs ahead of it.
inline void prefetch_start(const uint8_t* p, int64_t bytes) {
  const int64_t end = bytes < kPrefetchBytes ? bytes : kPrefetchBytes;
  for (int64_t line = 0; line < end; line += 64) __builtin_prefetch(p + line, 0, 0);
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#ifdef __AVX512F__
// 16 int32 lanes times d (+ m), as the numpy dequantizer rounds: a product, then a sum.
inline __m512 scale16(__m512i q, float d) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(d));
}
inline __m512 scale16(__m512i q, float d, float m) {
  return _mm512_add_ps(scale16(q, d), _mm512_set1_ps(m));
}
#endif

#ifdef __AVX512F__
// Lane t of out[c] = lane c of rows[t] (32-bit lanes): 16 rows of decoded weights (or
// codes) turned into the 16 columns of a panel.
inline void transpose16(const __m512i* rows, __m512i* out) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(rows[2 * i], rows[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // u[4i + j], 128-bit lane L: rows 4i .. 4i + 3 at column 4L + j.
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
    out[j] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    out[8 + j] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    out[4 + j] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    out[12 + j] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}
#endif

// Q8_0: half d, 32 int8 q; w = d * q.
struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34;
  static void decode(const uint8_t* b, float* w) {
    const float d = half_to_float(b);
#ifdef __AVX512F__
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2));
    _mm512_storeu_ps(w, scale16(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)), d));
    _mm512_storeu_ps(w + 16, scale16(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)), d));
#else
    for (int j = 0; j < 32; ++j) w[j] = d * static_cast<float>(static_cast<int8_t>(b[2 + j]));
#endif
  }
};

// The 32 unsigned 4-bit values of 16 bytes: low nibbles are weights 0..15, high 16..31.
#ifdef __AVX512F__
// The 16 bytes are widened once (one shuffle) and split in 32-bit lanes.
inline void nibbles(const uint8_t* qs, __m512i* low, __m512i* high) {
  const __m512i bytes =
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  *low = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f));
  *high = _mm512_srli_epi32(bytes, 4);
}
// The fifth bits of a Q5 block (bit j of qh is weight j's), as 16 at 0 or 16 per half.
inline void fifth_bits(uint32_t qh, __m512i* low, __m512i* high) {
  const __m512i sixteen = _mm512_set1_epi32(16);
  *low = _mm512_maskz_mov_epi32(static_cast<__mmask16>(qh & 0xffff), sixteen);
  *high = _mm512_maskz_mov_epi32(static_cast<__mmask16>(qh >> 16), sixteen);
}
#endif

// Q4_0: half d, 16 bytes of nibbles; w = d * (q - 8).
struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18;
  static void decode(const uint8_t* b, float* w) {
    const float d = half_to_float(b);
#ifdef __AVX512F__
    __m512i low, high;
    nibbles(b + 2, &low, &high);
    const __m512i eight = _mm512_set1_epi32(8);
    _mm512_storeu_ps(w, scale16(_mm512_sub_epi32(low, eight), d));
    _mm512_storeu_ps(w + 16, scale16(_mm512_sub_epi32(high, eight), d));
#else
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>((b[2 + j] & 0x0f) - 8);
      w[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
    }
#endif
  }
};

// Q4_1: half d, half m, 16 bytes of nibbles; w = d * q + m.
struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20;
  static void decode(const uint8_t* b, float* w) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
#ifdef __AVX512F__
    __m512i low, high;
    nibbles(b + 4, &low, &high);
    _mm512_storeu_ps(w, scale16(low, d, m));
    _mm512_storeu_ps(w + 16, scale16(high, d, m));
#else
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(b[4 + j] & 0x0f) + m;
      w[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
    }
#endif
  }
};

// Q5_0: half d, 32 fifth bits, 16 bytes of nibbles; w = d * (q - 16).
struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22;
  static void decode(const uint8_t* b, float* w) {
    const float d = half_to_float(b);
    const uint32_t qh = load_u32(b + 2);
#ifdef __AVX512F__
    __m512i low, high, low5, high5;
    nibbles(b + 6, &low, &high);
    fifth_bits(qh, &low5, &high5);
    const __m512i sixteen = _mm512_set1_epi32(16);
    _mm512_storeu_ps(w, scale16(_mm512_sub_epi32(_mm512_add_epi32(low, low5), sixteen), d));
    _mm512_storeu_ps(w + 16,
                     scale16(_mm512_sub_epi32(_mm512_add_epi32(high, high5), sixteen), d));
#else
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[6 + j] & 0x0f) | (((qh >> j) & 1) << 4);
      const int hi = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      w[j] = d * static_cast<float>(lo - 16);
      w[j + 16] = d * static_cast<float>(hi - 16);
    }
#endif
  }
};

// Q5_1: half d, half m, 32 fifth bits, 16 bytes of nibbles; w = d * q + m.
struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24;
  static void decode(const uint8_t* b, float* w) {
    const float d = half_to_float(b), m = half_to_float(b + 2);
    const uint32_t qh = load_u32(b + 4);
#ifdef __AVX512F__
    __m512i low, high, low5, high5;
    nibbles(b + 8, &low, &high);
    fifth_bits(qh, &low5, &high5);
    _mm512_storeu_ps(w, scale16(_mm512_add_epi32(low, low5), d, m));
    _mm512_storeu_ps(w + 16, scale16(_mm512_add_epi32(high, high5), d, m));
#else
    for (int j = 0; j < 16; ++j) {
      const int lo = (b[8 + j] & 0x0f) | (((qh >> j) & 1) << 4);
      const int hi = (b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      w[j] = d * static_cast<float>(lo) + m;
      w[j + 16] = d * static_cast<float>(hi) + m;
    }
#endif
  }
};

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block's 12 scale bytes.
inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The per-sub-block factors of a K-quant with mins: d * scale and dmin * min, rounded as
// the numpy dequantizer rounds them (float32 products).
inline void k_factors(const uint8_t* b, float* dl, float* ml) {
  const float d = half_to_float(b), dmin = half_to_float(b + 2);
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    scale_min_k4(j, b + 4, &scale, &min);
    dl[j] = d * static_cast<float>(scale);
    ml[j] = dmin * static_cast<float>(min);
  }
}

// Q4_K: 256 weights in 8 sub-blocks of 32: half d, half dmin, 12 bytes of 6-bit scales and
// mins, 128 bytes of nibbles (each 32 bytes hold sub-blocks 2i in low, 2i+1 in high
// nibbles); w = d * scale * q - dmin * min.
struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144;
  static void decode(const uint8_t* b, float* w) {
    float dl[8], ml[8];
    k_factors(b, dl, ml);
    const uint8_t* qs = b + 16;
    for (int i = 0; i < 4; ++i, qs += 32, w += 64) {
      for (int l = 0; l < 32; ++l) {
        w[l] = dl[2 * i] * static_cast<float>(qs[l] & 0x0f) - ml[2 * i];
        w[l + 32] = dl[2 * i + 1] * static_cast<float>(qs[l] >> 4) - ml[2 * i + 1];
      }
    }
  }
};

// Q5_K: Q4_K's layout with 32 bytes of fifth bits (bit 2i of byte l for sub-block 2i's
// weight l, bit 2i + 1 for sub-block 2i + 1's) before the nibbles.
struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176;
  static void decode(const uint8_t* b, float* w) {
    float dl[8], ml[8];
    k_factors(b, dl, ml);
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + 48;
    for (int i = 0; i < 4; ++i, qs += 32, w += 64) {
      for (int l = 0; l < 32; ++l) {
        const int lo = (qs[l] & 0x0f) | (((qh[l] >> (2 * i)) & 1) << 4);
        const int hi = (qs[l] >> 4) | (((qh[l] >> (2 * i + 1)) & 1) << 4);
        w[l] = dl[2 * i] * static_cast<float>(lo) - ml[2 * i];
        w[l + 32] = dl[2 * i + 1] * static_cast<float>(hi) - ml[2 * i + 1];
      }
    }
  }
};

// Q6_K: 256 weights in 16 sub-blocks of 16: 128 bytes of low nibbles, 64 bytes of high
// 2-bit pairs, 16 int8 scales, half d; w = d * scale * (q - 32). Each half of 128 weights
// takes 64 low-nibble bytes and 32 high-bit bytes.
struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210;
  static void decode(const uint8_t* b, float* w) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    const float d = half_to_float(b + 208);
    float ds[16];
    for (int j = 0; j < 16; ++j) ds[j] = d * static_cast<float>(sc[j]);
    for (int half = 0; half < 2; ++half, ql += 64, qh += 32, w += 128) {
      const float* s = ds + 8 * half;
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0x0f) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        w[l] = s[is] * static_cast<float>(q1);
        w[l + 32] = s[is + 2] * static_cast<float>(q2);
        w[l + 64] = s[is + 4] * static_cast<float>(q3);
        w[l + 96] = s[is + 6] * static_cast<float>(q4);
      }
    }
  }
};

// Op<B>::run(args...) with B the block format of `type`; false for a type without one.
template <template <typename> class Op, typename... Args>
bool with_format(int64_t type, Args&&... args) {
  switch (type) {
    case kQ8_0: Op<Q8_0>::run(args...); return true;
    case kQ4_0: Op<Q4_0>::run(args...); return true;
    case kQ4_1: Op<Q4_1>::run(args...); return true;
    case kQ5_0: Op<Q5_0>::run(args...); return true;
    case kQ5_1: Op<Q5_1>::run(args...); return true;
    case kQ4_K: Op<Q4_K>::run(args...); return true;
    case kQ5_K: Op<Q5_K>::run(args...); return true;
    case kQ6_K: Op<Q6_K>::run(args...); return true;
    default: return false;
  }
}

}  // namespace pagedllm::quant
