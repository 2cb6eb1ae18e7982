// What `pounce run` does, decided from its options before anything runs: the backend (and why), the
// shape, the number of ranks and iterations. Pure functions of the options and the machine facts passed
// in, so the decisions are unit-tested without a GPU.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "pounce/config.h"
#include "pounce/shape.h"

namespace pounce::cli {

struct RunOptions {
  std::string preset;  // "" = custom shape or the backend's default
  std::optional<int64_t> hidden, intermediate, experts, topk, shared_intermediate;
  std::optional<int64_t> tokens;  // per rank
  std::optional<int> ranks;
  std::string activation;  // "" = the preset's, else swiglu | gpt-oss
  std::optional<float> clamp;
  std::string backend = "auto";
  uint64_t seed = 2026;
  std::optional<int> iters;
  int comm_sms = 0;
  int64_t minibatch = 0;
  int64_t macrobatch = 0;
  std::string kernel = "fused";          // fused | staged | auto (GPU forward)
  std::string backward_kernel = "auto";  // auto | fused | staged (GPU backward)
  std::string combine = "auto";          // auto | push | scatter (the fused kernels' combine)
  std::optional<int64_t> check_tokens;   // per rank; 0 = all
  int64_t check_experts = 2;             // per rank
  int64_t check_rows = 4;                // per sampled expert
  double tolerance = 2e-2;
  std::string wgrad_dtype = "fp32";
  std::string precision = "bf16";  // bf16 | fp8 (the routed experts in block-scaled E4M3)
  bool biases = false;  // routed expert biases b_gate, b_up, b_down and their gradients (CPU backend only)
  std::string json;     // "" = none, "-" = stdout
};

// Machine facts the choice depends on.
struct Machine {
  bool cuda_compiled = false;
  int num_gpus = 0;
};
Machine probe_machine();

struct BackendChoice {
  Backend backend = Backend::kCpu;
  std::string reason;  // one sentence: why this backend
};
// auto -> gpu when CUDA is compiled in and a GPU is visible, else cpu. Throws pounce::Error when gpu is
// requested but impossible, or `requested` is not auto|cpu|gpu.
BackendChoice choose_backend(const std::string& requested, const Machine& machine);

// The CPU backend's default problem when neither a preset nor a shape is given: on a machine without a GPU,
// `pounce run` runs the CPU reference at a small size (and says so).
inline constexpr Shape kCpuDefaultShape = {256, 512, 256, 16, 4, 256, 2};
inline constexpr int64_t kCpuPresetTokens = 16;  // a preset on the CPU keeps its dims, not its batch
inline constexpr const char* kGpuDefaultPreset = "qwen3-30b-a3b";
inline constexpr int64_t kGpuDefaultTokens = 4096;

struct RunSetup {
  std::string preset;  // the preset's name, or "custom"
  Shape shape;         // max_tokens = tokens per rank, num_ranks = R
  Config config;
  BackendChoice backend;
  int warmup = 0;            // untimed runs before the timed ones (GPU: 1, the checked run)
  int iters = 1;             // timed runs, median reported
  int64_t check_tokens = 0;  // sampled tokens per rank for the fp64 check (0 = all)
  bool wgrad_fp32 = true;
};

// Applies the defaults of the chosen backend and validates shape and config (pounce::Error on bad input).
RunSetup resolve_run(const RunOptions& options, const BackendChoice& backend, const Machine& machine);

// "bf16" | "fp8" as Config::precision; throws pounce::Error naming --precision and the choices otherwise.
Precision parse_precision(const std::string& name);

Activation parse_activation(const std::string& name, std::optional<float> clamp, const Activation& fallback);
std::string describe_activation(const Activation& activation);

// Sampled tokens per rank of the check on GPUs (the default of --check-tokens there): a cost budget in
// multiply-adds over this machine's cores, between 8 and 64.
int64_t default_check_tokens(const Shape& shape);

// Host memory the CPU backend needs for `shape` (inputs, gradients, the reference's fp64 copies), bytes.
double estimate_cpu_bytes(const Shape& shape);
// Throws pounce::Error when that exceeds 85% of this machine's memory (instead of being killed mid-run).
// `who` names what needs it and `otherwise` the other fix.
void check_cpu_memory(const Shape& shape, const std::string& who = "the CPU backend",
                      const std::string& otherwise = "or run on a GPU machine");
// The same for `need` bytes (e.g. the CPU reference that checks `pounce run --precision fp8`:
// cli/reference_check.h estimate_reference_check_bytes).
void check_cpu_memory(double need, const Shape& shape, const std::string& who, const std::string& otherwise);

}  // namespace pounce::cli
