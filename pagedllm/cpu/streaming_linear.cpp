// y = x w^T + bias for few rows of x: every weight row is read from memory once and
// dotted with all rows of x while it sits in L1.
//
// torch's GEMM packs and blocks for many rows; with a handful of rows (a decode step)
// it reaches only a third of the memory bandwidth on the weights, which is all a decode
// step's matrix products are limited by. Here each thread walks its own share of the
// weight rows, NR rows at a time, as NR sequential streams, and computes an MR x NR tile
// of dot products per pass over K with float32 accumulators; x (MR rows) stays in cache.
// bfloat16 operands are multiplied as exact float32 products (the AVX-512 BF16 pair
// instruction where the CPU has it, widening otherwise), summed in float32 and rounded
// once to bfloat16 (round to nearest even), like torch's bfloat16 matmul.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace {

#ifdef __AVX512F__

constexpr int kRowsPerTile = 6;     // MR: rows of x per pass over a weight tile
constexpr int kWeightRows = 4;      // NR: weight rows streamed together
constexpr int64_t kMinParallelBytes = 1 << 18;  // smaller weights stay on one thread

// Sums of four accumulators, lane order 0..3.
inline __m128 sum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  auto half = [](__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  };
  return _mm_hadd_ps(_mm_hadd_ps(half(a0), half(a1)), _mm_hadd_ps(half(a2), half(a3)));
}

inline uint16_t to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays a quiet NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline void store(float* y, int64_t n, float value) { y[n] = value; }
inline void store(uint16_t* y, int64_t n, float value) { y[n] = to_bfloat16(value); }

// One step of K for float32: 16 values per vector.
struct Float32Step {
  using T = float;
  static constexpr int64_t kWidth = 16;
  static __m512 load(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
  static __m512 full(const float* p) { return _mm512_loadu_ps(p); }
  static __m512 fma(__m512 x, __m512 w, __m512 acc) { return _mm512_fmadd_ps(x, w, acc); }
  static __mmask16 tail(int64_t left) { return static_cast<__mmask16>((1u << left) - 1); }
};

#ifdef __AVX512BF16__
// bfloat16 with the pair-product instruction: 32 values per vector.
struct BFloat16Step {
  using T = uint16_t;
  static constexpr int64_t kWidth = 32;
  static __m512i load(const uint16_t* p, __mmask32 mask) {
    return _mm512_maskz_loadu_epi16(mask, p);
  }
  static __m512i full(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static __m512 fma(__m512i x, __m512i w, __m512 acc) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
  }
  static __mmask32 tail(int64_t left) { return static_cast<__mmask32>((1ull << left) - 1); }
};
#else
// bfloat16 widened to float32 (a bfloat16 is the top half of a float32): 16 per vector.
struct BFloat16Step {
  using T = uint16_t;
  static constexpr int64_t kWidth = 16;
  static __m512 widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static __m512 load(const uint16_t* p, __mmask16 mask) {
    return widen(_mm256_maskz_loadu_epi16(mask, p));
  }
  static __m512 full(const uint16_t* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512 fma(__m512 x, __m512 w, __m512 acc) { return _mm512_fmadd_ps(x, w, acc); }
  static __mmask16 tail(int64_t left) { return static_cast<__mmask16>((1u << left) - 1); }
};
#endif

// y[m, n0 + j] for m < MR, j < NR: rows m of x against weight rows n0 + j.
template <typename Step, int MR, int NR, typename T = typename Step::T>
void tile(const T* x, const T* w, int64_t K, const float* bias, T* y, int64_t ldy, int64_t n0) {
  __m512 acc[MR][kWeightRows];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kWeightRows; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + Step::kWidth <= K; k += Step::kWidth) {
    decltype(Step::full(w)) wv[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = Step::full(w + j * K + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + (j + NR) * K + k), _MM_HINT_T0);
    }
    for (int m = 0; m < MR; ++m) {
      const auto xv = Step::full(x + m * K + k);
      for (int j = 0; j < NR; ++j) acc[m][j] = Step::fma(xv, wv[j], acc[m][j]);
    }
  }
  if (k < K) {
    const auto mask = Step::tail(K - k);
    decltype(Step::full(w)) wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = Step::load(w + j * K + k, mask);
    for (int m = 0; m < MR; ++m) {
      const auto xv = Step::load(x + m * K + k, mask);
      for (int j = 0; j < NR; ++j) acc[m][j] = Step::fma(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(16) float sums[4];
    _mm_store_ps(sums, sum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
    for (int j = 0; j < NR; ++j) {
      store(y + m * ldy, n0 + j, sums[j] + (bias ? bias[n0 + j] : 0.0f));
    }
  }
}

// Weight rows [n0, n0 + NR) against every row of x.
template <typename Step, int NR, typename T = typename Step::T>
void weight_rows(const T* x, int64_t M, const T* w, int64_t K, const float* bias, T* y,
                 int64_t N, int64_t n0) {
  const T* rows = w + n0 * K;
  int64_t m = 0;
  for (; m + kRowsPerTile <= M; m += kRowsPerTile) {
    tile<Step, kRowsPerTile, NR>(x + m * K, rows, K, bias, y + m * N, N, n0);
  }
  switch (M - m) {
    case 5: tile<Step, 5, NR>(x + m * K, rows, K, bias, y + m * N, N, n0); break;
    case 4: tile<Step, 4, NR>(x + m * K, rows, K, bias, y + m * N, N, n0); break;
    case 3: tile<Step, 3, NR>(x + m * K, rows, K, bias, y + m * N, N, n0); break;
    case 2: tile<Step, 2, NR>(x + m * K, rows, K, bias, y + m * N, N, n0); break;
    case 1: tile<Step, 1, NR>(x + m * K, rows, K, bias, y + m * N, N, n0); break;
    default: break;
  }
}

template <typename Step, typename T = typename Step::T>
void run(const pagedllm::LinearProblem& p) {
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.weight);
  T* y = static_cast<T*>(p.y);
  const int64_t groups = p.N / kWeightRows;
  const int threads =
      p.N * p.K * static_cast<int64_t>(sizeof(T)) < kMinParallelBytes ? 1 : p.num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t g = 0; g < groups; ++g) {
    weight_rows<Step, kWeightRows>(x, p.M, w, p.K, p.bias, y, p.N, g * kWeightRows);
  }
  for (int64_t n = groups * kWeightRows; n < p.N; ++n) {
    weight_rows<Step, 1>(x, p.M, w, p.K, p.bias, y, p.N, n);
  }
}

#endif  // __AVX512F__

}  // namespace

namespace pagedllm {

bool avx512_kernels_available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

void streaming_linear(const LinearProblem& problem) {
#ifdef __AVX512F__
  if (problem.bfloat16) {
    run<BFloat16Step>(problem);
  } else {
    run<Float32Step>(problem);
  }
#else
  (void)problem;
#endif
}

}  // namespace pagedllm
