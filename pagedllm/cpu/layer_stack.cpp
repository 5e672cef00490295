// The decoder layers of a pre-norm transformer (RMSNorm, fused q/k/v with rotate-half
// RoPE over the whole head, paged attention, output projection, RMSNorm, gated SiLU MLP,
// residual adds) as one call per step: the same kernels, in the same order, on the same
// tensors as the Python layers (pagedllm/models/decoder.py), so every value is bit for bit
// the same; what goes away is Python and the dispatcher between ~11 operators per layer.
// Each residual add and the norm after it (the next layer's input norm included) run as
// one pass, add_rms_norm, and so do the rotary embedding and the K/V write of a cache in
// the model's dtype (rotary_to_cache), to the bits of the two.
// Registered as the torch class torch.classes.pagedllm_cpu.LayerStack.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/amax.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/div.h>
#include <ATen/ops/lt.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/where.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <chrono>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
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

// One stored form of a matrix and the kernel that multiplies it.
struct MatrixForm {
  MatrixKind kind;
  at::Tensor data;
  int64_t ggml_type, out_features;
  std::optional<at::Tensor> bias;  // float32 for our kernels, the model's dtype for torch's

  MatrixForm(MatrixKind kind, at::Tensor data, int64_t ggml_type, int64_t out_features,
             std::optional<at::Tensor> bias)
      : kind(kind), data(std::move(data)), ggml_type(ggml_type), out_features(out_features) {
    // Our kernels take float32 biases (torch's the model's dtype): converted once here
    // rather than at every call.
    if (bias.has_value() && kind != MatrixKind::kDense && kind != MatrixKind::kOneDNN)
      bias = bias->to(at::kFloat).contiguous();
    this->bias = std::move(bias);
  }

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

// A layer's matrix: one form, or GGUF blocks with an expanded copy that multiplies the
// calls of at least min_rows rows (pagedllm/models/block_expansion.py).
struct Matrix {
  MatrixForm form;
  std::optional<MatrixForm> expanded;
  int64_t min_rows = 0;

  at::Tensor apply(const at::Tensor& x) const {
    if (expanded.has_value() && x.size(0) >= min_rows) return expanded->apply(x);
    return form.apply(x);
  }
};

// The parts of a layer whose wall time a profiled forward pass adds up.
enum class Phase : size_t {
  kProducts, kAttention, kWriteKV, kNorms, kRotary, kActivation, kResidual, kCopies, kCount
};
constexpr std::array<const char*, static_cast<size_t>(Phase::kCount)> kPhaseNames = {
    "products", "attention", "write_kv", "norms", "rotary", "activation", "residual_adds",
    "copies"};
using PhaseSeconds = std::array<double, static_cast<size_t>(Phase::kCount)>;

// Adds the time since the previous lap to a phase; does nothing without a target.
class PhaseClock {
 public:
  explicit PhaseClock(PhaseSeconds* seconds) : seconds_(seconds), last_(now()) {}
  void lap(Phase phase) {
    if (seconds_ == nullptr) return;
    const auto t = now();
    (*seconds_)[static_cast<size_t>(phase)] += std::chrono::duration<double>(t - last_).count();
    last_ = t;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  PhaseSeconds* seconds_;
  std::chrono::steady_clock::time_point last_;
};

// A layer's compact 4-bit blocks (kv_cache_dtype int4): the tiles, and the block id from
// which a table entry names one of them.
struct CompactBlocks {
  at::Tensor tiles;
  int64_t num_full_blocks;
};

struct Layer {
  at::Tensor input_norm, post_attention_norm, k_cache, v_cache;
  double scale, logit_softcap;
  int64_t sliding_window;
  int64_t kv_group;  // whose slot mapping and block tables it writes and reads
  std::vector<Matrix> matrices;  // qkv, o, gate_up, down
  std::optional<CompactBlocks> compact;
};

// Rows [..., head_dim] (any float dtype) as fp8 cache rows of uint8: codes of
// `codes` and a bfloat16 scale, rounded up so that no code clips, as
// pagedllm/kv_storage/kv_quant.py's encode_rows makes them, with the same ATen operations
// (so the same bits).
at::Tensor encode_fp8_rows(const at::Tensor& rows, at::ScalarType codes, double max_code) {
  const at::Tensor x = rows.to(at::kFloat);
  const at::Tensor exact = (x.abs().amax({-1}, /*keepdim=*/true) / max_code).clamp_min(1e-30);
  at::Tensor scale = exact.to(at::kBFloat16);
  scale = at::where(scale.to(at::kFloat) < exact,
                    (scale.view(at::kShort) + 1).view(at::kBFloat16), scale);
  const at::Tensor coded = (x / scale.to(at::kFloat)).clamp(-max_code, max_code).to(codes);
  return at::cat({coded.view(at::kByte), scale.view(at::kByte)}, -1);
}

struct LayerStack : torch::CustomClassHolder {
  int64_t num_q_heads, num_kv_heads;
  double eps;
  at::Tensor cos, sin;  // [max_positions, head_dim / 2] of the model's dtype
  at::Tensor hadamard;  // float32 [head_dim, head_dim], for compact blocks
  // float32 [head_dim, head_dim]: over an int8 cache, keys are stored rotated by it and
  // queries rotated alike (pagedllm/kv_storage/key_rotation.py)
  std::optional<at::Tensor> key_rotation;
  // Over an fp8 cache: the format's largest code (kv_quant's max_code).
  std::optional<double> fp8_max_code;
  std::vector<Layer> layers;

