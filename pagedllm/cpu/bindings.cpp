// Torch operators over the kernels in paged_attention.cpp, paged_attention_compact.cpp,
// packed_linear.cpp, elementwise.cpp, argmax.cpp and the quant_*.cpp files: argument
// checks, then raw pointers. Registered as torch.ops.pagedllm_cpu.{paged_attention,
// paged_attention_compact, write_kv, write_kv_int8, pack_weight, packed_linear, rms_norm,
// add_rms_norm, silu_and_mul, rotary, rotary_to_cache, argmax_rows, quant_linear, quant_linear_x16, quant_linear_x16_int8,
// quant_x16_supports, quant_x16_int8_supports, dequantize_rows, avx512_kernels_available}.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "kernels.h"
#include "tensor_ops.h"

namespace {

constexpr int64_t kLanes = 16, kMaxVectors = 16;  // head_dim: multiple of 16, at most 256
constexpr int64_t kScaleBytes = 2;                 // a quantized row's bfloat16 scale

// The row format a cache dtype stands for; int8 and fp8 rows end with their scale.
pagedllm::KVFormat kv_format(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return pagedllm::KVFormat::kFloat32;
    case at::kBFloat16: return pagedllm::KVFormat::kBFloat16;
    case at::kHalf: return pagedllm::KVFormat::kFloat16;
    case at::kChar: return pagedllm::KVFormat::kInt8;
    case at::kFloat8_e4m3fn: return pagedllm::KVFormat::kFp8E4M3;
    case at::kFloat8_e5m2: return pagedllm::KVFormat::kFp8E5M2;
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", dtype);
  }
}

bool is_scaled(pagedllm::KVFormat format) {
  return format == pagedllm::KVFormat::kInt8 || format == pagedllm::KVFormat::kFp8E4M3 ||
         format == pagedllm::KVFormat::kFp8E5M2;
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4, "cache is [num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
              k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must match");
  TORCH_CHECK(k_cache.stride(3) == 1, "head_dim must be contiguous in the cache");
}

// The dtype flag of the kernels that take float32 or bfloat16: true for bfloat16.
bool is_bfloat16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(pagedllm::avx512_kernels_available(), what, " needs AVX-512");
  TORCH_CHECK(t.is_contiguous(), what, ": tensors must be contiguous");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what,
              ": dtype must be float32 or bfloat16");
  return t.scalar_type() == at::kBFloat16;
}

// Values of k per panel step: bfloat16 pairs them for the pair-product instruction.
int64_t panel_step(bool bfloat16) { return bfloat16 ? 2 : 1; }

// The weight's block format, checked against its shape: uint8 [N, K / values * bytes].
void check_quantized(const at::Tensor& weight, int64_t type, int64_t K, const char* what) {
  const int64_t values = pagedllm::quant_block_values(type);
  TORCH_CHECK(values > 0, what, ": no kernels for ggml type ", type);
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
              K % values == 0 && weight.size(1) == K / values * pagedllm::quant_block_bytes(type),
              what, ": weight must be contiguous uint8 [N, K / ", values, " * ",
              pagedllm::quant_block_bytes(type), "] for K = ", K);
}

// A bias [N] as contiguous float32 (undefined when there is none).
at::Tensor float_bias(const std::optional<at::Tensor>& bias, int64_t N, const char* what) {
  if (!bias.has_value()) return at::Tensor();
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, what, ": bias is [N]");
  return bias->to(at::kFloat).contiguous();
}

// y [M, N] of a product of x [M, K]: x's dtype, or float32 with float_output.
at::Tensor product_output(const at::Tensor& x, int64_t N, bool float_output) {
  return at::empty({x.size(0), N}, float_output ? x.options().dtype(at::kFloat) : x.options());
}

// The float32 output of a bfloat16 product (QuantProduct::y_float); null for bfloat16.
float* float_pointer(const at::Tensor& y) {
  return y.scalar_type() == at::kFloat ? y.data_ptr<float>() : nullptr;
}

