// The one set of fixtures of the GPU tests: the skip rule, models, routings and per-rank test data built from
// seeds, the cases several files share (4 and 8 ranks, CUDA graphs, the fused == staged matrix, the smallest
// macrobatch ring), the same problem for the CPU reference (tests/cpu/reference_fixtures.h's Case), device
// buffers behind the public API's tensor views, a thread-per-GPU driver, the poison pattern, the one bitwise
// comparison, the one tolerance comparison (docs/design.md §6) and the FP8 error budget. The forward and
// backward drivers built on them are forward_harness.h and backward_harness.h; test_gemm.cu uses the skip
// rule, buffers, poison and the bitwise comparison alone.
//
// Test data encodes its origin: x rows differ per rank and token, so a misrouted row shows up at once.
#pragma once

#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cpu/reference_fixtures.h"
#include "pounce/pounce.h"
#include "reference/reference.h"

namespace pounce::gpu_test {

// ---- GPUs ----

int visible_gpus();
// The rank counts of `wanted` this machine has GPUs for, in order (a 4-and-8-rank test runs 4 on 4 GPUs).
std::vector<int> visible_rank_counts(std::initializer_list<int> wanted);
// "" when `needed` CUDA GPUs are visible, else why the test skips (no GPU at all, or too few).
std::string gpu_skip_reason(int needed);

#define SKIP_UNLESS_GPUS(n)                                                  \
  do {                                                                       \
    const std::string why_skipped_ = ::pounce::gpu_test::gpu_skip_reason(n); \
    if (!why_skipped_.empty()) GTEST_SKIP() << why_skipped_;                 \
  } while (0)

// Throws "<what>: <CUDA error>" (a test body reports it as a failure; a rank thread as "rank r: ...").
void cuda_ok(cudaError_t status, const char* what);
#define CUDA_OK(call) ::pounce::gpu_test::cuda_ok((call), #call)

// Sets an environment variable until the end of the scope, then restores what was there (or its absence).
// The library reads its variables once per Workspace: set them before creating one.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value);
  ~ScopedEnv();
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> saved_;
};

// The running test's name: the default label of a check's failures.
std::string current_test_name();

// ---- problem description ----

enum class Routing { kRandom, kAllToOneExpert, kFewExperts, kSparse };

struct Call {
  std::vector<int64_t> num_tokens;  // [R]
  Routing routing = Routing::kRandom;
  bool idx_int64 = false;
  uint32_t seed = 1;
  int32_t bad_id = 0;  // != 0: write this id into rank 0's topk_idx[0, 0] (out-of-range test)
};

// Calls by routing (make_rank_data), from tokens per rank and the seed of the call's data:
//   random_routing     every slot a distinct random expert, 1 in 5 slots unused (-1)
//   all_to_one_expert  slot 0 to expert 0, the other slots unused
//   few_experts        slots 0 and 1 to experts 1 and E - 1, the other slots unused
//   sparse_routing     2 in 3 slots unused
Call random_routing(std::vector<int64_t> num_tokens, uint32_t seed);
Call all_to_one_expert(std::vector<int64_t> num_tokens, uint32_t seed);
Call few_experts(std::vector<int64_t> num_tokens, uint32_t seed);
Call sparse_routing(std::vector<int64_t> num_tokens, uint32_t seed);
// `call` with topk_idx passed as int64 instead of int32.
Call with_int64_idx(Call call);

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
// `activation` with a clamp low enough that the test data reaches it (GPT-OSS's preset 7 never would).
Activation clamped(Activation activation, float limit);
std::vector<uint16_t> random_bf16(size_t count, std::mt19937& gen, float scale);
Model make_model(const Shape& shape, Activation activation, uint32_t seed);
// x[t] of rank r: random, plus an offset that names (rank, token) so misrouted rows stand out.
RankData make_rank_data(const Shape& shape, const Call& call, int rank);
// Every call's data for every rank: [call][rank].
std::vector<std::vector<RankData>> make_call_data(const Shape& shape, const std::vector<Call>& calls);

// ---- cases that several test files share ----

