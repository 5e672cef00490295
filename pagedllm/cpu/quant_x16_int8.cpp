// y = x w^T + bias for bfloat16 x with w in the x16 layout of quant_x16.cpp (Q8_0, Q4_0,
// Q4_1), with x quantized to int8 on the fly, as llama.cpp does: the products then run on
// the CPU's int8 quad products (vpdpbusd, AVX-512 VNNI), 64 multiply-adds per
// instruction against the 32 of the bfloat16 pair products.
//
// Arithmetic. Each row of x is cut into blocks of 32 values; a block's scale is
// dx = max |x| / 127 (float32) and its codes q = round(x / dx) (to nearest, ties to even;
// all zero where the block is), so x is read as dx * q. Every weight format is
// w = d * c + o with an integer code c (Q8_0: the int8 code, Q4_0: nibble - 8, Q4_1: the
// nibble) and a per-block scale d and offset o (Q4_1's m, else 0). Then
//   sum_k x_k w_k = dx * d * sum_k q_k c_k + o * dx * sum_k q_k    (per block)
// where the integer sums are exact (int32). The instruction multiplies unsigned by signed
// bytes: x enters as q + 128 (1 .. 255) and the 128 * sum_k c_k it adds is taken off by
// starting each block's int32 sum at -128 * sum_k c_k, computed when the weights are
// decoded. The float32 sums over blocks are rounded once to bfloat16. So the result
// equals the float32 product of the quantized x with the dequantized weights up to float32
// rounding; against the exact product of quant_x16.cpp it differs by x's rounding to
// 8 bits per block (relative error up to 1/254 of the block's largest |x| per value).
//
// Up to kMaxDotRows rows, each group's block columns are decoded in registers and
// multiplied into kDotRows rows at a time (the bytes come from memory once; a pass
// decodes again from cache). More rows: the weights are decoded kPanel output features
// at a time into a cache-resident panel (int8 codes four k per lane, the block sums and
// factors) and every row runs against it, kRows at a time. Both paths add a block with
// the same float operations (integer sums are exact in any order), so a row's result
// never depends on the other rows or on the path. Measured on a 2-core Zen 4 (a step's
// Q8_0 products of the default model's shapes): passes led panels up to 64 rows (64:
// 29.7 against 30.6 ms; 16: 10.4 against 17.7), panels from 128 (52.6 against 55.9);
// 6-row passes spilled registers (2x slower).

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bfloat16.h"
#include "kernels.h"
#include "quant_codes.h"

namespace pagedllm {

#if defined(PAGEDLLM_QUANT_BF16) && defined(__AVX512VNNI__)

namespace {

using namespace quant;

constexpr int kGroup = 16;  // output features per interleaved group (quant_x16.cpp)
constexpr int kPanel = 32;  // output features per panel: two groups, two vectors
constexpr int kRows = 6;    // rows of x per tile: 2 x 6 block sums, 2 x 6 totals
constexpr int kSteps = 8;   // four-k steps per block of 32
constexpr int64_t kDotRows = 4;      // rows per pass of a block column decoded in registers
constexpr int64_t kMaxDotRows = 64;  // up to this many rows, the register passes

// Where a format keeps its codes in an x16 block column, and how two adjacent 32-byte
// code units become dword lanes of four consecutive k per feature.
template <typename B>
struct Int8Codes;

// Q8_0: unit j holds k = 2j, 2j + 1; units 2s and 2s + 1 give step s.
template <>
struct Int8Codes<Q8_0> {
  static constexpr int kFactorBytes = 32;
  static constexpr bool kOffset = false;
  // Steps 2t, 2t + 1 from the 64 code bytes of units 4t .. 4t + 3 (t < 4).
  static void steps(const uint8_t* column, int t, __m512i words_order, __m512i* out, int* at) {
    const uint8_t* units = column + kFactorBytes + 128 * t;
    out[0] = _mm512_permutexvar_epi16(words_order, _mm512_loadu_si512(units));
    out[1] = _mm512_permutexvar_epi16(words_order, _mm512_loadu_si512(units + 64));
    at[0] = 2 * t;
    at[1] = 2 * t + 1;
  }
};

// Q4_0 / Q4_1: unit c holds k = 2c, 2c + 1 (low nibbles) and 2c + 16, 2c + 17 (high);
// units 2t and 2t + 1 give steps t (low nibbles) and t + 4 (high).
template <int kFactorUnits, int kCodeBias>
struct NibbleCodes {
  static constexpr int kFactorBytes = 32 * kFactorUnits;
  static constexpr bool kOffset = kFactorUnits == 2;
  static void steps(const uint8_t* column, int t, __m512i words_order, __m512i* out, int* at) {
    const __m512i lanes = _mm512_permutexvar_epi16(
        words_order, _mm512_loadu_si512(column + kFactorBytes + 64 * t));
    const __m512i nibble = _mm512_set1_epi8(0x0f), bias = _mm512_set1_epi8(kCodeBias);
    out[0] = _mm512_sub_epi8(_mm512_and_si512(lanes, nibble), bias);
    out[1] = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(lanes, 4), nibble), bias);
    at[0] = t;
    at[1] = t + 4;
  }
};