bool quant_x16_supports(int64_t type) {
  return pagedllm::quant_linear_bf16_available() && pagedllm::quant_x16_supports(type);
}

bool quant_x16_int8_supports(int64_t type) { return pagedllm::quant_x16_int8_supports(type); }

bool avx512_kernels_available() { return pagedllm::avx512_kernels_available(); }

}  // namespace

namespace pagedllm::tensor_ops {

// Checks the step's metadata (int32, contiguous, query_start_loc spanning q's
// num_tokens rows) and that every used table entry of every sequence is below
// num_blocks; returns the number of sequences.
int64_t check_tables(int64_t num_tokens, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              query_start_loc.scalar_type() == at::kInt, "metadata must be int32");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous() &&
              query_start_loc.is_contiguous());
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(query_start_loc.size(0) == num_seqs + 1 && block_tables.size(0) == num_seqs);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_seqs] == num_tokens, "query_start_loc must span q");
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i];
    TORCH_CHECK(q_len >= 0 && q_len <= lens[i], "sequence ", i, ": bad query length");
    const int64_t used_blocks = (lens[i] + block_size - 1) / block_size;
    TORCH_CHECK(used_blocks <= block_tables.size(1), "sequence ", i,
                " is longer than its block table");
    const int32_t* table = block_tables.data_ptr<int32_t>() + i * block_tables.size(1);
    for (int64_t b = 0; b < used_blocks; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < num_blocks, "sequence ", i, " refers to block ",
                  table[b], " outside the cache");
    }
  }
  return num_seqs;
}

// The kernels' view of one call, its tensors checked by the caller.
pagedllm::AttentionBatch attention_batch(const at::Tensor& out, const at::Tensor& q,
                                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                                         const at::Tensor& block_tables,
                                         const at::Tensor& seq_lens,
                                         const at::Tensor& query_start_loc, double scale,
                                         int64_t sliding_window, double logit_softcap,
                                         pagedllm::KVFormat format) {
  return {q.data_ptr(),
          out.data_ptr(),
          k_cache.data_ptr(),
          v_cache.data_ptr(),
          block_tables.data_ptr<int32_t>(),
          seq_lens.data_ptr<int32_t>(),
          query_start_loc.data_ptr<int32_t>(),
          seq_lens.size(0),
          q.size(1),
          k_cache.size(1),
          q.size(2),
          __builtin_ctzll(k_cache.size(2)),
          block_tables.size(1),
          k_cache.stride(0),
          k_cache.stride(1),
          k_cache.stride(2),
          static_cast<float>(scale),
          sliding_window,
          static_cast<float>(logit_softcap),
          format,
          q.scalar_type() == at::kBFloat16,
          at::get_num_threads()};
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t sliding_window, double logit_softcap) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0,
              "sliding_window and logit_softcap must be >= 0 (0: off)");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && out.is_contiguous() &&
              out.sizes() == q.sizes(), "q and out are contiguous [num_tokens, Hq, head_dim]");
  const pagedllm::KVFormat format = kv_format(k_cache.scalar_type());
  TORCH_CHECK(q.scalar_type() == out.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat ||
              (q.scalar_type() == at::kBFloat16 && format == pagedllm::KVFormat::kBFloat16),
              "q must be float32, or bfloat16 over a bfloat16 cache");
  const int64_t block_size = k_cache.size(2);
  TORCH_CHECK((block_size & (block_size - 1)) == 0, "block size must be a power of two");
  const int64_t row = q.size(2) + (is_scaled(format) ? kScaleBytes : 0);
  TORCH_CHECK(row == k_cache.size(3) && q.size(2) % kLanes == 0 &&
              q.size(2) <= kLanes * kMaxVectors,
              "head_dim must fit the cache rows, be a multiple of 16 and at most 256");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  check_tables(q.size(0), block_tables, seq_lens, query_start_loc, block_size, k_cache.size(0));
  pagedllm::paged_attention(attention_batch(out, q, k_cache, v_cache, block_tables, seq_lens,
                                            query_start_loc, scale, sliding_window,
                                            logit_softcap, format));
}

