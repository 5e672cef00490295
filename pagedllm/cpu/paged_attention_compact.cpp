// Paged attention on CPU over block tables that mix full-size blocks (any format of
// kv_rows.h, laid out as paged_attention.cpp reads them) with compact 4-bit blocks
// (pagedllm/kv_storage/compact_blocks.py), both read in place, never copied out decoded.
//
// A table entry below num_full_blocks is a full block; any other entry e is compact block
// e - num_full_blocks: one tile per kv head of rotated key codes, value codes, per-channel
// key scales and zeros and per-token value scales and zeros. Full blocks are scored with
// the query, compact ones with the rotated query: (q H).(k H) = q.k.
//
// A work unit is a query tile (up to 32 tokens of one sequence) under every kv head, or
// one of them where there are too few units to keep every thread busy, over a range of
// its blocks: all its blocks, or, with too few units still (decode of a few long
// sequences), a part of them whose partial softmax state is merged with the other parts'
// afterwards. A row is one (query token, query
// head) pair; rows go through a block RB at a time (grouped-query attention: the heads
// of one kv head share every code loaded), the softmax online, one step per block or per
// kStep positions of a longer one, in float32. Compact blocks shorter than kStep go
// through in runs of up to kStep positions, one softmax step for the run (CompactRun):
// 16-token blocks measured 1.3x faster that way at 8k positions.
//
// A compact key block is scored with its codes as they are: per channel d the folded
// query q'[d] = q_rot[d] * key_scale[d] and once per block and row the bias
// q_rot . key_zero, so that score_t = bias + sum_d q'[d] code[t][d]. The folded query
// goes in 16-bit fixed point, two signed bytes, to meet the codes in VNNI dot products
// of bytes summed exactly in 32 bits: 64 code products take 2 instructions and a mask,
// against 4 float32 multiply-adds and 8 instructions to turn nibbles into floats. 16
// tokens' code rows are transposed in registers to one vector per 4 bytes with a token
// per lane, so the scores come out one token per lane without horizontal sums. Values
// go the same way where the CPU permutes bytes (AVX512-VBMI): each step's weights
// p_t value_scale[t] in 16-bit fixed point against 4 positions' codes of a channel per
// lane, sum_t p_t value_zero[t] apart; elsewhere channel by channel in float32.
// Rounding to 16 bits costs a score or a weight at most 1/65,000 of the largest, about
// a thousandth of what the codes lose. At 8k positions, SmolLM2's heads (9 query,
// 3 kv, 64 channels) and blocks of 64, decode runs ~2.2x faster than paged_attention
// over bfloat16 blocks (AMD Zen 4; see benchmarks/attention_compact.py).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"
#include "kv_rows.h"
#include "vector_math.h"

namespace {

using namespace pagedllm::vec;
using namespace pagedllm::kv_rows;

using Batch = pagedllm::CompactAttentionBatch;
using Shapes = pagedllm::AttentionBatch;

constexpr int64_t kQueryTile = 32;  // query tokens per tile in prefill
constexpr int kStep = 64;           // positions per online-softmax step (at most)
constexpr int kGroups = kStep / kLanes;
constexpr float kMinScore = -1e30f;
// Below this many (query row, position) pairs, waking a second thread costs more than
// it saves.
constexpr int64_t kMinParallelWork = 16384;
// Units wanted per thread, before units take one kv head each rather than all and
// before a tile's blocks are split into parts; and the fewest positions a part may have.
constexpr int64_t kUnitsPerThread = 4;
constexpr int64_t kMinPartPositions = 1024;
// Blocks are scattered, so the hardware prefetcher cannot run ahead of a unit: each
// block's data are fetched this many blocks ahead (Ahead).
constexpr int64_t kBlocksAhead = 2;

// Per-thread state of one unit's rows, `nv` vectors per row: the query scaled by the
// softmax scale, the same rotated, the output accumulator, running max; and 16 partial
// sums each of the softmax denominator and of p times the value zero points (added to
// every channel at the end).
struct Scratch {
  std::vector<vfloat> query, rotated, acc, row_sum, zeros;
  std::vector<float> row_max;
  std::vector<int64_t> pos;  // each row's position in its sequence
  void resize(int64_t rows, int64_t nv) {
    query.resize(rows * nv);
    rotated.resize(rows * nv);
    acc.resize(rows * nv);
    row_sum.resize(rows);
    zeros.resize(rows);
    row_max.resize(rows);
    pos.resize(rows);
  }
};

// Fetches the cache lines of [p, p + bytes) into L2. Inlined early on purpose: GCC 12
// takes a function of prefetches alone for one without effects and drops the calls.
[[gnu::always_inline]] inline void prefetch_lines(const void* p, int64_t bytes) {
  const auto* c = static_cast<const char*>(p);
  const char* line = c - reinterpret_cast<uintptr_t>(c) % 64;
  for (; line < c + bytes; line += 64) __builtin_prefetch(line, 0, 1);
}

// The block a unit reads kBlocksAhead blocks after the current one, fetched into L2 one
// slice per 16 positions scored: a compact block's tile, or a full block's K and V rows.
// All of a block at once (72 lines of a tile) overflows the queue of misses: measured
// no faster than no prefetch at all.
struct Ahead {
  const char* tile = nullptr;  // or
  const char* k = nullptr;     // and v: a full block's first rows, `stride` bytes apart
  const char* v = nullptr;
  int64_t block_size = 0, bytes = 0, stride = 0;  // bytes: of the tile, or of a row

