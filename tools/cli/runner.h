// Runs one MoE layer forward + backward through the public API (pounce::Group, Workspace, forward,
// backward) on every rank of a group, one std::thread per rank, and brings back timings and the values the
// fp64 check needs.
//
// Per rank:  poison outputs -> [forward, backward] x (warmup + iters) -> gather run 0's outputs at the
// check plan's coordinates -> poison again before the last run and compare it bitwise with run 0.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "pounce/config.h"
#include "tools/cli/dense_check.h"
#include "tools/cli/inputs.h"
#include "tools/cli/progress.h"

namespace pounce::cli {

struct RunRequest {
  const HostProblem* problem = nullptr;
  Config config;
  int warmup = 0;                   // untimed runs first (run 0 is always the checked one)
  int iters = 1;                    // timed runs
  const CheckPlan* plan = nullptr;  // null: time only
  bool wgrad_fp32 = true;           // weight gradients in fp32 (else bf16)
  bool run_backward = true;
  Progress* progress = nullptr;
};

struct RunOutcome {
  std::string device;               // what ran it, e.g. "2 x NVIDIA H200" or "CPU reference backend"
  std::vector<double> forward_ms;   // per timed run: the maximum over ranks
  std::vector<double> backward_ms;  // empty when backward did not run
  bool backward_ran = false;
  std::string backward_error;                // why backward did not run (e.g. not implemented yet on GPUs)
  SampledTensors observed;                   // run 0's outputs at the plan's coordinates, ranks concatenated
  std::optional<bool> repeat_bitwise_equal;  // last run == run 0 (out, d_x, d_topk_weights); none for 1 run
};

RunOutcome run_on_cpu(const RunRequest& request);
// Throws pounce::Error when this build has no CUDA device code.
RunOutcome run_on_gpu(const RunRequest& request);

// ---- the per-rank driver shared by both backends -------------------------------------------------------

// One rank's buffers and calls on one backend.
class RankRunner {
 public:
  virtual ~RankRunner() = default;
  virtual void poison() = 0;      // NaN (0xFF bytes) into every output
  virtual double forward() = 0;   // milliseconds
  virtual double backward() = 0;  // milliseconds
  // Readers over this rank's outputs (host copies); backward fields only when `with_backward`.
  virtual RankOutputs outputs(const CheckPlan& plan, bool with_backward) = 0;
  // The bytes of out (and d_x, d_topk_weights when `with_backward`), for the bitwise repeat check.
  virtual std::vector<uint8_t> snapshot(bool with_backward) = 0;
};

struct RankResult {
  std::vector<double> forward_ms, backward_ms;
  bool backward_ran = false;
  std::string backward_error;
  SampledTensors observed;
  std::optional<bool> repeat_bitwise_equal;
};

RankResult drive_rank(RankRunner& runner, const RunRequest& request, int rank);
// Per-iteration maximum over ranks; the first rank's backward error; ranks' samples concatenated.
RunOutcome combine(std::vector<RankResult> results);

// Runs `make_runner(rank)` + drive_rank on one thread per rank, rethrows the first rank's failure, and
// combines the results.
RunOutcome run_ranks(int num_ranks, const RunRequest& request,
                     const std::function<std::unique_ptr<RankRunner>(int rank)>& make_runner);

}  // namespace pounce::cli