// paged_attention over block tables mixing full blocks (entries below num_full_blocks)
// and compact 4-bit ones (entry - num_full_blocks in tiles [num_compact_blocks,
// num_kv_heads, tile_bytes], uint8); q, q_rotated (q @ H per head) and out are float32.
void paged_attention_compact(const at::Tensor& out, const at::Tensor& q,
                             const at::Tensor& q_rotated, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& tiles,
                             int64_t num_full_blocks, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                             double scale, int64_t sliding_window, double logit_softcap) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0,
              "sliding_window and logit_softcap must be >= 0 (0: off)");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous() &&
              q_rotated.sizes() == q.sizes() && q_rotated.scalar_type() == at::kFloat &&
              q_rotated.is_contiguous() && out.sizes() == q.sizes() &&
              out.scalar_type() == at::kFloat && out.is_contiguous(),
              "q, q_rotated and out are contiguous float32 [num_tokens, Hq, head_dim]");
  const pagedllm::KVFormat format = kv_format(k_cache.scalar_type());
  const int64_t head_dim = q.size(2), block_size = k_cache.size(2);
  TORCH_CHECK(head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256,
              "compact blocks need head_dim 32, 64, 128 or 256");
  TORCH_CHECK(k_cache.size(3) == head_dim + (is_scaled(format) ? kScaleBytes : 0),
              "head_dim must fit the cache rows");
  TORCH_CHECK(block_size >= 16 && (block_size & (block_size - 1)) == 0,
              "block size must be a power of two, at least 16");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  const int64_t tile_bytes = block_size * head_dim + 4 * head_dim + 4 * block_size;
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.dim() == 3 && tiles.is_contiguous() &&
              tiles.size(1) == k_cache.size(1) && tiles.size(2) == tile_bytes,
              "tiles are contiguous uint8 [num_compact_blocks, num_kv_heads, ", tile_bytes, "]");
  TORCH_CHECK(num_full_blocks >= 0 && num_full_blocks <= k_cache.size(0),
              "num_full_blocks must be within the cache");
  check_tables(q.size(0), block_tables, seq_lens, query_start_loc, block_size,
               num_full_blocks + tiles.size(0));
  const pagedllm::AttentionBatch full =
      attention_batch(out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                      sliding_window, logit_softcap, format);
  pagedllm::paged_attention_compact(
      {full, q_rotated.data_ptr(), tiles.data_ptr<uint8_t>(), num_full_blocks});
}

// The int64 slots of a K/V write, each checked to lie inside the cache (-1: skipped).
const int64_t* checked_slots(const at::Tensor& slot_mapping, const at::Tensor& k_cache) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < slot_mapping.size(0); ++i) {
    TORCH_CHECK(slots[i] < num_slots, "slot ", slots[i], " is outside the cache");
  }
  return slots;
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
  const int64_t* slots = checked_slots(slot_mapping, k_cache);
  pagedllm::write_kv({k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(), slots,
                      k.size(0), k_cache.size(1), k_cache.size(2),
                      k_cache.size(3) * k.element_size(), k_cache.stride(0), k_cache.stride(1),
                      k_cache.stride(2), k.element_size()});
}

// Quantizes row i of k and v (float32) to int8 codes and a scale, stored at flat slot
// slot_mapping[i] of the caches (uint8, or their int8 view); slot -1 is skipped.
void write_kv_int8(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && slot_mapping.is_contiguous());
  TORCH_CHECK(k_cache.scalar_type() == at::kByte || k_cache.scalar_type() == at::kChar,
              "an int8 cache is one byte per element");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "new K/V must be float32");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == k_cache.size(1) &&
              k.size(2) + 2 == k_cache.size(3) && k.size(0) == slot_mapping.size(0),
              "k and v are [num_tokens, num_kv_heads, head_dim], one slot per token");
  const int64_t* slots = checked_slots(slot_mapping, k_cache);
  pagedllm::write_kv_int8({k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                           slots, k.size(0), k_cache.size(1), k_cache.size(2),
                           k.size(2) * k.element_size(), k_cache.stride(0), k_cache.stride(1),
                           k_cache.stride(2), 1});
}

