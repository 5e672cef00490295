// The elementwise parts of a decoder layer, each one pass over its rows: RMSNorm (alone
// or after the residual add), SiLU(gate) * up, and rotary embeddings with the q / k / v split.
//
// torch runs each of these as several operators (RMSNorm alone is a square, a mean, an
// add, a reciprocal square root and two products), every one a pass over memory and a
// dispatch; at a decode step's few rows the dispatches dominate, at a prefill step's
// thousand rows the passes do. Results round like the Hugging Face modules they
// replace: float32 throughout for float32; for bfloat16, every place where transformers
// rounds an intermediate to bfloat16 is rounded here too.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "bfloat16.h"
#include "kernels.h"
#include "vector_math.h"

namespace {

#ifdef __AVX512F__

constexpr int64_t kLanes = 16;
constexpr int64_t kMinParallelElements = 1 << 16;  // fewer stay on one thread

int threads_for(int64_t elements, int num_threads) {
  return elements < kMinParallelElements ? 1 : num_threads;
}

struct Float32 {
  using T = float;
  static __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
  static __m512 round(__m512 v) { return v; }
};

struct BFloat16 {
  using T = uint16_t;
  static __m512 load(const uint16_t* p, __mmask16 m) {
    return pagedllm::bf16::widen(_mm256_maskz_loadu_epi16(m, p));
  }
  static void store(uint16_t* p, __m512 v, __mmask16 m) { pagedllm::bf16::store(p, v, m); }
  static __m512 round(__m512 v) { return pagedllm::bf16::round(v); }
};

inline __mmask16 lanes_left(int64_t left) {
  return left >= kLanes ? static_cast<__mmask16>(0xffff)
                        : static_cast<__mmask16>((1u << left) - 1);
}

// Row `xr` normed into `yr` given the sum of its squared elements, 16 partial sums in
// `squares` (lane i: elements i, i + 16, ...). X reads x and rounds the normed values
// where it is transformers' bfloat16 module, S reads the weight and writes the output.
template <typename S, typename X, typename T = typename S::T>
void norm_row(const typename X::T* xr, const T* weight, T* yr, int64_t dim, float eps,
              __m512 squares) {
  const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(dim);
  const __m512 inv_rms = _mm512_set1_ps(1.f / __builtin_sqrtf(mean + eps));
  for (int64_t i = 0; i < dim; i += kLanes) {
    const __mmask16 m = lanes_left(dim - i);
    const __m512 normed = X::round(_mm512_mul_ps(X::load(xr + i, m), inv_rms));
    S::store(yr + i, _mm512_mul_ps(S::load(weight + i, m), normed), m);
  }
}

template <typename S, typename X = S, typename T = typename S::T>
void rms_norm_rows(const pagedllm::RmsNormProblem& p) {
  using XT = typename X::T;
  const XT* x = static_cast<const XT*>(p.x);
  const T* weight = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out);
  const int64_t dim = p.dim;
#pragma omp parallel for schedule(static) num_threads(threads_for(p.rows * dim, p.num_threads))
  for (int64_t row = 0; row < p.rows; ++row) {
    const XT* xr = x + row * dim;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += kLanes) {
      const __m512 v = X::load(xr + i, lanes_left(dim - i));
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    norm_row<S, X>(xr, weight, out + row * dim, dim, p.eps, squares);
  }
}

// The residual add and the norm after it in one pass per row: each sum is stored and
// squared while in a register, and the row is still in L1 when the norm reads it back.
template <typename S, typename T = typename S::T>
void add_rms_norm_rows(const pagedllm::AddRmsNormProblem& p) {
  const T* branch = static_cast<const T*>(p.branch);
  const T* weight = static_cast<const T*>(p.weight);
  T* out = static_cast<T*>(p.out);
  const int64_t dim = p.dim;
#pragma omp parallel for schedule(static) num_threads(threads_for(p.rows * dim, p.num_threads))
  for (int64_t row = 0; row < p.rows; ++row) {
    float* xr = p.hidden + row * dim;
    const T* br = branch + row * dim;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += kLanes) {
      const __mmask16 m = lanes_left(dim - i);
      const __m512 v = _mm512_add_ps(Float32::load(xr + i, m), S::load(br + i, m));
      Float32::store(xr + i, v, m);
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    norm_row<S, Float32>(xr, weight, out + row * dim, dim, p.eps, squares);
  }
}

template <typename S, typename T = typename S::T>
void silu_and_mul_rows(const pagedllm::SiluMulProblem& p) {
  const T* gate_up = static_cast<const T*>(p.gate_up);
  T* out = static_cast<T*>(p.out);
  const int64_t width = p.width;
#pragma omp parallel for schedule(static) num_threads(threads_for(p.rows * width, p.num_threads))
  for (int64_t row = 0; row < p.rows; ++row) {
    const T* gate = gate_up + row * 2 * width;
    const T* up = gate + width;
    T* yr = out + row * width;
    for (int64_t i = 0; i < width; i += kLanes) {
      const __mmask16 m = lanes_left(width - i);
      const __m512 g = S::load(gate + i, m);
      const __m512 minus_g = _mm512_sub_ps(_mm512_setzero_ps(), g);
      const __m512 denominator = _mm512_add_ps(_mm512_set1_ps(1.f), pagedllm::vec::vexp(minus_g));
      const __m512 silu = S::round(_mm512_div_ps(g, denominator));
      S::store(yr + i, _mm512_mul_ps(silu, S::load(up + i, m)), m);
    }
  }
}

