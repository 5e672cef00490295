// Paged attention on CPU: K/V are read block by block through each sequence's block
// table, never copied into a contiguous tensor.
//
// Cache (per layer, K and V alike): [num_blocks, num_kv_heads, block_size, head_dim] with
// any strides but a contiguous head_dim; KVCache makes each (block, kv head) pair one
// contiguous block_size x head_dim tile.
// A work item is a group of query rows under one kv head: a tile of up to 32 query tokens
// of one sequence, or the decode tokens of sequences whose block tables start alike, read
// together over the blocks they share. A row is one (query token, query head) pair: the
// query heads of one kv head (grouped-query attention) share every K/V row loaded.
// Softmax is online, chunk by chunk; few rows score by dot products, many against the
// chunk's keys transposed, to the same bits. Numbers are accumulated in float32 whatever
// the storage format (kv_rows.h): float32, bfloat16 or float16 rows are widened; int8 and
// fp8 rows (one-byte codes and a bfloat16 scale) are decoded and multiplied by their
// scale here, never copied out decoded.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "kv_rows.h"
#include "vector_math.h"

namespace {

using namespace pagedllm::vec;
using namespace pagedllm::kv_rows;

constexpr int kMaxVectors = 16;  // head_dim <= 256
// Query tokens per work item in prefill: each chunk's keys are transposed once for all
// the tile's rows. 32 measured 1.07x the arithmetic rate of 16 on a shared-prefix
// prefill (float32 and bfloat16, Zen 4), 64 another 1.01x.
constexpr int kQueryTile = 32;
constexpr int kChunkVectors = 2;
constexpr int kChunk = kChunkVectors * kLanes;  // positions per online-softmax step
constexpr int64_t kPrefetchBytes = 6144;  // how far ahead each of K and V is fetched into L2
constexpr int64_t kNearPositions = 3;     // how many positions ahead K/V rows are fetched into L1
// Decode items take every kv head at once only when there are at least this many of them
// per thread (else the threads would go short of work).
constexpr int64_t kUnitsPerThread = 4;
// Tiles of at least this many query rows score against a transposed copy of each chunk's
// keys (TransposedScores): 48-row tiles measured 10-20% faster over a cache-resident
// context, 12-18-row tiles no faster.
constexpr int64_t kTransposedMinRows = 24;
// Decode rows of sequences sharing a prefix are attended together over it, up to this
// many rows per work item (16 sequences with 3 query heads per kv head).
constexpr int64_t kSharedRows = 48;
constexpr float kMinScore = -1e30f;
// Below this many (query row, position) pairs, waking a second thread costs more than
// it saves.
constexpr int64_t kMinParallelWork = 16384;

using Shapes = pagedllm::AttentionBatch;

// bfloat16 queries meet bfloat16 keys in the AVX-512 BF16 pair dot product: each
// instruction multiplies 32 pairs exactly and adds them into 16 float32 sums, where
// widening the keys took two instructions per 16 values and an FMA each. Scores then
// differ from the widened path's only in the order of float32 additions.
template <typename T, typename Rows, int NV>
constexpr bool kPairDot =
#ifdef __AVX512BF16__
    std::is_same_v<T, uint16_t> && std::is_same_v<Rows, BFloat16Rows> && NV > 0 && NV % 2 == 0;
#else
    false;
#endif

// Running state of one query row: float32 accumulator, max score and softmax sum (16
// partial sums, one per lane, added up only when the row is stored); and the current
// chunk's keys transposed, for tiles that score against them.
struct Scratch {
  std::vector<vfloat> query, acc, keys_t, row_sum;
  std::vector<float> row_max;
  std::vector<int64_t> pos;  // each row's position in its sequence
  void resize(int64_t rows, int64_t vectors) {
    pos.resize(rows);
    query.resize(rows * vectors);
    acc.resize(rows * vectors);
    keys_t.resize(kChunkVectors * vectors * kLanes);
    row_max.resize(rows);
    row_sum.resize(rows);
  }
};

// Fetches the K and V rows at element offset `off` into L2 (kLocality 1) or L1 (3).
template <int kLocality = 1, typename Elem>
inline void prefetch_rows(const Elem* k_cache, const Elem* v_cache, int64_t off,
                          int64_t row_bytes) {
  for (int64_t line = 0; line < row_bytes; line += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(k_cache + off) + line, 0, kLocality);
    __builtin_prefetch(reinterpret_cast<const char*>(v_cache + off) + line, 0, kLocality);
  }
}

// Two ways to the same scores. A query row's score at one position is the sum over
// words x = 16 j + l (a word: one dimension, or with the pair product two bfloat16
// dimensions) of q[x] k[x]: the terms of one l are chained in order of j into a partial
// A_l, and the 16 partials are added in the tree of transpose_sum,
// (((A0+A8)+(A4+A12))+((A2+A10)+(A6+A14))) + (((A1+A9)+(A5+A13))+((A3+A11)+(A7+A15))).
// Scoring by dot products keeps A_0..A_15 of one position as the lanes of one vector and
// adds them with transpose_sum; scoring against transposed keys keeps A_l of 16
// positions as the lanes of one vector and adds whole vectors, with no shuffles per row
// but a transpose of the keys per chunk, which pays from kTransposedMinRows rows on.
// The same operands meet in the same order either way, so a row's scores, and with them
// its output, do not depend on the tile it was scored in (batch invariance).