// weight [N, K] -> panels [num_panels(N), ceil(K / S), panel width, S] (see kernels.h).
at::Tensor pack_weight(const at::Tensor& weight) {
  const bool bf16 = is_bfloat16(weight, "pack_weight");
  TORCH_CHECK(weight.dim() == 2, "pack_weight: weight is [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), step = panel_step(bf16);
  at::Tensor panels = at::empty(
      {pagedllm::num_panels(N), (K + step - 1) / step, pagedllm::kPanelWidth, step},
      weight.options());
  pagedllm::pack_weight(weight.data_ptr(), N, K, bf16, panels.data_ptr(), at::get_num_threads());
  return panels;
}

// With float_output, a bfloat16 product's y is float32: its sums unrounded.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                         const std::optional<at::Tensor>& bias, bool float_output) {
  const bool bf16 = is_bfloat16(x, "packed_linear");
  const int64_t step = panel_step(bf16);
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 4 && panels.scalar_type() == x.scalar_type() &&
              panels.is_contiguous() && panels.size(0) == pagedllm::num_panels(out_features) &&
              panels.size(1) == (x.size(1) + step - 1) / step &&
              panels.size(2) == pagedllm::kPanelWidth && panels.size(3) == step,
              "packed_linear: x is [M, K] and panels come from pack_weight of an "
              "[out_features, K] weight of x's dtype");
  at::Tensor bias_f32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features, "bias is [out_features]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = product_output(x, out_features, float_output);
  pagedllm::packed_linear({x.data_ptr(), panels.data_ptr(),
                           bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr,
                           y.data_ptr(), x.size(0), out_features, x.size(1), bf16,
                           at::get_num_threads(), bf16 && float_output});
  return y;
}

// The output has the weight's dtype; x has it too, or is float32 under a bfloat16 weight
// (a bfloat16 model's float32 residual stream).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const bool bf16 = is_bfloat16(weight, "rms_norm");
  const bool x_float32 = bf16 && !is_bfloat16(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "rms_norm: x is [rows, dim] and weight [dim]");
  TORCH_CHECK(x_float32 || weight.scalar_type() == x.scalar_type(),
              "rms_norm: x has the weight's dtype, or is float32 under a bfloat16 weight");
  at::Tensor out = at::empty_like(x, weight.options());
  pagedllm::rms_norm({x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.size(0), x.size(1),
                      static_cast<float>(eps), bf16, at::get_num_threads(), x_float32});
  return out;
}

// hidden (float32, updated in place) += branch, then its RMSNorm in the weight's dtype;
// branch has the weight's dtype.
at::Tensor add_rms_norm(const at::Tensor& hidden, const at::Tensor& branch,
                        const at::Tensor& weight, double eps) {
  const bool bf16 = is_bfloat16(weight, "add_rms_norm");
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat && hidden.is_contiguous(),
              "add_rms_norm: hidden is a contiguous float32 [rows, dim]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden.size(1),
              "add_rms_norm: weight is [dim]");
  TORCH_CHECK(branch.sizes() == hidden.sizes() && branch.scalar_type() == weight.scalar_type(),
              "add_rms_norm: branch is [rows, dim] of the weight's dtype");
  const at::Tensor rows = branch.contiguous();
  at::Tensor out = at::empty_like(hidden, weight.options());
  pagedllm::add_rms_norm({hidden.data_ptr<float>(), rows.data_ptr(), weight.data_ptr(),
                          out.data_ptr(), hidden.size(0), hidden.size(1),
                          static_cast<float>(eps), bf16, at::get_num_threads()});
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  const bool bf16 = is_bfloat16(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up is [rows, 2 * width]");
  const int64_t width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  pagedllm::silu_and_mul(
      {gate_up.data_ptr(), out.data_ptr(), gate_up.size(0), width, bf16, at::get_num_threads()});
  return out;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.size(1) <= INT32_MAX &&
                  x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "argmax_rows: x is contiguous float32 [rows, n] with 0 < n < 2^31 on the CPU");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  pagedllm::argmax_rows(x.data_ptr<float>(), x.size(0), x.size(1), out.data_ptr<int64_t>(),
                        at::get_num_threads());
  return out;
}

