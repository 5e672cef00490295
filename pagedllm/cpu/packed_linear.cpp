// y = x w^T + bias over a weight packed once, at load time, into panels.
//
// A panel holds kPanelWidth consecutive output features for every k, k-major, in steps
// of S values of k (S = 1 for float32, 2 for bfloat16, whose pair-product instruction
// takes two k at once): panel[k / S][j][k % S] = w[p * kPanelWidth + j][k], zero past N
// and past K. A kRowsPerTile x kPanelWidth tile of y lives in 24 vector registers; each
// step loads one panel row (three vectors, read sequentially: the hardware prefetcher
// keeps them coming), broadcasts the step's x values of each of the tile's rows, and
// issues 24 multiply-adds, with no horizontal sums and no re-packing per call. The same
// kernel serves a decode step's few rows, where it is bound by reading the weights, and
// a prefill step's thousand, where it is bound by arithmetic. In between (9 to ~64 rows)
// a panel's first tile waits on memory and its later tiles on the multiply-adds; each
// tile therefore prefetches its share of the next panel into L2, so the next panel's
// reads overlap this panel's arithmetic (measured 1.04-1.3x faster at 16-64 rows). A
// panel too large for L2 (long K) is taken in blocks of K, all rows over each block in
// turn, and the tiles prefetch the next block instead.
//
// Every output is summed over k in the same order whatever M is and whichever tile its
// row falls in, so a row's result never depends on the other rows of the batch. Float32
// sums run in chunks of 256 values of k added into y, as blocked GEMMs do, which keeps
// the rounding error of long rows (K = 1,536) near torch's. bfloat16 products are exact
// in float32 and summed in float32 over all of K, then rounded once to bfloat16 (to
// nearest even), like torch's bfloat16 matmul, or stored unrounded as float32 when the
// problem asks for it (an LM head's logits).

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bfloat16.h"
#include "kernels.h"

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifdef __AVX512F__

constexpr int kRowsPerTile = 8;  // rows of x per tile
constexpr int kVectors = pagedllm::kPanelWidth / 16;
constexpr int64_t kMinParallelBytes = 1 << 18;  // smaller weights stay on one thread
constexpr int64_t kPanelBlockBytes = 1 << 19;     // larger panels are taken in blocks of K

struct Float32Panels {
  using T = float;
  using Y = float;  // y's type
  using Vec = __m512;
  static constexpr int64_t kStep = 1;
  static constexpr int64_t kChunk = 256;  // k values summed in registers at a time
  static constexpr bool kRoundedOnce = false;  // y holds the sums between chunks
  static Vec weights(const float* row, int v) { return _mm512_loadu_ps(row + 16 * v); }
  static Vec broadcast(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 fma(__m512 acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
  static __m512 load(const float* y, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, y); }
  static void store(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
};

struct BFloat16Panels {
  using T = uint16_t;
  using Y = uint16_t;
  using Vec = __m512i;  // 16 pairs of bfloat16
  static constexpr int64_t kStep = 2;
  static constexpr int64_t kChunk = std::numeric_limits<int64_t>::max();
  static constexpr bool kRoundedOnce = true;  // y is rounded once, from float32 sums
  static Vec weights(const uint16_t* row, int v) { return _mm512_loadu_si512(row + 32 * v); }
  static Vec broadcast(const uint16_t* x) {  // the pair x[0], x[1]
    uint32_t pair;
    std::memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(static_cast<int>(pair));
  }
  static Vec broadcast_last(const uint16_t* x) {  // x[0] paired with zero: odd K's last k
    return _mm512_set1_epi32(*x);
  }
  static __m512 fma(__m512 acc, Vec x, Vec w) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)w);
#else  // the even (low) and odd (high) halves of each pair, widened to float32
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
                          _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)), acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(x, high)),
                           _mm512_castsi512_ps(_mm512_and_si512(w, high)), acc);
#endif
  }
  static void store(uint16_t* y, __m512 v, __mmask16 mask) { pagedllm::bf16::store(y, v, mask); }
};

// bfloat16 products whose float32 sums are stored as they are.
struct BFloat16PanelsFloatOutput : BFloat16Panels {
  using Y = float;
  static void store(float* y, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(y, mask, v); }
};

// The part of the next panel rows one tile prefetches: one panel row (kRowBytes, three
// cache lines) every `every` steps of k counted from step `origin`, starting at `rows`;
// none when rows is null.
struct NextPanelShare {
  const char* rows;
  int64_t every;
  int64_t origin;
};