  LayerStack(int64_t num_q_heads, int64_t num_kv_heads, double eps, at::Tensor cos,
             at::Tensor sin)
      : num_q_heads(num_q_heads), num_kv_heads(num_kv_heads), eps(eps), cos(cos), sin(sin) {}

  // Appends a layer: its two norms' weights, its K/V caches, attention options and KV
  // layer group (the index of its slot mapping and block tables in forward's lists).
  // Its four matrices follow through add_matrix.
  void add_layer(at::Tensor input_norm, at::Tensor post_attention_norm, at::Tensor k_cache,
                 at::Tensor v_cache, double scale, int64_t sliding_window, double logit_softcap,
                 int64_t kv_group) {
    TORCH_CHECK(kv_group >= 0, "LayerStack: a KV layer group is >= 0, got ", kv_group);
    layers.push_back({input_norm, post_attention_norm, k_cache, v_cache, scale, logit_softcap,
                      sliding_window, kv_group, {}, std::nullopt});
  }

  // The last layer added also reads compact 4-bit blocks: its attention runs the by-age
  // kernel on a float32 query and the query rotated by `hadamard` [head_dim, head_dim],
  // as the paged backend's by-age path does.
  void add_compact(at::Tensor tiles, int64_t num_full_blocks, at::Tensor hadamard) {
    TORCH_CHECK(!layers.empty(), "LayerStack: add_layer first");
    layers.back().compact = CompactBlocks{tiles, num_full_blocks};
    this->hadamard = hadamard;
  }

  // Every layer's cache is int8 (codes and a scale per row): new K/V are quantized as
  // they are written, keys rotated by `rotation` first, and queries rotated alike meet
  // them as float32, as the paged backend does.
  void set_int8_cache(at::Tensor rotation) { key_rotation = rotation; }

  // Every layer's cache is fp8 (codes of the caches' dtype and a bfloat16 scale per row,
  // the largest code max_code): new K/V are encoded as they are written and float32
  // queries meet them, as the paged backend does.
  void set_fp8_cache(double max_code) { fp8_max_code = max_code; }

  // The next matrix of the last layer added: qkv, o, gate_up, then down.
  void add_matrix(int64_t kind, at::Tensor data, int64_t ggml_type, int64_t out_features,
                  std::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers.empty() && layers.back().matrices.size() < 4,
                "LayerStack: add_layer first; a layer has four matrices");
    layers.back().matrices.push_back(
        {MatrixForm(matrix_kind(kind), data, ggml_type, out_features, bias), {}, 0});
  }

  // An expanded copy of the last matrix added, for calls of at least min_rows rows.
  void add_expanded(int64_t kind, at::Tensor data, int64_t out_features,
                    std::optional<at::Tensor> bias, int64_t min_rows) {
    TORCH_CHECK(!layers.empty() && !layers.back().matrices.empty(),
                "LayerStack: add_matrix first");
    TORCH_CHECK(min_rows > 0, "LayerStack: an expanded copy needs min_rows > 0");
    Matrix& matrix = layers.back().matrices.back();
    matrix.expanded.emplace(matrix_kind(kind), data, 0, out_features, bias);
    matrix.min_rows = min_rows;
  }