// The checked problem of rotary over qkv, q allocated; k, v and the cache left to the
// caller.
pagedllm::RotaryProblem rotary_problem(const at::Tensor& qkv, const at::Tensor& positions,
                                       const at::Tensor& cos, const at::Tensor& sin,
                                       int64_t num_q_heads, int64_t num_kv_heads, at::Tensor& q) {
  const bool bf16 = is_bfloat16(qkv, "rotary");
  TORCH_CHECK(qkv.dim() == 2 && num_q_heads > 0 && num_kv_heads > 0 &&
              qkv.size(1) % (num_q_heads + 2 * num_kv_heads) == 0,
              "rotary: qkv is [tokens, (num_q_heads + 2 * num_kv_heads) * head_dim]");
  const int64_t head_dim = qkv.size(1) / (num_q_heads + 2 * num_kv_heads);
  TORCH_CHECK(head_dim % 2 == 0, "rotary: head_dim must be even");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == head_dim / 2 &&
              cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
              cos.is_contiguous() && sin.is_contiguous(),
              "rotary: cos and sin are [max_positions, head_dim / 2] of qkv's dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == qkv.size(0) &&
              positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rotary: positions is int64 [tokens]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.size(0); ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "rotary: position ", pos[t],
                " outside the table");
  }
  const int64_t tokens = qkv.size(0);
  q = at::empty({tokens, num_q_heads, head_dim}, qkv.options());
  return {qkv.data_ptr(), pos, cos.data_ptr(), sin.data_ptr(), q.data_ptr(), nullptr, nullptr,
          tokens, num_q_heads, num_kv_heads, head_dim, bf16, at::get_num_threads()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary(const at::Tensor& qkv,
                                                      const at::Tensor& positions,
                                                      const at::Tensor& cos,
                                                      const at::Tensor& sin,
                                                      int64_t num_q_heads, int64_t num_kv_heads) {
  at::Tensor q;
  pagedllm::RotaryProblem problem =
      rotary_problem(qkv, positions, cos, sin, num_q_heads, num_kv_heads, q);
  const std::vector<int64_t> shape = {problem.num_tokens, num_kv_heads, problem.head_dim};
  at::Tensor k = at::empty(shape, qkv.options());
  at::Tensor v = at::empty(shape, qkv.options());
  problem.k = k.data_ptr();
  problem.v = v.data_ptr();
  pagedllm::rotary(problem);
  return {q, k, v};
}

// rotary with k and v written to flat slots slot_mapping[t] of the caches, as write_kv
// writes them (-1: skipped), in the same pass; returns q.
at::Tensor rotary_to_cache(const at::Tensor& qkv, const at::Tensor& positions,
                           const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                           int64_t num_kv_heads, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  at::Tensor q;
  pagedllm::RotaryProblem problem =
      rotary_problem(qkv, positions, cos, sin, num_q_heads, num_kv_heads, q);
  check_cache(k_cache, v_cache);
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type(), "new K/V must have the cache's dtype");
  TORCH_CHECK(k_cache.size(1) == num_kv_heads && k_cache.size(3) == problem.head_dim,
              "rotary_to_cache: the cache is [num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == qkv.size(0) &&
              slot_mapping.is_contiguous(), "rotary_to_cache: one slot per token");
  const pagedllm::KVSlots slots{k_cache.data_ptr(), v_cache.data_ptr(),
                                checked_slots(slot_mapping, k_cache), k_cache.size(2),
                                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)};
  problem.cache = &slots;
  pagedllm::rotary(problem);
  return q;
}

