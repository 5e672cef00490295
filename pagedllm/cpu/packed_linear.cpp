// y = x w^T + bias in float32 over a weight packed once, at load time, into panels.
//
// A panel holds kPanelWidth consecutive output features for every k, k-major:
// panel[k][j] = w[p * kPanelWidth + j][k], features past N zero. A kRowsPerTile x
// kPanelWidth tile of y lives in 24 vector registers; each step of k loads one panel
// row (three vectors, read sequentially: the hardware prefetcher keeps them coming),
// broadcasts one value of each of the tile's rows of x, and issues 24 fused
// multiply-adds, with no horizontal sums and no re-packing per call. The same kernel
// serves a decode step's few rows, where it is bound by reading the weights, and a
// prefill step's thousand, where it is bound by arithmetic.
//
// Every output is summed over k in the same order whatever M is and whichever tile its
// row falls in, so a row's result never depends on the other rows of the batch. Sums run
// in chunks of kChunk values of k added into y, as blocked GEMMs do, which keeps the
// float32 rounding error of long rows (K = 1,536) near torch's.

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

namespace {

#ifdef __AVX512F__

constexpr int kRowsPerTile = 8;  // rows of x per tile
constexpr int kVectors = pagedllm::kPanelWidth / 16;
constexpr int64_t kChunk = 256;                 // k values summed in registers at a time
constexpr int64_t kMinParallelBytes = 1 << 18;  // smaller weights stay on one thread

// y[m, n0 .. n0 + width) for the MR rows of x starting at x, over k in [k0, k1); the
// first chunk stores, later ones add, the last adds the bias.
template <int MR>
void tile(const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1,
          const float* bias, float* y, int64_t N, int64_t n0, bool first, bool last) {
  __m512 acc[MR][kVectors];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; ++k) {
    __m512 w[kVectors];
    for (int v = 0; v < kVectors; ++v) {
      w[v] = _mm512_loadu_ps(panel + k * pagedllm::kPanelWidth + 16 * v);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * K + k]);
      for (int v = 0; v < kVectors; ++v) acc[m][v] = _mm512_fmadd_ps(xv, w[v], acc[m][v]);
    }
  }
  for (int v = 0; v < kVectors; ++v) {
    const int64_t left = N - n0 - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask =
        left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = last && bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * v)
                                  : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      float* out = y + m * N + n0 + 16 * v;
      __m512 sum = acc[m][v];
      if (!first) sum = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), sum);
      _mm512_mask_storeu_ps(out, mask, _mm512_add_ps(sum, b));
    }
  }
}

template <int MR>
void tiles_over_k(const float* x, int64_t K, const float* panel, const float* bias, float* y,
                  int64_t N, int64_t n0) {
  for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
    const int64_t k1 = k0 + kChunk < K ? k0 + kChunk : K;
    tile<MR>(x, K, panel, k0, k1, bias, y, N, n0, k0 == 0, k1 == K);
  }
}

// Every row of x against panel p.
void panel_rows(const pagedllm::PackedLinearProblem& p, int64_t panel_index) {
  const float* x = p.x;
  const float* panel = p.panels + panel_index * p.K * pagedllm::kPanelWidth;
  const int64_t n0 = panel_index * pagedllm::kPanelWidth;
  int64_t m = 0;
  for (; m + kRowsPerTile <= p.M; m += kRowsPerTile) {
    tiles_over_k<kRowsPerTile>(x + m * p.K, p.K, panel, p.bias, p.y + m * p.N, p.N, n0);
  }
  const float* xm = x + m * p.K;
  float* ym = p.y + m * p.N;
  switch (p.M - m) {
    case 7: tiles_over_k<7>(xm, p.K, panel, p.bias, ym, p.N, n0); break;
    case 6: tiles_over_k<6>(xm, p.K, panel, p.bias, ym, p.N, n0); break;
    case 5: tiles_over_k<5>(xm, p.K, panel, p.bias, ym, p.N, n0); break;
    case 4: tiles_over_k<4>(xm, p.K, panel, p.bias, ym, p.N, n0); break;
    case 3: tiles_over_k<3>(xm, p.K, panel, p.bias, ym, p.N, n0); break;
    case 2: tiles_over_k<2>(xm, p.K, panel, p.bias, ym, p.N, n0); break;
    case 1: tiles_over_k<1>(xm, p.K, panel, p.bias, ym, p.N, n0); break;
    default: break;
  }
}

#endif  // __AVX512F__

}  // namespace

namespace pagedllm {

int64_t num_panels(int64_t N) { return (N + kPanelWidth - 1) / kPanelWidth; }

void pack_weight(const float* weight, int64_t N, int64_t K, float* panels, int num_threads) {
  const int64_t count = num_panels(N);
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t p = 0; p < count; ++p) {
    float* panel = panels + p * K * kPanelWidth;
    for (int64_t j = 0; j < kPanelWidth; ++j) {
      const int64_t n = p * kPanelWidth + j;
      for (int64_t k = 0; k < K; ++k) panel[k * kPanelWidth + j] = n < N ? weight[n * K + k] : 0.f;
    }
  }
}

void packed_linear(const PackedLinearProblem& problem) {
#ifdef __AVX512F__
  const int64_t count = num_panels(problem.N);
  const int threads = count * problem.K * kPanelWidth * static_cast<int64_t>(sizeof(float)) <
                              kMinParallelBytes
                          ? 1
                          : problem.num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < count; ++p) panel_rows(problem, p);
#else
  (void)problem;
#endif
}

}  // namespace pagedllm