  static MatrixKind matrix_kind(int64_t kind) {
    TORCH_CHECK(kind >= 0 && kind <= 5, "LayerStack: unknown matrix kind ", kind);
    return static_cast<MatrixKind>(kind);
  }

  // Runs every layer over `hidden` [T, hidden_size] (updated in place, returned); with
  // `output_rows` (int64), the last layer keeps only those rows after attention, as the
  // Python layers do. `slot_mappings` and `block_tables` hold each KV layer group's.
  at::Tensor forward(at::Tensor hidden, at::Tensor positions,
                     std::vector<at::Tensor> slot_mappings, std::vector<at::Tensor> block_tables,
                     at::Tensor seq_lens, at::Tensor query_start_loc,
                     std::optional<at::Tensor> output_rows) {
    PhaseClock clock(profiling ? &phase_seconds : nullptr);
    TORCH_CHECK(slot_mappings.size() == block_tables.size(),
                "LayerStack: a slot mapping and block tables per KV layer group");
    at::Tensor normed;  // the residual stream normed for the layer's next product
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& layer = layers[i];
      TORCH_CHECK(layer.matrices.size() == 4, "LayerStack: layer ", i, " lacks matrices");
      TORCH_CHECK(static_cast<size_t>(layer.kv_group) < block_tables.size(), "LayerStack: layer ",
                  i, "'s KV layer group ", layer.kv_group, " has no block tables");
      const at::Tensor& slot_mapping = slot_mappings[layer.kv_group];
      const at::Tensor& tables = block_tables[layer.kv_group];
      const Matrix &qkv_proj = layer.matrices[0], &o_proj = layer.matrices[1],
                   &gate_up_proj = layer.matrices[2], &down_proj = layer.matrices[3];
      if (i == 0) {
        normed = ops::rms_norm(hidden, layer.input_norm, eps);
        clock.lap(Phase::kNorms);
      }
      const at::Tensor qkv = qkv_proj.apply(normed);
      clock.lap(Phase::kProducts);
      at::Tensor q;
      if (key_rotation.has_value() || fp8_max_code.has_value()) {  // K/V encoded as written
        at::Tensor k, v;
        std::tie(q, k, v) = ops::rotary(qkv, positions, cos, sin, num_q_heads, num_kv_heads);
        clock.lap(Phase::kRotary);
        if (key_rotation.has_value()) {
          const at::Tensor rotated_k = at::matmul(k.to(at::kFloat), *key_rotation);
          ops::write_kv_int8(layer.k_cache, layer.v_cache, rotated_k,
                             v.to(at::kFloat).contiguous(), slot_mapping);
        } else {
          const at::ScalarType codes = layer.k_cache.scalar_type();
          ops::write_kv(layer.k_cache.view(at::kByte), layer.v_cache.view(at::kByte),
                        encode_fp8_rows(k, codes, *fp8_max_code),
                        encode_fp8_rows(v, codes, *fp8_max_code), slot_mapping);
        }
        clock.lap(Phase::kWriteKV);
      } else {  // k and v rotated straight into their cache slots
        q = ops::rotary_to_cache(qkv, positions, cos, sin, num_q_heads, num_kv_heads,
                                 layer.k_cache, layer.v_cache, slot_mapping);
        clock.lap(Phase::kRotary);
      }
      at::Tensor attended = attend(layer, q, tables, seq_lens, query_start_loc);
      clock.lap(Phase::kAttention);
      if (i + 1 == layers.size() && output_rows.has_value()) {
        hidden = hidden.index_select(0, *output_rows);
        attended = attended.index_select(0, *output_rows);
        clock.lap(Phase::kCopies);
      }
      const at::Tensor projected =
          o_proj.apply(attended.reshape({hidden.size(0), q.size(1) * q.size(2)}));
      clock.lap(Phase::kProducts);
      normed = ops::add_rms_norm(hidden, projected, layer.post_attention_norm, eps);
      clock.lap(Phase::kNorms);
      const at::Tensor gate_up = gate_up_proj.apply(normed);
      clock.lap(Phase::kProducts);
      const at::Tensor activated = ops::silu_and_mul(gate_up);
      clock.lap(Phase::kActivation);
      const at::Tensor down = down_proj.apply(activated);
      clock.lap(Phase::kProducts);
      if (i + 1 < layers.size()) {  // the next layer's input norm, with the add before it
        normed = ops::add_rms_norm(hidden, down, layers[i + 1].input_norm, eps);
        clock.lap(Phase::kNorms);
      } else {
        hidden.add_(down);
        clock.lap(Phase::kResidual);
      }
    }
    if (profiling) ++profiled_steps;
    return hidden;
  }