  // The data of positions [t, t + 16).
  [[gnu::always_inline]] void fetch(int64_t t) const {
    if (tile) return prefetch_lines(tile + bytes * t / block_size, bytes * kLanes / block_size);
    if (!k) return;
    for (int64_t l = t; l < t + kLanes; ++l) {
      prefetch_lines(k + l * stride, bytes);
      prefetch_lines(v + l * stride, bytes);
    }
  }
};

// acc + in lane l the sum over its 4 bytes b of byte b of x (unsigned) times byte b of
// the 4 bytes at w (signed): the VNNI dot product of bytes, w broadcast to every lane.
// Written out because GCC 12 broadcasts w with an instruction of its own rather than
// within the product's memory operand (the kernel measured 1.05x faster without it).
inline vint dot_bytes(vint acc, vuint x, const int8_t* w) {
#ifdef __AVX512VNNI__
  asm("vpdpbusd %2%{1to16%}, %1, %0"
      : "+v"(acc)
      : "v"(x), "m"(*reinterpret_cast<const int32_t*>(w)));
  return acc;
#else
  int32_t word;
  std::memcpy(&word, w, sizeof word);
  const vint wide = vint{} + word;
  for (int b = 0; b < 4; ++b)
    acc += (vint)((x >> (8 * b)) & 255u) * ((wide << (24 - 8 * b)) >> 24);
  return acc;
#endif
}

// x rounded to the nearest integers.
inline vint round_to_int(vfloat x) {
#ifdef __AVX512F__
  return (vint)_mm512_cvtps_epi32((__m512)x);
#else
  return __builtin_convertvector(x + (x < 0.f ? vfloat{} - 0.5f : vfloat{} + 0.5f), vint);
#endif
}

// Codes within a tile (compact_blocks.py). In blocks of fewer than kFifthKeyBitTokens
// tokens a code is its nibble, 0 .. 15. From there on a key code is its nibble in the key
// codes plus 16 times its fifth bit, stored as bit 3 of a value nibble, 0 .. 31, and a
// value code is the low 3 bits of its nibble, 0 .. 7.
constexpr int64_t kFifthKeyBitTokens = 64;
constexpr uint32_t kNibbles = 0x0F0F0F0Fu;
constexpr uint32_t kThreeBits = 0x07070707u;
constexpr uint32_t kFifthKeyBits = 0x08080808u;  // where the keys' fifth bits lie

// Lane l: the float value of the low 4 bits of lane l of x.
inline vfloat nibble_values(vuint x) {
#ifdef __AVX512F__
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return (vfloat)_mm512_permutexvar_ps((__m512i)x, table);  // reads the low 4 bits only
#else
  return __builtin_convertvector(x & 15u, vfloat);
#endif
}

// 16 bytes zero-extended to 16 lanes.
inline vuint widen_bytes(const uint8_t* p) {
#ifdef __AVX512F__
  return (vuint)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  typedef uint8_t vbyte __attribute__((vector_size(16)));
  vbyte b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, vuint);
#endif
}

// Stores the low byte of each lane of x at p .. p + 15.
inline void store_low_bytes(int8_t* p, vint x) {
#ifdef __AVX512F__
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8((__m512i)x));
#else
  typedef int8_t vbyte __attribute__((vector_size(16)));
  const vbyte b = __builtin_convertvector(x, vbyte);
  std::memcpy(p, &b, sizeof b);
#endif
}

// One stage of a transpose: lanes of x whose bit log2(H) is set trade places with the
// lanes of y whose bit is clear (transpose16's stage of distance H).
constexpr int butterfly_low(int h, int j) { return (j / h) % 2 == 0 ? j : kLanes + j - h; }
constexpr int butterfly_high(int h, int j) { return (j / h) % 2 == 0 ? j + h : kLanes + j; }

template <int H, int... J>
inline void butterfly(vuint& x, vuint& y, std::integer_sequence<int, J...>) {
  const vuint low = __builtin_shufflevector(x, y, butterfly_low(H, J)...);
  y = __builtin_shufflevector(x, y, butterfly_high(H, J)...);
  x = low;
}

// Transposes the N x N blocks of N registers (block s: lanes s N .. s N + N - 1 of every
// register): afterwards lane s N + m of register k holds what lane s N + k of register m
// held. transpose16's last log2(N) stages.
template <int N, int H = N / 2>
inline void transpose_blocks(vuint* r) {
  if constexpr (H >= 1) {
    for (int i = 0; i < N; ++i)
      if (!(i & H)) butterfly<H>(r[i], r[i + H], std::make_integer_sequence<int, kLanes>{});
    transpose_blocks<N, H / 2>(r);
  }
}

// x with lane t taken from lane (t % P) N + t / P (P = 16 / N): the token order back
// from the lanes that transpose_blocks<N> leaves a tile's 16 code rows in.
template <int N, int... T>
inline vfloat tokens_in_order(vfloat x, std::integer_sequence<int, T...>) {
  constexpr int P = kLanes / N;
  if constexpr (P == 1) return x;
  else return __builtin_shufflevector(x, x, (T % P * N + T / P)...);
}

// Numbers x as integers Q ~ x / scale of at most kLimbRange in magnitude, kept in kLimbs
// signed bytes (limbs) L_l with Q = L_0 + 256 L_1: 16-bit fixed point, multiplied by
// the codes in VNNI dot products of bytes, for the folded query and a value step's
// weights alike. L_0 is the low byte of Q and L_1 = (Q + 128) >> 8: signed digits.
// (24 bits, three limbs, took 1.25x the time for a thousandth of the format's error.)
constexpr int kLimbs = 2;
// The largest Q whose limbs are both within a signed byte, 127 (1 + 256), less a margin
// for the rounding of max |x| / scale.
constexpr float kLimbRange = 127.f * (1 + 256) - 1;

// Stores the limbs of Q = x * inverse rounded (16 numbers) at limbs and limbs + stride;
// returns x - Q unit (unit = 1 / inverse, or 0 with inverse), what the rounding lost.
inline vfloat store_limbs(vfloat x, float inverse, float unit, int8_t* limbs, int64_t stride) {
  const vint rounded = round_to_int(x * inverse);
  store_low_bytes(limbs, rounded);
  store_low_bytes(limbs + stride, (rounded + 128) >> 8);
  return x - __builtin_convertvector(rounded, vfloat) * unit;
}

// acc[0] + 256 acc[1] in float32, summed exactly in 32 bits first: |acc[l]| <= 256 * 31 *
// 128 (a sum over up to 256 channels or 64 positions).
inline vfloat limbs_sum(const vint (&acc)[kLimbs]) {
  return __builtin_convertvector((acc[1] << 8) + acc[0], vfloat);
}

// Rows of the largest divisor of RB whose NV-vector accumulators fit 24 registers: the
// value passes' row blocks.
template <int NV, int RB>
constexpr int kValueRows = RB * NV <= 24 ? RB : RB % 2 == 0 && RB / 2 * NV <= 24 ? RB / 2 : 1;

// Rows of the largest divisor of RB whose integer sums (4 channel vectors of kLimbs
// limbs each) fit 24 registers: the byte value pass's row blocks.
template <int RB>
constexpr int byte_value_rows = RB * 4 * kLimbs <= 24                              ? RB
                                : RB % 2 == 0 && RB / 2 * 4 * kLimbs <= 24 ? RB / 2
                                                                                : 1;