template <> struct Int8Codes<Q4_0> : NibbleCodes<1, 8> {};
template <> struct Int8Codes<Q4_1> : NibbleCodes<2, 0> {};

// One block column of one group decoded: the 8 steps' codes (four signed codes of one
// feature per lane), the int32 sums' start (-128 * the block's sum of codes per feature),
// and the block's scales and offsets.
template <typename B>
struct BlockColumn {
  __m512i codes[kSteps], start;
  __m512 scale, offset;

  void zero() {
    for (__m512i& step : codes) step = _mm512_setzero_si512();
    start = _mm512_setzero_si512();
    scale = offset = _mm512_setzero_ps();
  }

  void decode(const uint8_t* column) {
    using X = Int8Codes<B>;
    // word 2o <- word o (first unit, feature o), word 2o + 1 <- word 16 + o (second unit)
    const __m512i words_order =
        _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                         22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ones = _mm512_set1_epi8(1);
    __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};  // two chains
    for (int t = 0; t < 4; ++t) {
      __m512i step[2];
      int which[2];
      X::steps(column, t, words_order, step, which);
      for (int i = 0; i < 2; ++i) {
        codes[which[i]] = step[i];
        sums[i] = _mm512_dpbusd_epi32(sums[i], ones, step[i]);
      }
    }
    const __m512i sum = _mm512_add_epi32(sums[0], sums[1]);
    start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(sum, 7));
    scale = halves(column);
    offset = X::kOffset ? halves(column + 32) : _mm512_setzero_ps();
  }
};

// Output features n0 .. n0 + kPanel decoded, per block and group: the codes
// [K / 4][kPanel] dwords (step-major, 16 per group), start, scales and offsets
// [kPanel]. Features past the weight's last group decode to zero.
struct Panel {
  std::vector<int32_t> codes;
  std::vector<int32_t> start;
  std::vector<float> scales, offsets;
};

template <typename B>
void decode_panel(const QuantLinearBf16Problem& p, int64_t index, Panel& panel) {
  const int64_t blocks = p.K / 32, column_bytes = kGroup * B::kBytes;
  const int64_t groups = (p.N + kGroup - 1) / kGroup;
  panel.codes.resize(blocks * kSteps * kPanel);
  panel.start.resize(blocks * kPanel);
  panel.scales.resize(blocks * kPanel);
  panel.offsets.resize(blocks * kPanel);
  for (int half = 0; half < 2; ++half) {
    const int64_t g = 2 * index + half;
    for (int64_t b = 0; b < blocks; ++b) {
      BlockColumn<B> column;
      if (g < groups) {
        const uint8_t* bytes = p.weight + (g * blocks + b) * column_bytes;
        prefetch_ahead(bytes, column_bytes, kPrefetchBytes);
        column.decode(bytes);
      } else {
        column.zero();
      }
      int32_t* codes = panel.codes.data() + b * kSteps * kPanel + kGroup * half;
      for (int s = 0; s < kSteps; ++s) _mm512_storeu_si512(codes + s * kPanel, column.codes[s]);
      const int64_t at = b * kPanel + kGroup * half;
      _mm512_storeu_si512(panel.start.data() + at, column.start);
      _mm512_storeu_ps(panel.scales.data() + at, column.scale);
      _mm512_storeu_ps(panel.offsets.data() + at, column.offset);
    }
  }
}

// x quantized: per row, K bytes q + 128; per (row, block) dx and dx * sum q.
struct QuantizedRows {
  std::vector<uint8_t> codes;
  std::vector<float> scales, sums;
};