// Products and sums rounded one by one (no fused multiply-add), as torch's separate
// operators do: the _round_ intrinsics are never contracted by the compiler.
constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

template <typename S>
inline __m512 product(__m512 a, __m512 b) {
  return S::round(_mm512_mul_round_ps(a, b, kNearest));
}

// Rotates `heads` heads of src (contiguous) into dst, head h at dst + h * dst_stride.
template <typename S, typename T = typename S::T>
void rotate_heads(const T* src, T* dst, int64_t dst_stride, int64_t heads, int64_t half,
                  const T* cos_row, const T* sin_row) {
  for (int64_t h = 0; h < heads; ++h) {
    const T* x = src + h * 2 * half;
    T* y = dst + h * dst_stride;
    for (int64_t i = 0; i < half; i += kLanes) {
      const __mmask16 m = lanes_left(half - i);
      const __m512 x1 = S::load(x + i, m), x2 = S::load(x + half + i, m);
      const __m512 c = S::load(cos_row + i, m), s = S::load(sin_row + i, m);
      S::store(y + i, _mm512_sub_round_ps(product<S>(x1, c), product<S>(x2, s), kNearest), m);
      S::store(y + half + i, _mm512_add_round_ps(product<S>(x2, c), product<S>(x1, s), kNearest),
               m);
    }
  }
}

template <typename S, typename T = typename S::T>
void rotary_rows(const pagedllm::RotaryProblem& p) {
  const T* qkv = static_cast<const T*>(p.qkv);
  const T* cos = static_cast<const T*>(p.cos);
  const T* sin = static_cast<const T*>(p.sin);
  const int64_t d = p.head_dim, half = d / 2;
  const int64_t q_width = p.num_q_heads * d, kv_width = p.num_kv_heads * d;
  const int64_t row_width = q_width + 2 * kv_width;
  const pagedllm::KVSlots* cache = p.cache;
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(p.num_tokens * row_width, p.num_threads))
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const T* row = qkv + t * row_width;
    const T* cos_row = cos + p.positions[t] * half;
    const T* sin_row = sin + p.positions[t] * half;
    rotate_heads<S>(row, static_cast<T*>(p.q) + t * q_width, d, p.num_q_heads, half, cos_row,
                    sin_row);
    // Where this token's k and v go: its rows of the k / v tensors, or its cache slot.
    T* k = static_cast<T*>(p.k) + t * kv_width;
    T* v = static_cast<T*>(p.v) + t * kv_width;
    int64_t head_stride = d;
    if (cache != nullptr) {
      const int64_t slot = cache->slots[t];
      if (slot < 0) continue;
      const int64_t at = slot / cache->block_size * cache->block_stride +
                         slot % cache->block_size * cache->token_stride;
      k = static_cast<T*>(cache->k_cache) + at;
      v = static_cast<T*>(cache->v_cache) + at;
      head_stride = cache->head_stride;
    }
    rotate_heads<S>(row + q_width, k, head_stride, p.num_kv_heads, half, cos_row, sin_row);
    for (int64_t h = 0; h < p.num_kv_heads; ++h)
      std::memcpy(v + h * head_stride, row + q_width + kv_width + h * d, d * sizeof(T));
  }
}

#endif  // __AVX512F__

}  // namespace

namespace pagedllm {

#ifdef __AVX512F__
void rms_norm(const RmsNormProblem& p) {
  if (!p.bfloat16) {
    rms_norm_rows<Float32>(p);
  } else if (p.x_float32) {
    rms_norm_rows<BFloat16, Float32>(p);
  } else {
    rms_norm_rows<BFloat16>(p);
  }
}
void add_rms_norm(const AddRmsNormProblem& p) {
  p.bfloat16 ? add_rms_norm_rows<BFloat16>(p) : add_rms_norm_rows<Float32>(p);
}
void silu_and_mul(const SiluMulProblem& p) {
  p.bfloat16 ? silu_and_mul_rows<BFloat16>(p) : silu_and_mul_rows<Float32>(p);
}
void rotary(const RotaryProblem& p) {
  p.bfloat16 ? rotary_rows<BFloat16>(p) : rotary_rows<Float32>(p);
}
#else
void rms_norm(const RmsNormProblem&) {}
void add_rms_norm(const AddRmsNormProblem&) {}
void silu_and_mul(const SiluMulProblem&) {}
void rotary(const RotaryProblem&) {}
#endif

}  // namespace pagedllm