// Fills keys_t with the chunk's keys transposed: keys_t[(c * words + j) * 16 + l] holds,
// in lane p, word 16 j + l of the key at chunk position 16 c + p (float32 dimensions
// widened; with the pair product, pairs of bfloat16 dimensions as stored). Positions
// without a loaded key (before `first` or from `n` on) are zeros.
template <typename Rows, bool kPair>
void transpose_keys(const typename Rows::Elem* const* k_rows, int64_t first, int64_t n,
                    int64_t words, vfloat* keys_t) {
  vfloat block[kLanes];
  for (int c = 0; c < kChunkVectors; ++c) {
    for (int64_t j = 0; j < words; ++j) {
      for (int p = 0; p < kLanes; ++p) {
        const int64_t t = c * kLanes + p;
        if (t < first || t >= n) {
          block[p] = vfloat{};
        } else if constexpr (kPair) {
          std::memcpy(&block[p], k_rows[t] + j * 2 * kLanes, sizeof(vfloat));
        } else {
          block[p] = Rows::widen(k_rows[t] + j * kLanes);
        }
      }
      transpose16(block);
      std::copy(block, block + kLanes, keys_t + (c * words + j) * kLanes);
    }
  }
}

// Scores of R query rows (nv vectors apart in `query`) against H 16-position halves of a
// chunk's transposed keys (`keys_t`: nv vectors per key, or nv / 2 with the pair product,
// half after half): node<0, 1> leaves them in out[h][i], one position per lane. node<L, D>
// is the tree's sum of the partials A_L, A_{L+D}, ... (D < 16). The pair product scores
// two rows against both halves at once (each query word broadcast once for both; measured
// 6-9% faster on bfloat16 prefill than four rows a half at a time); float32 scores all RB
// rows a half at a time (both halves at once measured 9-12% slower).
template <int NV, int H, int R, bool kPair>
struct TransposedScores {
  const vfloat* query;
  const vfloat* keys_t;
  int64_t nv;

  template <int L>
  void partial(vfloat (&out)[H][R]) const {
    const int64_t words = kPair ? NV / 2 : (NV ? NV : nv);
#ifdef __AVX512BF16__
    if constexpr (kPair) {
      const auto* q = reinterpret_cast<const int32_t*>(query);
      vfloat a[H][R] = {};
      for (int j = 0; j < NV / 2; ++j) {
        for (int i = 0; i < R; ++i) {
          const auto word = (__m512bh)_mm512_set1_epi32(q[(i * NV + j) * kLanes + L]);
          for (int h = 0; h < H; ++h)
            a[h][i] = (vfloat)_mm512_dpbf16_ps((__m512)a[h][i], word,
                                               (__m512bh)keys_t[(h * words + j) * kLanes + L]);
        }
      }
      std::copy(&a[0][0], &a[0][0] + H * R, &out[0][0]);
      return;
    }
#endif
    const auto* q = reinterpret_cast<const float*>(query);
    const int64_t row = words * kLanes;
    for (int h = 0; h < H; ++h) {
      const vfloat* k = keys_t + h * words * kLanes + L;
      for (int i = 0; i < R; ++i) out[h][i] = broadcast(q[i * row + L]) * k[0];
      for (int64_t j = 1; j < words; ++j) {
        for (int i = 0; i < R; ++i)
          out[h][i] = fmadd(broadcast(q[i * row + j * kLanes + L]), k[j * kLanes], out[h][i]);
      }
    }
  }

  template <int L, int D>
  void node(vfloat (&out)[H][R]) const {
    if constexpr (D == kLanes) {
      partial<L>(out);
    } else {
      vfloat other[H][R];
      node<L, 2 * D>(out);
      node<L + D, 2 * D>(other);
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < R; ++i) {
          out[h][i] += other[h][i];
          // Each sum where the tree has it: without this GCC 12 computed all 16 partials
          // of every row before adding any and spilled them (64 live vectors); float32
          // prefill attention 1.04-1.07x faster without the spills (Zen 5).
          pin(out[h][i]);
        }
    }
  }
};

// Scores of RB rows against the chunk's transposed keys into raw[c][i] (position 16 c + lane
// of row i), in passes of R rows over H halves as TransposedScores describes.
template <int NV, int RB, bool kPair>
void transposed_scores(const vfloat* query, const vfloat* keys_t, int64_t nv,
                       vfloat (&raw)[kChunkVectors][RB]) {
  constexpr bool kBothHalves = kPair && RB % 2 == 0;
  constexpr int H = kBothHalves ? kChunkVectors : 1;
  constexpr int R = kBothHalves ? 2 : RB;
  const int64_t words = kPair ? nv / 2 : nv;
  for (int c = 0; c < kChunkVectors; c += H) {
    for (int r = 0; r < RB; r += R) {
      vfloat part[H][R];
      TransposedScores<NV, H, R, kPair>{query + r * nv, keys_t + c * words * kLanes, nv}
          .template node<0, 1>(part);
      for (int h = 0; h < H; ++h) std::copy(part[h], part[h] + R, raw[c + h] + r);
    }
  }
}