void quantize_rows(const QuantLinearBf16Problem& p, QuantizedRows& out) {
  const int64_t blocks = p.K / 32;
  out.codes.resize(p.M * p.K);
  out.scales.resize(p.M * blocks);
  out.sums.resize(p.M * blocks);
  const __m512i shift = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < p.M * blocks; ++i) {
    const uint16_t* x = p.x + i * 32;
    const __m512 low = bf16::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    const __m512 high = bf16::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(low), _mm512_abs_ps(high)));
    const float dx = amax / 127.0f;
    __m512i q0 = _mm512_setzero_si512(), q1 = _mm512_setzero_si512();
    if (dx > 0.0f) {
      const __m512 d = _mm512_set1_ps(dx);
      constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(low, d), kNearest));
      q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(high, d), kNearest));
    }
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    out.scales[i] = dx;
    out.sums[i] = dx * static_cast<float>(sum);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.codes.data() + i * 32),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(q0, shift)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.codes.data() + i * 32 + 16),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(q1, shift)));
  }
}

// acc plus one block's share: the int32 sum times scale * dx, then offset * dx * sum q.
// Both paths add blocks with exactly these operations, so they give the same bits.
template <typename B>
inline __m512 add_block(__m512 acc, __m512i part, __m512 scale, __m512 offset, float dx,
                        float x_sum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part), _mm512_mul_ps(scale, _mm512_set1_ps(dx)), acc);
  if constexpr (Int8Codes<B>::kOffset) acc = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sum), acc);
  return acc;
}

// y[m, n0 .. n0 + 16) = acc + bias, rounded to bfloat16 (unless the problem asks for
// float32); features past N are left alone.
inline void store_row(const QuantLinearBf16Problem& p, __m512 acc, int64_t m, int64_t n0) {
  const int64_t left = p.N - n0;
  if (left <= 0) return;
  const __mmask16 mask =
      left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0) : _mm512_setzero_ps();
  bf16::store_sums(p, p.y + m * p.N + n0, _mm512_add_ps(acc, bias), mask);
}

inline __m512i x_quad(const QuantizedRows& xq, int64_t K, int64_t m, int64_t k) {
  return _mm512_set1_epi32(static_cast<int>(load_u32(xq.codes.data() + m * K + k)));
}

// Few rows: rows m0 .. m0 + MR against group g, each block column decoded in registers
// and multiplied into every row while there (a decode step reads each weight once).
template <typename B, int MR>
void dot_group(const QuantLinearBf16Problem& p, const QuantizedRows& xq, int64_t g, int64_t m0) {
  const int64_t blocks = p.K / 32, column_bytes = kGroup * B::kBytes;
  const uint8_t* bytes = p.weight + g * blocks * column_bytes;
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, bytes += column_bytes) {
    prefetch_ahead(bytes, column_bytes, kPrefetchBytes);
    BlockColumn<B> column;
    column.decode(bytes);
    __m512i part[MR][2];  // two chains per row (integer sums: any order is exact)
    for (int m = 0; m < MR; ++m) part[m][0] = column.start, part[m][1] = _mm512_setzero_si512();
    for (int s = 0; s < kSteps; ++s)
      for (int m = 0; m < MR; ++m)
        part[m][s % 2] = _mm512_dpbusd_epi32(
            part[m][s % 2], x_quad(xq, p.K, m0 + m, b * 32 + 4 * s), column.codes[s]);
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * blocks + b;
      acc[m] = add_block<B>(acc[m], _mm512_add_epi32(part[m][0], part[m][1]), column.scale,
                            column.offset, xq.scales[at], xq.sums[at]);
    }
  }
  for (int m = 0; m < MR; ++m) store_row(p, acc[m], m0 + m, g * kGroup);
}

template <typename B>
void dot_groups(const QuantLinearBf16Problem& p, const QuantizedRows& xq, int64_t g0,
                int64_t g1) {
  const int64_t group_bytes = p.K / 32 * kGroup * B::kBytes;
  prefetch_start(p.weight + g0 * group_bytes, (g1 - g0) * group_bytes);
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t m0 = 0; m0 < p.M; m0 += kDotRows) {
      switch (std::min<int64_t>(kDotRows, p.M - m0)) {
        case 1: dot_group<B, 1>(p, xq, g, m0); break;
        case 2: dot_group<B, 2>(p, xq, g, m0); break;
        case 3: dot_group<B, 3>(p, xq, g, m0); break;
        default: dot_group<B, 4>(p, xq, g, m0); break;  // kDotRows = 4
      }
    }
  }
}

