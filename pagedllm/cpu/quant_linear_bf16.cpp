// y = x w^T + bias for bfloat16 x with w kept in a GGUF block format, on the CPU's
// bfloat16 pair products (vdpbf16ps), without expanding w. Every format is read as
// w = scale * code + offset (quant_codes.h): products of bfloat16 x and the integer codes
// are exact, a group's pair products are summed in float32 and multiplied by its scales,
// and offset * (sum of the chunk's x) is added per chunk of 32; the float32 sums are
// rounded once to bfloat16, so a result differs from the float32 product over the
// dequantized weights by float32 rounding and that one rounding.
//
// Both paths add a row's products in one order (dot_quad describes it), so a row's result
// is the same bits whatever the other rows of the call and whichever path runs it: the
// engine's tokens do not change with the number of rows in a step (a speculative step's
// verification rows give the logits of one-token steps).
// Up to kMaxDotRows rows (decode, a verification): 4 outputs at a time decode into
// registers and multiply into every row (dot_quad), each block read from memory once.
// More rows: each thread decodes kPanel output features at a time into a panel
// (cache-resident): the codes as bfloat16 pairs, k-major ([K / 2][kPanel] pairs, the
// layout of the bfloat16 packed_linear panels), and the features' scales and offsets per
// group and chunk; every row of x then runs against it, kRows rows at a time (tile).
// Measured on a 2-core AMD EPYC Zen 5, one thread, a TinyLlama-1.1B layer's weights
// streamed from memory: 4 to 8 rows in registers take 0.44-0.77x the panels' time.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bfloat16.h"
#include "kernels.h"
#include "quant_codes.h"
#include "quant_panel.h"

namespace pagedllm {

#ifdef PAGEDLLM_QUANT_BF16

namespace {

using namespace quant;

constexpr int64_t kMaxDotRows = 8;  // up to this many rows, decode in registers
static_assert(kMaxDotRows == 8, "few_rows dispatches 1 to 8 rows");
constexpr int kQuad = 4;  // outputs decoded in registers together: 4 x 4 lanes of a vector
constexpr int kRows = 6;  // rows of x per panel tile

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

inline int load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Lane o (0 .. 3) = the half at blocks[o] + at, as float32 (exact).
inline __m128 halves_of(const uint8_t* const* blocks, int at) {
  __m128i h = _mm_cvtsi32_si128(load_u16(blocks[0] + at));
  h = _mm_insert_epi16(h, load_u16(blocks[1] + at), 1);
  h = _mm_insert_epi16(h, load_u16(blocks[2] + at), 2);
  h = _mm_insert_epi16(h, load_u16(blocks[3] + at), 3);
  return _mm_cvtph_ps(h);
}

// 16 bytes of each of the 4 blocks, from byte `at`: block o's in 128-bit lane o.
inline __m512i bytes_of(const uint8_t* const* blocks, int at) {
  auto load = [&](int o) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks[o] + at));
  };
  const __m512i v = _mm512_inserti32x4(_mm512_castsi128_si512(load(0)), load(1), 1);
  return _mm512_inserti32x4(_mm512_inserti32x4(v, load(2), 2), load(3), 3);
}

// Byte 4 k + j of lane o of v (bytes_of's lanes), an unsigned or signed integer, times
// lane o of d, as lane 4 o + j of out[k] (k, j = 0 .. 3): one float32 product each.
template <bool kSigned>
inline void floats_of(__m512i v, __m128 d, __m512 (&out)[4]) {
  const __m512i by_k = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
  const __m512 d_of_lane = _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
      _mm512_castps128_ps512(d));
  const __m128i parts[4] = {_mm512_castsi512_si128(by_k), _mm512_extracti32x4_epi32(by_k, 1),
                            _mm512_extracti32x4_epi32(by_k, 2), _mm512_extracti32x4_epi32(by_k, 3)};
  for (int k = 0; k < 4; ++k) {
    const __m512i wide =
        kSigned ? _mm512_cvtepi8_epi32(parts[k]) : _mm512_cvtepu8_epi32(parts[k]);
    out[k] = _mm512_mul_ps(d_of_lane, _mm512_cvtepi32_ps(wide));
  }
}

// Lane 4 o + j of v in every lane (q, o): output o's value j in each 128-bit lane q.
inline __m512 spread(__m512 v, int j) {
  const __m512i outputs = _mm512_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12);
  return _mm512_permutexvar_ps(_mm512_add_epi32(outputs, _mm512_set1_epi32(j)), v);
}