  // The layer's attention of q over its cache: the paged kernel, or the by-age one over
  // full and compact blocks (float32 query and its rotation, out in q's dtype).
  at::Tensor attend(const Layer& layer, const at::Tensor& q, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& query_start_loc) const {
    if (!layer.compact.has_value() && fp8_max_code.has_value()) {  // float32 query
      const at::Tensor query = q.to(at::kFloat).contiguous();
      at::Tensor out = at::empty_like(query);
      ops::paged_attention(out, query, layer.k_cache, layer.v_cache, block_tables, seq_lens,
                           query_start_loc, layer.scale, layer.sliding_window,
                           layer.logit_softcap);
      return out.to(q.scalar_type());
    }
    if (!layer.compact.has_value() && !key_rotation.has_value()) {
      at::Tensor attended = at::empty_like(q);
      ops::paged_attention(attended, q, layer.k_cache, layer.v_cache, block_tables, seq_lens,
                           query_start_loc, layer.scale, layer.sliding_window,
                           layer.logit_softcap);
      return attended;
    }
    if (!layer.compact.has_value()) {  // an int8 cache: a float32 query, rotated
      const at::Tensor query = at::matmul(q.to(at::kFloat), *key_rotation).contiguous();
      at::Tensor out = at::empty_like(query);
      ops::paged_attention(out, query, layer.k_cache, layer.v_cache, block_tables, seq_lens,
                           query_start_loc, layer.scale, layer.sliding_window,
                           layer.logit_softcap);
      return out.to(q.scalar_type());
    }
    const at::Tensor rotated = at::matmul(q.to(at::kFloat).contiguous(), hadamard).contiguous();
    // full blocks in int8 hold keys rotated like the compact ones
    const at::Tensor query = key_rotation.has_value() ? rotated : q.to(at::kFloat).contiguous();
    at::Tensor out = at::empty_like(query);
    ops::paged_attention_compact(out, query, rotated, layer.k_cache, layer.v_cache,
                                 layer.compact->tiles, layer.compact->num_full_blocks,
                                 block_tables, seq_lens, query_start_loc, layer.scale,
                                 layer.sliding_window, layer.logit_softcap);
    return out.to(q.scalar_type());
  }

  // Whether forward adds each phase's wall time to phase_seconds (off: no clock read).
  void set_profiling(bool on) { profiling = on; }

  // Seconds spent in each phase since the last reset, by name, and "steps".
  c10::Dict<std::string, double> phases() const {
    c10::Dict<std::string, double> out;
    for (size_t i = 0; i < kPhaseNames.size(); ++i) out.insert(kPhaseNames[i], phase_seconds[i]);
    out.insert("steps", static_cast<double>(profiled_steps));
    return out;
  }

  void reset_phases() {
    phase_seconds.fill(0.0);
    profiled_steps = 0;
  }

  bool profiling = false;
  PhaseSeconds phase_seconds{};
  int64_t profiled_steps = 0;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm_cpu, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, double, at::Tensor, at::Tensor>())
      .def("add_layer", &LayerStack::add_layer)
      .def("set_int8_cache", &LayerStack::set_int8_cache)
      .def("set_fp8_cache", &LayerStack::set_fp8_cache)
      .def("add_matrix", &LayerStack::add_matrix)
      .def("add_expanded", &LayerStack::add_expanded)
      .def("add_compact", &LayerStack::add_compact)
      .def("set_profiling", &LayerStack::set_profiling)
      .def("phases", &LayerStack::phases)
      .def("reset_phases", &LayerStack::reset_phases)
      .def("forward", &LayerStack::forward);
}