constexpr int64_t kRowBytes = pagedllm::kPanelWidth * 4;  // bytes per panel row, both types

// y[m, n0 .. n0 + kPanelWidth) for the MR rows of x starting at x, over k in [k0, k1);
// the first chunk stores, later ones add, the last adds the bias. With `partial` (MR x
// kPanelWidth float32 sums of bfloat16 products, whose y is rounded once), the sums
// carry over between calls instead: a call that is not the first starts from them and
// one that is not the last leaves them there, so they run on in the same order.
template <typename F, int MR, typename T = typename F::T, typename Y = typename F::Y>
void tile(const T* x, int64_t K, const T* panel, int64_t k0, int64_t k1, const float* bias,
          Y* y, int64_t N, int64_t n0, bool first, bool last, NextPanelShare next,
          float* partial) {
  constexpr int64_t kRow = pagedllm::kPanelWidth * F::kStep;  // values per panel row
  static_assert(kRow * sizeof(T) == kRowBytes);
  __m512 acc[MR][kVectors];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v)
      acc[m][v] = partial && !first ? _mm512_loadu_ps(partial + (m * kVectors + v) * 16)
                                    : _mm512_setzero_ps();
  // One step: panel row `step` against the step's x values of every row.
  auto multiply = [&](int64_t step, auto broadcast) {
    const T* row = panel + step * kRow;
    typename F::Vec w[kVectors];
    for (int v = 0; v < kVectors; ++v) w[v] = F::weights(row, v);
    for (int m = 0; m < MR; ++m) {
      const typename F::Vec xv = broadcast(x + m * K + step * F::kStep);
      for (int v = 0; v < kVectors; ++v) acc[m][v] = F::fma(acc[m][v], xv, w[v]);
    }
  };
  // Whole steps run in segments of next.every, each but the first started by prefetching
  // one panel row of the next panel; the steps inside check nothing (a test and a division
  // per step cost more than the multiply-adds left room for).
  const int64_t last_step = k1 / F::kStep;  // steps from here on hold k past K
  int64_t step = k0 / F::kStep;
  int64_t boundary = last_step;  // the next step that starts a segment
  const char* ahead = nullptr;
  if (next.rows) {
    const int64_t share = ceil_div(step - next.origin, next.every);
    boundary = next.origin + share * next.every;
    ahead = next.rows + share * kRowBytes;
  }
  while (true) {
    for (const int64_t end = std::min(boundary, last_step); step < end; ++step)
      multiply(step, [](const T* p) { return F::broadcast(p); });
    if (step >= last_step) break;
    for (int line = 0; line < kRowBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    ahead += kRowBytes;
    boundary += next.every;
  }
  if constexpr (F::kStep > 1) {
    if (k1 % F::kStep) multiply(last_step, [](const T* p) { return F::broadcast_last(p); });
  }
  if (partial && !last) {
    for (int m = 0; m < MR; ++m)
      for (int v = 0; v < kVectors; ++v)
        _mm512_storeu_ps(partial + (m * kVectors + v) * 16, acc[m][v]);
    return;
  }
  for (int v = 0; v < kVectors; ++v) {
    const int64_t left = N - n0 - 16 * v;
    if (left <= 0) break;
    const __mmask16 mask =
        left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
    const __m512 b = last && bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + 16 * v)
                                  : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) {
      Y* out = y + m * N + n0 + 16 * v;
      // Float32 chunks after the first add to the sums in y; a bfloat16 sum is whole here.
      __m512 sum = acc[m][v];
      if constexpr (!F::kRoundedOnce) {
        if (!first) sum = _mm512_add_ps(F::load(out, mask), sum);
      }
      F::store(out, _mm512_add_ps(sum, b), mask);
    }
  }
}

// Tiles over steps [s0, s1) of K, in chunks of F::kChunk values of k; k = K ends the sum.
template <typename F, int MR, typename T = typename F::T, typename Y = typename F::Y>
void tiles_over_k(const T* x, int64_t K, const T* panel, int64_t s0, int64_t s1,
                  const float* bias, Y* y, int64_t N, int64_t n0, NextPanelShare next,
                  float* partial) {
  const int64_t end = std::min(K, s1 * F::kStep);
  for (int64_t k0 = s0 * F::kStep, k1; k0 < end; k0 = k1) {
    k1 = end - k0 > F::kChunk ? k0 + F::kChunk : end;
    tile<F, MR>(x, K, panel, k0, k1, bias, y, N, n0, k0 == 0, k1 == K, next, partial);
  }
}