// x [M, K] (float32 or bfloat16) @ dequantized(weight)^T + bias, in x's dtype, or float32
// with float_output. bfloat16 x is multiplied in bfloat16 pairs where the CPU has them,
// else widened to float32; either way the float32 result is rounded once, if at all.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                        const std::optional<at::Tensor>& bias, bool float_output) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "quant_linear: x is float32 or bfloat16 [M, K]");
  const int64_t K = x.size(1), N = weight.size(0);
  check_quantized(weight, type, K, "quant_linear");
  const at::Tensor bias_f32 = float_bias(bias, N, "quant_linear");
  const float* bias_ptr = bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16 && pagedllm::quant_linear_bf16_available()) {
    const at::Tensor xc = x.contiguous();
    at::Tensor y = product_output(xc, N, float_output);
    pagedllm::quant_linear_bf16({reinterpret_cast<const uint16_t*>(xc.data_ptr()),
                                 weight.data_ptr<uint8_t>(), bias_ptr,
                                 reinterpret_cast<uint16_t*>(y.data_ptr()), x.size(0), N, K,
                                 type, at::get_num_threads(), float_pointer(y)});
    return y;
  }
  at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x32.options());
  pagedllm::quant_linear({x32.data_ptr<float>(), weight.data_ptr<uint8_t>(), bias_ptr,
                          y.data_ptr<float>(), x.size(0), N, K, type, at::get_num_threads()});
  return float_output ? y : y.to(x.scalar_type());
}

namespace {

// Checks x (bfloat16 [M, K]) and weight (an interleaved [ceil(N / 16), group bytes]) of
// the interleaved kernels and returns y [M, N] from `kernel`.
at::Tensor interleaved_product(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                               int64_t out_features, const std::optional<at::Tensor>& bias,
                               bool float_output, bool supported, const char* name,
                               void (*kernel)(const pagedllm::QuantLinearBf16Problem&)) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, name, ": x is bfloat16 [M, K]");
  TORCH_CHECK(supported, name, ": no interleaved kernel for ggml type ", type, " on this CPU");
  const int64_t K = x.size(1), N = out_features;
  const int64_t values = pagedllm::quant_block_values(type);
  const int64_t group_bytes = K / values * pagedllm::quant_block_bytes(type) * 16;
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2 && weight.is_contiguous() &&
              K % values == 0 && weight.size(0) == (N + 15) / 16 && weight.size(1) == group_bytes,
              name, ": weight must be contiguous uint8 [", (N + 15) / 16, ", ", group_bytes,
              "] for N = ", N, ", K = ", K);
  const at::Tensor bias_f32 = float_bias(bias, N, name);
  const at::Tensor xc = x.contiguous();
  at::Tensor y = product_output(xc, N, float_output);
  kernel({reinterpret_cast<const uint16_t*>(xc.data_ptr()), weight.data_ptr<uint8_t>(),
          bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr,
          reinterpret_cast<uint16_t*>(y.data_ptr()), x.size(0), N, K, type,
          at::get_num_threads(), float_pointer(y)});
  return y;
}

}  // namespace

// bfloat16 x [M, K] @ dequantized(weight)^T + bias [N] for a weight of N = out_features
// rows interleaved by groups of 16 (quant_x16.cpp): uint8 [ceil(N / 16), K / block values
// * block bytes * 16].
at::Tensor quant_linear_x16(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                            int64_t out_features, const std::optional<at::Tensor>& bias,
                            bool float_output) {
  return interleaved_product(x, weight, type, out_features, bias, float_output,
                             ::quant_x16_supports(type),
                             "quant_linear_x16", &pagedllm::quant_linear_x16);
}

// The same product with x quantized to int8 per block of 32 (quant_x16_int8.cpp).
at::Tensor quant_linear_x16_int8(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                                 int64_t out_features, const std::optional<at::Tensor>& bias,
                                 bool float_output) {
  return interleaved_product(x, weight, type, out_features, bias, float_output,
                             pagedllm::quant_x16_int8_supports(type), "quant_linear_x16_int8",
                             &pagedllm::quant_linear_x16_int8);
}