// The factors of one block of 4 outputs (blocks[o]: output o's) in the lanes (q, o) of
// dot_quad, the same in every q: scale(c, g), output o's scale of group g of chunk c;
// offset(c), its offset of chunk c. Each is the float32 value Codes<B>::factors gives
// decode_panel, computed for 4 blocks at once.
template <typename B, bool kOneChunk = Codes<B>::kChunks == 1>
class QuadFactors {  // one chunk: scale d (Q8_0, Q4_0, Q5_0), offset m (Q4_1, Q5_1)
 public:
  explicit QuadFactors(const uint8_t* const* blocks) {
    scale_ = _mm512_broadcast_f32x4(halves_of(blocks, 0));
    if constexpr (Codes<B>::kOffset) offset_ = _mm512_broadcast_f32x4(halves_of(blocks, 2));
  }
  __m512 scale(int, int) const { return scale_; }
  __m512 offset(int) const { return offset_; }

 private:
  __m512 scale_, offset_ = _mm512_setzero_ps();
};

template <typename B>
class QuadFactors<B, false> {  // Q4_K, Q5_K: d * scale_c and -(dmin * min_c), chunk c
 public:
  explicit QuadFactors(const uint8_t* const* blocks) {
    // Block o's bytes 0 .. 15: d, dmin, then q[0 .. 11], the 6-bit scales and mins. In its
    // 128-bit lane, byte j (j < 8) becomes scale j and byte 8 + j min j, as scale_min_k4 reads
    // them: for j < 4, q[j] & 63 and q[j + 4] & 63; from 4 on the low (scale) or high
    // (min) nibble of q[j + 4], with bits 6 and 7 of q[j - 4] (scale) or q[j] (min) above.
    const __m512i head = bytes_of(blocks, 0);
    const __m512i low = _mm512_shuffle_epi8(
        head, _mm512_broadcast_i32x4(
                  _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)));
    const __m512i nibbles =
        _mm512_mask_blend_epi8(0xf000f000f000f000ull, low, _mm512_srli_epi16(low, 4));
    const __m512i kept = _mm512_and_si512(
        nibbles, _mm512_broadcast_i32x4(_mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63,
                                                      63, 63, 15, 15, 15, 15)));
    const __m512i top = _mm512_shuffle_epi8(
        head, _mm512_broadcast_i32x4(
                  _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11)));
    const __m512i factors = _mm512_or_si512(
        kept, _mm512_and_si512(_mm512_srli_epi16(top, 2), _mm512_set1_epi8(0x30)));
    // -(dmin * min) is (-dmin) * min, bit for bit.
    const __m128 minus_dmin = _mm_xor_ps(halves_of(blocks, 2), _mm_set1_ps(-0.0f));
    __m512 scales[4], mins[4];
    floats_of<false>(factors, halves_of(blocks, 0), scales);  // [0], [1]: chunks 0-3, 4-7
    floats_of<false>(factors, minus_dmin, mins);              // [2], [3]: chunks 0-3, 4-7
    scales_[0] = scales[0], scales_[1] = scales[1];
    offsets_[0] = mins[2], offsets_[1] = mins[3];
  }
  __m512 scale(int c, int) const { return spread(scales_[c / 4], c % 4); }
  __m512 offset(int c) const { return spread(offsets_[c / 4], c % 4); }

 private:
  __m512 scales_[2], offsets_[2];  // lane 4 o + j of [k]: output o's, of chunk 4 k + j
};

template <>
class QuadFactors<Q6_K, false> {  // d * scale_g per 16 weights: chunk c, groups 2 c, 2 c + 1
 public:
  explicit QuadFactors(const uint8_t* const* blocks) {
    floats_of<true>(bytes_of(blocks, 192), halves_of(blocks, 208), scales_);
  }
  __m512 scale(int c, int g) const { return spread(scales_[c / 2], 2 * (c % 2) + g); }
  __m512 offset(int) const { return _mm512_setzero_ps(); }

 private:
  __m512 scales_[4];  // lane 4 o + j of [k]: output o's, of group 4 k + j
};

alignas(64) constexpr uint8_t kZeroBlock[256] = {};  // stands for outputs past N

