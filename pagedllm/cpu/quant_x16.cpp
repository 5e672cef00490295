// y = x w^T + bias for bfloat16 x with w in GGUF blocks interleaved by groups of 16 output
// features ("x16"): the same bytes as the file's, reordered once at load so that one
// vector holds one pair of weights of 16 outputs.
//
// Layout: output features are taken 16 at a time (a group; the last one padded with zero
// blocks); for each group and each block column b, the 16 features' blocks are read as
// [16][kBytes / 2] units of 2 bytes and stored transposed, [kBytes / 2][16]. So unit u of
// feature o lies at byte 32 u + 2 o of the group's block column: a block's half-precision
// factors (d, and m for Q4_1) become 16 consecutive halves, and each 2-byte unit of its
// codes becomes 32 bytes whose byte pair (2 o, 2 o + 1) is feature o's. For Q4_0 / Q4_1 a
// code unit c holds weights 2c, 2c + 1 (low nibbles) and 2c + 16, 2c + 17 (high); for
// Q8_0, unit j holds weights 2j and 2j + 1. Decoding a unit therefore yields the bfloat16
// pairs of 16 features for pairs of consecutive weights: x is used as stored (no
// permutation), and the scales of a block column are one vector (lane = feature).
//
// The arithmetic is that of quant_linear_bf16.cpp: exact bfloat16 code products summed in
// float32 per block, times the block's scale, plus offset * (the chunk's sum of x), one
// rounding at the end. Up to kMaxDotRows rows each group is decoded in registers and
// multiplied into kDotRows rows at a time (its bytes read from memory once, decoded once
// per pass); more rows decode two groups at a time into a panel (quant_panel.h) and run
// against it kChainedRows rows at a time. Both paths sum a block's pair products in the
// same order (kChains chains, each pair's chain given by its place in the block, the
// chains added in turn), so a row's result depends neither on the other rows nor on
// the path: the engine's tokens do not change with the number of rows in a step (a
// speculative step's verification rows give the logits of one-token steps). Measured
// on a 2-core Zen 4, the weights of a whole Q4_1 decode step streamed from memory: 16
// rows 13-16 ms in passes against 17-19 ms in panels.

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

constexpr int kGroup = 16;           // output features per interleaved group
constexpr int64_t kDotRows = 4;      // rows per pass of a group decoded in registers
static_assert(kDotRows == 4, "dot_groups dispatches 1 to 4 rows");
constexpr int kChains = 4;           // running sums per row: the same for every pass size
constexpr int64_t kMaxDotRows = 16;  // up to this many rows, the register path
constexpr int kChainedRows = 4;      // rows per panel tile: 6 vectors per row in registers
static_assert(kChainedRows == 4, "chained_rows dispatches 1 to 4 rows");

// Exact bfloat16 pairs of 16 features from one 32-byte unit row of an x16 block column.
template <typename B>
struct X16Codes;

// Q4_0 (code = q - 8) and Q4_1 (code = q): unit c -> pairs c (low nibbles) and c + 8.
template <int kFactorUnits, int kCodeBias>
struct X16Nibbles {
  static constexpr int kUnits = 8, kPairsPerUnit = 2, kFactorBytes = 32 * kFactorUnits;
  static constexpr int kBias = kCodeBias;
  static constexpr bool kOffset = kFactorUnits == 2;
  static void codes(const uint8_t* column, int c, const CodeTable& table, __m512i* pairs) {
    const __m512i words = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(column + kFactorBytes + 32 * c)));
    const __m512i nibble = _mm512_set1_epi16(0x0f);
    pairs[0] = table.lookup32(_mm512_and_si512(words, nibble));
    pairs[1] = table.lookup32(_mm512_srli_epi16(words, 4));
  }
  static constexpr int pair_index(int c, int k) { return c + 8 * k; }
};

template <> struct X16Codes<Q4_0> : X16Nibbles<1, 8> {};
template <> struct X16Codes<Q4_1> : X16Nibbles<2, 0> {};

