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
#include "quant_panel.h"

namespace pagedllm {

#ifdef PAGEDLLM_QUANT_BF16

namespace {

using namespace quant;

constexpr int64_t kMaxDotRows = 3;  // up to this many rows, decode in registers per output
static_assert(kMaxDotRows == 3, "few_rows dispatches 1, 2 or 3 rows");

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

// One block's scales and offsets as broadcast vectors, chunk by chunk: the one-chunk
// formats convert their halves straight into vectors; the K-quants unpack their factors
// once per block. The scale of lane t is its pair's group's (pair t / kGroupPairs).
template <typename C, bool kOneChunk = C::kChunks == 1>
class BlockFactors {
 public:
  void load(const uint8_t* block) {
    scale_ = C::scale_vector(block);
    offset_ = C::offset_vector(block);
  }
  __m512 scale(int) const { return scale_; }
  __m512 offset(int) const { return offset_; }

 private:
  __m512 scale_, offset_;
};

template <typename C>
class BlockFactors<C, false> {
 public:
  void load(const uint8_t* block) { C::factors(block, scale_, offset_); }
  __m512 scale(int chunk) const {
    if constexpr (C::kGroupPairs == 16) {
      return _mm512_set1_ps(scale_[chunk]);
    } else {
      return _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(scale_[2 * chunk]),
                                  _mm512_set1_ps(scale_[2 * chunk + 1]));
    }
  }
  __m512 offset(int chunk) const { return _mm512_set1_ps(offset_[chunk]); }

 private:
  float scale_[C::kChunks * 16 / C::kGroupPairs], offset_[C::kChunks];
};

// Few rows: y[m, n .. n + kOutputs) for the MR rows of x, each output's blocks decoded
// once into registers and multiplied into every row while there (a decode step reads
// each weight once). Per chunk, lane t of an output's sums takes the scaled pair
// products of pair t; lane 0 also takes offset * (the chunk's sum of x). The lanes are
// added once per output.
template <typename B, int MR, int kOutputs>
void dot_rows(const QuantLinearBf16Problem& p, const CodeTable& table, const uint16_t* x,
              const float* sums, uint16_t* y, int64_t n) {
  using C = Codes<B>;
  const int64_t blocks = p.K / B::kValues, chunks = p.K / 32;
  const int64_t row_bytes = blocks * B::kBytes;
  const int64_t distance = prefetch_rows(row_bytes, kOutputs) * row_bytes;
  const uint8_t* first = p.weight + n * row_bytes;
  __m512 acc[MR][kOutputs];
  for (int m = 0; m < MR; ++m)
    for (int o = 0; o < kOutputs; ++o) acc[m][o] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, first += B::kBytes) {
    BlockFactors<C> factors[kOutputs];
    for (int o = 0; o < kOutputs; ++o) {
      prefetch_ahead(first + o * row_bytes, B::kBytes, distance);
      factors[o].load(first + o * row_bytes);
    }
    for (int c = 0; c < C::kChunks; ++c) {
      const int64_t chunk = b * C::kChunks + c;
      __m512bh codes[kOutputs];
      for (int o = 0; o < kOutputs; ++o)
        codes[o] = (__m512bh)C::codes(first + o * row_bytes, c, table);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * p.K + chunk * 32);
        const __m512 x_sum = C::kOffset ? _mm512_zextps128_ps512(_mm_set_ss(sums[m * chunks + chunk]))
                                        : _mm512_setzero_ps();
        for (int o = 0; o < kOutputs; ++o) {
          const __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), xv, codes[o]);
          acc[m][o] = _mm512_fmadd_ps(part, factors[o].scale(c), acc[m][o]);
          if constexpr (C::kOffset)
            acc[m][o] = _mm512_fmadd_ps(factors[o].offset(c), x_sum, acc[m][o]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int o = 0; o < kOutputs; ++o) {
      const float bias = p.bias ? p.bias[n + o] : 0.0f;
      const float sum = _mm512_reduce_add_ps(acc[m][o]) + bias;
      bf16::store_sums(p, y + m * p.N + n + o, _mm512_set1_ps(sum), 1);
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