// One tile of query tokens: tokens [first_token, first_token + num_tokens) of sequence
// `seq`, the first at position first_pos, each later one a position further. cost: query
// tokens x positions seen, for the schedule.
struct Tile {
  int64_t seq, first_token, num_tokens, first_pos, cost;
};

// Element offset in q / out of row r of `tile` under kv head `kv_head`. A row is one
// (query token, query head) pair; the query heads of one kv head share every K/V row
// loaded (grouped-query attention).
int64_t query_offset(const Tile& tile, int64_t kv_head, int64_t r, const Shapes& s) {
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  return ((tile.first_token + r / group) * s.num_q_heads + kv_head * group + r % group) *
         s.head_dim;
}

// Copies the query rows of `tile` for kv head `kv_head` into the scratch from row `row`
// on, with an empty softmax state.
template <typename T, typename Rows, int NV>
void load_rows(const T* q, const Tile& tile, int64_t kv_head, int64_t row, const Shapes& s,
               Scratch& w) {
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const int64_t nv = NV ? NV : s.head_dim / kLanes;
  for (int64_t r = 0; r < tile.num_tokens * group; ++r) {
    const T* src = q + query_offset(tile, kv_head, r, s);
    vfloat* query = &w.query[(row + r) * nv];
    for (int64_t j = 0; j < nv; ++j) {
      if constexpr (kPairDot<T, Rows, NV>) {  // the bfloat16 bits as they are; scaled per score
        if (j < nv / 2) std::memcpy(&query[j], src + j * 2 * kLanes, sizeof(vfloat));
      } else {
        query[j] = load(src + j * kLanes) * s.scale;
      }
      w.acc[(row + r) * nv + j] = vfloat{};
    }
    w.pos[row + r] = tile.first_pos + r / group;
    w.row_max[row + r] = kMinScore;
    w.row_sum[row + r] = vfloat{};
  }
}

// Writes the normalized output of the rows `load_rows` put at `row`.
template <typename T, int NV>
void store_rows(T* out, const Tile& tile, int64_t kv_head, int64_t row, const Shapes& s,
                const Scratch& w) {
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const int64_t nv = NV ? NV : s.head_dim / kLanes;
  for (int64_t r = 0; r < tile.num_tokens * group; ++r) {
    T* dst = out + query_offset(tile, kv_head, r, s);
    const float inv = 1.f / hsum(w.row_sum[row + r]);
    for (int64_t j = 0; j < nv; ++j) {
      const vfloat o = w.acc[(row + r) * nv + j] * inv;
      for (int i = 0; i < kLanes; ++i) store(dst + j * kLanes + i, o[i]);
    }
  }
}