// One compact tile: block `block_size` tokens of one kv head (offsets as TileLayout's).
template <int NV>
struct CompactKeys {
  static constexpr int kDim = NV * kLanes;
  static constexpr int kRowBytes = kDim / 2;  // bytes of one token's codes
  static constexpr bool kRotated = true;        // scored with the rotated query
  static constexpr bool kZeros = true;          // values have zero points
  const uint8_t* key_codes;
  const uint8_t* value_codes;
  const uint16_t* key_scale;
  const uint16_t* key_zero;
  const uint16_t* value_scale;
  const uint16_t* value_zero;
  Ahead ahead;
  // The codes' bits (in every byte of a dword): the keys' fifth bits among the value
  // nibbles (0 when keys have 4 bits), the value codes' bits in each nibble.
  uint32_t fifth_key_bits = 0, value_bits = kNibbles;
  // Mean codes (7.5 for codes 0 .. 15): a sum of code times rounding loss over channels
  // (or positions) is the mean code times the losses' sum, plus a part of mean 0 half as
  // large at most. The kernel adds the first back.
  float mean_key_code = 7.5f, mean_value_code = 7.5f;

  static int64_t tile_bytes(int64_t block_size) {
    return block_size * kDim + 4 * kDim + 4 * block_size;
  }

  CompactKeys() = default;
  CompactKeys(const uint8_t* tile, int64_t block_size, const Ahead& next) : ahead(next) {
    const int64_t codes = block_size * kRowBytes;
    key_codes = tile;
    value_codes = tile + codes;
    key_scale = reinterpret_cast<const uint16_t*>(tile + 2 * codes);
    key_zero = key_scale + kDim;
    value_scale = key_zero + kDim;
    value_zero = value_scale + block_size;
    if (block_size >= kFifthKeyBitTokens) {
      fifth_key_bits = kFifthKeyBits;
      value_bits = kThreeBits;
      mean_key_code = 15.5f;
      mean_value_code = 3.5f;
    }
  }

  // RB rows' folded query q'[d] = q_rot[d] key_scale[d] (softmax scale included) in
  // limbs, scale = max |q'| / kLimbRange, and the bias q_rot . key_zero. A score is then
  // off by at most D * 15.5 / kLimbRange of max |q'| (5-bit codes).
  template <int RB>
  struct Query {
    alignas(64) int8_t limbs[RB][kLimbs][kDim];
    float scale[RB], bias[RB];
  };

  template <int RB>
  void fold(const vfloat* rotated, Query<RB>& q) const {
    static_assert(RB <= 4, "combine_rows reduces four rows");
    vfloat folded[RB][NV], bias[4] = {}, magnitude[4] = {};
    for (int i = 0; i < RB; ++i)
      for (int j = 0; j < NV; ++j) {
        const vfloat x = rotated[i * NV + j];
        folded[i][j] = x * load(key_scale + j * kLanes);
        bias[i] = fmadd(x, load(key_zero + j * kLanes), bias[i]);
        const vfloat a = folded[i][j] < 0.f ? -folded[i][j] : folded[i][j];
        magnitude[i] = magnitude[i] > a ? magnitude[i] : a;
      }
    const vfloat max = max_of_rows(magnitude);  // row i in lane i
    const vfloat scale = max * (1.f / kLimbRange);
    const vfloat inverse = max > 0.f ? kLimbRange / max : vfloat{};
    for (int i = 0; i < RB; ++i) {
      q.scale[i] = scale[i];
      for (int j = 0; j < NV; ++j) {
        const vfloat lost = store_limbs(folded[i][j], inverse[i], scale[i],
                                                   &q.limbs[i][0][j * kLanes], kDim);
        bias[i] = fmadd(broadcast(mean_key_code), lost, bias[i]);
      }
    }
    const vfloat sums = sum_of_rows(bias);
    for (int i = 0; i < RB; ++i) q.bias[i] = sums[i];
  }

  // Scores of tokens t .. t + 15 (t a multiple of 16), one per lane. The 16 key nibble
  // rows (64 N bytes) load as N registers and transpose so that register k holds dword k
  // of every token's row: channels 4k .. 4k + 3 in its low nibbles, 4k + D/2 .. in its
  // high ones, which a mask (and a shift) turn into 4 bytes per lane. 5-bit keys' fifth
  // bits (bit 3 of each value nibble) are stored transposed already (compact_blocks.py's
  // key_bit_order), so the value nibbles at the same offsets give them as they are, and
  // each becomes its byte's bit 4 (4-bit keys mask them to 0): 4 bytes of key codes to
  // meet 4 bytes of a limb in the dot product of bytes. D = 256 goes in two halves. Each
  // row's limbs sum in kSets interleaved chains, so that there are at least 6 to keep the
  // units busy.
  template <int RB>
  void scores(const Query<RB>& q, int64_t t, int, int, vfloat (&out)[RB]) const {
    if (fifth_key_bits) return scores_of<RB, true>(q, t, out);
    scores_of<RB, false>(q, t, out);
  }

  template <int RB, bool kFifthBit>
  void scores_of(const Query<RB>& q, int64_t t, vfloat (&out)[RB]) const {
    ahead.fetch(t);
    constexpr int kWords = kDim / 8;  // dwords per code row
    constexpr int N = std::min(kWords, kLanes);
    const uint8_t* codes = key_codes + t * kRowBytes;
    const uint8_t* high_bits = value_codes + t * kRowBytes;
    // The limbs are the same for every 16 tokens; read through a pointer the compiler
    // cannot follow, else it hoists their broadcasts out of the caller's loop and spills.
    const int8_t* limbs = &q.limbs[0][0][0];
    asm volatile("" : "+r"(limbs));
    constexpr int kSets = RB >= 3 ? 1 : 4 / RB;
    vint acc[kSets][RB][kLimbs] = {};
    for (int half = 0; half < kWords / N; ++half) {
      vuint col[N];
      for (int r = 0; r < N; ++r)
        std::memcpy(&col[r], codes + 64 * (r * (kWords / N) + half), sizeof col[r]);
      transpose_blocks<N>(col);
#pragma GCC unroll 16
      for (int k = 0; k < N; ++k) {
        const int word = half * N + k;
        vuint low = col[k] & kNibbles, high = (col[k] >> 4) & kNibbles;
        if constexpr (kFifthBit) {
          vuint bits;  // stored in the order the transpose leaves col in
          std::memcpy(&bits, high_bits + 64 * (k * (kWords / N) + half), sizeof bits);
          low |= (bits & kFifthKeyBits) << 1;
          high |= (bits >> 3) & (kFifthKeyBits << 1);
        }
        vint(&set)[RB][kLimbs] = acc[k % kSets];
        for (int i = 0; i < RB; ++i)
          for (int l = 0; l < kLimbs; ++l) {
            const int8_t* limb = limbs + (i * kLimbs + l) * kDim + 4 * word;
            set[i][l] = dot_bytes(set[i][l], low, limb);
            set[i][l] = dot_bytes(set[i][l], high, limb + kDim / 2);
          }
      }
    }
    for (int i = 0; i < RB; ++i) {
      for (int c = 1; c < kSets; ++c)
        for (int l = 0; l < kLimbs; ++l) acc[0][i][l] += acc[c][i][l];
      out[i] = tokens_in_order<N>(limbs_sum(acc[0][i]) * q.scale[i] + q.bias[i],
                                  std::make_integer_sequence<int, kLanes>{});
    }
  }

