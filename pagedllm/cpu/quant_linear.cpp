// y = x w^T + bias with w kept in a GGUF block format (quant_blocks.h), never expanded in
// memory.
//
// Few rows (a decode step): each weight block is decoded into registers (through an
// L1-resident scratch the compiler keeps in registers for 32-weight blocks) and
// multiplied into up to kMaxRows rows of x while it is there, kChannels output features
// at a time so that each vector of x is loaded once per group. Up to kMaxRows rows read
// each quantized weight once per call: a decode step reads the weights at their
// quantized size. Larger batches repeat the pass per kMaxRows rows.
// Many rows (prefill): each thread decodes kPanelWidth output features into a float32
// panel (K x kPanelWidth, cache-resident) and runs packed_linear's register-tiled kernel
// over every row of x; decoding is then a small fraction of the arithmetic.
//
// Sums are float32, in a fixed order per output within each path, so below kPanelRows
// rows a row's result does not depend on the other rows; the two paths sum in different
// orders. Both differ from a float32 matmul of the decoded weights by float32 rounding
// only.

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <vector>

#include "kernels.h"
#include "quant_blocks.h"

namespace {

using namespace pagedllm::quant;

constexpr int kChannels = 4;   // output features per group of the few-rows kernel
constexpr int kMaxRows = 4;    // rows of x per pass of the few-rows kernel
// From this many rows of x on, decode into panels. Measured on an idle 2-core AMD EPYC
// Zen 4 (Q4_1, 3,072 x 576; 576 x 1,536 and 960 x 576 alike): decoding in registers
// 1.0 ms at 32 rows against 1.2 ms for panels, even at 48 rows (1.5 ms), panels ahead
// from 64 rows (1.8 ms against 2.1 ms) and at 96 (2.0 against 2.9); at 8 rows panels
// cost 2.8x.
constexpr int64_t kPanelRows = 48;

// y[m, n .. n + C) for rows m < MR of x, output features n .. n + C.
template <typename B, int MR, int C>
void channels(const float* x, int64_t K, const uint8_t* weight, int64_t row_bytes,
              const float* bias, float* y, int64_t N, int64_t n) {
  alignas(64) float w[C][B::kValues];
#ifdef __AVX512F__
  __m512 acc[MR][C];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm512_setzero_ps();
#else
  float acc[MR][C][16] = {};
#endif
  const int64_t blocks = K / B::kValues;
  const int64_t distance = prefetch_rows(row_bytes, C) * row_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = weight + (n + c) * row_bytes + b * B::kBytes;
      prefetch_ahead(block, B::kBytes, distance);
      B::decode(block, w[c]);
    }
    const float* xb = x + b * B::kValues;
    for (int64_t v = 0; v < B::kValues; v += 16) {
      for (int m = 0; m < MR; ++m) {
#ifdef __AVX512F__
        const __m512 xv = _mm512_loadu_ps(xb + m * K + v);
        for (int c = 0; c < C; ++c)
          acc[m][c] = _mm512_fmadd_ps(xv, _mm512_load_ps(w[c] + v), acc[m][c]);
#else
        for (int c = 0; c < C; ++c)
          for (int l = 0; l < 16; ++l) acc[m][c][l] += xb[m * K + v + l] * w[c][v + l];
#endif
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int c = 0; c < C; ++c) {
#ifdef __AVX512F__
      float sum = _mm512_reduce_add_ps(acc[m][c]);
#else
      float sum = 0.0f;
      for (int l = 0; l < 16; ++l) sum += acc[m][c][l];
#endif
      y[m * N + n + c] = sum + (bias ? bias[n + c] : 0.0f);
    }
  }
}

template <typename B, int MR>
void few_rows_pass(const pagedllm::QuantLinearProblem& p, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t row_bytes = p.K / B::kValues * B::kBytes;
  const float* x = p.x + m0 * p.K;
  float* y = p.y + m0 * p.N;
  int64_t n = n0;
  for (; n + kChannels <= n1; n += kChannels)
    channels<B, MR, kChannels>(x, p.K, p.weight, row_bytes, p.bias, y, p.N, n);
  for (; n < n1; ++n) channels<B, MR, 1>(x, p.K, p.weight, row_bytes, p.bias, y, p.N, n);
}

// Output features [n0, n1) for every row of x, kMaxRows rows per pass over the weights.
template <typename B>
void few_rows(const pagedllm::QuantLinearProblem& p, int64_t n0, int64_t n1) {
  int64_t m = 0;
  for (; m + kMaxRows <= p.M; m += kMaxRows) few_rows_pass<B, kMaxRows>(p, m, n0, n1);
  switch (p.M - m) {
    case 3: few_rows_pass<B, 3>(p, m, n0, n1); break;
    case 2: few_rows_pass<B, 2>(p, m, n0, n1); break;
    case 1: few_rows_pass<B, 1>(p, m, n0, n1); break;
    default: break;
  }
}

template <typename B>
int threads_for(const pagedllm::QuantLinearProblem& p) {
  return p.N * (p.K / B::kValues * B::kBytes) < kMinParallelBytes ? 1 : p.num_threads;
}