// Attention of the scratch's rows [row_begin, row_begin + rows) over positions
// [begin, end) of the sequence whose block table is `table`; begin is a multiple of
// kChunk and end is past the last position any of the rows sees, or a later multiple of
// kChunk (the rest comes in a later call). K/V rows are prefetched up to prefetch_end
// (>= end; positions there must be in the table). Row r sits at position
// w.pos[r] and sees [0, w.pos[r]] (with a sliding window W, [w.pos[r] - W + 1, w.pos[r]]
// only). Rows are processed RB at a time so that every K/V row loaded serves RB query
// rows. NV is head_dim / 16, or 0 when only known at run time. Each row's result does not
// depend on the other rows, nor on how its positions are split between calls at multiples
// of kChunk: every row meets its chunks in order, one at a time.
template <typename T, typename Rows, int NV, int RB>
void attend_rows(const typename Rows::Elem* k_cache, const typename Rows::Elem* v_cache,
                 const int32_t* table, int64_t kv_head, int64_t row_begin, int64_t rows,
                 int64_t begin, int64_t end, int64_t prefetch_end, const Shapes& s,
                 Scratch& w) {
  constexpr int kNV = NV ? NV : kMaxVectors;
  const int64_t nv = NV ? NV : s.head_dim / kLanes;
  const int64_t block_mask = (int64_t{1} << s.block_size_shift) - 1;
  constexpr bool pair_dot = kPairDot<T, Rows, NV>;
  using Elem = typename Rows::Elem;
  const Elem* k_rows[kChunk];
  const Elem* v_rows[kChunk];
  alignas(64) float k_scales[kChunk];
  float v_scales[kChunk];
  vfloat parts[RB][kChunk];
  alignas(64) float probs[RB][kChunk];
  const vfloat lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t window = s.sliding_window;
  const int64_t* pos = &w.pos[row_begin];
  // The first position any row sees. Rows before it are never loaded: their blocks may
  // have been released (a null block-table entry). Chunks stay aligned to kChunk
  // positions, so the summation order does not depend on where a query tile starts.
  int64_t window_begin = begin;
  if (window) {
    const int64_t first_pos = *std::min_element(pos, pos + rows);
    window_begin = std::max(begin, first_pos - window + 1);
  }
  const int64_t visible_begin = window_begin / kChunk * kChunk;
  const int64_t row_bytes = s.head_dim * static_cast<int64_t>(sizeof(Elem));
  const int64_t prefetch_distance = std::max<int64_t>(1, kPrefetchBytes / row_bytes);
  const bool transposed = rows >= kTransposedMinRows;
  const int64_t words = pair_dot ? nv / 2 : nv;  // vectors of words per key
  auto row_offset = [&](int64_t pos) {
    return table[pos >> s.block_size_shift] * s.block_stride + kv_head * s.head_stride +
           (pos & block_mask) * s.token_stride;
  };
  for (int64_t c0 = visible_begin; c0 < end; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, end - c0);
    const int64_t first = std::max<int64_t>(0, window_begin - c0);
    for (int64_t t = 0; t < kChunk; ++t) {
      if (t < first || t >= n) {
        k_scales[t] = v_scales[t] = 0.f;
        continue;
      }
      const int64_t off = row_offset(c0 + t);
      k_rows[t] = k_cache + off;
      v_rows[t] = v_cache + off;
      k_scales[t] = row_scale<Rows>(k_rows[t], s.head_dim);
      v_scales[t] = row_scale<Rows>(v_rows[t], s.head_dim);
    }
    if (transposed) {
      transpose_keys<Rows, pair_dot>(k_rows, first, n, words, w.keys_t.data());
      for (int64_t t = first; t < n && c0 + t + prefetch_distance < prefetch_end; ++t)
        prefetch_rows(k_cache, v_cache, row_offset(c0 + t + prefetch_distance), row_bytes);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      // Row i sees chunk positions [seen_from[i], seen[i]); these RB rows together
      // [seen_min, seen_max).
      int64_t seen[RB], seen_from[RB];
      int64_t seen_max = 0, seen_min = n;
      bool any_seen = false;
      for (int i = 0; i < RB; ++i) {
        seen[i] = std::clamp<int64_t>(pos[r0 + i] + 1 - c0, 0, n);
        seen_from[i] = window ? std::clamp<int64_t>(pos[r0 + i] - window + 1 - c0, 0, n) : 0;
        seen_max = std::max(seen_max, seen[i]);
        seen_min = std::min(seen_min, seen_from[i]);
        any_seen = any_seen || seen_from[i] < seen[i];
      }
      if (!any_seen) continue;
      const vfloat* qr = &w.query[(row_begin + r0) * nv];
      vfloat raw[kChunkVectors][RB];  // scores before the scales, one position per lane
      if (transposed) {
        transposed_scores<NV, RB, pair_dot>(qr, w.keys_t.data(), nv, raw);
      } else {
        for (int64_t t = 0; t < kChunk; ++t) {
          if (t >= seen_max || t < seen_min) {
            for (int i = 0; i < RB; ++i) parts[i][t] = vfloat{};
            continue;
          }
          // Blocks are scattered, so the hardware prefetcher cannot run ahead of us: each
          // position scored fetches the K/V rows of one position kPrefetchBytes ahead
          // into L2, and of one kNearPositions ahead from there into L1. Spread out like
          // this it measured 20-30% faster on decode than a burst per chunk (Zen 4); the
          // L1 step and 6 instead of 8 KiB ahead another 1.2-1.3x on cold caches (Zen 5:
          // 26 -> 33 GB/s of float32 K/V, 20 -> 25 of bfloat16).
          if (r0 == 0) {
            if (c0 + t + prefetch_distance < prefetch_end)
              prefetch_rows(k_cache, v_cache, row_offset(c0 + t + prefetch_distance), row_bytes);
            if (c0 + t + kNearPositions < prefetch_end)
              prefetch_rows<3>(k_cache, v_cache, row_offset(c0 + t + kNearPositions), row_bytes);
          }
          if constexpr (pair_dot) {
#ifdef __AVX512BF16__
            __m512bh key[NV / 2];
            for (int j = 0; j < NV / 2; ++j)
              key[j] = (__m512bh)_mm512_loadu_si512(k_rows[t] + j * 2 * kLanes);
            for (int i = 0; i < RB; ++i) {
              __m512 a = _mm512_setzero_ps();
              for (int j = 0; j < NV / 2; ++j)
                a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(&qr[i * NV + j]), key[j]);
              parts[i][t] = (vfloat)a;
            }
#endif
          } else {
            vfloat key[kNV];
            for (int64_t j = 0; j < nv; ++j) key[j] = Rows::widen(k_rows[t] + j * kLanes);
            for (int i = 0; i < RB; ++i) {
              vfloat a = qr[i * nv] * key[0];
              for (int64_t j = 1; j < nv; ++j) a = fmadd(qr[i * nv + j], key[j], a);
              parts[i][t] = a;
            }
          }
        }
        for (int c = 0; c < kChunkVectors; ++c)
          for (int i = 0; i < RB; ++i) raw[c][i] = transpose_sum(&parts[i][c * kLanes]);
      }
      // A chunk every one of these rows sees whole needs no mask.
      bool whole = n == kChunk;
      for (int i = 0; i < RB; ++i) whole = whole && seen_from[i] == 0 && seen[i] == kChunk;
      vfloat score[RB][kChunkVectors], visible[RB][kChunkVectors];
      static_assert(RB <= 4, "max_of_rows reduces four rows");
      vfloat chunk_max[4];
      for (int i = 0; i < 4; ++i) chunk_max[i] = broadcast(kMinScore);
      for (int i = 0; i < RB; ++i) {
        for (int c = 0; c < kChunkVectors; ++c) {
          vfloat x = raw[c][i];
          if constexpr (Rows::kScaled) x *= load(&k_scales[c * kLanes]);
          if constexpr (pair_dot) x *= s.scale;
          if (s.logit_softcap > 0.f) {
            for (int l = 0; l < kLanes; ++l)
              x[l] = s.logit_softcap * std::tanh(x[l] / s.logit_softcap);
          }
          if (!whole) {
            const vfloat index = lane + static_cast<float>(c * kLanes);
            visible[i][c] = index < static_cast<float>(seen[i]) &&
                                    index >= static_cast<float>(seen_from[i])
                                ? vfloat{} + 1.f
                                : vfloat{};
            x = visible[i][c] > 0.f ? x : vfloat{} + kMinScore;
          }
          score[i][c] = x;
          chunk_max[i] = chunk_max[i] > x ? chunk_max[i] : x;
        }
      }
      // The rows' maxima before and after this chunk, row i in lane i.
      float* row_max = &w.row_max[row_begin + r0];
      vfloat old_max = broadcast(kMinScore);
      std::memcpy(&old_max, row_max, RB * sizeof(float));
      const vfloat chunk_maxima = max_of_rows(chunk_max);
      const vfloat new_max = old_max > chunk_maxima ? old_max : chunk_maxima;
      std::memcpy(row_max, &new_max, RB * sizeof(float));
      // exp(old max - new max) per row: exactly 1 where the maximum did not move.
      const vfloat correction = vexp(old_max - new_max);
      for (int i = 0; i < RB; ++i) {
        vfloat sum = vfloat{};
        for (int c = 0; c < kChunkVectors; ++c) {
          vfloat p = vexp(score[i][c] - new_max[i]);
          if (!whole) p *= visible[i][c];
          sum += p;
          std::memcpy(&probs[i][c * kLanes], &p, sizeof p);
        }
        vfloat& row_sum = w.row_sum[row_begin + r0 + i];
        row_sum = row_sum * correction[i] + sum;
      }
      vfloat acc[RB][kNV];
      for (int i = 0; i < RB; ++i)
        for (int64_t j = 0; j < nv; ++j)
          acc[i][j] = w.acc[(row_begin + r0 + i) * nv + j] * correction[i];
      for (int64_t t = seen_min; t < seen_max; ++t) {
        vfloat value[kNV];
        for (int64_t j = 0; j < nv; ++j) value[j] = Rows::widen(v_rows[t] + j * kLanes);
        for (int i = 0; i < RB; ++i) {
          const float p = Rows::kScaled ? probs[i][t] * v_scales[t] : probs[i][t];
          for (int64_t j = 0; j < nv; ++j) acc[i][j] += p * value[j];
        }
      }
      for (int i = 0; i < RB; ++i)
        for (int64_t j = 0; j < nv; ++j) w.acc[(row_begin + r0 + i) * nv + j] = acc[i][j];
    }
  }
}

