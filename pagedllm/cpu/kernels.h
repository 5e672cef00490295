// Interface between the torch bindings (bindings.cpp) and the torch-free kernels
// (paged_attention.cpp, packed_linear.cpp, elementwise.cpp), so that they compile in
// parallel.
#pragma once

#include <cstdint>

namespace pagedllm {

// How K/V rows are stored. Quantized rows (int8 and fp8) are head_dim one-byte codes
// followed by the row's bfloat16 scale; a value is decode(code) * scale.
enum class KVFormat { kFloat32, kBFloat16, kFloat16, kInt8, kFp8E4M3, kFp8E5M2 };

// One flattened batch, as raw pointers. Strides are in elements and shared by the K and
// V caches ([num_blocks, num_kv_heads, block_size, row], the row contiguous);
// q and out are contiguous [num_tokens, num_q_heads, head_dim]. Metadata has the meaning
// of pagedllm.attention.metadata.AttentionMetadata and has been validated.
struct AttentionBatch {
  const void* q;
  void* out;
  const void* k_cache;
  const void* v_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t num_seqs, num_q_heads, num_kv_heads, head_dim, block_size_shift, max_blocks;
  int64_t block_stride, head_stride, token_stride;
  float scale;
  // A query at position p sees keys p - sliding_window + 1 .. p (0: all keys 0 .. p).
  int64_t sliding_window;
  // Scores become logit_softcap * tanh(score / logit_softcap) before the softmax (0: off).
  float logit_softcap;
  KVFormat kv_format;
  bool bfloat16_query;  // q and out are bfloat16 (only with a bfloat16 cache), else float32
  int num_threads;  // torch's intra-op thread count
};

void paged_attention(const AttentionBatch& batch);

// paged_attention over block tables that mix full blocks (entries below num_full_blocks,
// in full.k_cache / full.v_cache) with compact 4-bit blocks (entry - num_full_blocks):
// tiles [num_compact_blocks, num_kv_heads, tile_bytes] contiguous, laid out as
// pagedllm/kv_storage/compact_blocks.py says (block_size >= 16, head_dim 32, 64, 128 or
// 256). q is float32 (full.bfloat16_query false) and q_rotated = q @ H per head, with H
// the Hadamard rotation of the compact keys (paged_attention_compact.cpp).
struct CompactAttentionBatch {
  AttentionBatch full;
  const void* q_rotated;
  const uint8_t* tiles;
  int64_t num_full_blocks;
};

void paged_attention_compact(const CompactAttentionBatch& batch);

// Copies row i (row_bytes bytes per kv head) of k and v to flat slot slots[i]; -1 skips.
struct KVWrite {
  void* k_cache;
  void* v_cache;
  const void* k;
  const void* v;
  const int64_t* slots;
  int64_t num_tokens, num_kv_heads, block_size, row_bytes;
  int64_t block_stride, head_stride, token_stride, element_size;  // cache strides
};

void write_kv(const KVWrite& w);
// The same from float32 rows (row_bytes = head_dim * 4) into an int8 cache (element_size
// 1, rows of head_dim codes and a bfloat16 scale), quantizing each row as it goes.
void write_kv_int8(const KVWrite& w);

// Whether this build has the AVX-512 kernels: packed_linear and the elementwise ones
// below do nothing without it.
bool avx512_kernels_available();

// Weights packed into panels (packed_linear.cpp): kPanelWidth output features per panel,
// k-major in steps of S values of k (S = 1 for float32, 2 for bfloat16), shaped
// [num_panels(N), ceil(K / S), kPanelWidth, S]; features past N and k past K are zero.
constexpr int64_t kPanelWidth = 48;
int64_t num_panels(int64_t N);
// Packs weight [N, K] (float32, or bfloat16 when `bfloat16`) into panels.
void pack_weight(const void* weight, int64_t N, int64_t K, bool bfloat16, void* panels,
                 int num_threads);

// y [M, N] = x [M, K] weight^T (+ bias [N]) with the weight packed; x, panels and y share
// one dtype (float32, or bfloat16 when `bfloat16`), bias is float32; all contiguous. With
// `float_output` (and `bfloat16`) y is float32: the sums unrounded. A row's result does
// not depend on M or on the other rows.
struct PackedLinearProblem {
  const void* x;
  const void* panels;
  const float* bias;
  void* y;
  int64_t M, N, K;
  bool bfloat16;
  int num_threads;
  bool float_output = false;
};
void packed_linear(const PackedLinearProblem& problem);

// y [M, N] = x [M, K] weight^T (+ bias [N]) with weight rows kept in a GGUF block format:
// row n is the K / values(type) blocks at weight + n * row_bytes, never expanded. x and y
// are float32 (quant_linear.cpp) or bfloat16 bits (quant_linear_bf16.cpp: codes
// multiplied in bfloat16 pairs, float32 sums rounded once; only where the CPU has AVX-512
// bfloat16 pair products, quant_linear_bf16_available()); bias is float32; all contiguous.
// With y_float (bfloat16 products only), y is float32 there, the sums unrounded, and `y`
// only names positions in it: y + i stands for element i.
template <typename T>
struct QuantProduct {
  const T* x;
  const uint8_t* weight;
  const float* bias;
  T* y;
  int64_t M, N, K, type;
  int num_threads;
  float* y_float = nullptr;
};
using QuantLinearProblem = QuantProduct<float>;
using QuantLinearBf16Problem = QuantProduct<uint16_t>;
void quant_linear(const QuantLinearProblem& problem);
bool quant_linear_bf16_available();
void quant_linear_bf16(const QuantLinearBf16Problem& problem);
// The same product with the weight's blocks interleaved by groups of 16 output features
// (quant_x16.cpp: [ceil(N / 16)][K / block values][block bytes / 2][16] units of 2
// bytes); for the types quant_x16_supports, where quant_linear_bf16_available().
bool quant_x16_supports(int64_t type);
void quant_linear_x16(const QuantLinearBf16Problem& problem);
// The same product with x quantized to int8 per block of 32 values and multiplied on the
// int8 quad products (quant_x16_int8.cpp); for the types quant_x16_int8_supports (none
// without AVX-512 VNNI and bfloat16).
bool quant_x16_int8_supports(int64_t type);
void quant_linear_x16_int8(const QuantLinearBf16Problem& problem);
// out [count, K] float32 = the rows `rows` of a [N, K] weight kept as in quant_linear.
void dequantize_rows(const uint8_t* weight, int64_t K, int64_t type, const int64_t* rows,
                     int64_t count, float* out, int num_threads);
// Weights and bytes per block of ggml type `type`; 0 for a type without kernels.
int64_t quant_block_values(int64_t type);
int64_t quant_block_bytes(int64_t type);

// Elementwise kernels (elementwise.cpp). Tensors are contiguous and share one dtype,
// float32, or bfloat16 when `bfloat16`; arithmetic is float32, rounded to bfloat16 where
// transformers' modules round.

// out [rows, dim] = x / sqrt(mean(x^2) + eps) * weight [dim]. With `x_float32` (and
// `bfloat16`), x alone is float32: a bfloat16 model's float32 residual stream, normed
// without rounding and rounded once to bfloat16 at the output.
struct RmsNormProblem {
  const void* x;
  const void* weight;
  void* out;
  int64_t rows, dim;
  float eps;
  bool bfloat16;
  int num_threads;
  bool x_float32 = false;
};
void rms_norm(const RmsNormProblem& problem);

// hidden [rows, dim] (float32, updated in place) += branch [rows, dim], then out = the
// RMSNorm of the sum, as rms_norm with x_float32 makes it: one pass over the rows where
// an add and a norm took two. branch, weight and out are float32, or bfloat16 when
// `bfloat16` (widened exactly into the float32 sum, as torch's add promotes them).
struct AddRmsNormProblem {
  float* hidden;
  const void* branch;
  const void* weight;
  void* out;
  int64_t rows, dim;
  float eps;
  bool bfloat16;
  int num_threads;
};
void add_rms_norm(const AddRmsNormProblem& problem);

// out [rows, width] = silu(gate_up[:, :width]) * gate_up[:, width:].
struct SiluMulProblem {
  const void* gate_up;
  void* out;
  int64_t rows, width;
  bool bfloat16;
  int num_threads;
};
void silu_and_mul(const SiluMulProblem& problem);

// out[r] = torch.argmax(x[r]) for the rows of x [rows, n] (float32, contiguous,
// 0 < n < 2^31: lane indices are int32):
// the first maximum, or the first NaN where a row has one (argmax.cpp).
void argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out, int num_threads);

// Where rotary writes k and v instead of into tensors: row t goes to flat slot slots[t]
// of the caches (element strides as in KVWrite), as write_kv would copy it; slot -1 is
// skipped.
struct KVSlots {
  void* k_cache;
  void* v_cache;
  const int64_t* slots;
  int64_t block_size, block_stride, head_stride, token_stride;
};

// Splits qkv [num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim] into q, k, v
// ([num_tokens, heads, head_dim] each), rotating q and k ("rotate half" layout) by the
// cos / sin rows [max_positions, head_dim / 2] of each token's position. With `cache`,
// k and v go to their cache slots instead (k and v unused): the K/V write in the same
// pass.
struct RotaryProblem {
  const void* qkv;
  const int64_t* positions;
  const void* cos;
  const void* sin;
  void* q;
  void* k;
  void* v;
  int64_t num_tokens, num_q_heads, num_kv_heads, head_dim;
  bool bfloat16;
  int num_threads;
  const KVSlots* cache = nullptr;
};
void rotary(const RotaryProblem& problem);

}  // namespace pagedllm