// Q8_0: unit j -> pair j (integers below 2^8 in magnitude: the float's high half).
template <>
struct X16Codes<Q8_0> {
  static constexpr int kUnits = 16, kPairsPerUnit = 1, kFactorBytes = 32, kBias = 0;
  static constexpr bool kOffset = false;
  static void codes(const uint8_t* column, int j, const CodeTable& table, __m512i* pairs) {
    // Codes<Q8_0> reads a block's 32 codes after its 2-byte scale: point 2 bytes early.
    pairs[0] = Codes<Q8_0>::codes(column + kFactorBytes + 32 * j - 2, 0, table);
  }
  static constexpr int pair_index(int j, int) { return j; }
};

template <typename B>
inline __m512 offsets_of(const uint8_t* column) {
  if constexpr (X16Codes<B>::kOffset) return halves(column + 32);
  return _mm512_setzero_ps();
}

// y[m0 + m, 16 g .. 16 g + 16) for rows m0 .. m0 + MR of x: the group's block columns
// decoded into registers, each pair multiplied into every row (x's pair broadcast),
// kChains running sums per row, added and scaled per block column.
template <typename B, int MR>
void dot_group(const QuantLinearBf16Problem& p, const CodeTable& table, const float* sums,
               int64_t g, int64_t m0) {
  using X = X16Codes<B>;
  const int64_t blocks = p.K / B::kValues, column_bytes = kGroup * B::kBytes;
  const uint16_t* x = p.x + m0 * p.K;
  const uint8_t* column = p.weight + g * blocks * column_bytes;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, column += column_bytes) {
    prefetch_ahead(column, column_bytes, kPrefetchBytes);
    __m512 part[MR][kChains];
    for (int m = 0; m < MR; ++m)
      for (int c = 0; c < kChains; ++c) part[m][c] = _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int unit = 0; unit < X::kUnits; ++unit) {
      __m512i pairs[X::kPairsPerUnit];
      X::codes(column, unit, table, pairs);
#pragma GCC unroll 2
      for (int k = 0; k < X::kPairsPerUnit; ++k) {
        const int pair = X::pair_index(unit, k);
        const int chain = (unit * X::kPairsPerUnit + k) % kChains;
        for (int m = 0; m < MR; ++m) {
          const __m512bh xv = (__m512bh)pair_of(x + m * p.K + b * 32 + 2 * pair);
          part[m][chain] = _mm512_dpbf16_ps(part[m][chain], xv, (__m512bh)pairs[k]);
        }
      }
    }
    const __m512 scale = halves(column), offset = offsets_of<B>(column);
    for (int m = 0; m < MR; ++m) {
      __m512 sum = part[m][0];
      for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, part[m][c]);
      acc[m] = _mm512_fmadd_ps(sum, scale, acc[m]);
      if constexpr (X::kOffset)
        acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[(m0 + m) * blocks + b]), acc[m]);
    }
  }
  const int64_t n0 = g * kGroup, left = p.N - n0;
  const __mmask16 mask = left >= kGroup ? static_cast<__mmask16>(0xffff)
                                        : static_cast<__mmask16>((1u << left) - 1);
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0) : _mm512_setzero_ps();
  uint16_t* y = p.y + m0 * p.N + n0;
  for (int m = 0; m < MR; ++m)
    bf16::store_sums(p, y + m * p.N, _mm512_add_ps(acc[m], bias), mask);
}

// Groups g0 .. g1 for every row, kDotRows rows at a time: a group's bytes are read from
// memory once and decoded once per chunk of rows (they stay in cache between chunks).
template <typename B>
void dot_groups(const QuantLinearBf16Problem& p, const float* sums, int64_t g0, int64_t g1) {
  const CodeTable table(X16Codes<B>::kBias);
  const int64_t group_bytes = p.K / B::kValues * kGroup * B::kBytes;
  prefetch_start(p.weight + g0 * group_bytes, (g1 - g0) * group_bytes);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m0 = 0; m0 < p.M; m0 += kDotRows) {
      switch (std::min<int64_t>(kDotRows, p.M - m0)) {
        case 1: dot_group<B, 1>(p, table, sums, g, m0); break;
        case 2: dot_group<B, 2>(p, table, sums, g, m0); break;
        case 3: dot_group<B, 3>(p, table, sums, g, m0); break;
        default: dot_group<B, 4>(p, table, sums, g, m0); break;  // kDotRows = 4
      }
    }
  }
}