// Tokens per rank of a case written for one or two ranks: {rank0} or {rank0, rank1}.
std::vector<int64_t> tokens_per_rank(int num_ranks, int64_t rank0, int64_t rank1);
// The calls of the 4- and 8-rank cases, seeds first_seed, + 1, + 2: unequal T per rank with rank 0
// empty ((r * 97) % (max_tokens + 1)) and random routing; every rank full, all to one expert, int64 ids;
// `few_tokens` per rank to few experts.
std::vector<Call> many_rank_calls(int num_ranks, int64_t max_tokens, int64_t few_tokens, uint32_t first_seed);
// The calls of the CUDA graph cases on one or two ranks of max_tokens 256, seeds first_seed, + 1, + 2: the
// same tokens per rank in every call (the captured shapes: {190} or {256, 190}), new routing each call
// (random, all to one expert, sparse).
std::vector<Call> graph_calls(int num_ranks, uint32_t first_seed);
// The smallest macrobatch ring the workspace accepts: num_ranks * max_tokens rows, padded to kBlockM.
int64_t smallest_ring(const Shape& shape);

// The fused == staged matrix (docs/design.md §6): 1 and 2 ranks (as many as are visible) x both combines
// (push by the communication CTAs, scatter from the epilogues) x minibatches of one m-block (many handoffs)
// and the default. `body` gets the rank count, a Config with the combine and the minibatch set, and a label
// naming the variant.
void for_each_fused_variant(
    const std::function<void(int num_ranks, const Config& tuning, const std::string& label)>& body);

// ---- reference ----

// The CPU reference's view of one call (Numerics::kBf16, bf16 inputs converted to double, d_out included), at
// `precision` (kFP8: the reference quantizes the bf16 routed weights itself, as quantize_weights_fp8 does).
reference::testing::Case make_reference_case(const Model& m, const std::vector<RankData>& data,
                                             Precision precision = Precision::kBF16);

// ---- device buffers (on the current device) ----

// Outputs are filled with 0xFF bytes before every run: a bf16 NaN (0xFFFF) and an fp32 NaN, so an element
// a kernel failed to write can never pass for a result.
// The spacing of bf16 values around |x| (8 significant bits): the unit of the GEMM tests' tolerances.
inline float bf16_ulp(float x) {
  int e = 0;
  std::frexp(std::fabs(x), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0f, e - 8);
}

inline constexpr uint16_t kPoison = 0xFFFF;
void poison(void* ptr, size_t bytes, cudaStream_t stream);

// cudaMalloc'd room for `count` elements of T, plus 16 bytes so that an empty buffer has an address too.
// A pageable cudaMemcpy may return before its DMA lands, and kernels on a non-blocking stream do not wait
// for the legacy stream: `upload` synchronises it so that setup copies are complete before any pass.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t count_) : count(count_) { CUDA_OK(cudaMalloc(&ptr, count * sizeof(T) + 16)); }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void upload(const std::vector<T>& host) const {
    if (host.empty()) return;
    CUDA_OK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    CUDA_OK(cudaStreamSynchronize(nullptr));
  }
  void poison(cudaStream_t stream = nullptr) const { gpu_test::poison(ptr, count * sizeof(T), stream); }
};

