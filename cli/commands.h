// The subcommands of the `pounce` tool; each returns the process exit code.
//   0 success, 1 a correctness check failed, 2 an error (pounce::Error, no GPU for `bench`).
#pragma once

#include <string>
#include <vector>

#include "cli/plan.h"
#include "cli/run_setup.h"

namespace pounce::cli {

int run_command(const RunOptions& options);

struct InfoOptions {
  std::string json;  // "" = none, "-" = stdout
};
int info_command(const InfoOptions& options);

struct BenchOptions {
  std::vector<std::string> presets = {"qwen3-30b-a3b", "deepseek-v3", "gpt-oss-120b", "mixtral-8x7b"};
  std::vector<int64_t> tokens = {4096, 8192};
  std::vector<std::string> impls = {"fused"};
  int64_t macrobatch =
      0;  // rows of the routed activation ring: 0 = the worst case, -1 = the smallest (R x T)
  std::vector<std::string> passes = {"all"};  // forward | backward | forward_backward | all
  std::string precision = "bf16";  // bf16 | fp8 (fp8 also measures the BF16 layer, for speedup_vs_bf16)
  std::string backend = "auto";    // auto (= gpu) | gpu | cpu (tests the tool; no baseline)
  int ranks = 0;                   // 0 = every visible GPU (2 on the CPU backend)
  int input_sets = 0;              // rotated input sets; 0 = enough to exceed twice the L2
  int warmup = 3;
  int iters = 20;
  uint64_t seed = 2026;
  bool no_baseline = false;
  std::vector<std::string> peers;  // liger | transformers | floor | all | none, beside the baseline
  std::string torchrun = "torchrun";
  std::string baseline_script = "bench/baselines/torch_moe.py";
  std::string plot_script = "bench/plot_results.py";  // "" = no chart
  std::string python = "python3";
  std::string name;  // results file stem; "" = pounce-bench-<UTC date>
  std::string out;   // "" = $TMPDIR/<name>.json; "DIR/" = record into DIR (--record: bench/results/)
};
int bench_command(const BenchOptions& options, const std::string& command_line);
// Records the measured records of a finished run's file (one fetched from a GPU machine) into `dir`.
int record_command(const std::string& run_file, const std::string& dir);

// `pounce plan`: the cost model, its validation and the internode simulation (cli/plan.h).
int plan_command(const PlanCommandOptions& options);

}  // namespace pounce::cli
