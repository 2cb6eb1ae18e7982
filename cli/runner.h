// Runs one MoE layer forward + backward through the public API (pounce::Group, Workspace, forward,
// backward) on every rank of a group, one std::thread per rank, and brings back timings and the values the
// fp64 check needs.
//
// Per rank:  poison outputs -> [forward, backward] x (warmup + iters), run i on input set i % N -> gather
// run 0's outputs at the check plan's coordinates -> poison again before the last run and compare it
// bitwise with the first run on the same input set (run 0 when N = 1).
#pragma once

#include <array>
#include <barrier>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pounce/config.h"
#include "pounce/fp8.h"
#include "pounce/layer.h"
#include "cli/dense_check.h"
#include "cli/inputs.h"
#include "cli/progress.h"

namespace pounce::cli {

struct RunRequest {
  const HostProblem* problem = nullptr;
  Config config;   // precision kFP8: the runners quantize the routed weights once, before the runs
  int warmup = 0;  // untimed runs first (run 0 is always the checked one)
  int iters = 1;   // timed runs
  const CheckPlan* plan = nullptr;  // null: time only
  bool wgrad_fp32 = true;           // weight gradients in fp32 (else bf16)
  bool run_backward = true;
  Progress* progress = nullptr;
  // Input sets rotated over the runs (run i uses set i % num_input_sets), so that L2 does not keep one
  // run's x, topk_idx, topk_weights and d_out for the next (docs/design.md §7). Set 0 is the problem as
  // generated (the one the check plan reads); set s holds the same tokens shifted by input_set_shift rows,
  // so every set routes the same pairs, at its own addresses.
  int num_input_sets = 1;
};

struct RunOutcome {
  std::string device;                       // what ran it, e.g. "2 x NVIDIA H200" or "CPU reference backend"
  std::vector<double> forward_ms;           // per timed run: the maximum over ranks
  std::vector<double> backward_ms;          // empty when backward did not run
  std::vector<double> forward_backward_ms;  // per timed run: the maximum over ranks of forward + backward
  bool backward_ran = false;
  std::string backward_error;  // why backward did not run (e.g. not implemented yet on GPUs)
  SampledTensors observed;     // run 0's outputs at the plan's coordinates, ranks concatenated
  // The last run == the first run on the same input set (out, d_x, d_topk_weights); none when no earlier
  // run used that set (e.g. a single run).
  std::optional<bool> repeat_bitwise_equal;
  // FP8: the one quantize_weights_fp8 call of each rank, before (outside) the timed runs, the slowest rank.
  std::optional<double> weight_quantize_ms;
};

// Input set `set_idx` of `num_sets` starts at this token of set 0: its row t is row (t + shift) % T of
// set 0 (t < T = num_tokens).
int64_t input_set_shift(int64_t num_tokens, int set_idx, int num_sets);

RunOutcome run_on_cpu(const RunRequest& request);
// Throws pounce::Error when this build has no CUDA device code.
RunOutcome run_on_gpu(const RunRequest& request);

// ---- the per-rank driver shared by both backends -------------------------------------------------------

// Where one rank's tensors live (host or device memory); the shared ones are read only when the shape has a
// shared expert.
struct RankBuffers {
  void *x, *topk_idx, *topk_weights, *d_out;  // inputs of input set 0
  void* routed[3];                            // gate, up, down
  void* shared[3];
  void *out, *d_x, *d_topk_weights;
  void* d_routed[3];
  void* d_shared[3];
};

// The layer call's views over `buffers`: x, out, d_out, d_x [T, H] bf16; topk_idx [T, k] int32;
// topk_weights, d_topk_weights [T, k] fp32; weights bf16 and their gradients `wgrad`, routed [El, I, H] x2 +
// [El, H, I], shared [Is, H] x2 + [H, Is].
BackwardArgs rank_views(const Shape& shape, int64_t num_tokens, const RankBuffers& buffers, DType wgrad,
                        DeviceKind device = DeviceKind::kCpu, int device_idx = 0);

// One rank's FP8 routed weights (include/pounce/fp8.h) in the order gate, up, down, gate_t, up_t, down_t:
// data [El, N, K] e4m3 bytes, scale [El, ceil(N / 128), ceil(K / 128)] fp32.
struct Fp8Extents {
  std::vector<int64_t> data, scale;
};
inline constexpr int kNumFp8Tensors = 6;
std::array<Fp8Extents, kNumFp8Tensors> fp8_weight_extents(const Shape& shape);
int64_t numel_of(const std::vector<int64_t>& extents);
// The views quantize_weights_fp8 writes and ForwardArgs::routed_fp8 reads, over memory sized as above.
Fp8Weights fp8_weight_views(const Shape& shape, void* const (&data)[kNumFp8Tensors],
                            void* const (&scale)[kNumFp8Tensors], DeviceKind device = DeviceKind::kCpu,
                            int device_idx = 0);

// One input set's token tensors (RunRequest::num_input_sets).
struct InputSetData {
  void *x, *topk_idx, *topk_weights, *d_out;
};
// Points `args` at `sets[set_idx]` (sets[0] is the problem as generated); throws when there is no such set.
void bind_input_set(BackwardArgs& args, const std::vector<InputSetData>& sets, int set_idx);

// One rank's buffers and calls on one backend.
class RankRunner {
 public:
  virtual ~RankRunner() = default;
  virtual void poison() = 0;      // NaN (0xFF bytes) into every output
  virtual double forward() = 0;   // milliseconds
  virtual double backward() = 0;  // milliseconds
  // Binds input set `set_idx` (RunRequest::num_input_sets) for the next calls; runners without rotation
  // accept only set 0.
  virtual void use_input_set(int set_idx);
  // Readers over this rank's outputs (host copies); backward fields only when `with_backward`.
  virtual RankOutputs outputs(const CheckPlan& plan, bool with_backward) = 0;
  // The bytes of out (and d_x, d_topk_weights when `with_backward`), for the bitwise repeat check.
  virtual std::vector<uint8_t> snapshot(bool with_backward) = 0;
  // FP8: how long the runner's one quantize_weights_fp8 took (none in BF16).
  virtual std::optional<double> weight_quantize_ms() const { return std::nullopt; }
};

struct RankResult {
  std::vector<double> forward_ms, backward_ms;
  bool backward_ran = false;
  std::string backward_error;
  SampledTensors observed;
  std::optional<bool> repeat_bitwise_equal;
  std::optional<double> weight_quantize_ms;
};

// With `align`, the ranks' threads meet there before every timed call, so no rank's call starts (and waits
// inside the layer for its peers) while another rank is still busy on the host.
RankResult drive_rank(RankRunner& runner, const RunRequest& request, int rank,
                      std::barrier<>* align = nullptr);
// Per-iteration maximum over ranks (forward, backward, and their sum), and of the weight quantization; the
// first rank's backward error; ranks' samples concatenated.
RunOutcome combine(std::vector<RankResult> results);

// Runs `make_runner(rank)` + drive_rank on one thread per rank (aligned before every timed call), rethrows
// the first rank's failure, and combines the results.
RunOutcome run_ranks(int num_ranks, const RunRequest& request,
                     const std::function<std::unique_ptr<RankRunner>(int rank)>& make_runner);

}  // namespace pounce::cli
