// Paged attention on CPU: K/V are read block by block through each sequence's block
// table, never copied into a contiguous tensor.
//
// Cache layout (per layer, K and V alike): [num_blocks, num_kv_heads, block_size, head_dim],
// so one (block, kv head) pair is a contiguous block_size x head_dim tile.
// Work items are (sequence, query tile, kv head); every item handles the
// query_heads / kv_heads query heads that share one kv head (grouped-query attention),
// so each K/V row is loaded once per group. Softmax is online, chunk by chunk.
// Numbers are accumulated in float32 whatever the storage dtype (float32 or bfloat16).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

typedef float vfloat __attribute__((vector_size(64)));
typedef int32_t vint __attribute__((vector_size(64)));
typedef uint32_t vuint __attribute__((vector_size(64)));
typedef uint16_t vhalf __attribute__((vector_size(32)));
constexpr int kLanes = 16;
constexpr int kMaxVectors = 16;  // head_dim <= 256
constexpr int kQueryTile = 16;  // query tokens per work item in prefill
constexpr int kChunkVectors = 2;
constexpr int kChunk = kChunkVectors * kLanes;  // positions per online-softmax step
constexpr int kPrefetchDistance = 32;           // positions ahead that K/V rows are prefetched
constexpr float kMinScore = -1e30f;
// Below this many (query row, position) pairs, waking a second thread costs more than
// it saves.
constexpr int64_t kMinParallelWork = 16384;

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the high half of a float32: widen by a 16-bit shift.
inline vfloat load(const uint16_t* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  vuint w = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  uint32_t w = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}
inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {
  c10::BFloat16 b(x);  // round to nearest even
  std::memcpy(p, &b, sizeof b);
}

inline float hsum(vfloat v) {
  typedef float half8 __attribute__((vector_size(32)));
  half8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += h[i];
  return s;
}

inline float hmax(vfloat v) {
  typedef float half8 __attribute__((vector_size(32)));
  const half8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const half8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const half8 h = a > b ? a : b;
  float m = h[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, h[i]);
  return m;
}

