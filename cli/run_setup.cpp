#include "cli/run_setup.h"

#include <unistd.h>

#include <algorithm>
#include <sstream>
#include <thread>

#include "pounce/error.h"
#include "pounce/version.h"
#include "src/gpu_backend.h"

namespace pounce::cli {

// A cost budget in multiply-adds: the check's per-token work over half the cores, 4e9 each.
int64_t default_check_tokens(const Shape& s) {
  const double per_token = 6.0 * static_cast<double>(s.hidden) *
                           static_cast<double>(s.num_topk * s.intermediate + s.shared_intermediate);
  const double budget = 4e9 * std::max(1u, std::thread::hardware_concurrency() / 2);
  const int64_t fit = static_cast<int64_t>(budget / (per_token * static_cast<double>(s.num_ranks)));
  return std::clamp<int64_t>(fit, 8, 64);
}

namespace {

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page_size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page_size > 0 ? static_cast<double>(pages) * static_cast<double>(page_size) : 0.0;
}

}  // namespace

Machine probe_machine() {
  Machine machine;
  machine.cuda_compiled = build_info().cuda;
  machine.num_gpus = machine.cuda_compiled ? gpu::device_count() : 0;
  return machine;
}

BackendChoice choose_backend(const std::string& requested, const Machine& machine) {
  POUNCE_CHECK(requested == "auto" || requested == "cpu" || requested == "gpu", "--backend ", requested,
               " is unknown; choose auto, cpu or gpu");
  if (requested == "cpu") return {Backend::kCpu, "--backend cpu was requested"};
  const bool gpu_possible = machine.cuda_compiled && machine.num_gpus > 0;
  if (requested == "gpu") {
    POUNCE_CHECK(machine.cuda_compiled, "--backend gpu, but this build of Pounce has no CUDA device code; ",
                 "rebuild with the CUDA toolkit installed, or use --backend cpu");
    POUNCE_CHECK(machine.num_gpus > 0, "--backend gpu, but no CUDA GPU is visible (no driver, or ",
                 "CUDA_VISIBLE_DEVICES hides them); use --backend cpu");
  }
  if (gpu_possible) {
    return {Backend::kGpu, std::to_string(machine.num_gpus) + " CUDA GPU" +
                               (machine.num_gpus > 1 ? "s" : "") +
                               " visible and the build has CUDA device code"};
  }
  if (!machine.cuda_compiled)
    return {Backend::kCpu, "this build has no CUDA device code: nvcc was not found when it was configured"};
  return {Backend::kCpu, "no CUDA GPU is visible (no driver, or CUDA_VISIBLE_DEVICES hides them)"};
}

KernelPath parse_kernel_path(const std::string& name, const char* option) {
  if (name == "fused") return KernelPath::kFused;
  if (name == "staged") return KernelPath::kStaged;
  POUNCE_CHECK(name == "auto", option, " ", name, " is unknown; choose auto, fused or staged");
  return KernelPath::kAuto;
}

CombineMode parse_combine(const std::string& name) {
  if (name == "push") return CombineMode::kPush;
  if (name == "scatter") return CombineMode::kScatter;
  POUNCE_CHECK(name == "auto", "--combine ", name, " is unknown; choose auto, push or scatter");
  return CombineMode::kAuto;
}

Precision parse_precision(const std::string& name) {
  if (name == "fp8") return Precision::kFP8;
  POUNCE_CHECK(name == "bf16", "--precision ", name, " is unknown; choose bf16 or fp8");
  return Precision::kBF16;
}

Activation parse_activation(const std::string& name, std::optional<float> clamp, const Activation& fallback) {
  Activation activation = fallback;
  if (name == "swiglu") {
    activation = Activation::swiglu();
  } else if (name == "gpt-oss" || name == "gptoss") {
    activation = Activation::gpt_oss();
  } else {
    POUNCE_CHECK(name.empty(), "--activation ", name, " is unknown; choose swiglu or gpt-oss");
  }
  if (clamp) activation.clamp_limit = *clamp;
  return activation;
}

std::string describe_activation(const Activation& activation) {
  std::ostringstream out;
  out << to_string(activation.kind);
  if (activation.kind == ActivationKind::kGptOss) out << " (alpha " << activation.alpha << ")";
  if (activation.clamp_limit) out << ", clamp " << *activation.clamp_limit;
  return out.str();
}

double estimate_cpu_bytes(const Shape& s) {
  // bf16 weights (2 B) + fp32 gradients (4 B) + the reference's fp64 weights and gradients (16 B)
  // + its fp32 working copies (4 B), per parameter; activations are small next to the weights.
  const double params =
      3.0 * static_cast<double>(s.hidden) *
      static_cast<double>(s.num_experts * s.intermediate + s.num_ranks * s.shared_intermediate);
  const double activations = 40.0 * static_cast<double>(s.num_ranks * s.max_tokens) *
                             static_cast<double>(s.hidden + s.num_topk * (s.hidden + 3 * s.intermediate));
  return 26.0 * params + activations;
}

