// The vector units' multiply-add peak: each thread runs 12 independent chains of one
// multiply-add instruction on registers, so that nothing waits on memory or on a
// previous result (12 chains cover a 4-cycle latency on two pipes with room to spare).
// Read against it, a kernel's GFLOP/s says how much of the machine it uses.

#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr int kChains = 12;
constexpr int64_t kIterations = 1 << 24;  // per chain and thread: ~0.05 s at 4 GHz

// Seconds for every thread to run kIterations steps of `step` on kChains registers of
// type V; the registers' starting values are hidden from the compiler so that it can
// neither fold the chains into one nor drop them.
template <typename V, typename Step>
double time_chains(int threads, V start, Step step) {
  const auto begin = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    V acc[kChains];
    for (int i = 0; i < kChains; ++i) {
      acc[i] = start;
      asm volatile("" : "+v"(acc[i]));
    }
    for (int64_t n = 0; n < kIterations; ++n) {
#pragma GCC unroll 12
      for (int i = 0; i < kChains; ++i) acc[i] = step(acc[i]);
    }
    for (int i = 0; i < kChains; ++i) asm volatile("" : : "v"(acc[i]));
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
}

// Floating-point operations per instruction and the best of three timings.
template <typename V, typename Step>
double gflops(int threads, int flops_per_instruction, V start, Step step) {
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) best = std::min(best, time_chains(threads, start, step));
  return double(kIterations) * kChains * threads * flops_per_instruction / best / 1e9;
}

std::vector<std::string> instructions() {
  std::vector<std::string> names;
#ifdef __FMA__
  names.push_back("avx2_fma");
#endif
#ifdef __AVX512F__
  names.push_back("avx512_fma");
#endif
#ifdef __AVX512BF16__
  names.push_back("avx512_bf16_dot");
#endif
  return names;
}

double multiply_add_peak(const std::string& instruction, int64_t threads) {
  if (threads < 1) throw std::invalid_argument("threads must be >= 1");
  const int n = static_cast<int>(threads);
#ifdef __FMA__
  if (instruction == "avx2_fma") {  // 8 float32 lanes, a multiply and an add each
    const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
    return gflops(n, 16, _mm256_set1_ps(1e-3f), [&](__m256 a) { return _mm256_fmadd_ps(a, b, c); });
  }
#endif
#ifdef __AVX512F__
  if (instruction == "avx512_fma") {  // 16 float32 lanes
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
    return gflops(n, 32, _mm512_set1_ps(1e-3f), [&](__m512 a) { return _mm512_fmadd_ps(a, b, c); });
  }
#endif
#ifdef __AVX512BF16__
  if (instruction == "avx512_bf16_dot") {  // 16 lanes, two bfloat16 products each
    const __m512bh pair = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // (1, 1)
    return gflops(n, 64, _mm512_set1_ps(1e-3f),
                  [&](__m512 a) { return _mm512_dpbf16_ps(a, pair, pair); });
  }
#endif
  std::string known;
  for (const auto& name : instructions()) known += " " + name;
  throw std::invalid_argument("no multiply-add instruction " + instruction +
                              " on this CPU; it has:" + known);
}

}  // namespace

TORCH_LIBRARY(pagedllm_peak, m) {
  m.def("instructions() -> str[]", &instructions);
  m.def("multiply_add_peak(str instruction, int threads) -> float", &multiply_add_peak);
}