  vfloat value_scales(int64_t t, int, int) const { return load(value_scale + t); }
  uint32_t value_code_bits() const { return value_bits; }
  float mean_value_of_codes() const { return mean_value_code; }
  vfloat value_zeros(int64_t t) const { return load(value_zero + t); }

  // The value codes of position t.
  const uint8_t* value_row(int64_t t) const { return value_codes + t * kRowBytes; }

  template <int RB>
  void values(int64_t step, int64_t lo, int64_t hi, const float (&weight)[RB][kStep],
              vfloat correction, vfloat* acc) const {
    values_of<RB>(*this, step, lo, hi, weight, correction, acc);
  }

  // acc[i] = acc[i] correction[i] + the sum over step positions t in [lo, hi) of
  // weight[i][t] code[step + t] (weight: p times the value scale, 0 where row i does not
  // see t), VB rows at a time; codes from rows.value_row(position), 4 positions from
  // t, a multiple of 4, adjacent.
  template <int RB, typename Rows>
  static void values_of(const Rows& rows, int64_t step, int64_t lo, int64_t hi,
                        const float (&weight)[RB][kStep], vfloat correction, vfloat* acc) {
#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
    if constexpr (NV % 4 == 0)
      return values_in_bytes<RB>(rows, step, lo, hi, weight, correction, acc);
#endif
    constexpr int VB = kValueRows<NV, RB>;
    for (int v0 = 0; v0 < RB; v0 += VB) {
      vfloat a[VB][NV];
      for (int i = 0; i < VB; ++i)
        for (int j = 0; j < NV; ++j) a[i][j] = acc[(v0 + i) * NV + j] * correction[v0 + i];
      const uint32_t both_nibbles = (rows.value_code_bits() & 0xFFu) * 0x11u;  // one byte's
      for (int64_t t = lo; t < hi; ++t) {
        const uint8_t* row = rows.value_row(step + t);
        for (int h = 0; h < NV / 2; ++h) {  // bytes 16 h ..: channels 16 h .. (low), + D/2 (high)
          const vuint bytes = widen_bytes(row + h * kLanes) & both_nibbles;
          const vfloat low = nibble_values(bytes), high = nibble_values(bytes >> 4);
          for (int i = 0; i < VB; ++i) {
            const vfloat p = broadcast(weight[v0 + i][t]);
            a[i][h] = fmadd(p, low, a[i][h]);
            a[i][NV / 2 + h] = fmadd(p, high, a[i][NV / 2 + h]);
          }
        }
      }
      for (int i = 0; i < VB; ++i)
        for (int j = 0; j < NV; ++j) acc[(v0 + i) * NV + j] = a[i][j];
    }
  }

#if defined(__AVX512VBMI__) && defined(__AVX512VNNI__)
  // As values, the codes met in VNNI dot products of bytes: each row's weights over the
  // step in kLimbs bytes of fixed point (unit: its largest weight / kLimbRange, so
  // a weight is off by at most 1 / 65,000 of that), the codes of 4 positions under one
  // channel in the 4 bytes of a lane. One byte permutation interleaves them from 4
  // code rows: bytes 4 l + b of the register `low` are byte l of code row b (channels
  // l and l + D/2 of its 32-byte span), of `high` byte 16 + l. Positions go 4 at a time
  // over [lo, hi) rounded out to 4; weights there are 0 where no row sees them.
  template <int RB, typename Rows>
  static void values_in_bytes(const Rows& rows, int64_t step, int64_t lo, int64_t hi,
                              const float (&weight)[RB][kStep], vfloat correction, vfloat* acc) {
    constexpr int VB = byte_value_rows<RB>;
    alignas(64) int8_t limbs[RB][kLimbs][kStep];
    float unit[RB], restored[RB];
    const int64_t t0 = lo / 4 * 4, t1 = (hi + 3) / 4 * 4;
    const int g0 = static_cast<int>(t0 / kLanes), g1 = static_cast<int>((t1 + kLanes - 1) / kLanes);
    for (int i = 0; i < RB; ++i) {
      vfloat most = vfloat{};
      for (int g = g0; g < g1; ++g) {
        const vfloat w = load(&weight[i][g * kLanes]);
        most = most > w ? most : w;
      }
      const float max = hmax(most);
      const float inverse = max > 0.f ? kLimbRange / max : 0.f;
      unit[i] = max / kLimbRange;
      vfloat lost = vfloat{};
      for (int g = g0; g < g1; ++g)
        lost += store_limbs(load(&weight[i][g * kLanes]), inverse, unit[i],
                               &limbs[i][0][g * kLanes], kStep);
      restored[i] = rows.mean_value_of_codes() * hsum(lost);
    }
    static const __m512i low_index = interleave_index(0), high_index = interleave_index(16);
    const uint32_t bits = rows.value_code_bits();
    for (int v0 = 0; v0 < RB; v0 += VB) {
      for (int span = 0; span < NV / 4; ++span) {  // bytes 32 span .. + 31 of each code row
        vint sums[VB][4][kLimbs] = {};
        for (int64_t t = t0; t < t1; t += 4) {
          const uint8_t* bytes = rows.value_row(step + t) + 32 * span;
          const __m512i first = two_spans(bytes), second = two_spans(bytes + 2 * kRowBytes);
          const vuint low = (vuint)_mm512_permutex2var_epi8(first, low_index, second);
          const vuint high = (vuint)_mm512_permutex2var_epi8(first, high_index, second);
          const vuint codes[4] = {low & bits, high & bits, (low >> 4) & bits, (high >> 4) & bits};
          for (int i = 0; i < VB; ++i)
            for (int k = 0; k < 4; ++k)
              for (int l = 0; l < kLimbs; ++l)
                sums[i][k][l] = dot_bytes(sums[i][k][l], codes[k], &limbs[v0 + i][l][t]);
        }
        // codes[k]'s channels: 32 span + 16 k (k < 2), D/2 + 32 span + 16 (k - 2).
        for (int i = 0; i < VB; ++i)
          for (int k = 0; k < 4; ++k) {
            vfloat& a = acc[(v0 + i) * NV + (k / 2) * (NV / 2) + 2 * span + k % 2];
            a = a * correction[v0 + i] + (limbs_sum(sums[i][k]) * unit[v0 + i] + restored[v0 + i]);
          }
      }
    }
  }

