// The decoder layers of a pre-norm transformer (RMSNorm, fused q/k/v with rotate-half
// RoPE over the whole head, paged attention, output projection, RMSNorm, gated SiLU MLP,
// residual adds) as one call per step: the same kernels, in the same order, on the same
// tensors as the Python layers (pagedllm/models/decoder.py), so every value is bit for bit
// the same; what goes away is Python and the dispatcher between ~11 operators per layer.
// Registered as the torch class torch.classes.pagedllm_cpu.LayerStack.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "tensor_ops.h"

namespace {

namespace ops = pagedllm::tensor_ops;

// How a matrix is stored, hence which kernel multiplies it (values shared with
// pagedllm/models/layer_stack.py).
enum class MatrixKind : int64_t {
  kDense = 0,        // a plain [N, K] tensor: torch's linear (oneDNN)
  kPacked = 1,       // panels of pack_weight
  kBlocks = 2,       // GGUF blocks in the file's row order
  kInterleaved = 3,  // GGUF blocks interleaved by groups of 16 rows
  kInterleavedInt8 = 4,  // the same, x quantized to int8 (quant_x16_int8.cpp)
  kOneDNN = 5,       // oneDNN's blocked layout (pagedllm/cpu/onednn.py)
};

// torch's mkldnn::_linear_pointwise, as pagedllm/cpu/onednn.py calls it from Python.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& reordered,
                         const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, reordered, bias, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string()};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

struct Matrix {
  MatrixKind kind;
  at::Tensor data;
  int64_t ggml_type, out_features;
  std::optional<at::Tensor> bias;

  at::Tensor apply(const at::Tensor& x) const {
    switch (kind) {
      case MatrixKind::kDense: return at::linear(x, data, bias);
      case MatrixKind::kPacked: return ops::packed_linear(x.contiguous(), data, out_features, bias);
      case MatrixKind::kBlocks: return ops::quant_linear(x.contiguous(), data, ggml_type, bias);
      case MatrixKind::kInterleaved:
        return ops::quant_linear_x16(x.contiguous(), data, ggml_type, out_features, bias);
      case MatrixKind::kInterleavedInt8:
        return ops::quant_linear_x16_int8(x.contiguous(), data, ggml_type, out_features, bias);
      case MatrixKind::kOneDNN: return onednn_linear(x, data, bias);
    }
    TORCH_CHECK(false, "LayerStack: unknown matrix kind");
  }
};

struct Layer {
  at::Tensor input_norm, post_attention_norm, k_cache, v_cache;
  double scale, logit_softcap;
  int64_t sliding_window;
  std::vector<Matrix> matrices;  // qkv, o, gate_up, down
};

struct LayerStack : torch::CustomClassHolder {
  int64_t num_q_heads, num_kv_heads;
  double eps;
  at::Tensor cos, sin;  // [max_positions, head_dim / 2] of the model's dtype
  std::vector<Layer> layers;

  LayerStack(int64_t num_q_heads, int64_t num_kv_heads, double eps, at::Tensor cos,
             at::Tensor sin)
      : num_q_heads(num_q_heads), num_kv_heads(num_kv_heads), eps(eps), cos(cos), sin(sin) {}

  // Appends a layer: its two norms' weights, its K/V caches and attention options.
  // Its four matrices follow through add_matrix.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, at::Tensor k_cache,
                 at::Tensor v_cache, double scale, int64_t sliding_window,
                 double logit_softcap) {
    layers.push_back({input_norm, post_attention_norm, k_cache, v_cache, scale, logit_softcap,
                      sliding_window, {}});
  }

  // The next matrix of the last layer added: qkv, o, gate_up, then down.
  void add_matrix(int64_t kind, at::Tensor data, int64_t ggml_type, int64_t out_features,
                  std::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers.empty() && layers.back().matrices.size() < 4,
                "LayerStack: add_layer first; a layer has four matrices");
    TORCH_CHECK(kind >= 0 && kind <= 5, "LayerStack: unknown matrix kind ", kind);
    const auto matrix_kind = static_cast<MatrixKind>(kind);
    // Our kernels take float32 biases (torch's the model's dtype): converted once here
    // rather than at every call.
    if (bias.has_value() && matrix_kind != MatrixKind::kDense &&
        matrix_kind != MatrixKind::kOneDNN)
      bias = bias->to(at::kFloat).contiguous();
    layers.back().matrices.push_back({matrix_kind, data, ggml_type, out_features, bias});
  }

  // Runs every layer over `hidden` [T, hidden_size] (updated in place, returned); with
  // `output_rows` (int64), the last layer keeps only those rows after attention, as the
  // Python layers do.
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_lens, at::Tensor query_start_loc,
                     std::optional<at::Tensor> output_rows) {
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      TORCH_CHECK(layer.matrices.size() == 4, "LayerStack: layer ", i, " lacks matrices");
      const Matrix &qkv_proj = layer.matrices[0], &o_proj = layer.matrices[1],
                   &gate_up_proj = layer.matrices[2], &down_proj = layer.matrices[3];
      const at::Tensor qkv = qkv_proj.apply(ops::rms_norm(hidden, layer.input_norm, eps));
      auto [q, k, v] = ops::rotary(qkv, positions, cos, sin, num_q_heads, num_kv_heads);
      ops::write_kv(layer.k_cache, layer.v_cache, k, v, slot_mapping);
      at::Tensor attended = at::empty_like(q);
      ops::paged_attention(attended, q, layer.k_cache, layer.v_cache, block_tables, seq_lens,
                           query_start_loc, layer.scale, layer.sliding_window,
                           layer.logit_softcap);
      if (i + 1 == layers.size() && output_rows.has_value()) {
        hidden = hidden.index_select(0, *output_rows);
        attended = attended.index_select(0, *output_rows);
      }
      hidden.add_(o_proj.apply(attended.reshape({hidden.size(0), q.size(1) * q.size(2)})));
      const at::Tensor gate_up =
          gate_up_proj.apply(ops::rms_norm(hidden, layer.post_attention_norm, eps));
      hidden.add_(down_proj.apply(ops::silu_and_mul(gate_up)));
    }
    return hidden;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, double, at::Tensor, at::Tensor>())
      .def("add_layer", &LayerStack::add_layer)
      .def("add_matrix", &LayerStack::add_matrix)
      .def("forward", &LayerStack::forward);
}