// `count` elements at `ptr`, copied to the host (after the work that wrote them was synchronised).
template <typename T>
std::vector<T> download(const void* ptr, size_t count) {
  std::vector<T> host(count);
  if (count > 0) CUDA_OK(cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
  return host;
}

// Forward inputs and `out` at max_tokens capacity, so a captured graph sees the same addresses every call.
struct DeviceInputs {
  DeviceBuffer<uint16_t> x;     // [max_tokens, H]
  DeviceBuffer<int64_t> idx;    // [max_tokens, k], int64 capacity
  DeviceBuffer<float> weights;  // [max_tokens, k]
  DeviceBuffer<uint16_t> out;   // [max_tokens, H]
  explicit DeviceInputs(const Shape& s);
  // Stream-ordered: the copies land before later work on `stream` (and on the legacy stream when null).
  void upload(const Shape& s, const RankData& d, bool idx_int64, cudaStream_t stream);
  ForwardArgs args(const Shape& s, int64_t T, bool idx_int64, int device) const;
};

// This rank's slice of the routed weights and the shared weights, as bf16 device tensors. With
// Precision::kFP8 also the routed weights quantized on the GPU by pounce::quantize_weights_fp8 (e4m3 data
// and scales, both orientations, poisoned before), which routed_fp8 points at: ForwardArgs::routed_fp8. The
// shared expert stays BF16.
struct DeviceWeights {
  std::vector<std::unique_ptr<DeviceBuffer<uint16_t>>> buffers;
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> fp8_buffers;
  ExpertWeights routed, shared;
  Fp8Weights fp8;
  const Fp8Weights* routed_fp8 = nullptr;  // &fp8 in FP8, else null
  DeviceWeights(const Model& m, int rank, int device, Precision precision = Precision::kBF16);
  DeviceWeights(const DeviceWeights&) = delete;  // routed_fp8 points into this object
  DeviceWeights& operator=(const DeviceWeights&) = delete;
};

// ---- rank threads ----

// One thread per GPU of this process (rank r on device r) through Group::create_nccl_local; rethrows the
// first rank's exception as "rank r: ...".
void run_ranks(int num_ranks, const std::function<void(const Group& group, int rank)>& body);

// ---- checks ----

// How many elements of [begin, end) no longer hold the poison (all bytes 0xFF).
template <typename T>
int64_t count_unpoisoned(const T* begin, const T* end) {
  return std::count_if(begin, end, [](const T& v) {
    T poisoned;
    std::memset(&poisoned, 0xFF, sizeof(T));
    return std::memcmp(&v, &poisoned, sizeof(T)) != 0;
  });
}

// The one bitwise comparison (determinism, fused == staged, exact expectations): "" when `a` and `b` hold
// the same bytes, NaNs included, else "<name>: ..." naming the sizes or the first differing element and
// both values' bits.
std::string bitwise_difference(const std::string& name, const void* a, size_t a_count, const void* b,
                               size_t b_count, size_t element_bytes);
template <typename T>
std::string bitwise_difference(const std::string& name, const std::vector<T>& a, const std::vector<T>& b) {
  return bitwise_difference(name, a.data(), a.size(), b.data(), b.size(), sizeof(T));
}
template <typename T>
bool same_bits(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// The one tolerance comparison, docs/design.md §6 per tensor: max|gpu - ref64| <= 2 * max|ref_bf16 - ref64| +
// atol, i.e. the GPU is no further from the exact answer than twice the bf16 reference's own rounding noise
// (accumulation order differs, so an element may sit an ulp or a flipped rounding away from ref_bf16).
// atol = 1e-6 * max|ref64| + extra_atol. `dims` name the coordinates of a failure. Returns "" on success,
// else the first coordinate beyond the bound with all three values. `noise_factor` replaces the 2 (see
// noise_factor_for).
std::string compare_close(const std::string& name, const std::vector<int64_t>& dims,
                          const std::vector<double>& gpu, const std::vector<double>& ref,
                          const std::vector<double>& ref64, const std::vector<bool>* mask = nullptr,
                          double extra_atol = 0, double noise_factor = 2);
// The factor of compare_close's noise bound per precision: 2 in BF16; 4 in FP8, where a one-ulp difference
// in g, u or d_g (accumulation order) can flip an e4m3 rounding of the next GEMM's operand, a step of 1/16
// to 1/8 of the value, so the largest noise of two independent evaluations differs more than in BF16 (seen
// on H200: d_topk_weights 2.3 x the reference pair's noise, with every other tensor within 2 x).
inline double noise_factor_for(Precision precision) {
  return precision == Precision::kFP8 ? 4.0 : 2.0;
}
// The FP8 error budget (docs/design.md §1 "FP8 mode"): the FP8 layer against the BF16 layer on the same
// inputs, per tensor ||gpu - bf16|| / ||bf16|| <= 0.1 and, for a gradient, cosine similarity >= 0.996.
// `bf16` is the reference at Precision::kBF16; `mask` selects the elements that count (used y slots). A
// tensor the BF16 layer leaves all zero must be all zero. Returns "" on success, else both figures.
inline constexpr double kFp8MaxRelativeError = 0.1;
inline constexpr double kFp8MinCosine = 0.996;
std::string fp8_budget_difference(const std::string& name, const std::vector<double>& gpu,
                                  const std::vector<double>& bf16, bool gradient,
                                  const std::vector<bool>* mask = nullptr);
// "[i, j, k]" of flat index `index` in a row-major tensor of shape `dims`.
std::string coordinate(const std::vector<int64_t>& dims, int64_t index);

}  // namespace pounce::gpu_test
