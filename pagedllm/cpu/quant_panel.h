// Products of bfloat16 rows of x with panels of decoded weights (quant_linear_bf16.cpp
// decodes GGUF rows into them, quant_x16.cpp interleaved groups): a panel holds kPanel
// output features as exact bfloat16 codes with their float32 scales and offsets
// (quant_codes.h), and every row of x runs against it, kRows rows at a time. A row's
// sums run in the same order whatever M is.
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
constexpr int kRows = 6;    // rows of x per tile: 2 x 6 sums, 2 x 6 group sums in registers

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

// y[m, n0 .. n0 + kPanel) for the MR rows of x starting at x; chunk_sums holds each
// row's sum of x per chunk ([MR][K / 32], only read for formats with offsets).
template <typename B, int MR>
void tile(const QuantLinearBf16Problem& p, const Panel& panel, const uint16_t* x,
          const float* chunk_sums, uint16_t* y, int64_t n0) {
  using C = Codes<B>;
  constexpr int kGroupsPerChunk = 16 / C::kGroupPairs;
  const int64_t chunks = p.K / 32;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const uint32_t* codes = panel.codes.data();
  const float* scales = panel.scales.data();
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    for (int g = 0; g < kGroupsPerChunk; ++g, scales += kPanel) {
      __m512 part[MR][2];
      for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
      const int64_t k0 = chunk * 32 + g * 2 * C::kGroupPairs;
      for (int j = 0; j < C::kGroupPairs; ++j, codes += kPanel) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(codes);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(codes + 16);
        for (int m = 0; m < MR; ++m) {
          const __m512bh xv = (__m512bh)pair_of(x + m * p.K + k0 + 2 * j);
          part[m][0] = _mm512_dpbf16_ps(part[m][0], xv, w0);
          part[m][1] = _mm512_dpbf16_ps(part[m][1], xv, w1);
        }
      }
      const __m512 s0 = _mm512_loadu_ps(scales), s1 = _mm512_loadu_ps(scales + 16);
      for (int m = 0; m < MR; ++m) {
        acc[m][0] = _mm512_fmadd_ps(part[m][0], s0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(part[m][1], s1, acc[m][1]);
      }
    }
    if constexpr (C::kOffset) {
      const float* offsets = panel.offsets.data() + chunk * kPanel;
      const __m512 o0 = _mm512_loadu_ps(offsets), o1 = _mm512_loadu_ps(offsets + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 sum = _mm512_set1_ps(chunk_sums[m * chunks + chunk]);
        acc[m][0] = _mm512_fmadd_ps(o0, sum, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(o1, sum, acc[m][1]);
      }
    }
  }
  store_panel_sums<MR>(p, acc, y, n0);
}

template <typename B>
void panel_rows(const QuantLinearBf16Problem& p, const Panel& panel, const float* sums,
                int64_t n0) {
  const int64_t chunks = p.K / 32;
  int64_t m = 0;
  for (; m + kRows <= p.M; m += kRows)
    tile<B, kRows>(p, panel, p.x + m * p.K, sums + m * chunks, p.y + m * p.N, n0);
  const uint16_t* x = p.x + m * p.K;
  uint16_t* y = p.y + m * p.N;
  const float* s = sums + m * chunks;
  switch (p.M - m) {
    case 5: tile<B, 5>(p, panel, x, s, y, n0); break;
    case 4: tile<B, 4>(p, panel, x, s, y, n0); break;
    case 3: tile<B, 3>(p, panel, x, s, y, n0); break;
    case 2: tile<B, 2>(p, panel, x, s, y, n0); break;
    case 1: tile<B, 1>(p, panel, x, s, y, n0); break;
    default: break;
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