  // The 32 bytes at p and the 32 one code row on, in one register.
  static __m512i two_spans(const uint8_t* p) {
    if constexpr (kRowBytes == 32) return _mm512_loadu_si512(p);
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kRowBytes));
    return _mm512_inserti64x4(_mm512_castsi256_si512(first), second, 1);
  }

  // Byte 4 l + b: byte offset + l of code row b, rows 0 and 1 in the permutation's first
  // register (32 bytes each), 2 and 3 in its second.
  static __m512i interleave_index(int offset) {
    alignas(64) uint8_t index[64];
    for (int l = 0; l < kLanes; ++l)
      for (int b = 0; b < 4; ++b) index[4 * l + b] = static_cast<uint8_t>(32 * b + offset + l);
    return _mm512_load_si512(index);
  }
#endif
};

// Up to kMaxRun consecutive compact blocks of block_size < kStep tokens (all full) read
// as one block of count * block_size positions: one online-softmax step over all of
// them, where each block alone would take its own (its folded query stays its own).
template <int NV>
struct CompactRun {
  static constexpr int kMaxRun = 4;
  static constexpr bool kRotated = true;
  static constexpr bool kZeros = true;
  CompactKeys<NV> part[kMaxRun];
  int count;
  int shift;  // log2 block_size

  template <int RB>
  struct Query {
    typename CompactKeys<NV>::template Query<RB> part[kMaxRun];
  };

  template <int RB>
  void fold(const vfloat* rotated, Query<RB>& q) const {
    for (int b = 0; b < count; ++b) part[b].template fold<RB>(rotated, q.part[b]);
  }

  // Positions t .. t + 15 lie in one block (block_size a multiple of 16).
  template <int RB>
  void scores(const Query<RB>& q, int64_t t, int lo, int hi, vfloat (&out)[RB]) const {
    const int64_t b = t >> shift;
    part[b].template scores<RB>(q.part[b], t - (b << shift), lo, hi, out);
  }
  vfloat value_scales(int64_t t, int lo, int hi) const {
    const int64_t b = t >> shift;
    return part[b].value_scales(t - (b << shift), lo, hi);
  }
  vfloat value_zeros(int64_t t) const {
    const int64_t b = t >> shift;
    return part[b].value_zeros(t - (b << shift));
  }
  // Its blocks are of one size, so of one code format.
  uint32_t value_code_bits() const { return part[0].value_code_bits(); }
  float mean_value_of_codes() const { return part[0].mean_value_of_codes(); }
  const uint8_t* value_row(int64_t t) const {
    const int64_t b = t >> shift;
    return part[b].value_row(t - (b << shift));
  }

  template <int RB>
  void values(int64_t step, int64_t lo, int64_t hi, const float (&weight)[RB][kStep],
              vfloat correction, vfloat* acc) const {
    CompactKeys<NV>::template values_of<RB>(*this, step, lo, hi, weight, correction, acc);
  }
};

// One full block of one kv head: rows `token_stride` elements apart in K and V.
template <typename Rows, int NV>
struct FullKeys {
  using Elem = typename Rows::Elem;
  static constexpr bool kRotated = false;
  static constexpr bool kZeros = false;
  const Elem* k;
  const Elem* v;
  int64_t token_stride;
  Ahead ahead;

  template <int RB>
  struct Query {
    const vfloat* rows;  // RB query rows, scaled
  };

  template <int RB>
  void fold(const vfloat* query, Query<RB>& q) const {
    q.rows = query;
  }

  // Scores of tokens t + lo .. t + hi - 1 in lanes lo .. hi - 1 (0 in the others, whose
  // rows are never loaded): dot products, 16 summed at once by transpose_sum.
  template <int RB>
  void scores(const Query<RB>& q, int64_t t, int lo, int hi, vfloat (&out)[RB]) const {
    ahead.fetch(t);
    vfloat parts[RB][kLanes];
    alignas(64) float k_scales[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      k_scales[l] = 0.f;
      if (l < lo || l >= hi) {
        for (int i = 0; i < RB; ++i) parts[i][l] = vfloat{};
        continue;
      }
      const Elem* row = k + (t + l) * token_stride;
      vfloat key[NV];
      for (int j = 0; j < NV; ++j) key[j] = Rows::widen(row + j * kLanes);
      for (int i = 0; i < RB; ++i) {
        vfloat a = q.rows[i * NV] * key[0];
        for (int j = 1; j < NV; ++j) a = fmadd(q.rows[i * NV + j], key[j], a);
        parts[i][l] = a;
      }
      k_scales[l] = row_scale<Rows>(row, NV * kLanes);
    }
    for (int i = 0; i < RB; ++i) {
      out[i] = transpose_sum(parts[i]);
      if constexpr (Rows::kScaled) out[i] *= load(k_scales);
    }
  }

  // The value rows' scales in lanes lo .. hi - 1, 0 elsewhere (rows never loaded); 1 in
  // every lane for rows without scales.
  vfloat value_scales(int64_t t, int lo, int hi) const {
    if constexpr (!Rows::kScaled) return broadcast(1.f);
    vfloat x = vfloat{};
    for (int l = lo; l < hi; ++l) x[l] = row_scale<Rows>(v + (t + l) * token_stride, NV * kLanes);
    return x;
  }
  vfloat value_zeros(int64_t) const { return vfloat{}; }

  // As CompactKeys::values.
  template <int RB>
  void values(int64_t step, int64_t lo, int64_t hi, const float (&weight)[RB][kStep],
              vfloat correction, vfloat* acc) const {
    constexpr int VB = kValueRows<NV, RB>;
    for (int v0 = 0; v0 < RB; v0 += VB) {
      vfloat a[VB][NV];
      for (int i = 0; i < VB; ++i)
        for (int j = 0; j < NV; ++j) a[i][j] = acc[(v0 + i) * NV + j] * correction[v0 + i];
      for (int64_t t = lo; t < hi; ++t) {
        const Elem* row = v + (step + t) * token_stride;
        vfloat value[NV];
        for (int j = 0; j < NV; ++j) value[j] = Rows::widen(row + j * kLanes);
        for (int i = 0; i < VB; ++i) {
          const vfloat p = broadcast(weight[v0 + i][t]);
          for (int j = 0; j < NV; ++j) a[i][j] = fmadd(p, value[j], a[i][j]);
        }
      }
      for (int i = 0; i < VB; ++i)
        for (int j = 0; j < NV; ++j) acc[(v0 + i) * NV + j] = a[i][j];
    }
  }
};