// y[m, n0 .. n0 + kQuad) for the MR rows of x, the outputs' blocks decoded into registers
// once and multiplied into every row while there (a decode step reads each weight once).
//
// The order of both paths, per output (lane): one running sum, from zero. Per chunk of
// 32 weights (16 pairs) and per group of the chunk (its pairs sharing a scale: 16, or
// Q6_K's 8), each quarter of the chunk in the group (4 pairs, 4q .. 4q + 3) chains its 4
// pair products from zero in pair order; the group's quarters are added pairwise,
// (first + second) + (third + fourth), or first + second for 8 pairs; the running sum
// takes that times the group's scale (a multiply-add), then offset * (the row's sum of
// x over the chunk). Last, the bias.
//
// Here lane (q, o) of a vector is lane o of 128-bit lane q: per chunk the 4 outputs'
// codes are transposed within 128-bit lanes so that vector i holds pair 4q + i of output
// o in lane (q, o), x's pair 4q + i is broadcast within lane q, and 4 chained pair
// products give every quarter of the 4 outputs; two 128-bit shuffles add the quarters.
template <typename B, int MR>
void dot_quad(const QuantLinearBf16Problem& p, const CodeTable& table, const float* sums,
              int64_t n0) {
  using C = Codes<B>;
  static_assert(kQuad == 4, "lane (q, o) of a vector: 4 x 4");
  const int64_t blocks = p.K / B::kValues, chunks = p.K / 32;
  const int64_t row_bytes = blocks * B::kBytes;
  const int64_t distance = prefetch_rows(row_bytes, kQuad) * row_bytes;
  const int live = static_cast<int>(std::min<int64_t>(kQuad, p.N - n0));
  const uint8_t* block[kQuad];  // output o's block b; past N, kZeroBlock throughout
  int64_t step[kQuad];
  for (int o = 0; o < kQuad; ++o) {
    block[o] = o < live ? p.weight + (n0 + o) * row_bytes : kZeroBlock;
    step[o] = o < live ? B::kBytes : 0;
  }
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    for (int o = 0; o < live; ++o) prefetch_ahead(block[o], B::kBytes, distance);
    const QuadFactors<B> factors(block);
    // Unrolled, a K-quant's chunk shifts and offsets are constants: 1.3-1.5x faster.
#pragma GCC unroll 8
    for (int c = 0; c < C::kChunks; ++c) {
      const int64_t chunk = b * C::kChunks + c;
      const __m512i codes0 = C::codes(block[0], c, table), codes1 = C::codes(block[1], c, table);
      const __m512i codes2 = C::codes(block[2], c, table), codes3 = C::codes(block[3], c, table);
      const __m512i low01 = _mm512_unpacklo_epi32(codes0, codes1);
      const __m512i high01 = _mm512_unpackhi_epi32(codes0, codes1);
      const __m512i low23 = _mm512_unpacklo_epi32(codes2, codes3);
      const __m512i high23 = _mm512_unpackhi_epi32(codes2, codes3);
      const __m512bh pairs[4] = {(__m512bh)_mm512_unpacklo_epi64(low01, low23),
                                 (__m512bh)_mm512_unpackhi_epi64(low01, low23),
                                 (__m512bh)_mm512_unpacklo_epi64(high01, high23),
                                 (__m512bh)_mm512_unpackhi_epi64(high01, high23)};
      const __m512 offset = factors.offset(c);
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = _mm512_loadu_si512(p.x + m * p.K + chunk * 32);
        __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(),
                                       (__m512bh)_mm512_shuffle_epi32(xv, _MM_PERM_AAAA), pairs[0]);
        part = _mm512_dpbf16_ps(part, (__m512bh)_mm512_shuffle_epi32(xv, _MM_PERM_BBBB), pairs[1]);
        part = _mm512_dpbf16_ps(part, (__m512bh)_mm512_shuffle_epi32(xv, _MM_PERM_CCCC), pairs[2]);
        part = _mm512_dpbf16_ps(part, (__m512bh)_mm512_shuffle_epi32(xv, _MM_PERM_DDDD), pairs[3]);
        // 128-bit lanes 0 and 2: quarters 0 + 1 and 2 + 3 (lanes 1 and 3 the same sums).
        const __m512 halves = _mm512_add_ps(part, _mm512_shuffle_f32x4(part, part, 0xb1));
        const __m512 other = _mm512_shuffle_f32x4(halves, halves, 0x4e);  // 2 + 3 in lane 0
        if constexpr (C::kGroupPairs == 16) {
          acc[m] = _mm512_fmadd_ps(_mm512_add_ps(halves, other), factors.scale(c, 0), acc[m]);
        } else {  // quarters 0, 1 in the chunk's first group, 2, 3 in its second
          acc[m] = _mm512_fmadd_ps(halves, factors.scale(c, 0), acc[m]);
          acc[m] = _mm512_fmadd_ps(other, factors.scale(c, 1), acc[m]);
        }
        if constexpr (C::kOffset)
          acc[m] = _mm512_fmadd_ps(offset, _mm512_set1_ps(sums[m * chunks + chunk]), acc[m]);
      }
    }
    for (int o = 0; o < kQuad; ++o) block[o] += step[o];
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1);
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(mask, p.bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MR; ++m)
    bf16::store_sums(p, p.y + m * p.N + n0, _mm512_add_ps(acc[m], bias), mask);
}

