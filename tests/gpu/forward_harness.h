// The forward driver and checks the forward test files share (test_forward.cpp, test_fused_forward.cpp,
// test_macrobatch_ring.cpp, test_faults.cpp, test_process_group.cpp).
//
// Every call goes through the public API (Workspace, pounce::forward, recompute_forward_context), one thread
// per GPU. Each call runs twice with `out` poisoned before each run; the two results must be bitwise equal.
// recompute_forward_context must then rebuild every used y slot bitwise (the slots poisoned first) and leave
// `out` alone. Checked against reference::forward (Numerics::kBf16, inputs converted from bf16 to double):
//   - the receive schedule rows, segment offsets and segment rows read back from the workspace equal
//     reference::build_schedule exactly;
//   - y per (token, used slot) and out within rounding-order noise (docs/design.md §6): max|gpu - ref64| <=
//     2 * max|ref_bf16 - ref64| + atol per tensor (GEMM accumulation order differs from the reference's).
// At Precision::kFP8 (the Config's precision: the routed weights are also quantized on the GPU and passed as
// ForwardArgs::routed_fp8) the reference is the FP8 layer, ref64 its kFp64 twin (same quantization points),
// and y and out must also be within the FP8 error budget of the BF16 reference (fp8_budget_difference).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {

// One rank's outputs of one call.
struct ForwardResult {
  std::vector<uint16_t> out[2];       // [T, H] per run
  std::vector<uint16_t> y_slots;      // [T, k, H], second run
  std::vector<int32_t> schedule;      // [rows][4]
  std::vector<int32_t> group_offset;  // [El + 1]
  std::vector<int32_t> group_rows;    // [El]
  std::string error;                  // check_device_errors / exception text ("" = none)
};
using ForwardResults = std::vector<std::vector<ForwardResult>>;  // [call][rank]

// How each rank drives its calls: eager twice (Config's kernel path, the fused kernel by default), a
// captured CUDA graph then eager, or the staged chain then the fused kernel (check_forward_call then demands
// fused == staged bitwise, docs/design.md §6).
enum class ForwardMode { kEagerTwice, kGraphVsEager, kStagedVsFused };

// One rank's share of `calls` on `device` through `group`; fills results[call][rank]. `tuning`: the Config
// fields a test varies (minibatch, macrobatch, combine); the activation is the model's. Throws on failure.
void run_forward_rank(const Model& m, const std::vector<std::vector<RankData>>& data,
                      const std::vector<Call>& calls, ForwardMode mode, const Group& group, int rank,
                      int device, ForwardResults& results, const Config& tuning);

// Runs `calls` on R GPUs of this process, one thread each.
ForwardResults run_forward(const Model& m, const std::vector<std::vector<RankData>>& data,
                           const std::vector<Call>& calls, ForwardMode mode, const Config& tuning = {});

// The file comment's checks of one call. `only_rank` >= 0: this process ran that rank alone (one process per
// GPU); the others are not checked. `precision`: the workspaces' Config::precision.
void check_forward_call(const Model& m, const Call& call, const std::vector<RankData>& data,
                        const std::vector<ForwardResult>& results, const std::string& label,
                        int only_rank = -1, Precision precision = Precision::kBF16);

// Builds the calls' data, runs them and checks every call (at tuning.precision); `name` labels the failures.
// Returns the results, for comparisons between runs.
ForwardResults check_forward(const Model& m, const std::vector<Call>& calls, ForwardMode mode,
                             const std::string& name = current_test_name(), const Config& tuning = {});

// Two runs of the same calls (another kernel path, another config) gave bitwise the same out and y slots.
void expect_same_forward(const ForwardResults& a, const ForwardResults& b, const std::string& name);

}  // namespace pounce::gpu_test