// Lane t of the result is the sum of the lanes of parts[t]: 16 horizontal sums in
// 15 shuffle-add pairs instead of 16 separate reductions.
inline vfloat transpose_sum(const vfloat* parts) {
  vfloat b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) {
    const vfloat x = parts[2 * i], y = parts[2 * i + 1];
    b[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  }
  for (int i = 0; i < 4; ++i) {
    const vfloat x = b[2 * i], y = b[2 * i + 1];
    c[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                   31);
  }
  for (int i = 0; i < 2; ++i) {
    const vfloat x = c[2 * i], y = c[2 * i + 1];
    d[i] = __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                   31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}

// exp(x) for x <= 0, relative error ~1e-7; inputs below -87 are clamped.
inline vfloat vexp(vfloat x) {
  x = x < -87.f ? vfloat{} - 87.f : x;
  vfloat t = x * 1.44269504088896341f - 0.5f;
  vint n = __builtin_convertvector(t, vint);  // truncation toward 0 = round(x / ln2)
  vfloat nf = __builtin_convertvector(n, vfloat);
  vfloat r = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
  vfloat p = vfloat{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vint bits = (n + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Strides are in elements and shared by the K and V caches; head_dim is contiguous.
struct Shapes {
  int64_t num_q_heads, num_kv_heads, head_dim, block_size_shift, max_blocks;
  int64_t block_stride, head_stride, token_stride;
  float scale;
};

// Running state of one query row: float32 accumulator, max score and softmax sum.
struct Scratch {
  std::vector<vfloat> query, acc;
  std::vector<float> row_max, row_sum;
  void resize(int64_t rows, int64_t vectors) {
    query.resize(rows * vectors);
    acc.resize(rows * vectors);
    row_max.resize(rows);
    row_sum.resize(rows);
  }
};

// Attention of query tokens [first_token, first_token + num_tokens) of one sequence,
// for the query heads of kv head `kv_head`. The first of these tokens sits at position
// `first_pos` of the sequence and sees positions [0, first_pos]; each later one sees one
// more. A row is one (query token, query head) pair; rows are processed RB at a time so
// that every K/V row loaded serves RB query rows. NV is head_dim / 16, or 0 when only
// known at run time.
template <typename T, int NV, int RB>
void attend_tile(const T* q, T* out, const T* k_cache, const T* v_cache,
                 const int32_t* table, int64_t first_token, int64_t num_tokens,
                 int64_t first_pos, int64_t kv_head, const Shapes& s, Scratch& w) {
  constexpr int kNV = NV ? NV : kMaxVectors;
  const int64_t group = s.num_q_heads / s.num_kv_heads;
  const int64_t rows = num_tokens * group;
  const int64_t nv = NV ? NV : s.head_dim / kLanes;
  const int64_t block_mask = (int64_t{1} << s.block_size_shift) - 1;
  w.resize(rows, nv);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + ((first_token + r / group) * s.num_q_heads + kv_head * group +
                        r % group) * s.head_dim;
    for (int64_t j = 0; j < nv; ++j) {
      w.query[r * nv + j] = load(src + j * kLanes) * s.scale;
      w.acc[r * nv + j] = vfloat{};
    }
    w.row_max[r] = kMinScore;
    w.row_sum[r] = 0.f;
  }
  const T* k_rows[kChunk];
  const T* v_rows[kChunk];
  vfloat parts[RB][kChunk];
  alignas(64) float probs[RB][kChunk];
  const vfloat lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t visible_end = first_pos + num_tokens;
  const int64_t row_bytes = s.head_dim * static_cast<int64_t>(sizeof(T));
  auto row_offset = [&](int64_t pos) {
    return table[pos >> s.block_size_shift] * s.block_stride + kv_head * s.head_stride +
           (pos & block_mask) * s.token_stride;
  };
  for (int64_t c0 = 0; c0 < visible_end; c0 += kChunk) {
    const int64_t n = std::min<int64_t>(kChunk, visible_end - c0);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t off = row_offset(c0 + t);
      k_rows[t] = k_cache + off;
      v_rows[t] = v_cache + off;
    }
    // Blocks are scattered, so the hardware prefetcher cannot run ahead of us; fetching
    // into L2 (locality 1) measured faster than into L1 or not at all.
    const int64_t ahead_end = std::min(visible_end, c0 + kPrefetchDistance + kChunk);
    for (int64_t pos = c0 + kPrefetchDistance; pos < ahead_end; ++pos) {
      const int64_t off = row_offset(pos);
      for (int64_t line = 0; line < row_bytes; line += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(k_cache + off) + line, 0, 1);
        __builtin_prefetch(reinterpret_cast<const char*>(v_cache + off) + line, 0, 1);
      }
    }
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      int64_t seen[RB];
      int64_t seen_max = 0;
      for (int i = 0; i < RB; ++i) {
        seen[i] = std::clamp<int64_t>(first_pos + (r0 + i) / group + 1 - c0, 0, n);
        seen_max = std::max(seen_max, seen[i]);
      }
      if (seen_max == 0) continue;
      const vfloat* qr = &w.query[r0 * nv];
      for (int64_t t = 0; t < kChunk; ++t) {
        if (t >= seen_max) {
          for (int i = 0; i < RB; ++i) parts[i][t] = vfloat{};
          continue;
        }
        vfloat key[kNV];
        for (int64_t j = 0; j < nv; ++j) key[j] = load(k_rows[t] + j * kLanes);
        for (int i = 0; i < RB; ++i) {
          vfloat a = qr[i * nv] * key[0];
          for (int64_t j = 1; j < nv; ++j) a += qr[i * nv + j] * key[j];
          parts[i][t] = a;
        }
      }
      for (int i = 0; i < RB; ++i) {
        const int64_t r = r0 + i;
        vfloat visible[kChunkVectors], score[kChunkVectors];
        vfloat chunk_max = vfloat{} + kMinScore;
        for (int c = 0; c < kChunkVectors; ++c) {
          visible[c] = lane + static_cast<float>(c * kLanes) < static_cast<float>(seen[i])
                           ? vfloat{} + 1.f
                           : vfloat{};
          score[c] = visible[c] > 0.f ? transpose_sum(&parts[i][c * kLanes])
                                      : vfloat{} + kMinScore;
          chunk_max = chunk_max > score[c] ? chunk_max : score[c];
        }
        const float new_max = std::max(w.row_max[r], hmax(chunk_max));
        if (new_max > w.row_max[r]) {
          const float correction = vexp(vfloat{} + (w.row_max[r] - new_max))[0];
          w.row_sum[r] *= correction;
          for (int64_t j = 0; j < nv; ++j) w.acc[r * nv + j] *= correction;
          w.row_max[r] = new_max;
        }
        vfloat sum = vfloat{};
        for (int c = 0; c < kChunkVectors; ++c) {
          const vfloat p = vexp(score[c] - new_max) * visible[c];
          sum += p;
          std::memcpy(&probs[i][c * kLanes], &p, sizeof p);
        }
        w.row_sum[r] += hsum(sum);
      }
      vfloat acc[RB][kNV];
      for (int i = 0; i < RB; ++i)
        for (int64_t j = 0; j < nv; ++j) acc[i][j] = w.acc[(r0 + i) * nv + j];
      for (int64_t t = 0; t < seen_max; ++t) {
        vfloat value[kNV];
        for (int64_t j = 0; j < nv; ++j) value[j] = load(v_rows[t] + j * kLanes);
        for (int i = 0; i < RB; ++i)
          for (int64_t j = 0; j < nv; ++j) acc[i][j] += probs[i][t] * value[j];
      }
      for (int i = 0; i < RB; ++i)
        for (int64_t j = 0; j < nv; ++j) w.acc[(r0 + i) * nv + j] = acc[i][j];
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((first_token + r / group) * s.num_q_heads + kv_head * group + r % group) *
                       s.head_dim;
    const float inv = 1.f / w.row_sum[r];
    for (int64_t j = 0; j < nv; ++j) {
      const vfloat o = w.acc[r * nv + j] * inv;
      for (int i = 0; i < kLanes; ++i) store(dst + j * kLanes + i, o[i]);
    }
  }
}

// Picks the compile-time variant: RB rows per pass must divide the tile's rows and, with
// their accumulators, fit the 32 vector registers.
template <typename T>
void attend_tile_dispatch(const T* q, T* out, const T* k_cache, const T* v_cache,
                          const int32_t* table, int64_t first_token, int64_t num_tokens,
                          int64_t first_pos, int64_t kv_head, const Shapes& s, Scratch& w) {
  const int64_t rows = num_tokens * (s.num_q_heads / s.num_kv_heads);
#define PAGEDLLM_ATTEND(NV, RB)                                                              \
  return attend_tile<T, NV, RB>(q, out, k_cache, v_cache, table, first_token, num_tokens, \
                                first_pos, kv_head, s, w)
  if (s.head_dim == 64) {
    if (rows % 4 == 0) PAGEDLLM_ATTEND(4, 4);
    if (rows % 3 == 0) PAGEDLLM_ATTEND(4, 3);
    if (rows % 2 == 0) PAGEDLLM_ATTEND(4, 2);
    PAGEDLLM_ATTEND(4, 1);
  }
  if (s.head_dim == 128) {
    if (rows % 2 == 0) PAGEDLLM_ATTEND(8, 2);
    PAGEDLLM_ATTEND(8, 1);
  }
  PAGEDLLM_ATTEND(0, 1);
#undef PAGEDLLM_ATTEND
}

struct Tile {
  int64_t seq, first_token, num_tokens, first_pos, cost;
};

template <typename T>
void run(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const at::Tensor& block_tables,
         const at::Tensor& seq_lens, const at::Tensor& query_start_loc, const Shapes& s) {
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  std::vector<Tile> tiles;
  tiles.reserve(num_seqs);
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i];
    const int64_t context = lens[i] - q_len;
    for (int64_t t0 = 0; t0 < q_len; t0 += kQueryTile) {
      const int64_t n = std::min<int64_t>(kQueryTile, q_len - t0);
      tiles.push_back({i, starts[i] + t0, n, context + t0, n * (context + t0 + n)});
    }
  }
  // Longest first: dynamic scheduling then balances the two ends of the queue.
  std::stable_sort(tiles.begin(), tiles.end(),
                   [](const Tile& a, const Tile& b) { return a.cost > b.cost; });
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t items = static_cast<int64_t>(tiles.size()) * s.num_kv_heads;
  int64_t work = 0;  // query rows x visible positions, summed
  for (const Tile& tile : tiles) work += tile.cost * s.num_q_heads;
  const int threads = work < kMinParallelWork ? 1 : at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < items; ++item) {
    thread_local Scratch scratch;
    const Tile& tile = tiles[item / s.num_kv_heads];
    attend_tile_dispatch<T>(qp, op, kp, vp, tables + tile.seq * s.max_blocks, tile.first_token,
                            tile.num_tokens, tile.first_pos, item % s.num_kv_heads, s, scratch);
  }
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4, "cache is [num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
              k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must match");
  TORCH_CHECK(k_cache.stride(3) == 1, "head_dim must be contiguous in the cache");
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() &&
              out.sizes() == q.sizes(), "q and out are contiguous [num_tokens, Hq, head_dim]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
              "q, out and the cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              query_start_loc.scalar_type() == at::kInt, "metadata must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() &&
              query_start_loc.is_contiguous());
  const int64_t block_size = k_cache.size(2);
  TORCH_CHECK((block_size & (block_size - 1)) == 0, "block size must be a power of two");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(2) % kLanes == 0 &&
              q.size(2) <= kLanes * kMaxVectors, "head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == q.size(0), "query_start_loc must span q");
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[i], "sequence ", i, ": bad query length");
    const int64_t used_blocks = (lens[i] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= block_tables.size(1), "sequence ", i,
                " is longer than its block table");
    const int32_t* table = block_tables.data_ptr<int32_t>() + i * block_tables.size(1);
    for (int64_t b = 0; b < used_blocks; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < k_cache.size(0), "sequence ", i,
                  " refers to block ", table[b], " outside the cache");
    }
  }
  Shapes s{q.size(1), k_cache.size(1), q.size(2), __builtin_ctzll(block_size),
           block_tables.size(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
           static_cast<float>(scale)};
  if (q.scalar_type() == at::kFloat) {
    run<float>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, s);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
    run<uint16_t>(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, s);
  }
}

// Copies row i of k and v to flat slot slot_mapping[i] of the caches; slot -1 is skipped.
void write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && slot_mapping.is_contiguous());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type(),
              "new K/V must have the cache's dtype");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) &&
              k.size(2) == k_cache.size(3) && k.size(0) == slot_mapping.size(0),
              "k and v are [num_tokens, num_kv_heads, head_dim], one slot per token");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(2);
  const int64_t heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t block_stride = k_cache.stride(0), head_stride = k_cache.stride(1);
  const int64_t token_stride = k_cache.stride(2);
  const int64_t row_bytes = k_cache.size(3) * k.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* ks = static_cast<const char*>(k.data_ptr());
  const auto* vs = static_cast<const char*>(v.data_ptr());
  for (int64_t i = 0; i < slot_mapping.size(0); ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot ", slot, " is outside the cache");
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t dst = ((slot / block_size) * block_stride + h * head_stride +
                           (slot % block_size) * token_stride) * k.element_size();
      const int64_t src = (i * heads + h) * row_bytes;
      std::memcpy(kc + dst, ks + src, row_bytes);
      std::memcpy(vc + dst, vs + src, row_bytes);
    }
  }
}

}  // namespace

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale) -> ()");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}