template <typename B, int MR>
void dot_quads(const QuantLinearBf16Problem& p, const float* sums, int64_t q0, int64_t q1) {
  const CodeTable table(Codes<B>::kBias);
  const int64_t row_bytes = p.K / B::kValues * B::kBytes;
  if (q0 < q1)
    prefetch_start(p.weight + q0 * kQuad * row_bytes,
                   (std::min(p.N, q1 * kQuad) - q0 * kQuad) * row_bytes);
  for (int64_t q = q0; q < q1; ++q) dot_quad<B, MR>(p, table, sums, q * kQuad);
}

template <typename B>
void few_rows(const QuantLinearBf16Problem& p, const float* sums, int threads) {
#pragma omp parallel num_threads(threads)
  {
    const int64_t quads = (p.N + kQuad - 1) / kQuad;
    const int64_t count = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t q0 = quads * t / count, q1 = quads * (t + 1) / count;
    switch (p.M) {
      case 1: dot_quads<B, 1>(p, sums, q0, q1); break;
      case 2: dot_quads<B, 2>(p, sums, q0, q1); break;
      case 3: dot_quads<B, 3>(p, sums, q0, q1); break;
      case 4: dot_quads<B, 4>(p, sums, q0, q1); break;
      case 5: dot_quads<B, 5>(p, sums, q0, q1); break;
      case 6: dot_quads<B, 6>(p, sums, q0, q1); break;
      case 7: dot_quads<B, 7>(p, sums, q0, q1); break;
      default: dot_quads<B, 8>(p, sums, q0, q1); break;  // M <= kMaxDotRows = 8
    }
  }
}

// y[m, n0 .. n0 + kPanel) for the MR rows of x starting at x against a decoded panel, in
// dot_quad's order (lane: output). chunk_sums holds each row's sum of x per chunk
// ([MR][K / 32], only read for formats with offsets).
template <typename B, int MR>
void tile(const QuantLinearBf16Problem& p, const Panel& panel, const uint16_t* x,
          const float* chunk_sums, uint16_t* y, int64_t n0) {
  using C = Codes<B>;
  constexpr int kGroupsPerChunk = 16 / C::kGroupPairs;
  constexpr int kGroupQuarters = C::kGroupPairs / 4;
  const int64_t chunks = p.K / 32;
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const uint32_t* codes = panel.codes.data();
  const float* scales = panel.scales.data();
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    for (int g = 0; g < kGroupsPerChunk; ++g, scales += kPanel) {
      // Quarter q of the chunk (pairs 4q .. 4q + 3, the next 4 rows of codes) chained
      // from zero into part.
      auto quarter = [&](__m512 (&part)[MR][2], int q) {
        for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm512_setzero_ps();
        for (int i = 0; i < 4; ++i, codes += kPanel) {
          const __m512bh w0 = (__m512bh)_mm512_loadu_si512(codes);
          const __m512bh w1 = (__m512bh)_mm512_loadu_si512(codes + 16);
          for (int m = 0; m < MR; ++m) {
            const __m512bh xv = (__m512bh)pair_of(x + m * p.K + chunk * 32 + 8 * q + 2 * i);
            part[m][0] = _mm512_dpbf16_ps(part[m][0], xv, w0);
            part[m][1] = _mm512_dpbf16_ps(part[m][1], xv, w1);
          }
        }
      };
      __m512 sum[MR][2], part[MR][2];
      const int q0 = g * kGroupQuarters;
      quarter(sum, q0);
      quarter(part, q0 + 1);
      for (int m = 0; m < MR; ++m)
        for (int v = 0; v < 2; ++v) sum[m][v] = _mm512_add_ps(sum[m][v], part[m][v]);
      if constexpr (kGroupQuarters == 4) {
        __m512 third[MR][2];
        quarter(third, 2);
        quarter(part, 3);
        for (int m = 0; m < MR; ++m)
          for (int v = 0; v < 2; ++v)
            sum[m][v] = _mm512_add_ps(sum[m][v], _mm512_add_ps(third[m][v], part[m][v]));
      }
      const __m512 s0 = _mm512_loadu_ps(scales), s1 = _mm512_loadu_ps(scales + 16);
      for (int m = 0; m < MR; ++m) {
        acc[m][0] = _mm512_fmadd_ps(sum[m][0], s0, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(sum[m][1], s1, acc[m][1]);
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
