// Arithmetic on vectors of 16 float32 lanes (one AVX-512 register; two AVX2 halves
// elsewhere), shared by the CPU attention kernel: loads that widen, stores that round,
// fused multiply-add, horizontal reductions, transposes, exp and a compiler barrier.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>

namespace pagedllm::vec {

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));
constexpr int kLanes = 16;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the high half of a float32: widen by a 16-bit shift. With AVX-512 one
// zero-extending load and one shift; the generic vector conversion compiled to two
// half-width conversions and an insert, and measured 1.5x slower over cached K/V.
inline vfloat load(const uint16_t* p) {
#ifdef __AVX512F__
  const __m512i w = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  const vuint w = __builtin_convertvector(h, vuint) << 16;
#endif
  vfloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *p = 0x7fc0;  // NaN stays NaN
    return;
  }
  *p = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);  // nearest even
}

// x in every lane.
inline vfloat broadcast(float x) {
#ifdef __AVX512F__
  return (vfloat)_mm512_set1_ps(x);
#else
  return vfloat{} + x;
#endif
}

// a * b + c rounded once. Written out because the compiler's own contraction of
// `x * y + z * w` may fuse either product, and the two scoring paths below must round
// alike.
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#ifdef __AVX512F__
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  typedef float half8 __attribute__((vector_size(32)));
  const auto half = [](vfloat v, int h) {
    half8 x;
    std::memcpy(&x, reinterpret_cast<const float*>(&v) + 8 * h, sizeof x);
    return (__m256)x;
  };
  vfloat r;
  for (int h = 0; h < 2; ++h) {
    const __m256 x = _mm256_fmadd_ps(half(a, h), half(b, h), half(c, h));
    std::memcpy(reinterpret_cast<float*>(&r) + 8 * h, &x, sizeof x);
  }
  return r;
#else
  vfloat r;
  for (int l = 0; l < kLanes; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}

// Makes the compiler compute x here, in a register (an empty asm that reads and writes
// it), so that it cannot move the work before this point past it. A no-op without AVX-512.
inline void pin(vfloat& x) {
#ifdef __AVX512F__
  asm volatile("" : "+v"(x));
#else
  (void)x;
#endif
}

inline float hsum(vfloat v) {
  typedef float half8 __attribute__((vector_size(32)));
  half8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += h[i];
  return s;
}

inline float hmax(vfloat v) {
  typedef float half8 __attribute__((vector_size(32)));
  const half8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const half8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const half8 h = a > b ? a : b;
  float m = h[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, h[i]);
  return m;
}

// Lane i of the result (i < 4) is rows[i]'s lanes combined by op (max, +; associative
// and commutative); the other lanes hold copies of those. Four horizontal reductions in
// 14 shuffles and ops instead of ~40.
template <typename Op>
inline vfloat combine_rows(const vfloat (&rows)[4], Op op) {
  const auto halves = [&](vfloat x, vfloat y) {  // lanes 0-7: x's halves, 8-15: y's
    return op(
        __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23),
        __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                31));
  };
  const vfloat ab = halves(rows[0], rows[1]), cd = halves(rows[2], rows[3]);
  // Lanes 4 i .. 4 i + 3: rows[i] in four lanes.
  vfloat x = op(
      __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27),
      __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                              31));
  x = op(x, __builtin_shufflevector(x, x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  x = op(x, __builtin_shufflevector(x, x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return __builtin_shufflevector(x, x, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
}

// Lane i (i < 4): the largest lane of rows[i].
inline vfloat max_of_rows(const vfloat (&rows)[4]) {
  return combine_rows(rows, [](vfloat a, vfloat b) { return a > b ? a : b; });
}

// Lane i (i < 4): the sum of rows[i]'s lanes.
inline vfloat sum_of_rows(const vfloat (&rows)[4]) {
  return combine_rows(rows, [](vfloat a, vfloat b) { return a + b; });
}

// Lane t of the result is the sum of the lanes of parts[t]: 16 horizontal sums in
// 15 shuffle-add pairs instead of 16 separate reductions.
inline vfloat transpose_sum(const vfloat* parts) {
  vfloat b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    const vfloat x = parts[2 * i], y = parts[2 * i + 1];
    b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  }
  for (int i = 0; i < 4; ++i) {
    const vfloat x = b[2 * i], y = b[2 * i + 1];
    c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  }
  for (int i = 0; i < 2; ++i) {
    const vfloat x = c[2 * i], y = c[2 * i + 1];
    d[i] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// Transposes 16 vectors of 16 32-bit lanes in place: afterwards lane i of r[l] holds what
// lane l of r[i] held. Four butterfly stages; stage b swaps the lanes whose bit b differs
// from their vector's bit b.
inline void transpose16(vfloat* r) {
  for (int i = 0; i < 8; ++i) {
    const vfloat x = r[i], y = r[i + 8];
    r[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    r[i + 8] =
        __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i : {0, 1, 2, 3, 8, 9, 10, 11}) {
    const vfloat x = r[i], y = r[i + 4];
    r[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    r[i + 4] =
        __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
  for (int i : {0, 1, 4, 5, 8, 9, 12, 13}) {
    const vfloat x = r[i], y = r[i + 2];
    r[i] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[i + 2] =
        __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
  for (int i = 0; i < 16; i += 2) {
    const vfloat x = r[i], y = r[i + 1];
    r[i] = __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    r[i + 1] =
        __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
}

// exp(x) for every float32 x: x = n ln 2 + r with n = round(x / ln 2) and |r| <= ln 2 / 2,
// a degree-7 polynomial in r (relative error ~1e-8 there), times 2^n. With AVX-512, n is
// rounded with roundscale and applied with scalef, which saturates to 0 and inf (four
// instructions fewer than converting n to an integer and shifting it into the
// exponent); elsewhere x is clamped to [-87, 88] first so that 2^n stays a normal float.
inline vfloat vexp(vfloat x) {
#ifdef __AVX512F__
  const __m512 v =
      _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.8f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  vfloat v = x < -87.f ? vfloat{} - 87.f : x;
  v = v > 88.f ? vfloat{} + 88.f : v;
  const vfloat half = v < 0.f ? vfloat{} - 0.5f : vfloat{} + 0.5f;  // truncation rounds
  const vfloat n = __builtin_convertvector(
      __builtin_convertvector(v * 1.44269504088896341f + half, vint), vfloat);
#endif
  vfloat r = v - n * 0.693145751953125f;
  r = r - n * 1.428606765330187e-06f;
  vfloat p = vfloat{} + 1.f / 5040.f;
  for (const float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
    p = p * r + c;
#ifdef __AVX512F__
  return _mm512_scalef_ps(p, n);
#else
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
#endif
}

}  // namespace pagedllm::vec