// Picks the compile-time variant: RB rows per pass must divide the rows and, with their
// accumulators, fit the 32 vector registers.
template <typename T, typename Rows, int NV>
void attend_rows_dispatch(const typename Rows::Elem* k_cache,
                          const typename Rows::Elem* v_cache, const int32_t* table,
                          int64_t kv_head, int64_t row_begin, int64_t rows, int64_t begin,
                          int64_t end, int64_t prefetch_end, const Shapes& s, Scratch& w) {
#define PAGEDLLM_ATTEND(RB)                                                                \
  return attend_rows<T, Rows, NV, RB>(k_cache, v_cache, table, kv_head, row_begin, rows, \
                                      begin, end, prefetch_end, s, w)
  if constexpr (NV == 4) {
    if (rows % 4 == 0) PAGEDLLM_ATTEND(4);
    if (rows % 3 == 0) PAGEDLLM_ATTEND(3);
  }
  if constexpr (NV == 4 || NV == 8) {
    if (rows % 2 == 0) PAGEDLLM_ATTEND(2);
  }
  PAGEDLLM_ATTEND(1);
#undef PAGEDLLM_ATTEND
}

// One work item, done once per kv head: tiles [first_tile, first_tile + num_tiles). With
// shared_end > 0, positions [0, shared_end) are the same blocks in the tables of all the
// tiles' sequences and every row of them sees them all: they are read once, through the
// first tile's table, for all the rows together; then each tile goes on alone. cost:
// the tiles' costs summed, for the schedule.
struct WorkItem {
  int64_t first_tile, num_tiles, shared_end, cost;
};