// Every row of x against the panel of output features n0 .. n0 + kPanelWidth. A panel
// larger than kPanelBlockBytes is taken in blocks of steps of K that fit in L2, all the
// rows over one block before the next (else every tile of rows would read the whole
// panel from L3); the rows' sums carry over from block to block in y (float32, as
// between chunks) or in float32 scratch (bfloat16), in the order of k either way. With
// more than one tile of rows, the tiles prefetch in equal shares what comes next: the
// panel's next block, or next_panel (null: none).
template <typename F, typename T = typename F::T>
void panel_rows(const pagedllm::PackedLinearProblem& p, const T* panel, int64_t n0,
                const typename F::T* next_panel) {
  const T* x = static_cast<const T*>(p.x);
  auto* y = static_cast<typename F::Y*>(p.y);
  // One row past whole tiles joins the last tile (9 rows, 27 sums: still in registers)
  // rather than taking a second pass over the panel of its own.
  const bool widened = p.M > kRowsPerTile && p.M % kRowsPerTile == 1;
  const int64_t tiles = ceil_div(p.M, kRowsPerTile) - widened;
  const int64_t steps = ceil_div(p.K, F::kStep);
  // Blocks of whole float32 chunks, so that no chunk of the sums moves.
  constexpr int64_t kBlockSteps =
      kPanelBlockBytes / kRowBytes / Float32Panels::kChunk * Float32Panels::kChunk;
  const int64_t block_steps = steps * kRowBytes <= kPanelBlockBytes ? steps : kBlockSteps;
  float* partials = nullptr;
  if constexpr (F::kRoundedOnce) {
    thread_local std::vector<float> scratch;
    if (block_steps < steps) {
      scratch.resize(p.M * pagedllm::kPanelWidth);
      partials = scratch.data();
    }
  }
  const char* panel_bytes = reinterpret_cast<const char*>(panel);
  for (int64_t s0 = 0; s0 < steps; s0 += block_steps) {
    const int64_t s1 = std::min(steps, s0 + block_steps);
    // What comes after this block, and how many steps of it the tiles share out.
    const char* ahead = s1 < steps ? panel_bytes + s1 * kRowBytes
                                   : reinterpret_cast<const char*>(next_panel);
    const int64_t ahead_steps = s1 < steps ? std::min(block_steps, steps - s1) : s1 - s0;
    auto share = [&](int64_t tile_index) {
      if (tiles < 2 || !ahead) return NextPanelShare{nullptr, 1, 0};
      return NextPanelShare{ahead + tile_index * ahead_steps / tiles * kRowBytes, tiles, s0};
    };
    auto rows = [&]<int MR>(int64_t m) {
      float* partial = partials ? partials + m * pagedllm::kPanelWidth : nullptr;
      tiles_over_k<F, MR>(x + m * p.K, p.K, panel, s0, s1, p.bias, y + m * p.N, p.N, n0,
                          share(m / kRowsPerTile), partial);
    };
    int64_t m = 0;
    const int64_t whole = p.M - (widened ? kRowsPerTile + 1 : p.M % kRowsPerTile);
    for (; m < whole; m += kRowsPerTile) rows.template operator()<kRowsPerTile>(m);
    switch (p.M - m) {
      case kRowsPerTile + 1: rows.template operator()<kRowsPerTile + 1>(m); break;
      case 7: rows.template operator()<7>(m); break;
      case 6: rows.template operator()<6>(m); break;
      case 5: rows.template operator()<5>(m); break;
      case 4: rows.template operator()<4>(m); break;
      case 3: rows.template operator()<3>(m); break;
      case 2: rows.template operator()<2>(m); break;
      case 1: rows.template operator()<1>(m); break;
      default: break;
    }
  }
}

// How many blocks of rows each panel's work is cut into: one, unless the panels are too
// few to share out evenly (a thread's last panel of a prefill step can leave the other
// waiting for most of a panel's time), then enough for kTasksPerThread tasks per thread,
// each of at least kMinBlockRows rows.
constexpr int64_t kTasksPerThread = 8;
constexpr int64_t kMinBlockRows = 64;
int64_t row_blocks(int64_t M, int64_t panels, int threads) {
  if (threads < 2) return 1;
  const int64_t wanted = ceil_div(kTasksPerThread * threads, panels);
  return std::clamp<int64_t>(wanted, 1, std::max<int64_t>(1, M / kMinBlockRows));
}