RunSetup resolve_run(const RunOptions& options, const BackendChoice& backend, const Machine& machine) {
  const bool on_gpu = backend.backend == Backend::kGpu;
  const bool custom = options.hidden || options.intermediate || options.experts || options.topk;
  RunSetup setup;
  setup.backend = backend;
  Shape shape;
  Activation activation;
  int64_t tokens = 0;
  if (!options.preset.empty() || (on_gpu && !custom)) {
    const Preset& preset = find_preset(options.preset.empty() ? kGpuDefaultPreset : options.preset);
    setup.preset = preset.name;
    shape = preset.shape;
    activation = preset.activation;
    tokens = on_gpu ? kGpuDefaultTokens : kCpuPresetTokens;
  } else if (custom) {
    POUNCE_CHECK(options.hidden && options.intermediate && options.experts && options.topk,
                 "a custom shape needs --hidden, --intermediate, --experts and --topk (missing ",
                 !options.hidden         ? "--hidden"
                 : !options.intermediate ? "--intermediate"
                 : !options.experts      ? "--experts"
                                         : "--topk",
                 "); or pass --preset NAME");
    setup.preset = "custom";
    tokens = on_gpu ? kGpuDefaultTokens : kCpuDefaultShape.max_tokens;
  } else {
    setup.preset = "cpu-default";
    shape = kCpuDefaultShape;
    tokens = kCpuDefaultShape.max_tokens;
  }
  // Explicit dims override the preset's.
  if (options.hidden) shape.hidden = *options.hidden;
  if (options.intermediate) shape.intermediate = *options.intermediate;
  if (options.experts) shape.num_experts = *options.experts;
  if (options.topk) shape.num_topk = *options.topk;
  if (options.shared_intermediate) shape.shared_intermediate = *options.shared_intermediate;
  if (custom && setup.preset != "custom") setup.preset += " (modified)";
  shape.max_tokens = options.tokens.value_or(tokens);
  shape.num_ranks = options.ranks.value_or(on_gpu ? machine.num_gpus : kCpuDefaultShape.num_ranks);
  POUNCE_CHECK(shape.max_tokens >= 1, "--tokens ", shape.max_tokens, " must be at least 1 token per rank");
  if (on_gpu) {
    POUNCE_CHECK(shape.num_ranks >= 1 && shape.num_ranks <= machine.num_gpus, "--ranks ", shape.num_ranks,
                 " needs that many GPUs but ", machine.num_gpus, " are visible; pass --ranks 1..",
                 machine.num_gpus);
  } else {
    POUNCE_CHECK(shape.num_ranks >= 1 && shape.num_ranks <= 64, "--ranks ", shape.num_ranks,
                 " must be in [1, 64] on the CPU backend (one thread per simulated rank)");
  }
  validate(shape);
  POUNCE_CHECK(!options.biases || backend.backend == Backend::kCpu,
               "--biases: expert biases are not supported on GPUs yet; fix: run with --backend cpu, or drop "
               "--biases");
  setup.config.precision = parse_precision(options.precision);
  POUNCE_CHECK(
      !options.biases || setup.config.precision == Precision::kBF16,
      "--biases with --precision fp8: expert biases are BF16-only for now (the layer rejects them with "
      "config.precision = fp8); fix: drop --biases, or run with --precision bf16");

  setup.config.activation = parse_activation(options.activation, options.clamp, activation);
  setup.config.forward_comm_sms = options.comm_sms;
  setup.config.backward_comm_sms = options.comm_sms;
  setup.config.minibatch_size = options.minibatch;
  setup.config.macrobatch_size = options.macrobatch;
  setup.config.kernel_path = parse_kernel_path(options.kernel, "--kernel");
  setup.config.backward_kernel_path = parse_kernel_path(options.backward_kernel, "--backward-kernel");
  setup.config.combine = parse_combine(options.combine);
  setup.config.backend = backend.backend;
  validate(setup.config, shape);
  setup.shape = shape;

  POUNCE_CHECK(options.wgrad_dtype == "fp32" || options.wgrad_dtype == "bf16", "--wgrad-dtype ",
               options.wgrad_dtype, " is unknown; choose fp32 or bf16");
  setup.wgrad_fp32 = options.wgrad_dtype == "fp32";
  setup.warmup = on_gpu ? 1 : 0;
  setup.iters = options.iters.value_or(on_gpu ? 10 : 1);
  POUNCE_CHECK(setup.iters >= 1, "--iters ", setup.iters, " must be at least 1");
  setup.check_tokens = options.check_tokens.value_or(on_gpu ? default_check_tokens(shape) : 0);
  POUNCE_CHECK(setup.check_tokens >= 0, "--check-tokens ", setup.check_tokens, " must be >= 0 (0 = all)");
  POUNCE_CHECK(options.tolerance > 0, "--tolerance ", options.tolerance, " must be positive");

  return setup;
}

void check_cpu_memory(const Shape& shape, const std::string& who, const std::string& otherwise) {
  check_cpu_memory(estimate_cpu_bytes(shape), shape, who, otherwise);
}

void check_cpu_memory(double need, const Shape& shape, const std::string& who, const std::string& otherwise) {
  const double have = physical_memory_bytes();
  POUNCE_CHECK(have == 0.0 || need < 0.85 * have, who, " needs about ", static_cast<int64_t>(need / 1e9),
               " GB of host memory for this shape but the machine has ", static_cast<int64_t>(have / 1e9),
               " GB; shrink it (e.g. --experts ", std::max<int64_t>(shape.num_ranks, shape.num_topk),
               " keeps the other dims) ", otherwise);
}

}  // namespace pounce::cli
