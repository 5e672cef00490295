// The kernels as functions of tensors: arguments checked, raw pointers passed on. The
// torch operators of bindings.cpp are these functions; layer_stack.cpp calls them
// directly, without the dispatcher. Meanings and shapes as in pagedllm/cpu/extension.py.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace pagedllm::tensor_ops {

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t sliding_window, double logit_softcap);
void paged_attention_compact(const at::Tensor& out, const at::Tensor& q,
                             const at::Tensor& q_rotated, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& tiles,
                             int64_t num_full_blocks, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                             double scale, int64_t sliding_window, double logit_softcap);
void write_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
              const at::Tensor& v, const at::Tensor& slot_mapping);
void write_kv_int8(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& slot_mapping);
at::Tensor pack_weight(const at::Tensor& weight);
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& panels, int64_t out_features,
                         const std::optional<at::Tensor>& bias, bool float_output = false);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm(const at::Tensor& hidden, const at::Tensor& branch,
                        const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor argmax_rows(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary(const at::Tensor& qkv,
                                                      const at::Tensor& positions,
                                                      const at::Tensor& cos,
                                                      const at::Tensor& sin,
                                                      int64_t num_q_heads, int64_t num_kv_heads);
at::Tensor rotary_to_cache(const at::Tensor& qkv, const at::Tensor& positions,
                           const at::Tensor& cos, const at::Tensor& sin, int64_t num_q_heads,
                           int64_t num_kv_heads, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& slot_mapping);
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                        const std::optional<at::Tensor>& bias, bool float_output = false);
at::Tensor quant_linear_x16(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                            int64_t out_features, const std::optional<at::Tensor>& bias,
                            bool float_output = false);
at::Tensor quant_linear_x16_int8(const at::Tensor& x, const at::Tensor& weight, int64_t type,
                                 int64_t out_features, const std::optional<at::Tensor>& bias,
                                 bool float_output = false);
at::Tensor dequantize_rows(const at::Tensor& weight, int64_t type, int64_t K,
                           const at::Tensor& rows);

}  // namespace pagedllm::tensor_ops