// Rows [r0, r0 + RB) of the scratch over positions [step, step + n) of a block (relative
// to its first position `first`): scores, the online softmax, values. `q` is what
// keys.fold made of the rows.
template <int NV, int RB, typename Keys>
void attend_step(const Keys& keys, const typename Keys::template Query<RB>& q, int64_t first,
                 int64_t step, int64_t n, int64_t r0, const Shapes& s, Scratch& w) {
  // Row i sees step positions [from[i], to[i]); the rows together [lo, hi); all of
  // them all n when `whole`.
  int64_t from[RB], to[RB], lo = n, hi = 0;
  bool any = false, whole = n % kLanes == 0;
  for (int i = 0; i < RB; ++i) {
    const int64_t pos = w.pos[r0 + i] - first - step;  // the row's own position
    to[i] = std::clamp<int64_t>(pos + 1, 0, n);
    from[i] = s.sliding_window ? std::clamp<int64_t>(pos - s.sliding_window + 1, 0, n) : 0;
    any = any || from[i] < to[i];
    whole = whole && from[i] == 0 && to[i] == n;
    lo = std::min(lo, from[i]);
    hi = std::max(hi, to[i]);
  }
  if (!any) return;
  const int g_lo = static_cast<int>(lo / kLanes);
  const int g_hi = static_cast<int>((hi + kLanes - 1) / kLanes);
  vfloat score[kGroups][RB];
  for (int g = g_lo; g < g_hi; ++g) {
    const int l_lo = static_cast<int>(std::max<int64_t>(lo - g * kLanes, 0));
    const int l_hi = static_cast<int>(std::min<int64_t>(hi - g * kLanes, kLanes));
    keys.template scores<RB>(q, step + g * kLanes, l_lo, l_hi, score[g]);
  }
  const vint lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  vint visible[kGroups][RB];  // unless whole
  static_assert(RB <= 4, "max_of_rows reduces four rows");
  vfloat chunk_max[4];
  for (int i = 0; i < 4; ++i) chunk_max[i] = broadcast(kMinScore);
  for (int i = 0; i < RB; ++i) {
    for (int g = g_lo; g < g_hi; ++g) {
      vfloat x = score[g][i];
      if (s.logit_softcap > 0.f) {
        for (int l = 0; l < kLanes; ++l) x[l] = s.logit_softcap * std::tanh(x[l] / s.logit_softcap);
      }
      if (!whole) {
        const vint index = lane + g * kLanes;
        visible[g][i] = (index >= static_cast<int>(from[i])) & (index < static_cast<int>(to[i]));
        x = visible[g][i] ? x : broadcast(kMinScore);
      }
      score[g][i] = x;
      chunk_max[i] = chunk_max[i] > x ? chunk_max[i] : x;
    }
  }
  // The rows' maxima before and after this step, row i in lane i.
  float* row_max = &w.row_max[r0];
  vfloat old_max = broadcast(kMinScore);
  std::memcpy(&old_max, row_max, RB * sizeof(float));
  const vfloat chunk_maxima = max_of_rows(chunk_max);
  const vfloat new_max = old_max > chunk_maxima ? old_max : chunk_maxima;
  std::memcpy(row_max, &new_max, RB * sizeof(float));
  // exp(old max - new max) per row: exactly 1 where the maximum did not move.
  const vfloat correction = vexp(old_max - new_max);
  alignas(64) float weight[RB][kStep];  // p * value scale, by position in the step
  for (int i = 0; i < RB; ++i) {
    vfloat sum = vfloat{}, zeros = vfloat{};
    for (int g = g_lo; g < g_hi; ++g) {
      vfloat p = vexp(score[g][i] - new_max[i]);
      if (!whole) p = visible[g][i] ? p : vfloat{};
      sum += p;
      const int l_lo = static_cast<int>(std::max<int64_t>(lo - g * kLanes, 0));
      const int l_hi = static_cast<int>(std::min<int64_t>(hi - g * kLanes, kLanes));
      const vfloat u = p * keys.value_scales(step + g * kLanes, l_lo, l_hi);
      std::memcpy(&weight[i][g * kLanes], &u, sizeof u);
      if constexpr (Keys::kZeros) zeros = fmadd(p, keys.value_zeros(step + g * kLanes), zeros);
    }
    w.row_sum[r0 + i] = w.row_sum[r0 + i] * correction[i] + sum;
    w.zeros[r0 + i] = w.zeros[r0 + i] * correction[i] + zeros;
  }
  keys.template values<RB>(step, lo, hi, weight, correction, &w.acc[r0 * NV]);
}

// Rows [begin, end) of the scratch over positions [first, first + n) of one block, RB
// rows at a time.
template <int NV, int RB, typename Keys>
void attend_block_rows(const Keys& keys, int64_t first, int64_t n, int64_t begin, int64_t end,
                       const Shapes& s, Scratch& w) {
  for (int64_t r0 = begin; r0 < end; r0 += RB) {
    typename Keys::template Query<RB> q;
    keys.template fold<RB>(&(Keys::kRotated ? w.rotated : w.query)[r0 * NV], q);
    for (int64_t step = 0; step < n; step += kStep)
      attend_step<NV, RB>(keys, q, first, step, std::min<int64_t>(kStep, n - step), r0, s, w);
  }
}

// Rows [begin, begin + rows) of the scratch: RB rows at a time, the largest RB <= 4 that
// divides them, or 4 and the 1 or 3 left over.
template <int NV, typename Keys>
void attend_block(const Keys& keys, int64_t first, int64_t n, int64_t begin, int64_t rows,
                  const Shapes& s, Scratch& w) {
  const int64_t end = begin + rows;
  if (rows % 4 == 0) return attend_block_rows<NV, 4>(keys, first, n, begin, end, s, w);
  if (rows % 3 == 0) return attend_block_rows<NV, 3>(keys, first, n, begin, end, s, w);
  if (rows % 2 == 0) return attend_block_rows<NV, 2>(keys, first, n, begin, end, s, w);
  const int64_t fours = begin + rows / 4 * 4;
  attend_block_rows<NV, 4>(keys, first, n, begin, fours, s, w);
  if (end - fours == 3) return attend_block_rows<NV, 3>(keys, first, n, fours, end, s, w);
  attend_block_rows<NV, 1>(keys, first, n, fours, end, s, w);
}

// Query tokens [first_token, first_token + num_tokens) of sequence `seq`, the first at
// position first_pos; they see positions [seen_begin, first_pos + num_tokens).
struct Tile {
  int64_t seq, first_token, num_tokens, first_pos, seen_begin;
};

