// Shared fixtures of the staged GPU tests (test_staged_forward.cpp, test_staged_backward.cpp): the model
// and per-rank test data built from a seed, the same problem for the CPU reference, device buffers behind
// the public API's tensor views, a thread-per-GPU driver, and the docs/design.md §6 comparison.
//
// Test data encodes its origin: x rows differ per rank and token, so a misrouted row shows up at once.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "pounce/pounce.h"
#include "reference/reference.h"

namespace pounce::staged_test {

inline constexpr uint16_t kPoison = 0xFFFF;  // a bf16 NaN; memset 0xFF gives an fp32 NaN too

int visible_gpus();

#define SKIP_UNLESS_GPUS(n)                                                                                  \
  do {                                                                                                       \
    const int gpus_ = ::pounce::staged_test::visible_gpus();                                                 \
    if (gpus_ == 0) GTEST_SKIP() << "no CUDA GPU visible (cudaGetDeviceCount found none): GPU test skipped"; \
    if (gpus_ < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, " << gpus_ << " visible: skipped";           \
  } while (0)

void cuda_ok(cudaError_t status, const char* what);
#define CUDA_OK(call) ::pounce::staged_test::cuda_ok((call), #call)

// ---- problem description ----

enum class Routing { kRandom, kAllToOneExpert, kFewExperts, kSparse };

struct Call {
  std::vector<int64_t> num_tokens;  // [R]
  Routing routing = Routing::kRandom;
  bool idx_int64 = false;
  uint32_t seed = 1;
  int32_t bad_id = 0;  // != 0: write this id into rank 0's topk_idx[0, 0] (out-of-range test)
};

struct RankData {
  std::vector<uint16_t> x;          // [T, H] bf16
  std::vector<int32_t> topk_idx;    // [T, k]
  std::vector<float> topk_weights;  // [T, k]
  std::vector<uint16_t> d_out;      // [T, H] bf16, backward only (its own generator: x etc. do not move)
};

struct Model {
  Shape shape;
  Activation activation;
  std::vector<uint16_t> gate, up, down;  // routed, global [E, I, H], [E, I, H], [E, H, I]
  std::vector<uint16_t> shared_gate, shared_up, shared_down;  // [Is, H], [Is, H], [H, Is]
};

Shape make_shape(int64_t max_tokens, int64_t H, int64_t I, int64_t E, int64_t k, int64_t Is, int64_t R);
std::vector<uint16_t> random_bf16(size_t count, std::mt19937& gen, float scale);
Model make_model(const Shape& shape, Activation activation, uint32_t seed);
// x[t] of rank r: random, plus an offset that names (rank, token) so misrouted rows stand out.
RankData make_rank_data(const Shape& shape, const Call& call, int rank);
// Every call's data for every rank: [call][rank].
std::vector<std::vector<RankData>> make_call_data(const Shape& shape, const std::vector<Call>& calls);

// ---- reference ----

// The CPU reference's view of one call (Numerics::kBf16, bf16 inputs converted to double, d_out included).
struct ReferenceCase {
  reference::Problem problem;
  std::vector<reference::RankInputs> ranks;  // [R]
  std::vector<reference::Weights> routed;    // [R], each rank's local experts
  reference::Weights shared;
};
ReferenceCase make_reference_case(const Model& m, const std::vector<RankData>& data);

// ---- device buffers (allocated on the current device) ----

// A pageable cudaMemcpy may return before its DMA lands, and kernels on a non-blocking stream do not wait
// for the legacy stream: synchronise it so that setup copies are complete before any pass.
template <typename T>
T* device_copy(const std::vector<T>& host, size_t capacity) {
  T* ptr = nullptr;
  CUDA_OK(cudaMalloc(&ptr, std::max<size_t>(capacity, 1) * sizeof(T)));
  if (!host.empty()) {
    CUDA_OK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    CUDA_OK(cudaStreamSynchronize(nullptr));
  }
  return ptr;
}

// Forward inputs and `out` at max_tokens capacity, so a captured graph sees the same addresses every call.
struct DeviceInputs {
  void* x = nullptr;
  void* idx = nullptr;  // int64 capacity
  float* weights = nullptr;
  void* out = nullptr;
  explicit DeviceInputs(const Shape& s);
  ~DeviceInputs();
  DeviceInputs(const DeviceInputs&) = delete;
  DeviceInputs& operator=(const DeviceInputs&) = delete;
  // Stream-ordered: the copies land before later work on `stream` (and on the legacy stream when null).
  void upload(const Shape& s, const RankData& d, bool idx_int64, cudaStream_t stream);
  ForwardArgs args(const Shape& s, int64_t T, bool idx_int64, int device) const;
};

// This rank's slice of the routed weights and the shared weights, as bf16 device tensors.
struct DeviceWeights {
  std::vector<void*> buffers;
  ExpertWeights routed, shared;
  DeviceWeights(const Model& m, int rank, int device);
  ~DeviceWeights();
  DeviceWeights(const DeviceWeights&) = delete;
  DeviceWeights& operator=(const DeviceWeights&) = delete;
};

// One thread per GPU of this process (rank r on device r) through Group::create_nccl_local; rethrows the
// first rank's exception as "rank r: ...".
void run_ranks(int num_ranks, const std::function<void(const Group& group, int rank)>& body);

// ---- checks ----

// docs/design.md §6 per tensor: max|gpu - ref64| <= 2 * max|ref_bf16 - ref64| + atol, i.e. the GPU is no further
// from the exact answer than twice the bf16 reference's own rounding noise (accumulation order differs, so
// an element may sit an ulp or a flipped rounding away from ref_bf16). atol = 1e-6 * max|ref64| + extra_atol.
// `dims` name the coordinates of a failure. Returns "" on success, else the first coordinate beyond the
// bound with all three values.
std::string compare_close(const std::string& name, const std::vector<int64_t>& dims,
                          const std::vector<double>& gpu, const std::vector<double>& ref,
                          const std::vector<double>& ref64, const std::vector<bool>* mask = nullptr,
                          double extra_atol = 0);
// "[i, j, k]" of flat index `index` in a row-major tensor of shape `dims`.
std::string coordinate(const std::vector<int64_t>& dims, int64_t index);

}  // namespace pounce::staged_test
