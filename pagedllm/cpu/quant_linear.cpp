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
// panel (K x kPanelWidth, cache-resident) and runs register tiles of rows over it
// (residue_pass); decoding is then a small fraction of the arithmetic.
//
// Sums are float32 and both paths add a row's products in one order: per output, residue
// r (0 .. 15) chains x[k] w[k] for k = r, r + 16, ... by multiply-adds from zero (lane r
// of the few-rows kernel's vector), and the 16 residue sums are added as a tree of halves
// (sum_lanes), then the bias. So a row's result is the same bits whatever the other rows
// of the call and whichever path runs it: the engine's tokens do not change with the
// number of rows in a step (a speculative step's verification rows give the logits of
// one-token steps). Both differ from a float32 matmul of the decoded weights by float32
// rounding only.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
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

#ifdef __AVX512F__
// The 16 lanes of v added as a tree of halves: lane l + 8 onto lane l, then l + 4, l + 2
// and l + 1. residue_pass adds its 16 residue sums in this same tree.
inline float sum_lanes(__m512 v) {
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 eight = _mm256_add_ps(_mm512_castps512_ps256(v), upper);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
#endif

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
      float sum = sum_lanes(acc[m][c]);
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
// Decodes the output features of panel `index` into `panel` (zero past N), 16 features
// at a time: their blocks b decode side by side, and each 16 k values of the 16 rows are
// transposed into 16 vector stores of panel rows (a gather per k made a 64-row product
// 1.3-1.4x slower). Rows are residue-major: k's row is (k % 16) * (K / 16) + k / 16, so
// that residue_pass reads each residue's rows in one run.
template <typename B>
void decode_panel(const pagedllm::QuantLinearProblem& p, int64_t index, float* panel) {
  constexpr int64_t W = pagedllm::kPanelWidth;
  const int64_t row_bytes = p.K / B::kValues * B::kBytes, steps = p.K / 16;
  alignas(64) float w[16][B::kValues];
  for (int64_t g = 0; g < W / 16; ++g) {
    const int64_t n0 = index * W + g * 16;
    const int64_t live = p.N - n0 < 16 ? (p.N - n0 > 0 ? p.N - n0 : 0) : 16;
    for (int64_t j = live; j < 16; ++j)
      for (int64_t t = 0; t < B::kValues; ++t) w[j][t] = 0.0f;
    for (int64_t b = 0; b < p.K / B::kValues; ++b) {
      for (int64_t j = 0; j < live; ++j)
        B::decode(p.weight + (n0 + j) * row_bytes + b * B::kBytes, w[j]);
      for (int64_t t0 = 0; t0 < B::kValues; t0 += 16) {
        __m512i rows[16], columns[16];
        for (int j = 0; j < 16; ++j) rows[j] = _mm512_castps_si512(_mm512_load_ps(w[j] + t0));
        transpose16(rows, columns);
        float* out = panel + (b * B::kValues + t0) / 16 * W + g * 16;
        for (int r = 0; r < 16; ++r)
          _mm512_storeu_ps(out + r * steps * W, _mm512_castsi512_ps(columns[r]));
      }
    }
  }
}

// The residues in the order in which a binary counter's carries add them as sum_lanes
// does: 0 + 8, 4 + 12, then (0 + 8) + (4 + 12), and so on.
constexpr int kResidueOrder[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

constexpr int kTileRows = 8;  // rows per residue tile: 24 sums in registers
constexpr int kVectors = pagedllm::kPanelWidth / 16;
// A panel of more bytes than this (long rows) would not stay in L2 while a tile takes
// its residues in turn: groups of kGroupTiles tiles then take each residue in turn.
constexpr int64_t kPanelCacheBytes = 1 << 19;
constexpr int kGroupTiles = 8;

bool long_rows(const pagedllm::QuantLinearProblem& p) {
  return p.K * pagedllm::kPanelWidth * static_cast<int64_t>(sizeof(float)) > kPanelCacheBytes;
}

// x [M][K] by residue, [M][16][K / 16]: row m's residue r is x[m][r], x[m][r + 16], ...
// (so that a pass reads its x in one run, not one value per cache line). Runs as a
// worksharing loop of the calling team.
void by_residue(const pagedllm::QuantLinearProblem& p, float* out) {
  const int64_t steps = p.K / 16;
  const __m512i residues = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
#pragma omp for schedule(static)
  for (int64_t m = 0; m < p.M; ++m) {
    const float* x = p.x + m * p.K;
    float* row = out + m * p.K;
    int64_t s = 0;
    for (; s + 16 <= steps; s += 16)  // 16 steps of each residue: one gather each
      for (int r = 0; r < 16; ++r)
        _mm512_storeu_ps(row + r * steps + s, _mm512_i32gather_ps(residues, x + 16 * s + r, 4));
    for (; s < steps; ++s)
      for (int r = 0; r < 16; ++r) row[r * steps + s] = x[16 * s + r];
  }
}

// Pass i of a tile of MR rows (xr: their rows by_residue; y: their outputs): residue
// r = kResidueOrder[i] of y[m, n0 .. n0 + kPanelWidth) in the few-rows kernel's order,
// x[k] w[k] for k = r, r + 16, ... chained by multiply-adds as lane r of channels()
// chains them. The residue sums are added as a binary counter carries, in sum_lanes'
// tree, the finished sums waiting in `done` ([4][kTileRows][kVectors] vectors:
// done[level] holds a sum of 2^level residues); the last pass stores the total plus the
// bias.
template <int MR>
void residue_pass(const pagedllm::QuantLinearProblem& p, const float* panel, const float* xr,
                  float* y, int64_t n0, int i, __m512* done) {
  constexpr int64_t W = pagedllm::kPanelWidth;
  constexpr int V = kVectors;
  const int64_t steps = p.K / 16;
  const int residue = kResidueOrder[i];
  __m512 acc[MR][V];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < V; ++v) acc[m][v] = _mm512_setzero_ps();
  const float* row = panel + residue * steps * W;
  const float* xs = xr + residue * steps;
  for (int64_t s = 0; s < steps; ++s, row += W) {
    __m512 w[V];
    for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_ps(row + 16 * v);
    for (int m = 0; m < MR; ++m) {
      const __m512 xv = _mm512_set1_ps(xs[m * p.K + s]);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_fmadd_ps(xv, w[v], acc[m][v]);
    }
  }
  auto at = [&](int level, int m, int v) { return done + (level * kTileRows + m) * V + v; };
  int level = 0;
  for (; (i >> level) & 1; ++level)
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) acc[m][v] = _mm512_add_ps(*at(level, m, v), acc[m][v]);
  if (level < 4) {
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < V; ++v) *at(level, m, v) = acc[m][v];
    return;
  }
  for (int v = 0; v < V; ++v) {  // all 16 residues: the total
    const int64_t left = p.N - n0 - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask =
        left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 bias =
        p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      _mm512_mask_storeu_ps(y + m * p.N + n0 + 16 * v, mask, _mm512_add_ps(acc[m][v], bias));
  }
}