// A tile under kv heads [kv_head, kv_head + num_heads) over blocks [block_begin,
// block_end) of its table, block by block, the heads in turn: a block's tiles (or K/V
// rows) of all heads, adjacent in the pool, are read together. partial: where in the
// partial-state buffer it leaves its rows' state (rows x (head_dim + 2) floats:
// accumulators, maxima, sums) for merge_parts, or -1 when it covers all the tile's
// blocks and writes the output itself.
struct Unit {
  int64_t tile, kv_head, num_heads, block_begin, block_end, partial, cost;
};

// A tile under kv heads [kv_head, kv_head + num_heads) whose blocks `parts` units share,
// their states stored one after another from `partial` on.
struct Merge {
  int64_t tile, kv_head, num_heads, partial, parts;
};

// Row r of a tile from kv head h on: query token first_token + r % per_head / group,
// query head h group + r (mod per_head, the tile's rows under one kv head). Its element
// offset in q, q_rotated and out:
int64_t row_offset(const Tile& tile, int64_t kv_head, int64_t r, const Shapes& s) {
  const int64_t group = s.num_q_heads / s.num_kv_heads, per_head = tile.num_tokens * group;
  const int64_t head = kv_head + r / per_head, row = r % per_head;
  return ((tile.first_token + row / group) * s.num_q_heads + head * group + row % group) *
         s.head_dim;
}

template <typename Rows, int NV>
void attend_unit(const Unit& unit, const Tile& tile, const Batch& b, Scratch& w,
                 float* partials) {
  const Shapes& s = b.full;
  const int64_t group = s.num_q_heads / s.num_kv_heads, per_head = tile.num_tokens * group;
  const int64_t rows = per_head * unit.num_heads;
  w.resize(rows, NV);
  const auto* q = static_cast<const float*>(s.q);
  const auto* q_rotated = static_cast<const float*>(b.q_rotated);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t off = row_offset(tile, unit.kv_head, r, s);
    for (int j = 0; j < NV; ++j) {
      w.query[r * NV + j] = load(q + off + j * kLanes) * s.scale;
      w.rotated[r * NV + j] = load(q_rotated + off + j * kLanes) * s.scale;
      w.acc[r * NV + j] = vfloat{};
    }
    w.pos[r] = tile.first_pos + r % per_head / group;
    w.row_max[r] = kMinScore;
    w.row_sum[r] = w.zeros[r] = vfloat{};
  }
  const int64_t block_size = int64_t{1} << s.block_size_shift;
  const int64_t end = tile.first_pos + tile.num_tokens;  // past the last position seen
  const int32_t* table = s.block_tables + tile.seq * s.max_blocks;
  const int64_t tile_bytes = CompactKeys<NV>::tile_bytes(block_size);
  const auto* k_cache = static_cast<const typename Rows::Elem*>(s.k_cache);
  const auto* v_cache = static_cast<const typename Rows::Elem*>(s.v_cache);
  const int64_t elem = sizeof(typename Rows::Elem);
  const int64_t row_bytes = (s.head_dim + (Rows::kScaled ? 2 : 0)) * elem;
  // Where a block's data are under kv head h: its tile, or its K and V rows from
  // element offset full_offset on.
  const auto tile_of = [&](int64_t entry, int64_t h) {
    return b.tiles + ((entry - b.num_full_blocks) * s.num_kv_heads + h) * tile_bytes;
  };
  const auto full_offset = [&](int64_t entry, int64_t h) {
    return entry * s.block_stride + h * s.head_stride;
  };
  // Kv head h's data of `block` as an Ahead: none past the unit's blocks.
  const auto ahead_of = [&](int64_t block, int64_t h) {
    Ahead ahead;
    if (block >= unit.block_end) return ahead;
    const int64_t entry = table[block];
    if (entry >= b.num_full_blocks) {
      ahead = {reinterpret_cast<const char*>(tile_of(entry, h)), nullptr, nullptr, block_size,
               tile_bytes, 0};
    } else {
      const int64_t off = full_offset(entry, h);
      ahead = {nullptr, reinterpret_cast<const char*>(k_cache + off),
               reinterpret_cast<const char*>(v_cache + off), block_size, row_bytes,
               s.token_stride * elem};
    }
    return ahead;
  };
  // Blocks shorter than a softmax step go in runs (CompactRun) where they are compact and
  // whole: how many from `block` on.
  const int64_t max_run = std::clamp<int64_t>(kStep / block_size, 1, CompactRun<NV>::kMaxRun);
  const auto run_at = [&](int64_t block) {
    int64_t run = 0;
    while (run < max_run && block + run < unit.block_end &&
           table[block + run] >= b.num_full_blocks && (block + run + 1) * block_size <= end)
      ++run;
    return run;
  };
  for (int64_t block = unit.block_begin; block < unit.block_end;) {
    const int64_t entry = table[block], first = block * block_size;
    const int64_t n = std::min(block_size, end - first);
    const int64_t run = max_run > 1 ? run_at(block) : 0;
    for (int64_t i = 0; i < unit.num_heads; ++i) {
      const int64_t h = unit.kv_head + i;
      if (run > 1) {
        CompactRun<NV> keys;
        keys.count = static_cast<int>(run);
        keys.shift = s.block_size_shift;
        for (int64_t r = 0; r < run; ++r)
          keys.part[r] = CompactKeys<NV>(tile_of(table[block + r], h), block_size,
                                         ahead_of(block + r + kBlocksAhead * run, h));
        attend_block<NV>(keys, first, run * block_size, i * per_head, per_head, s, w);
      } else if (entry >= b.num_full_blocks) {
        attend_block<NV>(
            CompactKeys<NV>(tile_of(entry, h), block_size, ahead_of(block + kBlocksAhead, h)),
            first, n, i * per_head, per_head, s, w);
      } else {
        const int64_t off = full_offset(entry, h);
        attend_block<NV>(FullKeys<Rows, NV>{k_cache + off, v_cache + off, s.token_stride,
                                            ahead_of(block + kBlocksAhead, h)},
                         first, n, i * per_head, per_head, s, w);
      }
    }
    block += std::max<int64_t>(run, 1);
  }
  // Each row's accumulator with the zero points' share, and its softmax denominator:
  // the output once divided, or the unit's partial state.
  auto* out = static_cast<float*>(s.out);
  float* state = unit.partial < 0 ? nullptr : partials + unit.partial;
  for (int64_t r = 0; r < rows; ++r) {
    const float zeros = hsum(w.zeros[r]), sum = hsum(w.row_sum[r]);
    const float inv = state ? 1.f : 1.f / sum;
    float* dst = state ? state + r * NV * kLanes : out + row_offset(tile, unit.kv_head, r, s);
    for (int j = 0; j < NV; ++j) {
      const vfloat o = (w.acc[r * NV + j] + zeros) * inv;
      std::memcpy(dst + j * kLanes, &o, sizeof o);
    }
    if (state) {
      state[rows * NV * kLanes + r] = w.row_max[r];
      state[rows * (NV * kLanes + 1) + r] = sum;
    }
  }
}