template <typename T, typename Rows, int NV>
void attend_item(const WorkItem& item, const Tile* tiles, int64_t kv_head, const Shapes& s,
                 Scratch& w) {
  const auto* kp = static_cast<const typename Rows::Elem*>(s.k_cache);
  const auto* vp = static_cast<const typename Rows::Elem*>(s.v_cache);
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const Tile* first = tiles + item.first_tile;
  const Tile* last = first + item.num_tiles;
  int64_t rows = 0;
  for (const Tile* t = first; t != last; ++t) rows += t->num_tokens * group;
  w.resize(rows, NV ? NV : s.head_dim / kLanes);
  int64_t row = 0;
  for (const Tile* t = first; t != last; ++t) {
    load_rows<T, Rows, NV>(static_cast<const T*>(s.q), *t, kv_head, row, s, w);
    row += t->num_tokens * group;
  }
  const auto table = [&](const Tile* t) { return s.block_tables + t->seq * s.max_blocks; };
  if (item.shared_end > 0)
    attend_rows_dispatch<T, Rows, NV>(kp, vp, table(first), kv_head, 0, rows, 0,
                                      item.shared_end, item.shared_end, s, w);
  row = 0;
  for (const Tile* t = first; t != last; ++t) {
    const int64_t tile_rows = t->num_tokens * group;
    const int64_t end = t->first_pos + t->num_tokens;
    attend_rows_dispatch<T, Rows, NV>(kp, vp, table(t), kv_head, row, tile_rows,
                                      item.shared_end, end, end, s, w);
    store_rows<T, NV>(static_cast<T*>(s.out), *t, kv_head, row, s, w);
    row += tile_rows;
  }
}

// A decode item alone (one tile, no shared prefix) under every kv head at once: the heads
// take turns chunk by chunk, so that the K (and V) rows of all heads in a block,
// contiguous in the pool, are read together rather than one head's slice of each block
// per pass; each head keeps prefetching its own rows past its chunk. Measured 1.02-1.2x
// the K/V read rate of one head per pass on decode (Zen 4). Splitting positions between
// calls at multiples of kChunk changes no bit (attend_rows).
template <typename T, typename Rows, int NV>
void attend_item_heads(const WorkItem& item, const Tile* tiles, const Shapes& s, Scratch& w) {
  const Tile& tile = tiles[item.first_tile];
  const auto* kp = static_cast<const typename Rows::Elem*>(s.k_cache);
  const auto* vp = static_cast<const typename Rows::Elem*>(s.v_cache);
  const int64_t rows = tile.num_tokens * (s.num_q_heads / s.num_kv_heads);
  const int32_t* table = s.block_tables + tile.seq * s.max_blocks;
  w.resize(rows * s.num_kv_heads, NV ? NV : s.head_dim / kLanes);
  for (int64_t h = 0; h < s.num_kv_heads; ++h)
    load_rows<T, Rows, NV>(static_cast<const T*>(s.q), tile, h, h * rows, s, w);
  const int64_t end = tile.first_pos + tile.num_tokens;
  for (int64_t c = 0; c < end; c += kChunk)
    for (int64_t h = 0; h < s.num_kv_heads; ++h)
      attend_rows_dispatch<T, Rows, NV>(kp, vp, table, h, h * rows, rows, c,
                                        std::min(end, c + kChunk), end, s, w);
  for (int64_t h = 0; h < s.num_kv_heads; ++h)
    store_rows<T, NV>(static_cast<T*>(s.out), tile, h, h * rows, s, w);
}

// Whether a tile has too few query rows to score against transposed keys (decode): such
// tiles share work items over a common prefix, or take all kv heads at once.
bool few_rows(const Shapes& s, const Tile& t) {
  return t.num_tokens * (s.num_q_heads / s.num_kv_heads) < kTransposedMinRows;
}

// Leading positions, a multiple of kChunk, that sequence b's block table shares with
// sequence a's and that every row of b's tile sees.
int64_t shared_positions(const Shapes& s, const Tile& a, const Tile& b) {
  const int32_t* ta = s.block_tables + a.seq * s.max_blocks;
  const int32_t* tb = s.block_tables + b.seq * s.max_blocks;
  const int64_t seen = std::min(a.first_pos, b.first_pos) + 1;  // positions both see whole
  const int64_t blocks = std::min(seen >> s.block_size_shift, s.max_blocks);
  int64_t same = 0;
  while (same < blocks && ta[same] == tb[same]) ++same;
  return std::min(same << s.block_size_shift, seen) / kChunk * kChunk;
}

