// y = x w^T + bias for bfloat16 x with w kept in a GGUF block format, on the CPU's
// bfloat16 pair products (vdpbf16ps), without expanding w. Every format is read as
// w = scale * code + offset (quant_codes.h): products of bfloat16 x and the integer codes
// are exact, a group's pair products are summed in float32 and multiplied by its scales,
// and offset * (sum of the chunk's x) is added per chunk of 32; the float32 sums are
// rounded once to bfloat16, so a result differs from the float32 product over the
// dequantized weights by float32 rounding and that one rounding.
//
// Up to kMaxDotRows rows (decode): each output's blocks are decoded into registers once
// and multiplied into every row (dot_rows), 4 outputs at a time.
// More rows: each thread decodes kPanel output features at a time into a panel
// (cache-resident): the codes as bfloat16 pairs, k-major ([K / 2][kPanel] pairs, the
// layout of the bfloat16 packed_linear panels), and the features' scales and offsets per
// group and chunk; every row of x then runs against it, kRows rows at a time.
// Within each path a row's sums run in the same order whatever M is, so a row's result
// does not depend on the other rows; the two paths sum in different orders.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bfloat16.h"
#include "kernels.h"
#include "quant_codes.h"

namespace pagedllm {

#ifdef PAGEDLLM_QUANT_BF16

namespace {

using namespace quant;

constexpr int kPanel = 32;  // output features per panel: two vectors
constexpr int kRows = 6;    // rows of x per tile: 2 x 6 sums, 2 x 6 group sums in registers
constexpr int64_t kMaxDotRows = 3;  // up to this many rows, decode in registers per output
static_assert(kMaxDotRows == 3, "few_rows dispatches 1, 2 or 3 rows");
constexpr int64_t kMinParallelBytes = 1 << 16;  // smaller weights stay on one thread

// Lane t of out[c] = lane c of rows[t] (32-bit lanes).
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

// One panel: codes [K / 2][kPanel] bfloat16 pairs, scales [groups][kPanel], offsets
// [chunks][kPanel]; features past N decode to zero.
struct Panel {
  std::vector<uint32_t> codes;
  std::vector<float> scales, offsets;
};

template <typename B>
void decode_panel(const uint8_t* weight, int64_t N, int64_t K, int64_t n0, Panel& panel) {
  using C = Codes<B>;
  constexpr int kGroupsPerChunk = 16 / C::kGroupPairs;
  constexpr int kGroupsPerBlock = C::kChunks * kGroupsPerChunk;
  const int64_t blocks = K / B::kValues, chunks = K / 32;
  const int64_t row_bytes = blocks * B::kBytes;
  panel.codes.resize(K / 2 * kPanel);
  panel.scales.resize(chunks * kGroupsPerChunk * kPanel);
  panel.offsets.resize(C::kOffset ? chunks * kPanel : 0);
  const CodeTable table(C::kBias);
  float scale[kGroupsPerBlock], offset[C::kChunks];
  __m512i rows[16], columns[16];
  for (int half = 0; half < kPanel / 16; ++half) {
    for (int64_t b = 0; b < blocks; ++b) {
      for (int c = 0; c < C::kChunks; ++c) {
        const int64_t chunk = b * C::kChunks + c;
        for (int j = 0; j < 16; ++j) {
          const int64_t n = n0 + 16 * half + j;
          if (n >= N) {
            rows[j] = _mm512_setzero_si512();
            continue;
          }
          rows[j] = C::codes(weight + n * row_bytes + b * B::kBytes, c, table);
        }
        transpose16(rows, columns);
        uint32_t* out = panel.codes.data() + chunk * 16 * kPanel + 16 * half;
        for (int t = 0; t < 16; ++t) _mm512_storeu_si512(out + t * kPanel, columns[t]);
      }
      for (int j = 0; j < 16; ++j) {
        const int64_t n = n0 + 16 * half + j;
        if (n < N) {
          C::factors(weight + n * row_bytes + b * B::kBytes, scale, offset);
        } else {
          for (float& s : scale) s = 0.0f;
          for (float& o : offset) o = 0.0f;
        }
        const int64_t column = 16 * half + j;
        for (int g = 0; g < kGroupsPerBlock; ++g)
          panel.scales[(b * kGroupsPerBlock + g) * kPanel + column] = scale[g];
        if constexpr (C::kOffset) {
          for (int c = 0; c < C::kChunks; ++c)
            panel.offsets[(b * C::kChunks + c) * kPanel + column] = offset[c];
        }
      }
    }
  }
}

inline __m512i pair_of(const uint16_t* x) {
  uint32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return _mm512_set1_epi32(static_cast<int>(pair));
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
  for (int v = 0; v < 2; ++v) {
    const int64_t left = p.N - n0 - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask =
        left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 bias =
        p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0 + 16 * v) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      bf16::store(y + m * p.N + n0 + 16 * v, _mm512_add_ps(acc[m][v], bias), mask);
  }
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
std::vector<float> chunk_sums(const QuantLinearBf16Problem& p) {
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

// The 16 lanes' scales of one chunk: pair t of the chunk takes group t / kGroupPairs's.
template <typename C>
inline __m512 lane_scales(const float* scale, int chunk) {
  if constexpr (C::kGroupPairs == 16) {
    return _mm512_set1_ps(scale[chunk]);
  } else {
    return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(scale[2 * chunk]),
                                _mm512_set1_ps(scale[2 * chunk + 1]));
  }
}

// Few rows: y[m, n .. n + kOutputs) for the MR rows of x, each output's blocks decoded
// once into registers and multiplied into every row while there (a decode step reads
// each weight once). Lanes of a chunk's pair products are scaled, summed over the
// chunks, and reduced once per output; offsets are added per chunk as scalars.
template <typename B, int MR, int kOutputs>
void dot_rows(const QuantLinearBf16Problem& p, const CodeTable& table, const uint16_t* x,
              const float* sums, uint16_t* y, int64_t n) {
  using C = Codes<B>;
  constexpr int kScales = C::kChunks * 16 / C::kGroupPairs;
  const int64_t blocks = p.K / B::kValues, chunks = p.K / 32;
  const int64_t row_bytes = blocks * B::kBytes;
  const int64_t distance = prefetch_rows(row_bytes, kOutputs) * row_bytes;
  const uint8_t* end = p.weight + p.N * row_bytes;
  __m512 acc[MR][kOutputs];
  float offset_sum[MR][kOutputs] = {};
  for (int m = 0; m < MR; ++m)
    for (int o = 0; o < kOutputs; ++o) acc[m][o] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    float scale[kOutputs][kScales], offset[kOutputs][C::kChunks];
    const uint8_t* block[kOutputs];
    for (int o = 0; o < kOutputs; ++o) {
      block[o] = p.weight + (n + o) * row_bytes + b * B::kBytes;
      C::factors(block[o], scale[o], offset[o]);
      prefetch_ahead(block[o], B::kBytes, distance, end);
    }
    for (int c = 0; c < C::kChunks; ++c) {
      const int64_t chunk = b * C::kChunks + c;
      __m512bh codes[kOutputs];
      for (int o = 0; o < kOutputs; ++o) codes[o] = (__m512bh)C::codes(block[o], c, table);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * p.K + chunk * 32);
        for (int o = 0; o < kOutputs; ++o) {
          const __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), xv, codes[o]);
          acc[m][o] = _mm512_fmadd_ps(part, lane_scales<C>(scale[o], c), acc[m][o]);
          if constexpr (C::kOffset) offset_sum[m][o] += offset[o][c] * sums[m * chunks + chunk];
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int o = 0; o < kOutputs; ++o) {
      const float bias = p.bias ? p.bias[n + o] : 0.0f;
      const float sum = _mm512_reduce_add_ps(acc[m][o]) + offset_sum[m][o] + bias;
      bf16::store(y + m * p.N + n + o, _mm512_set1_ps(sum), 1);
    }
  }
}

