// Panels of decoded weights for products with bfloat16 rows of x (quant_linear_bf16.cpp
// decodes GGUF rows into them, quant_x16.cpp interleaved groups): a panel holds kPanel
// output features as exact bfloat16 codes with their float32 scales and offsets
// (quant_codes.h); each kernel runs every row of x against it in the order of its own
// register path.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "bfloat16.h"
#include "kernels.h"
#include "quant_codes.h"

#ifdef PAGEDLLM_QUANT_BF16

namespace pagedllm::quant {

constexpr int kPanel = 32;  // output features per panel: two vectors

// One panel: codes [K / 2][kPanel] bfloat16 pairs, scales [groups][kPanel], offsets
// [chunks][kPanel]; features past N decode to zero.
struct Panel {
  std::vector<uint32_t> codes;
  std::vector<float> scales, offsets;
};

inline __m512i pair_of(const uint16_t* x) {
  uint32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return _mm512_set1_epi32(static_cast<int>(pair));
}

// The float32 sums acc[m][v] (MR rows, two vectors of a panel) plus the bias, stored
// into y[m, n0 .. n0 + kPanel) (features past N left alone).
template <int MR>
void store_panel_sums(const QuantLinearBf16Problem& p, const __m512 (&acc)[MR][2], uint16_t* y,
                      int64_t n0) {
  for (int v = 0; v < 2; ++v) {
    const int64_t left = p.N - n0 - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask =
        left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 bias =
        p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      bf16::store_sums(p, y + m * p.N + n0 + 16 * v, _mm512_add_ps(acc[m][v], bias), mask);
  }
}

// Each row's sum of x over each chunk of 32, float32 ([M][K / 32]).
inline std::vector<float> chunk_sums(const QuantLinearBf16Problem& p) {
  const int64_t chunks = p.K / 32;
  std::vector<float> sums(p.M * chunks);
  for (int64_t m = 0; m < p.M; ++m) {
    for (int64_t c = 0; c < chunks; ++c) {
      const uint16_t* x = p.x + m * p.K + c * 32;
      const __m512 low = bf16::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
      const __m512 high =
          bf16::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
      sums[m * chunks + c] = _mm512_reduce_add_ps(_mm512_add_ps(low, high));
    }
  }
  return sums;
}

}  // namespace pagedllm::quant

#endif  // PAGEDLLM_QUANT_BF16
