// Interface between the torch bindings (bindings.cpp) and the torch-free kernels
// (paged_attention.cpp, streaming_linear.cpp), so that they compile in parallel.
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
  KVFormat kv_format;
  bool bfloat16_query;  // q and out are bfloat16 (only with a bfloat16 cache), else float32
  int num_threads;  // torch's intra-op thread count
};

void paged_attention(const AttentionBatch& batch);

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

// y [M, N] = x [M, K] weight [N, K]^T (+ bias [N]), all contiguous, for few rows M
// (streaming_linear.cpp). x, weight and y share one dtype: float32, or bfloat16 when
// `bfloat16`; bias, if not null, is float32. Accumulation is float32.
struct LinearProblem {
  const void* x;
  const void* weight;
  const float* bias;
  void* y;
  int64_t M, N, K;
  bool bfloat16;
  int num_threads;  // torch's intra-op thread count
};

// Whether this build has the kernel (it needs AVX-512); streaming_linear does nothing
// without it.
bool streaming_linear_available();
void streaming_linear(const LinearProblem& problem);

}  // namespace pagedllm