// The output of m's tile under its kv heads from the partial states of its units.
void merge_parts(const Merge& m, const Tile& tile, const float* partials, const Shapes& s) {
  const int64_t partial = m.partial, parts = m.parts;
  const int64_t rows = tile.num_tokens * (s.num_q_heads / s.num_kv_heads) * m.num_heads;
  const int64_t d = s.head_dim, part_floats = rows * (d + 2);
  auto* out = static_cast<float*>(s.out);
  for (int64_t r = 0; r < rows; ++r) {
    float max = kMinScore;
    for (int64_t p = 0; p < parts; ++p)
      max = std::max(max, partials[partial + p * part_floats + rows * d + r]);
    float* o = out + row_offset(tile, m.kv_head, r, s);
    std::fill_n(o, d, 0.f);
    float sum = 0.f;
    for (int64_t p = 0; p < parts; ++p) {
      const float* state = partials + partial + p * part_floats;
      const float weight = std::exp(state[rows * d + r] - max);
      sum += weight * state[rows * (d + 1) + r];
      for (int64_t j = 0; j < d; ++j) o[j] += weight * state[r * d + j];
    }
    for (int64_t j = 0; j < d; ++j) o[j] /= sum;
  }
}

template <typename Rows>
void run(const Batch& b) {
  const Shapes& s = b.full;
  const int64_t block_size = int64_t{1} << s.block_size_shift;
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  std::vector<Tile> tiles;
  int64_t work = 0;  // query rows x positions seen, summed
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t start = s.query_start_loc[i];
    const int64_t q_len = s.query_start_loc[i + 1] - start;
    const int64_t context = s.seq_lens[i] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile) {
      const int64_t n = std::min(kQueryTile, q_len - t0);
      const int64_t first_pos = context + t0;
      const int64_t seen_begin =
          s.sliding_window ? std::max<int64_t>(0, first_pos - s.sliding_window + 1) : 0;
      tiles.push_back({i, start + t0, n, first_pos, seen_begin});
      work += n * group * (first_pos + n - seen_begin);
    }
  }
  const int threads = work < kMinParallelWork ? 1 : s.num_threads;
  // A tile's visible blocks, and in how many parts they may split: none shorter than
  // kMinPartPositions, and with one thread none at all.
  const auto blocks_of = [&](const Tile& tile) {
    const int64_t end = tile.first_pos + tile.num_tokens;
    return std::pair(tile.seen_begin / block_size, (end + block_size - 1) / block_size);
  };
  const auto max_parts = [&](const Tile& tile) {
    const auto [begin, end] = blocks_of(tile);
    const int64_t positions = tile.first_pos + tile.num_tokens - tile.seen_begin;
    return threads > 1 ? std::clamp<int64_t>(positions / kMinPartPositions, 1, end - begin) : 1;
  };
  // Units take all kv heads at once (Unit) where that leaves kUnitsPerThread of them per
  // thread once tiles are split, else one kv head each.
  const int64_t wanted = kUnitsPerThread * threads;
  int64_t together = 0;
  for (const Tile& tile : tiles) together += max_parts(tile);
  const int64_t heads = threads == 1 || together >= wanted ? s.num_kv_heads : 1;
  const int64_t pairs = static_cast<int64_t>(tiles.size()) * (s.num_kv_heads / heads);
  const int64_t parts_wanted = (wanted + pairs - 1) / pairs;
  std::vector<Unit> units;
  std::vector<Merge> merges;
  int64_t partial_floats = 0;
  for (int64_t t = 0; t < static_cast<int64_t>(tiles.size()); ++t) {
    const Tile& tile = tiles[t];
    const auto [block_begin, block_end] = blocks_of(tile);
    const int64_t parts = std::min(parts_wanted, max_parts(tile));
    const int64_t rows = tile.num_tokens * group * heads;
    for (int64_t h = 0; h < s.num_kv_heads; h += heads) {
      if (parts > 1) merges.push_back({t, h, heads, partial_floats, parts});
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t begin = block_begin + (block_end - block_begin) * p / parts;
        const int64_t finish = block_begin + (block_end - block_begin) * (p + 1) / parts;
        units.push_back({t, h, heads, begin, finish, parts > 1 ? partial_floats : -1,
                         rows * (finish - begin)});
        if (parts > 1) partial_floats += rows * (s.head_dim + 2);
      }
    }
  }
  // Costliest first: dynamic scheduling then balances the two ends of the queue.
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& a, const Unit& u) { return a.cost > u.cost; });
  std::vector<float> partials(partial_floats);
  const int64_t num_units = static_cast<int64_t>(units.size());
  const int64_t num_merges = static_cast<int64_t>(merges.size());
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_units; ++i) {
      const Unit& unit = units[i];
      const Tile& tile = tiles[unit.tile];
      switch (s.head_dim) {
        case 32: attend_unit<Rows, 2>(unit, tile, b, scratch, partials.data()); break;
        case 64: attend_unit<Rows, 4>(unit, tile, b, scratch, partials.data()); break;
        case 128: attend_unit<Rows, 8>(unit, tile, b, scratch, partials.data()); break;
        default: attend_unit<Rows, 16>(unit, tile, b, scratch, partials.data()); break;
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_merges; ++i) {
      merge_parts(merges[i], tiles[merges[i].tile], partials.data(), s);
    }
  }
}

}  // namespace

namespace pagedllm {

void paged_attention_compact(const CompactAttentionBatch& batch) {
  switch (batch.full.kv_format) {
    case KVFormat::kFloat32: return run<Float32Rows>(batch);
    case KVFormat::kBFloat16: return run<BFloat16Rows>(batch);
    case KVFormat::kFloat16: return run<Float16Rows>(batch);
    case KVFormat::kInt8: return run<Int8Rows>(batch);
    case KVFormat::kFp8E4M3: return run<Fp8Rows<kE4M3>>(batch);
    case KVFormat::kFp8E5M2: return run<Fp8Rows<kE5M2>>(batch);
  }
}

}  // namespace pagedllm