// More rows: y[m, n0 .. n0 + kPanel) for the MR rows m0 .. m0 + MR against a panel.
template <typename B, int MR>
void tile(const QuantLinearBf16Problem& p, const Panel& panel, const QuantizedRows& xq,
          int64_t m0, int64_t n0) {
  const int64_t blocks = p.K / 32;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int32_t* codes = panel.codes.data();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * kPanel;
    const __m512i start[2] = {_mm512_loadu_si512(panel.start.data() + at),
                              _mm512_loadu_si512(panel.start.data() + at + 16)};
    __m512i part[MR][2];
    for (int m = 0; m < MR; ++m) part[m][0] = start[0], part[m][1] = start[1];
    for (int s = 0; s < kSteps; ++s, codes += kPanel) {
      const __m512i w0 = _mm512_loadu_si512(codes), w1 = _mm512_loadu_si512(codes + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = x_quad(xq, p.K, m0 + m, b * 32 + 4 * s);
        part[m][0] = _mm512_dpbusd_epi32(part[m][0], xv, w0);
        part[m][1] = _mm512_dpbusd_epi32(part[m][1], xv, w1);
      }
    }
    for (int v = 0; v < 2; ++v) {
      const __m512 scale = _mm512_loadu_ps(panel.scales.data() + at + 16 * v);
      const __m512 offset = _mm512_loadu_ps(panel.offsets.data() + at + 16 * v);
      for (int m = 0; m < MR; ++m) {
        const int64_t row_block = (m0 + m) * blocks + b;
        acc[m][v] = add_block<B>(acc[m][v], part[m][v], scale, offset, xq.scales[row_block],
                                 xq.sums[row_block]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < 2; ++v) store_row(p, acc[m][v], m0 + m, n0 + 16 * v);
}

template <typename B>
void panel_rows(const QuantLinearBf16Problem& p, const Panel& panel, const QuantizedRows& xq,
                int64_t n0) {
  int64_t m = 0;
  for (; m + kRows <= p.M; m += kRows) tile<B, kRows>(p, panel, xq, m, n0);
  switch (p.M - m) {
    case 5: tile<B, 5>(p, panel, xq, m, n0); break;
    case 4: tile<B, 4>(p, panel, xq, m, n0); break;
    case 3: tile<B, 3>(p, panel, xq, m, n0); break;
    case 2: tile<B, 2>(p, panel, xq, m, n0); break;
    case 1: tile<B, 1>(p, panel, xq, m, n0); break;
    default: break;
  }
}

template <typename B>
void multiply(const QuantLinearBf16Problem& p) {
  if (p.M == 0) return;
  QuantizedRows xq;
  quantize_rows(p, xq);
  const int64_t groups = (p.N + kGroup - 1) / kGroup, panels = (groups + 1) / 2;
  const int64_t bytes = groups * kGroup * (p.K / 32 * B::kBytes);
  const int threads = bytes < kMinParallelBytes ? 1 : p.num_threads;
  if (p.M <= kMaxDotRows) {
#pragma omp parallel num_threads(threads)
    {
      const int64_t count = omp_get_num_threads(), t = omp_get_thread_num();
      dot_groups<B>(p, xq, groups * t / count, groups * (t + 1) / count);
    }
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    Panel panel;
#pragma omp for schedule(static)
    for (int64_t index = 0; index < panels; ++index) {
      decode_panel<B>(p, index, panel);
      panel_rows<B>(p, panel, xq, index * kPanel);
    }
  }
}

}  // namespace

bool quant_x16_int8_supports(int64_t type) {
  return type == kQ8_0 || type == kQ4_0 || type == kQ4_1;
}

void quant_linear_x16_int8(const QuantLinearBf16Problem& p) {
  switch (p.type) {
    case kQ8_0: multiply<Q8_0>(p); break;
    case kQ4_0: multiply<Q4_0>(p); break;
    case kQ4_1: multiply<Q4_1>(p); break;
    default: break;  // the bindings check quant_x16_int8_supports first
  }
}

#else  // no AVX-512 VNNI and bfloat16 pair products: no int8-activation kernels

bool quant_x16_int8_supports(int64_t) { return false; }
void quant_linear_x16_int8(const QuantLinearBf16Problem&) {}

#endif

}  // namespace pagedllm