// The work items: each tile of kTransposedMinRows rows or more alone (it already shares
// every K/V row among many query rows), and the smaller tiles (decode) of sequences that
// start on the same block grouped, up to kSharedRows rows per item, by how much of their
// block tables they share, longest sharing first. Not with a sliding window.
std::vector<WorkItem> plan_items(const Shapes& s, std::vector<Tile>& tiles) {
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const auto small = [&](const Tile& t) {
    return !s.sliding_window && few_rows(s, t) && t.first_pos >= kChunk;
  };
  const auto first_block = [&](const Tile& t) { return s.block_tables[t.seq * s.max_blocks]; };
  // Tiles to group first, by first block; the rest after them, as they were.
  std::stable_partition(tiles.begin(), tiles.end(), small);
  const auto grouped_end = std::find_if_not(tiles.begin(), tiles.end(), small);
  std::stable_sort(tiles.begin(), grouped_end, [&](const Tile& a, const Tile& b) {
    return first_block(a) < first_block(b);
  });
  std::vector<WorkItem> items;
  const int64_t num_grouped = grouped_end - tiles.begin();
  for (int64_t i = 0; i < num_grouped;) {
    int64_t j = i + 1;
    while (j < num_grouped && first_block(tiles[j]) == first_block(tiles[i])) ++j;
    // Tiles [i, j) start on one block: order them by what they share with tile i, so
    // that each item's shared length is that of its last tile.
    std::vector<std::pair<int64_t, Tile>> run;
    for (int64_t k = i; k < j; ++k)
      run.emplace_back(shared_positions(s, tiles[i], tiles[k]), tiles[k]);
    std::stable_sort(run.begin(), run.end(),
                     [](const auto& a, const auto& b) { return a.first > b.first; });
    for (int64_t k = 0; k < j - i; ++k) tiles[i + k] = run[k].second;
    for (int64_t k = 0; k < j - i;) {
      const int64_t tile_rows = run[k].second.num_tokens * group;
      const int64_t n = std::min(std::max<int64_t>(1, kSharedRows / tile_rows), j - i - k);
      WorkItem item{i + k, n, n > 1 ? run[k + n - 1].first : 0, 0};
      for (int64_t m = k; m < k + n; ++m) item.cost += run[m].second.cost;
      items.push_back(item);
      k += n;
    }
    i = j;
  }
  for (int64_t i = num_grouped; i < static_cast<int64_t>(tiles.size()); ++i)
    items.push_back({i, 1, 0, tiles[i].cost});
  // Longest first: dynamic scheduling then balances the two ends of the queue.
  std::stable_sort(items.begin(), items.end(),
                   [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });
  return items;
}

// One work unit: the item under kv head `kv_head`, or under all of them when it is -1.
template <typename T, typename Rows, int NV>
void attend_unit(const WorkItem& item, const Tile* tiles, int64_t kv_head, const Shapes& s,
                 Scratch& w) {
  if (kv_head < 0) return attend_item_heads<T, Rows, NV>(item, tiles, s, w);
  attend_item<T, Rows, NV>(item, tiles, kv_head, s, w);
}

template <typename T, typename Rows>
void run(const Shapes& s) {
  std::vector<Tile> tiles;
  tiles.reserve(s.num_seqs);
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t start = s.query_start_loc[i];
    const int64_t q_len = s.query_start_loc[i + 1] - start;
    const int64_t context = s.seq_lens[i] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile) {
      const int64_t n = std::min<int64_t>(kQueryTile, q_len - t0);
      const int64_t keys = context + t0 + n;
      const int64_t seen = s.sliding_window ? std::min(keys, s.sliding_window + n) : keys;
      tiles.push_back({i, start + t0, n, context + t0, n * seen});
    }
  }
  const std::vector<WorkItem> items = plan_items(s, tiles);
  // Work units: (item, kv head), or (item, -1) for a decode item under every head at
  // once (attend_item_heads) where there are enough of those to keep every thread busy;
  // the costliest first, as dynamic scheduling then balances the ends of the queue.
  const auto heads_together = [&](const WorkItem& item) {
    return item.num_tiles == 1 && item.shared_end == 0 && !s.sliding_window &&
           few_rows(s, tiles[item.first_tile]);
  };
  const int64_t together = std::count_if(items.begin(), items.end(), heads_together);
  const bool enough = s.num_kv_heads > 1 && together >= kUnitsPerThread * s.num_threads;
  std::vector<std::pair<int64_t, int64_t>> units;  // (item, kv head or -1)
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    if (enough && heads_together(items[i])) {
      units.emplace_back(i, -1);
    } else {
      for (int64_t h = 0; h < s.num_kv_heads; ++h) units.emplace_back(i, h);
    }
  }
  const auto unit_cost = [&](const std::pair<int64_t, int64_t>& unit) {
    return items[unit.first].cost * (unit.second < 0 ? s.num_kv_heads : 1);
  };
  std::stable_sort(units.begin(), units.end(), [&](const auto& a, const auto& b) {
    return unit_cost(a) > unit_cost(b);
  });
  const int64_t num_units = static_cast<int64_t>(units.size());
  int64_t work = 0;  // query rows x visible positions, summed
  for (const Tile& tile : tiles) work += tile.cost * s.num_q_heads;
  const int threads = work < kMinParallelWork ? 1 : s.num_threads;
  // Each thread's scratch is a local of the parallel region, not a thread_local: GCC
  // propagated a thread_local's address into the kernels and looked it up again
  // (__tls_get_addr, spilling the vector registers) once per chunk of rows.