template <typename B, int MR>
void dot_rows_range(const QuantLinearBf16Problem& p, const float* sums, int64_t n0,
                    int64_t n1) {
  constexpr int kOutputs = 4;
  const CodeTable table(Codes<B>::kBias);
  const int64_t row_bytes = p.K / B::kValues * B::kBytes;
  prefetch_start(p.weight + n0 * row_bytes, (n1 - n0) * row_bytes);
  int64_t n = n0;
  for (; n + kOutputs <= n1; n += kOutputs)
    dot_rows<B, MR, kOutputs>(p, table, p.x, sums, p.y, n);
  for (; n < n1; ++n) dot_rows<B, MR, 1>(p, table, p.x, sums, p.y, n);
}

template <typename B>
void few_rows(const QuantLinearBf16Problem& p, const float* sums, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int64_t groups = (p.N + 3) / 4, count = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t n0 = std::min(p.N, groups * t / count * 4);
    const int64_t n1 = std::min(p.N, groups * (t + 1) / count * 4);
    switch (p.M) {
      case 1: dot_rows_range<B, 1>(p, sums, n0, n1); break;
      case 2: dot_rows_range<B, 2>(p, sums, n0, n1); break;
      default: dot_rows_range<B, 3>(p, sums, n0, n1); break;  // M <= kMaxDotRows = 3
    }
  }
}

// x with each chunk's 32 values in split-pair order (t, t + 16), as such codes take them.
std::vector<uint16_t> split_pairs(const QuantLinearBf16Problem& p) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
  std::vector<uint16_t> out(p.M * p.K);
  for (int64_t i = 0; i < p.M * p.K; i += 32) {
    const __m512i chunk = _mm512_loadu_si512(p.x + i);
    _mm512_storeu_si512(out.data() + i, _mm512_permutexvar_epi16(order, chunk));
  }
  return out;
}

template <typename B>
void multiply(const QuantLinearBf16Problem& problem) {
  const std::vector<float> sums =
      Codes<B>::kOffset ? chunk_sums(problem) : std::vector<float>();
  QuantLinearBf16Problem p = problem;
  std::vector<uint16_t> permuted;
  if constexpr (Codes<B>::kSplitPairs) {
    permuted = split_pairs(problem);
    p.x = permuted.data();
  }
  const int64_t count = (p.N + kPanel - 1) / kPanel;
  const int64_t bytes = p.N * (p.K / B::kValues * B::kBytes);
  const int threads = bytes < kMinParallelBytes ? 1 : p.num_threads;
  if (p.M <= kMaxDotRows) {
    few_rows<B>(p, sums.data(), threads);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    Panel panel;
#pragma omp for schedule(static)
    for (int64_t index = 0; index < count; ++index) {
      decode_panel<B>(p.weight, p.N, p.K, index * kPanel, panel);
      panel_rows<B>(p, panel, sums.data(), index * kPanel);
    }
  }
}

template <typename B>
struct Multiply {
  static void run(const QuantLinearBf16Problem& p) { multiply<B>(p); }
};

}  // namespace

bool quant_linear_bf16_available() { return true; }

void quant_linear_bf16(const QuantLinearBf16Problem& p) {
  quant::with_format<Multiply>(p.type, p);
}

#else  // no AVX-512 bfloat16 pair products: bindings widen x and call quant_linear

bool quant_linear_bf16_available() { return false; }
void quant_linear_bf16(const QuantLinearBf16Problem&) {}

#endif  // PAGEDLLM_QUANT_BF16

}  // namespace pagedllm
