// `pounce run`: one MoE layer forward + backward on a preset or custom shape, on every visible GPU (or the
// CPU reference backend), checked against an independent fp64 evaluation, timed.
#include <chrono>
#include <iostream>

#include "pounce/error.h"
#include "cli/commands.h"
#include "cli/dense_check.h"
#include "cli/inputs.h"
#include "cli/parallel.h"
#include "cli/progress.h"
#include "cli/reference_check.h"
#include "cli/report.h"
#include "cli/runner.h"

namespace pounce::cli {
namespace {

using nlohmann::json;

struct Timing {
  double forward_ms = 0.0, backward_ms = 0.0;
  double forward_flops = 0.0;  // per GPU
  bool has_backward = false;
};

std::string describe_shape(const Shape& s, const Activation& activation) {
  return format("H %lld, I %lld, E %lld (%lld per rank), top-%lld, shared %lld, %s",
                static_cast<long long>(s.hidden), static_cast<long long>(s.intermediate),
                static_cast<long long>(s.num_experts), static_cast<long long>(s.num_local_experts()),
                static_cast<long long>(s.num_topk), static_cast<long long>(s.shared_intermediate),
                describe_activation(activation).c_str());
}

std::string count_or_all(int64_t sampled, int64_t total) {
  return sampled == 0 || sampled >= total ? "all " + std::to_string(total) : std::to_string(sampled);
}

void print_checks(std::ostream& out, const std::vector<TensorCheck>& checks, std::optional<bool> repeat) {
  out << format("  %-16s %10s %11s %11s %11s %9s\n", "tensor", "values", "max|err|", "max|ref|", "rel err",
                "tol");
  for (const TensorCheck& c : checks) {
    out << format("  %-16s %10lld %11.3e %11.3e %11.3e %9.1e  %s\n", c.name.c_str(),
                  static_cast<long long>(c.count), c.max_abs_error, c.max_abs_ref, c.rel_error, c.tolerance,
                  c.passed ? "ok" : "FAIL");
  }
  if (repeat) {
    out << format(
        "  %-16s %s\n", "bitwise repeat",
        *repeat ? "ok (last run == first run: out, d_x, d_topk_weights)" : "FAIL (last run != first run)");
  }
  for (const TensorCheck& c : checks)
    if (!c.passed) out << "  first bad value of " << c.name << ": " << c.first_bad << "\n";
}

void print_budget(std::ostream& out, const std::vector<BudgetCheck>& budget) {
  out << format(
      "FP8 error budget against the CPU reference in BF16 (docs/design.md §1: rel err <= %g per tensor, "
      "cosine >= %g per gradient):\n",
      kFp8MaxRelError, kFp8MinGradCosine);
  out << format("  %-16s %10s %11s %11s\n", "tensor", "values", "rel err", "cosine");
  for (const BudgetCheck& c : budget) {
    out << format("  %-16s %10lld %11.3e %11s  %s\n", c.name.c_str(), static_cast<long long>(c.count),
                  c.rel_error, c.gradient ? format("%.6f", c.cosine).c_str() : "-", c.passed ? "ok" : "FAIL");
  }
}

void print_timing(std::ostream& out, const Timing& timing, int iters) {
  out << format(
      "timing (median of %d run%s, per run the slowest rank; TFLOP/s per rank as docs/design.md §7):\n",
      iters, iters > 1 ? "s" : "");
  out << format("  forward            %10.3f ms  %8.3g TFLOP/s\n", timing.forward_ms,
                tflops(timing.forward_flops, timing.forward_ms));
  if (!timing.has_backward) return;
  out << format("  backward           %10.3f ms  %8.3g TFLOP/s\n", timing.backward_ms,
                tflops(2.0 * timing.forward_flops, timing.backward_ms));
  out << format("  forward+backward   %10.3f ms  %8.3g TFLOP/s\n", timing.forward_ms + timing.backward_ms,
                tflops(3.0 * timing.forward_flops, timing.forward_ms + timing.backward_ms));
}

json budget_json(const std::vector<BudgetCheck>& budget) {
  json tensors = json::array();
  bool passed = true;
  for (const BudgetCheck& c : budget) {
    passed &= c.passed;
    tensors.push_back({{"name", c.name},
                       {"values", c.count},
                       {"rel_error", c.rel_error},
                       {"cosine", c.gradient ? json(c.cosine) : json(nullptr)},
                       {"passed", c.passed}});
  }
  return {
      {"reference", "the CPU reference in BF16 at the check's coordinates (d_shared.*: the fp64 evaluation)"},
      {"max_rel_error", kFp8MaxRelError},
      {"min_gradient_cosine", kFp8MinGradCosine},
      {"passed", passed},
      {"tensors", tensors}};
}

json to_json(const RunOptions& options, const RunSetup& setup, const RunOutcome& outcome,
             const Timing& timing, const std::vector<TensorCheck>& checks,
             const std::vector<BudgetCheck>& budget, bool passed, double check_seconds) {
  const bool fp8 = setup.config.precision == Precision::kFP8;
  const Shape& s = setup.shape;
  const Activation& act = setup.config.activation;
  json tensors = json::array();
  for (const TensorCheck& c : checks) {
    tensors.push_back({{"name", c.name},
                       {"values", c.count},
                       {"max_abs_error", c.max_abs_error},
                       {"max_abs_ref", c.max_abs_ref},
                       {"rel_error", c.rel_error},
                       {"tolerance", c.tolerance},
                       {"passed", c.passed},
                       {"first_bad", c.first_bad.empty() ? json(nullptr) : json(c.first_bad)}});
  }
  const double fb_ms = timing.forward_ms + timing.backward_ms;
  return {
      {"command", "run"},
      {"passed", passed},
      {"preset", setup.preset},
      {"shape",
       {{"hidden", s.hidden},
        {"intermediate", s.intermediate},
        {"num_experts", s.num_experts},
        {"num_local_experts", s.num_local_experts()},
        {"num_topk", s.num_topk},
        {"shared_intermediate", s.shared_intermediate},
        {"tokens_per_rank", s.max_tokens},
        {"num_ranks", s.num_ranks}}},
      {"activation",
       {{"kind", to_string(act.kind)},
        {"clamp_limit", act.clamp_limit ? json(*act.clamp_limit) : json(nullptr)},
        {"alpha", act.alpha}}},
      {"precision", to_string(setup.config.precision)},
      {"weight_grad_dtype", setup.wgrad_fp32 ? "fp32" : "bf16"},
      {"backend", to_string(setup.backend.backend)},
      {"backend_reason", setup.backend.reason},
      {"device", outcome.device},
      {"config",
       {{"comm_sms", setup.config.forward_comm_sms},
        {"minibatch_size", setup.config.minibatch_size},
        {"macrobatch_size", setup.config.macrobatch_size},
        {"kernel_path", to_string(setup.config.kernel_path)},
        {"backward_kernel_path", to_string(setup.config.backward_kernel_path)},
        {"combine", to_string(setup.config.combine)}}},
      {"seed", options.seed},
      {"warmup", setup.warmup},
      {"iters", setup.iters},
      {"backward",
       {{"ran", outcome.backward_ran},
        {"error", outcome.backward_error.empty() ? json(nullptr) : json(outcome.backward_error)}}},
      {"timing",
       {{"forward_ms", timing.forward_ms},
        {"backward_ms", timing.has_backward ? json(timing.backward_ms) : json(nullptr)},
        {"forward_backward_ms", timing.has_backward ? json(fb_ms) : json(nullptr)},
        {"forward_ms_runs", outcome.forward_ms},
        {"backward_ms_runs", outcome.backward_ms},
        {"weight_quantize_ms",
         outcome.weight_quantize_ms ? json(*outcome.weight_quantize_ms) : json(nullptr)}}},
      {"flops_per_rank", {{"forward", timing.forward_flops}, {"backward", 2.0 * timing.forward_flops}}},
      {"tflops",
       {{"forward", tflops(timing.forward_flops, timing.forward_ms)},
        {"backward",
         timing.has_backward ? json(tflops(2.0 * timing.forward_flops, timing.backward_ms)) : json(nullptr)},
        {"forward_backward",
         timing.has_backward ? json(tflops(3.0 * timing.forward_flops, fb_ms)) : json(nullptr)}}},
      {"check",
       {{"method", fp8 ? "the CPU reference in FP8 (the oracle; d_shared.*: the fp64 evaluation)"
                       : "fp64 dense per-token evaluation (no schedule, no dispatch)"},
        {"tolerance", options.tolerance},
        {"tokens_per_rank", setup.check_tokens},
        {"experts_per_rank", options.check_experts},
        {"rows_per_expert", options.check_rows},
        {"seconds", check_seconds},
        {"bitwise_repeat",
         outcome.repeat_bitwise_equal ? json(*outcome.repeat_bitwise_equal) : json(nullptr)},
        {"tensors", tensors}}},
      {"fp8_budget", fp8 ? budget_json(budget) : json(nullptr)},
      {"build", build_info_json()},
  };
}

}  // namespace

int run_command(const RunOptions& options) {
  const Machine machine = probe_machine();
  const BackendChoice choice = choose_backend(options.backend, machine);
  const RunSetup setup = resolve_run(options, choice, machine);
  const Shape& s = setup.shape;
  const bool on_gpu = setup.backend.backend == Backend::kGpu;
  const bool fp8 = setup.config.precision == Precision::kFP8;
  if (!on_gpu) check_cpu_memory(s);
  if (on_gpu && fp8)
    check_cpu_memory(
        estimate_reference_check_bytes(s, setup.check_tokens, options.check_experts), s,
        "the FP8 check (the host inputs and the CPU reference at the check's tokens and experts)",
        "or pass a smaller --check-tokens or --check-experts, or run with --precision bf16 (its "
        "fp64 check reads the weights in place)");
  // With --json - the JSON owns stdout; the human report goes to stderr.
  std::ostream& out = options.json == "-" ? std::cerr : std::cout;

  out << "pounce run: " << setup.preset << ": " << describe_shape(s, setup.config.activation) << "\n";
  out << format("  %lld tokens per rank x %lld rank%s, %s, weight gradients %s, seed %llu\n",
                static_cast<long long>(s.max_tokens), static_cast<long long>(s.num_ranks),
                s.num_ranks > 1 ? "s" : "",
                fp8 ? "fp8 (routed experts in block-scaled E4M3, shared expert bf16)" : "bf16",
                setup.wgrad_fp32 ? "fp32" : "bf16", static_cast<unsigned long long>(options.seed));
  out << "backend: " << to_string(setup.backend.backend) << " (" << setup.backend.reason << ")";
  if (on_gpu) {
    auto kernels = [](KernelPath path) {
      return path == KernelPath::kFused    ? " kernel"
             : path == KernelPath::kStaged ? " stage kernels"
                                           : " (by shape)";
    };
    out << "; forward: " << to_string(setup.config.kernel_path) << kernels(setup.config.kernel_path)
        << ", backward: " << to_string(setup.config.backward_kernel_path)
        << kernels(setup.config.backward_kernel_path);
    // include/pounce/config.h: the fused kernels are BF16 only.
    if (fp8) out << " (fp8: the stage kernels, whatever --kernel and --backward-kernel say)";
  }
  out << "\n";
  if (!on_gpu) {
    const bool no_gpu = !(machine.cuda_compiled && machine.num_gpus > 0);
    out << (no_gpu ? "note: no GPU here, so the CPU reference backend runs"
                   : "note: the CPU reference backend runs")
        << (setup.preset == "cpu-default" ? " at a small default size (pass --preset NAME or "
                                            "--hidden/--intermediate/--experts/--topk to change it)"
            : setup.preset == "custom"    ? " at the requested size"
                                          : " with the preset's dims but " + std::to_string(s.max_tokens) +
                                             " tokens per rank (--tokens to change)")
        << "\n";
  }
  out << std::flush;

  Progress progress(true);
  progress.stage("generating inputs");
  const HostProblem problem =
      generate_problem(s, setup.config.activation, options.seed, 0, {}, options.biases);
  const CheckPlan plan =
      make_check_plan(problem, {setup.check_tokens, options.check_experts, options.check_rows, options.seed});

  RunRequest request;
  request.problem = &problem;
  request.config = setup.config;
  request.warmup = setup.warmup;
  request.iters = setup.iters;
  request.plan = &plan;
  request.wgrad_fp32 = setup.wgrad_fp32;
  request.progress = &progress;
  const RunOutcome outcome = on_gpu ? run_on_gpu(request) : run_on_cpu(request);

  progress.stage(fp8 ? "CPU reference check (FP8)" : "fp64 dense check");
  const auto check_start = std::chrono::steady_clock::now();
  std::vector<TensorCheck> checks;
  std::vector<BudgetCheck> budget;
  if (!fp8) {
    const SampledTensors expected = dense_evaluate(problem, plan, outcome.backward_ran);
    checks = compare(plan, s, outcome.observed, expected, options.tolerance);
  } else {
    // The FP8 oracle is the CPU reference in FP8, compared by the same rule; the budget is against it in
    // BF16. The shared expert stays BF16, so its weight gradients' reference is the fp64 evaluation in both.
    CheckPlan shared_only = plan;
    for (std::vector<int64_t>& tokens : shared_only.tokens) tokens.clear();
    for (std::vector<int64_t>& experts : shared_only.experts) experts.clear();
    const SampledTensors shared = dense_evaluate(problem, shared_only, outcome.backward_ran);
    const SampledTensors oracle =
        fill_missing(reference_evaluate(problem, plan, outcome.backward_ran, Precision::kFP8), shared);
    checks = compare(plan, s, outcome.observed, oracle, options.tolerance);
    progress.stage("CPU reference in BF16 (the FP8 error budget)");
    const SampledTensors bf16 =
        fill_missing(reference_evaluate(problem, plan, outcome.backward_ran, Precision::kBF16), shared);
    budget = check_fp8_budget(outcome.observed, bf16);
  }
  const double check_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - check_start).count();
  progress.finish();