// The work is cut into tasks, (panel, block of rows), panel after panel, and shared out
// between threads in pairs: each pair owns a run of tasks in proportion to its threads;
// one thread of a pair takes tasks from the run's front, the other from its back, each
// claiming one at a time, until they meet. A thread slowed down (by the machine, or by
// its own cold cache) thus leaves its partner more of the run instead of a wait at the
// end, while each thread still walks its panels in order and prefetches the one it
// takes next. Which thread computes a task, and which rows share a block, changes no bit.
template <typename F>
void run(const pagedllm::PackedLinearProblem& p) {
  using T = typename F::T;
  const int64_t count = pagedllm::num_panels(p.N);
  const int64_t bytes = count * p.K * pagedllm::kPanelWidth * sizeof(T);
  const int threads = bytes < kMinParallelBytes ? 1 : p.num_threads;
  const auto* panels = static_cast<const T*>(p.panels);
  const int64_t panel_size = ceil_div(p.K, F::kStep) * pagedllm::kPanelWidth * F::kStep;
  // Blocks of whole tiles of rows; as many as it then takes to cover M.
  const int64_t wanted = row_blocks(p.M, count, threads);
  const int64_t block_rows = ceil_div(ceil_div(p.M, wanted), kRowsPerTile) * kRowsPerTile;
  const int64_t blocks = block_rows ? ceil_div(p.M, block_rows) : 1;
  const int64_t tasks = count * blocks;
  std::vector<std::atomic<int64_t>> claimed((threads + 1) / 2);  // tasks taken, per pair
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t pair = t / 2, from_back = t % 2;
    const int64_t lo = tasks * (2 * pair) / team;
    const int64_t hi = tasks * std::min(2 * pair + 2, team) / team;
    const int64_t step = from_back ? -1 : 1;
    int64_t task = from_back ? hi - 1 : lo;
    while (claimed[pair].fetch_add(1, std::memory_order_relaxed) < hi - lo) {
      const int64_t panel = task / blocks, first_row = task % blocks * block_rows;
      const int64_t ahead = task + step;
      // The next task's panel, to prefetch, when it is another one.
      const T* next = ahead >= lo && ahead < hi && ahead / blocks != panel
                          ? panels + ahead / blocks * panel_size
                          : nullptr;
      pagedllm::PackedLinearProblem rows = p;
      rows.x = static_cast<const T*>(p.x) + first_row * p.K;
      rows.y = static_cast<typename F::Y*>(p.y) + first_row * p.N;
      rows.M = std::min(block_rows, p.M - first_row);
      panel_rows<F>(rows, panels + panel * panel_size, panel * pagedllm::kPanelWidth, next);
      task = ahead;
    }
  }
}

#endif  // __AVX512F__

template <typename T>
void pack(const T* weight, int64_t N, int64_t K, int64_t step, T* panels, int num_threads) {
  const int64_t steps = ceil_div(K, step);
  const int64_t count = pagedllm::num_panels(N);
#pragma omp parallel for schedule(static) num_threads(num_threads)
  for (int64_t p = 0; p < count; ++p) {
    T* panel = panels + p * steps * pagedllm::kPanelWidth * step;
    for (int64_t s = 0; s < steps; ++s) {
      for (int64_t j = 0; j < pagedllm::kPanelWidth; ++j) {
        const int64_t n = p * pagedllm::kPanelWidth + j;
        for (int64_t t = 0; t < step; ++t) {
          const int64_t k = s * step + t;
          panel[(s * pagedllm::kPanelWidth + j) * step + t] =
              n < N && k < K ? weight[n * K + k] : T{};
        }
      }
    }
  }
}

}  // namespace

namespace pagedllm {

bool avx512_kernels_available() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

int64_t num_panels(int64_t N) { return ceil_div(N, kPanelWidth); }

void pack_weight(const void* weight, int64_t N, int64_t K, bool bfloat16, void* panels,
                 int num_threads) {
  if (bfloat16) {
    pack(static_cast<const uint16_t*>(weight), N, K, 2, static_cast<uint16_t*>(panels),
         num_threads);
  } else {
    pack(static_cast<const float*>(weight), N, K, 1, static_cast<float*>(panels), num_threads);
  }
}

void packed_linear(const PackedLinearProblem& problem) {
#ifdef __AVX512F__
  if (problem.bfloat16 && problem.float_output) {
    run<BFloat16PanelsFloatOutput>(problem);
  } else if (problem.bfloat16) {
    run<BFloat16Panels>(problem);
  } else {
    run<Float32Panels>(problem);
  }
#else
  (void)problem;
#endif
}

}  // namespace pagedllm