// Panel index (kPanel = 2 groups) decoded: codes [K / 2][kPanel] pairs, scales and
// offsets [blocks][kPanel]; a group past the weight's last decodes to zero.
template <typename B>
void decode_panel(const QuantLinearBf16Problem& p, int64_t index, Panel& panel) {
  using X = X16Codes<B>;
  static_assert(kPanel == 2 * kGroup, "a panel is two groups");
  const int64_t blocks = p.K / B::kValues, column_bytes = kGroup * B::kBytes;
  const int64_t groups = (p.N + kGroup - 1) / kGroup;
  panel.codes.resize(p.K / 2 * kPanel);
  panel.scales.resize(blocks * kPanel);
  panel.offsets.resize(X::kOffset ? blocks * kPanel : 0);
  const CodeTable table(X::kBias);
  for (int half = 0; half < 2; ++half) {
    const int64_t g = 2 * index + half;
    for (int64_t b = 0; b < blocks; ++b) {
      uint32_t* codes = panel.codes.data() + b * 16 * kPanel + kGroup * half;
      float* scales = panel.scales.data() + b * kPanel + kGroup * half;
      if (g >= groups) {
        for (int pair = 0; pair < 16; ++pair)
          _mm512_storeu_si512(codes + pair * kPanel, _mm512_setzero_si512());
        _mm512_storeu_ps(scales, _mm512_setzero_ps());
        if constexpr (X::kOffset)
          _mm512_storeu_ps(panel.offsets.data() + b * kPanel + kGroup * half, _mm512_setzero_ps());
        continue;
      }
      const uint8_t* column = p.weight + (g * blocks + b) * column_bytes;
      for (int unit = 0; unit < X::kUnits; ++unit) {
        __m512i pairs[X::kPairsPerUnit];
        X::codes(column, unit, table, pairs);
        for (int k = 0; k < X::kPairsPerUnit; ++k)
          _mm512_storeu_si512(codes + X::pair_index(unit, k) * kPanel, pairs[k]);
      }
      _mm512_storeu_ps(scales, halves(column));
      if constexpr (X::kOffset)
        _mm512_storeu_ps(panel.offsets.data() + b * kPanel + kGroup * half, offsets_of<B>(column));
    }
  }
}

// y[m, n0 .. n0 + kPanel) for MR rows of x against a decoded panel (two groups), summing
// each block's pair products exactly as dot_group does: chain c holds the pairs at
// places c, c + kChains, ... of the block's (unit, pair) order, and the chains are added
// in turn before the block's scale (and offset) apply.
template <typename B, int MR>
void chained_tile(const QuantLinearBf16Problem& p, const Panel& panel, const uint16_t* x,
                  const float* sums, uint16_t* y, int64_t n0) {
  using X = X16Codes<B>;
  constexpr int kPairs = X::kUnits * X::kPairsPerUnit;  // pairs per block: 16
  const int64_t blocks = p.K / B::kValues;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint32_t* codes = panel.codes.data() + b * kPairs * kPanel;
    __m512 sum[MR][2];
    for (int c = 0; c < kChains; ++c) {
      __m512 part[MR][2];
      for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int place = c; place < kPairs; place += kChains) {
        const int pair = X::pair_index(place / X::kPairsPerUnit, place % X::kPairsPerUnit);
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(codes + pair * kPanel);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(codes + pair * kPanel + 16);
        for (int m = 0; m < MR; ++m) {
          const __m512bh xv = (__m512bh)pair_of(x + m * p.K + b * 32 + 2 * pair);
          part[m][0] = _mm512_dpbf16_ps(part[m][0], xv, w0);
          part[m][1] = _mm512_dpbf16_ps(part[m][1], xv, w1);
        }
      }
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 2; ++v)
          sum[m][v] = c == 0 ? part[m][v] : _mm512_add_ps(sum[m][v], part[m][v]);
    }
    const float* scales = panel.scales.data() + b * kPanel;
    const __m512 s0 = _mm512_loadu_ps(scales), s1 = _mm512_loadu_ps(scales + 16);
    for (int m = 0; m < MR; ++m) {
      acc[m][0] = _mm512_fmadd_ps(sum[m][0], s0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(sum[m][1], s1, acc[m][1]);
    }
    if constexpr (X::kOffset) {
      const float* offsets = panel.offsets.data() + b * kPanel;
      const __m512 o0 = _mm512_loadu_ps(offsets), o1 = _mm512_loadu_ps(offsets + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 chunk = _mm512_set1_ps(sums[m * blocks + b]);
        acc[m][0] = _mm512_fmadd_ps(o0, chunk, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(o1, chunk, acc[m][1]);
      }
    }
  }
  store_panel_sums<MR>(p, acc, y, n0);
}

