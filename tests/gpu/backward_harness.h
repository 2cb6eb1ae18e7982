// The backward driver and checks the backward test files share (test_backward.cpp, test_fused_backward.cpp,
// test_macrobatch_ring.cpp, test_faults.cpp).
//
// Every call goes through the public API (Workspace, pounce::forward, backward, recompute_forward_context),
// one thread per GPU, every rank running the same steps in lockstep. Per call:
//   forward; backward into fp32 weight gradients    -> checked against the reference (below)
//   backward again on the same context               -> bitwise equal: backward leaves the context alone
//   backward into bf16 weight gradients              -> d_x, d_topk_weights bitwise equal; weights exactly
//                                                       bf16(the fp32 run's), and within tolerance
//   backward adding into random fp32 main_grad       -> weights exactly fp32(prefill + the fp32 run's)
//   forward again; backward                          -> bitwise equal (determinism), out bitwise equal
//   forward of other routing; recompute_forward_context; backward -> bitwise equal (checkpointing)
//   [graph cases] forward + backward captured once in a CUDA graph, replayed with each call's inputs
//                 copied into the captured buffers   -> bitwise equal to eager
// Before each run every output is poisoned (gpu_fixtures.h) at max_tokens capacity; d_x and d_topk_weights
// rows at or beyond T must keep the poison.
// Reference (Numerics::kBf16 rounding points; Numerics::kFp64 the exact answer), docs/design.md §6 per
// tensor: max|gpu - ref64| <= 2 * max|ref_bf16 - ref64| + atol for d_x, d_topk_weights (fp32 values), each
// local expert's d_routed.{gate,up,down} and d_shared.{gate,up,down}. Exact: an unused slot's d_topk_weights
// is 0; an expert without rows (and the shared expert of a rank without tokens) gets exact zeros, and nothing
// is added to main_grad.
// At Precision::kFP8 (Config::precision: the routed weights are also quantized on the GPU and passed as
// ForwardArgs::routed_fp8) the reference is the FP8 layer, ref64 its kFp64 twin (same quantization points),
// and the fp32 run's d_x, d_topk_weights and every rank's weight gradients must also be within the FP8 error
// budget of the BF16 reference (fp8_budget_difference).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {

enum class GradMode { kStoreF32, kStoreBf16, kAccumulateF32 };

// The outputs of one backward run, in this order everywhere: d_x, d_topk_weights, then the weight gradients.
inline constexpr int kNumOutputs = 8;
inline constexpr int kFirstWeightGrad = 2;
inline constexpr int kNumWeightGrads = kNumOutputs - kFirstWeightGrad;
extern const char* const kOutputNames[kNumOutputs];  // "d_x", "d_topk_weights", "d_routed.gate", ...

// One run's outputs as raw bytes (T rows of d_x and d_topk_weights), so equality is bitwise even for NaNs.
struct Snapshot {
  std::vector<std::vector<uint8_t>> outputs;  // [kNumOutputs]
  std::vector<size_t> element_bytes;          // [kNumOutputs]
  bool tail_poisoned = true;                  // d_x and d_topk_weights rows >= T still hold the poison
};
// "" when `a` and `b` are bitwise equal, else the first output and element that differ.
std::string snapshot_difference(const Snapshot& a, const Snapshot& b);

// d_out and every backward output of one rank at max_tokens capacity, at fixed addresses (a captured graph
// replays with them). d_x and d_topk_weights have one buffer for every mode; the weight gradients one in fp32
// (store and accumulate runs) and one in bf16.
class DeviceBackward {
 public:
  DeviceBackward(const Shape& s, int device);
  void upload_d_out(const std::vector<uint16_t>& d_out, cudaStream_t stream);
  // Poisons every output of `mode`; when accumulating, the weight gradients start from `prefill` instead.
  void prepare(GradMode mode, const std::vector<std::vector<float>>& prefill, cudaStream_t stream);
  BackwardArgs args(const ForwardArgs& inputs, int64_t T, GradMode mode) const;
  // Reads the outputs of `mode` after the stream was synchronised.
  Snapshot read(GradMode mode, int64_t T) const;

 private:
  static int slot(int output, GradMode mode) {
    return output >= kFirstWeightGrad && mode == GradMode::kStoreBf16 ? 1 : 0;
  }
  void* buffer(int output, int slot) const {
    return buffers_[output][slot] ? buffers_[output][slot]->ptr : nullptr;
  }

  Shape shape_;
  int device_;
  DeviceBuffer<uint16_t> d_out_;
  std::optional<DeviceBuffer<uint8_t>> buffers_[kNumOutputs][2];  // [output][slot]
};

struct BackwardResult {
  std::string error;             // the first unexpected failure ("" = none)
  int64_t routing_errors = 0;    // "topk_idx value out of range" reports (expected on a bad-id call only)
  std::vector<uint16_t> out[2];  // forward outputs: first and repeated forward
  std::vector<std::pair<std::string, Snapshot>> fp32_runs;  // every fp32 run, labelled
  Snapshot bf16_run, accumulate_run;
  std::vector<std::vector<float>> prefill;  // [kNumWeightGrads] what the accumulate run added into
};
using BackwardResults = std::vector<std::vector<BackwardResult>>;  // [call][rank]

// Runs `calls` (the file comment's steps; `graph` adds the CUDA graph replay) and checks every call against
// the reference at config.precision; `name` labels the failures. `config`'s activation is the model's.
BackwardResults check_backward(const Model& m, const std::vector<Call>& calls, bool graph = false,
                               const std::string& name = current_test_name(), Config config = {});

// Two runs of the same calls (another path, another config) gave bitwise the same forward outputs and every
// gradient: each fp32 run, the bf16 and the accumulate run.
void expect_same_backward(const BackwardResults& a, const BackwardResults& b, const std::string& name);

}  // namespace pounce::gpu_test