  bool passed = outcome.repeat_bitwise_equal.value_or(true);
  for (const TensorCheck& c : checks) passed &= c.passed;
  for (const BudgetCheck& c : budget) passed &= c.passed;

  Timing timing;
  timing.forward_ms = median(outcome.forward_ms);
  timing.has_backward = outcome.backward_ran && !outcome.backward_ms.empty();
  timing.backward_ms = median(outcome.backward_ms);
  timing.forward_flops = forward_flops_per_rank(problem);

  out << "device: " << outcome.device << "\n";
  if (!outcome.backward_ran)
    out << "backward: NOT RUN: " << outcome.backward_error << "\n  (forward results below still stand)\n";
  const int64_t experts_checked = plan.experts.empty() ? 0 : static_cast<int64_t>(plan.experts[0].size());
  out << format(
      fp8 ? "check: the CPU reference in FP8 (the oracle; d_shared.*: the fp64 evaluation, the shared "
            "expert stays BF16); %s tokens/rank"
          : "check: fp64 dense per-token evaluation (no schedule/dispatch); %s tokens/rank",
      count_or_all(setup.check_tokens, s.max_tokens).c_str());
  if (outcome.backward_ran)
    out << format("; weight grads: %lld expert%s/rank x %lld rows over all their tokens",
                  static_cast<long long>(experts_checked), experts_checked == 1 ? "" : "s",
                  static_cast<long long>(plan.rows.size()));
  out << format(" (%.1f s)\n", check_seconds);
  print_checks(out, checks, outcome.repeat_bitwise_equal);
  if (fp8) print_budget(out, budget);
  print_timing(out, timing, setup.iters);
  if (outcome.weight_quantize_ms)
    out << format(
        "  weight quantization %9.3f ms  (quantize_weights_fp8 once, before the runs: not in their times)\n",
        *outcome.weight_quantize_ms);
  out << "result: " << (passed ? "PASS" : "FAIL")
      << (passed && !outcome.backward_ran ? " (forward only: backward did not run)" : "") << "\n"
      << std::flush;

  if (!options.json.empty())
    write_json(to_json(options, setup, outcome, timing, checks, budget, passed, check_seconds), options.json);
  return passed ? 0 : 1;
}

}  // namespace pounce::cli
