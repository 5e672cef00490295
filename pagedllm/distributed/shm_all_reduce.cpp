// All-reduce through shared memory for tensor-parallel ranks on one machine.
//
// The buffer (one mapping shared by every rank) holds, per rank, a sequence counter on
// its own cache line, then two generations of one slot per rank. Call g of every rank:
// post() copies the rank's tensor into slot [g % 2][rank] and publishes g in its counter
// (release); reduce() waits until every counter reaches g (acquire), then sums the slots
// in rank order into the tensor, so every rank computes the same bits. A slot of
// generation g is rewritten at call g + 2 only: a rank reaches it after every other
// rank posted g + 1, which each did after it had finished reading generation g.
#include <torch/extension.h>

#include <immintrin.h>
#include <sched.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLine = 64;

int64_t* counter(const torch::Tensor& buffer, int64_t rank) {
  return reinterpret_cast<int64_t*>(buffer.data_ptr<uint8_t>() + rank * kLine);
}

uint8_t* slot(const torch::Tensor& buffer, int64_t data_offset, int64_t slot_bytes,
              int64_t world, int64_t generation, int64_t rank) {
  const int64_t index = (generation & 1) * world + rank;
  return buffer.data_ptr<uint8_t>() + data_offset + index * slot_bytes;
}

void post(torch::Tensor x, torch::Tensor buffer, int64_t rank, int64_t world,
          int64_t generation, int64_t data_offset, int64_t slot_bytes) {
  TORCH_CHECK(x.is_contiguous() && x.nbytes() <= static_cast<size_t>(slot_bytes),
              "shm all-reduce: the tensor must be contiguous and fit one slot");
  std::memcpy(slot(buffer, data_offset, slot_bytes, world, generation, rank), x.data_ptr(),
              x.nbytes());
  __atomic_store_n(counter(buffer, rank), generation, __ATOMIC_RELEASE);
}

// out = slot 0 + slot 1 + ... in rank order, accumulated in float32.
template <typename T>
void sum_slots(torch::Tensor x, const torch::Tensor& buffer, int64_t world,
               int64_t generation, int64_t data_offset, int64_t slot_bytes) {
  const int64_t n = x.numel();
  std::vector<const T*> parts(world);
  for (int64_t r = 0; r < world; ++r) {
    parts[r] = reinterpret_cast<const T*>(
        slot(buffer, data_offset, slot_bytes, world, generation, r));
  }
  std::vector<float> total(parts[0], parts[0] + n);
  for (int64_t r = 1; r < world; ++r) {
    const T* part = parts[r];
    for (int64_t i = 0; i < n; ++i) total[i] += static_cast<float>(part[i]);
  }
  T* out = x.data_ptr<T>();
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(total[i]);
}

// Waits up to wait_s for every rank's post of `generation`; false when it did not come.
bool reduce(torch::Tensor x, torch::Tensor buffer, int64_t world, int64_t generation,
            int64_t data_offset, int64_t slot_bytes, double wait_s) {
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(wait_s);
  for (int64_t r = 0; r < world; ++r) {
    int64_t spins = 0;
    while (__atomic_load_n(counter(buffer, r), __ATOMIC_ACQUIRE) < generation) {
      if (++spins % 1024 == 0) {
        if (std::chrono::steady_clock::now() > deadline) return false;
        if (spins > (1 << 20)) sched_yield();  // more ranks than cores: let the others run
      }
      _mm_pause();
    }
  }
  switch (x.scalar_type()) {
    case torch::kFloat:
      sum_slots<float>(x, buffer, world, generation, data_offset, slot_bytes);
      break;
    case torch::kBFloat16:
      sum_slots<at::BFloat16>(x, buffer, world, generation, data_offset, slot_bytes);
      break;
    case torch::kHalf:
      sum_slots<at::Half>(x, buffer, world, generation, data_offset, slot_bytes);
      break;
    default:
      TORCH_CHECK(false, "shm all-reduce: float32, bfloat16 or float16 only");
  }
  return true;
}

}  // namespace

TORCH_LIBRARY(pagedllm_shm, m) {
  m.def("post(Tensor x, Tensor buffer, int rank, int world, int generation, "
        "int data_offset, int slot_bytes) -> ()", &post);
  m.def("reduce(Tensor(a!) x, Tensor buffer, int world, int generation, int data_offset, "
        "int slot_bytes, float wait_s) -> bool", &reduce);
}