template <typename B>
void run_few_rows(const pagedllm::QuantLinearProblem& p) {
  const int64_t groups = (p.N + kChannels - 1) / kChannels;
#pragma omp parallel num_threads(threads_for<B>(p))
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t g0 = groups * t / threads, g1 = groups * (t + 1) / threads;
    const int64_t n1 = g1 * kChannels < p.N ? g1 * kChannels : p.N;
    const int64_t row_bytes = p.K / B::kValues * B::kBytes;
    if (g0 * kChannels < n1) {
      prefetch_start(p.weight + g0 * kChannels * row_bytes, (n1 - g0 * kChannels) * row_bytes);
      few_rows<B>(p, g0 * kChannels, n1);
    }
  }
}

#ifdef __AVX512F__
// Decodes the output features of panel `index` into `panel` [K][kPanelWidth] (zero past
// N), 16 features at a time: their blocks b decode side by side, and each of the block's
// k values is gathered across the 16 into one vector store of a panel row.
template <typename B>
void decode_panel(const pagedllm::QuantLinearProblem& p, int64_t index, float* panel) {
  constexpr int64_t W = pagedllm::kPanelWidth;
  const int64_t row_bytes = p.K / B::kValues * B::kBytes;
  alignas(64) float w[16][B::kValues];
  const __m512i lanes = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(B::kValues)));
  for (int64_t g = 0; g < W / 16; ++g) {
    const int64_t n0 = index * W + g * 16;
    const int64_t live = p.N - n0 < 16 ? (p.N - n0 > 0 ? p.N - n0 : 0) : 16;
    for (int64_t j = live; j < 16; ++j)
      for (int64_t t = 0; t < B::kValues; ++t) w[j][t] = 0.0f;
    for (int64_t b = 0; b < p.K / B::kValues; ++b) {
      for (int64_t j = 0; j < live; ++j)
        B::decode(p.weight + (n0 + j) * row_bytes + b * B::kBytes, w[j]);
      float* out = panel + b * B::kValues * W + g * 16;
      for (int64_t t = 0; t < B::kValues; ++t)
        _mm512_storeu_ps(out + t * W, _mm512_i32gather_ps(lanes, &w[0][t], 4));
    }
  }
}

template <typename B>
void run_panels(const pagedllm::QuantLinearProblem& p) {
  const int64_t count = pagedllm::num_panels(p.N);
  const pagedllm::PackedLinearProblem packed{p.x, nullptr, p.bias, p.y, p.M, p.N, p.K, false,
                                             1};
#pragma omp parallel num_threads(p.num_threads)
  {
    std::vector<float> panel(p.K * pagedllm::kPanelWidth);
#pragma omp for schedule(static)
    for (int64_t index = 0; index < count; ++index) {
      decode_panel<B>(p, index, panel.data());
      pagedllm::packed_panel_float32(packed, panel.data(), index);
    }
  }
}
#endif  // __AVX512F__

template <typename B>
void multiply(const pagedllm::QuantLinearProblem& p) {
#ifdef __AVX512F__
  if (p.M >= kPanelRows) {
    run_panels<B>(p);
    return;
  }
#endif
  run_few_rows<B>(p);
}

template <typename B>
void rows_of(const uint8_t* weight, int64_t K, const int64_t* rows, int64_t count, float* out,
             int num_threads) {
  const int64_t row_bytes = K / B::kValues * B::kBytes;
  const int threads = count * row_bytes < kMinParallelBytes ? 1 : num_threads;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t i = 0; i < count; ++i) {
    const uint8_t* row = weight + rows[i] * row_bytes;
    for (int64_t b = 0; b < K / B::kValues; ++b)
      B::decode(row + b * B::kBytes, out + i * K + b * B::kValues);
  }
}

template <typename B>
struct Linear {
  static void run(const pagedllm::QuantLinearProblem& p) { multiply<B>(p); }
};
template <typename B>
struct Rows {
  static void run(const uint8_t* weight, int64_t K, const int64_t* rows, int64_t count,
                  float* out, int num_threads) {
    rows_of<B>(weight, K, rows, count, out, num_threads);
  }
};
template <typename B>
struct Size {
  static void run(int64_t* values, int64_t* bytes) { *values = B::kValues, *bytes = B::kBytes; }
};

}  // namespace

namespace pagedllm {

int64_t quant_block_values(int64_t type) {
  int64_t values = 0, bytes = 0;
  with_format<Size>(type, &values, &bytes);
  return values;
}

int64_t quant_block_bytes(int64_t type) {
  int64_t values = 0, bytes = 0;
  with_format<Size>(type, &values, &bytes);
  return bytes;
}

void quant_linear(const QuantLinearProblem& problem) { with_format<Linear>(problem.type, problem); }

void dequantize_rows(const uint8_t* weight, int64_t K, int64_t type, const int64_t* rows,
                     int64_t count, float* out, int num_threads) {
  with_format<Rows>(type, weight, K, rows, count, out, num_threads);
}

}  // namespace pagedllm