// Every row of x (xr: by_residue's rows) against the decoded panel `index`, kTileRows
// rows at a time: each tile takes the panel's residues in turn, or for a panel of long
// rows groups of kGroupTiles tiles take each residue in turn, so that a residue's K / 16
// rows of the panel stay in cache for the group.
void residue_rows(const pagedllm::QuantLinearProblem& p, const float* panel, const float* xr,
                  int64_t index, __m512* done) {
  const int64_t n0 = index * pagedllm::kPanelWidth;
  const int64_t group_rows = (long_rows(p) ? kGroupTiles : 1) * kTileRows;
  for (int64_t g0 = 0; g0 < p.M; g0 += group_rows) {
    const int64_t g1 = std::min(p.M, g0 + group_rows);
    for (int i = 0; i < 16; ++i) {
      for (int64_t m = g0; m < g1; m += kTileRows) {
        const float* x = xr + m * p.K;
        float* y = p.y + m * p.N;
        __m512* tile = done + (m - g0) / kTileRows * 4 * kTileRows * kVectors;
        switch (std::min<int64_t>(kTileRows, g1 - m)) {
          case 1: residue_pass<1>(p, panel, x, y, n0, i, tile); break;
          case 2: residue_pass<2>(p, panel, x, y, n0, i, tile); break;
          case 3: residue_pass<3>(p, panel, x, y, n0, i, tile); break;
          case 4: residue_pass<4>(p, panel, x, y, n0, i, tile); break;
          case 5: residue_pass<5>(p, panel, x, y, n0, i, tile); break;
          case 6: residue_pass<6>(p, panel, x, y, n0, i, tile); break;
          case 7: residue_pass<7>(p, panel, x, y, n0, i, tile); break;
          default: residue_pass<8>(p, panel, x, y, n0, i, tile); break;  // kTileRows = 8
        }
      }
    }
  }
}

template <typename B>
void run_panels(const pagedllm::QuantLinearProblem& p) {
  const int64_t count = pagedllm::num_panels(p.N);
  std::vector<float> xr(p.M * p.K);
#pragma omp parallel num_threads(p.num_threads)
  {
    by_residue(p, xr.data());  // a worksharing loop: its barrier ends it for every thread
    std::vector<float> panel(p.K * pagedllm::kPanelWidth);
    std::vector<__m512> done((long_rows(p) ? kGroupTiles : 1) * 4 * kTileRows * kVectors);
#pragma omp for schedule(static)
    for (int64_t index = 0; index < count; ++index) {
      decode_panel<B>(p, index, panel.data());
      residue_rows(p, panel.data(), xr.data(), index, done.data());
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