// Rows `rows` (int64) of the [N, K] weight, decoded to float32 [len(rows), K].
at::Tensor dequantize_rows(const at::Tensor& weight, int64_t type, int64_t K,
                           const at::Tensor& rows) {
  check_quantized(weight, type, K, "dequantize_rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong,
              "dequantize_rows: rows is int64 [count]");
  at::Tensor index = rows.contiguous();
  const int64_t* r = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < index.size(0); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < weight.size(0), "dequantize_rows: row ", r[i],
                " outside the weight");
  }
  at::Tensor out = at::empty({index.size(0), K}, weight.options().dtype(at::kFloat));
  pagedllm::dequantize_rows(weight.data_ptr<uint8_t>(), K, type, r, index.size(0),
                            out.data_ptr<float>(), at::get_num_threads());
  return out;
}

}  // namespace pagedllm::tensor_ops

TORCH_LIBRARY(pagedllm_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window=0, float logit_softcap=0.0) -> ()");
  m.def("paged_attention_compact(Tensor(a!) out, Tensor q, Tensor q_rotated, Tensor k_cache, "
        "Tensor v_cache, Tensor tiles, int num_full_blocks, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, float scale, int sliding_window=0, "
        "float logit_softcap=0.0) -> ()");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
        "Tensor slot_mapping) -> ()");
  m.def("write_kv_int8(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, "
        "Tensor slot_mapping) -> ()");
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("packed_linear(Tensor x, Tensor panels, int out_features, Tensor? bias, "
        "bool float_output=False) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor branch, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("rotary(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, int num_q_heads, "
        "int num_kv_heads) -> (Tensor, Tensor, Tensor)");
  m.def("rotary_to_cache(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, "
        "int num_q_heads, int num_kv_heads, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor weight, int type, Tensor? bias, "
        "bool float_output=False) -> Tensor");
  m.def("quant_linear_x16(Tensor x, Tensor weight, int type, int out_features, Tensor? bias, "
        "bool float_output=False) -> Tensor");
  m.def("quant_linear_x16_int8(Tensor x, Tensor weight, int type, int out_features, "
        "Tensor? bias, bool float_output=False) -> Tensor");
  m.def("quant_x16_supports(int type) -> bool", &quant_x16_supports);
  m.def("quant_x16_int8_supports(int type) -> bool", &quant_x16_int8_supports);
  m.def("dequantize_rows(Tensor weight, int type, int K, Tensor rows) -> Tensor");
  m.def("avx512_kernels_available() -> bool", &avx512_kernels_available);
}

TORCH_LIBRARY_IMPL(pagedllm_cpu, CPU, m) {
  m.impl("paged_attention", &pagedllm::tensor_ops::paged_attention);
  m.impl("paged_attention_compact", &pagedllm::tensor_ops::paged_attention_compact);
  m.impl("write_kv", &pagedllm::tensor_ops::write_kv);
  m.impl("write_kv_int8", &pagedllm::tensor_ops::write_kv_int8);
  m.impl("pack_weight", &pagedllm::tensor_ops::pack_weight);
  m.impl("packed_linear", &pagedllm::tensor_ops::packed_linear);
  m.impl("rms_norm", &pagedllm::tensor_ops::rms_norm);
  m.impl("add_rms_norm", &pagedllm::tensor_ops::add_rms_norm);
  m.impl("silu_and_mul", &pagedllm::tensor_ops::silu_and_mul);
  m.impl("argmax_rows", &pagedllm::tensor_ops::argmax_rows);
  m.impl("rotary", &pagedllm::tensor_ops::rotary);
  m.impl("rotary_to_cache", &pagedllm::tensor_ops::rotary_to_cache);
  m.impl("quant_linear", &pagedllm::tensor_ops::quant_linear);
  m.impl("quant_linear_x16", &pagedllm::tensor_ops::quant_linear_x16);
  m.impl("quant_linear_x16_int8", &pagedllm::tensor_ops::quant_linear_x16_int8);
  m.impl("dequantize_rows", &pagedllm::tensor_ops::dequantize_rows);
}