// Every row of x against one decoded panel, kChainedRows rows at a time.
template <typename B>
void chained_rows(const QuantLinearBf16Problem& p, const Panel& panel, const float* sums,
                  int64_t n0) {
  const int64_t blocks = p.K / B::kValues;
  for (int64_t m = 0; m < p.M; m += kChainedRows) {
    const uint16_t* x = p.x + m * p.K;
    uint16_t* y = p.y + m * p.N;
    const float* s = X16Codes<B>::kOffset ? sums + m * blocks : sums;
    switch (std::min<int64_t>(kChainedRows, p.M - m)) {
      case 1: chained_tile<B, 1>(p, panel, x, s, y, n0); break;
      case 2: chained_tile<B, 2>(p, panel, x, s, y, n0); break;
      case 3: chained_tile<B, 3>(p, panel, x, s, y, n0); break;
      default: chained_tile<B, 4>(p, panel, x, s, y, n0); break;  // kChainedRows = 4
    }
  }
}

template <typename B>
void multiply(const QuantLinearBf16Problem& p) {
  const std::vector<float> sums = X16Codes<B>::kOffset ? chunk_sums(p) : std::vector<float>();
  const int64_t groups = (p.N + kGroup - 1) / kGroup;
  const int64_t bytes = groups * kGroup * (p.K / B::kValues * B::kBytes);
  const int threads = bytes < kMinParallelBytes ? 1 : p.num_threads;
  if (p.M <= kMaxDotRows) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t count = omp_get_num_threads(), t = omp_get_thread_num();
      dot_groups<B>(p, sums.data(), groups * t / count, groups * (t + 1) / count);
    }
    return;
  }
  const int64_t panels = (groups + 1) / 2;
#pragma omp parallel num_threads(threads)
  {
    Panel panel;
#pragma omp for schedule(static)
    for (int64_t index = 0; index < panels; ++index) {
      decode_panel<B>(p, index, panel);
      chained_rows<B>(p, panel, sums.data(), index * kPanel);
    }
  }
}

}  // namespace

bool quant_x16_supports(int64_t type) {
  return type == kQ8_0 || type == kQ4_0 || type == kQ4_1;
}

void quant_linear_x16(const QuantLinearBf16Problem& p) {
  switch (p.type) {
    case kQ8_0: multiply<Q8_0>(p); break;
    case kQ4_0: multiply<Q4_0>(p); break;
    case kQ4_1: multiply<Q4_1>(p); break;
    default: break;  // the bindings check quant_x16_supports first
  }
}

#else  // no AVX-512 bfloat16 pair products: no interleaved kernels

bool quant_x16_supports(int64_t) { return false; }
void quant_linear_x16(const QuantLinearBf16Problem&) {}

#endif  // PAGEDLLM_QUANT_BF16

}  // namespace pagedllm