#pragma omp parallel num_threads(threads)
  {
    Scratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < num_units; ++index) {
      const auto [item_index, kv_head] = units[index];
      const WorkItem& item = items[item_index];
      if (s.head_dim == 64) {
        attend_unit<T, Rows, 4>(item, tiles.data(), kv_head, s, scratch);
      } else if (s.head_dim == 128) {
        attend_unit<T, Rows, 8>(item, tiles.data(), kv_head, s, scratch);
      } else {
        attend_unit<T, Rows, 0>(item, tiles.data(), kv_head, s, scratch);
      }
    }
  }
}

}  // namespace

namespace pagedllm {

void paged_attention(const AttentionBatch& batch) {
  if (batch.bfloat16_query) return run<uint16_t, BFloat16Rows>(batch);
  switch (batch.kv_format) {
    case KVFormat::kFloat32: return run<float, Float32Rows>(batch);
    case KVFormat::kBFloat16: return run<float, BFloat16Rows>(batch);
    case KVFormat::kFloat16: return run<float, Float16Rows>(batch);
    case KVFormat::kInt8: return run<float, Int8Rows>(batch);
    case KVFormat::kFp8E4M3: return run<float, Fp8Rows<kE4M3>>(batch);
    case KVFormat::kFp8E5M2: return run<float, Fp8Rows<kE5M2>>(batch);
  }
}

namespace {

// The row x (head_dim float32 values) as int8 codes followed by their bfloat16 scale, at
// dst: kv_quant.encode_rows' encoding bit for bit. The scale is amax|x| / 127 (at least
// 1e-30) rounded to the nearest bfloat16, one step up if that fell below it; a code is
// x / scale clamped to +-127 and rounded half to even.
void quantize_row_int8(const float* x, int64_t head_dim, uint8_t* dst) {
  float amax = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float exact = std::max(amax / 127.f, 1e-30f);
  const auto as_float = [](uint32_t half) {
    const uint32_t bits = half << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  };
  uint32_t bits;
  std::memcpy(&bits, &exact, sizeof bits);
  uint32_t half = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // to nearest, ties to even
  if (as_float(half) < exact) ++half;
  const float scale = as_float(half);
  for (int64_t d = 0; d < head_dim; ++d) {
    const float code = std::nearbyint(std::clamp(x[d] / scale, -127.f, 127.f));
    dst[d] = static_cast<uint8_t>(static_cast<int8_t>(code));
  }
  const auto scale_bits = static_cast<uint16_t>(half);
  std::memcpy(dst + head_dim, &scale_bits, sizeof scale_bits);
}

}  // namespace

void write_kv_int8(const KVWrite& w) {
  auto* kc = static_cast<uint8_t*>(w.k_cache);
  auto* vc = static_cast<uint8_t*>(w.v_cache);
  const auto* ks = static_cast<const float*>(w.k);
  const auto* vs = static_cast<const float*>(w.v);
  const int64_t head_dim = w.row_bytes / static_cast<int64_t>(sizeof(float));
  for (int64_t i = 0; i < w.num_tokens; ++i) {
    const int64_t slot = w.slots[i];
    if (slot < 0) continue;
    for (int64_t h = 0; h < w.num_kv_heads; ++h) {
      const int64_t dst = (slot / w.block_size) * w.block_stride + h * w.head_stride +
                          (slot % w.block_size) * w.token_stride;
      const int64_t src = (i * w.num_kv_heads + h) * head_dim;
      quantize_row_int8(ks + src, head_dim, kc + dst);
      quantize_row_int8(vs + src, head_dim, vc + dst);
    }
  }
}

void write_kv(const KVWrite& w) {
  auto* kc = static_cast<char*>(w.k_cache);
  auto* vc = static_cast<char*>(w.v_cache);
  const auto* ks = static_cast<const char*>(w.k);
  const auto* vs = static_cast<const char*>(w.v);
  for (int64_t i = 0; i < w.num_tokens; ++i) {
    const int64_t slot = w.slots[i];
    if (slot < 0) continue;
    for (int64_t h = 0; h < w.num_kv_heads; ++h) {
      const int64_t dst = ((slot / w.block_size) * w.block_stride + h * w.head_stride +
                           (slot % w.block_size) * w.token_stride) * w.element_size;
      const int64_t src = (i * w.num_kv_heads + h) * w.row_bytes;
      std::memcpy(kc + dst, ks + src, w.row_bytes);
      std::memcpy(vc + dst, vs + src, w.row_bytes);
    }
  }
}

}  // namespace pagedllm
