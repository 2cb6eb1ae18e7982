// The `pounce` command-line tool: run (one checked, timed MoE layer), bench (sweeps against the PyTorch
// baseline), info (build, devices, backend choice), plan (the cost model; docs/internode.md). docs/design.md
// §5.
#include <CLI/CLI.hpp>

#include <iostream>
#include <string>

#include "pounce/error.h"
#include "cli/commands.h"

namespace {

// CLI11 2.1 has no std::optional options: parse into a value and keep it only when given.
template <typename T>
struct OptionalValue {
  T value{};
  CLI::Option* option = nullptr;
  std::optional<T> get() const { return option->count() > 0 ? std::optional<T>(value) : std::nullopt; }
};

template <typename T>
OptionalValue<T>& add_optional(CLI::App* app, OptionalValue<T>& slot, const std::string& name,
                               const std::string& help) {
  slot.option = app->add_option(name, slot.value, help);
  return slot;
}

std::string strip_prefix(const std::string& message) {
  const std::string prefix = "pounce: ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace pounce::cli;
  CLI::App app{"Pounce: a fused Mixture-of-Experts layer for Hopper GPUs (docs/design.md §5)"};
  app.require_subcommand(1);

  // ---- run ---------------------------------------------------------------------------------------------
  RunOptions run;
  OptionalValue<int64_t> hidden, intermediate, experts, topk, shared, tokens, check_tokens;
  OptionalValue<int> ranks, iters;
  OptionalValue<float> clamp;
  CLI::App* run_app = app.add_subcommand("run",
                                         "One MoE layer forward + backward on every visible GPU (or the CPU "
                                         "reference backend), checked against an "
                                         "independent fp64 evaluation, timed");
  run_app->add_option("--preset", run.preset, "qwen3-30b-a3b | deepseek-v3 | gpt-oss-120b | mixtral-8x7b");
  add_optional(run_app, hidden, "--hidden", "H (custom shape, or overrides the preset's)");
  add_optional(run_app, intermediate, "--intermediate", "I, routed expert intermediate size");
  add_optional(run_app, experts, "--experts", "E, experts over the whole group");
  add_optional(run_app, topk, "--topk", "k, experts per token");
  add_optional(run_app, shared, "--shared-intermediate", "Is, shared expert intermediate size (0 = none)");
  add_optional(run_app, tokens, "--tokens",
               "tokens per rank (default: 4096 on GPUs; 256 on the CPU, 16 with a preset)");
  add_optional(run_app, ranks, "--ranks", "expert-parallel ranks (default: every visible GPU; 2 on the CPU)");
  run_app->add_option("--activation", run.activation,
                      "swiglu | gpt-oss (default: the preset's, else swiglu)");
  add_optional(run_app, clamp, "--clamp", "clamp limit L of the activation");
  run_app->add_option("--backend", run.backend, "auto | cpu | gpu")->capture_default_str();
  run_app->add_option("--seed", run.seed, "seed of every input")->capture_default_str();
  add_optional(run_app, iters, "--iters",
               "timed repetitions, median reported (default: 10 on GPUs, 1 on the CPU)");
  run_app->add_option("--comm-sms", run.comm_sms, "communication SMs per kernel (0 = heuristic)")
      ->capture_default_str();
  run_app->add_option("--minibatch", run.minibatch, "rows per dispatch->GEMM handoff (0 = heuristic)")
      ->capture_default_str();
  run_app
      ->add_option(
          "--macrobatch", run.macrobatch,
          "rows of the routed activation ring (0 = the dropless worst case; at least ranks x tokens)")
      ->capture_default_str();
  run_app
      ->add_option("--kernel", run.kernel,
                   "forward on GPUs: fused (one persistent kernel) | staged | auto (= fused)")
      ->capture_default_str();
  run_app
      ->add_option("--backward-kernel", run.backward_kernel,
                   "backward on GPUs: auto (by shape) | fused | staged")
      ->capture_default_str();
  run_app
      ->add_option("--combine", run.combine,
                   "fused kernels on GPUs: auto (by shape) | push (communication SMs) | scatter (epilogues)")
      ->capture_default_str();
  add_optional(run_app, check_tokens, "--check-tokens",
               "tokens per rank in the fp64 check (0 = all; default: all on the CPU, 8..64 on GPUs)");
  run_app->add_option("--check-experts", run.check_experts, "experts per rank in the weight-gradient check")
      ->capture_default_str();
  run_app->add_option("--check-rows", run.check_rows, "intermediate rows per checked expert")
      ->capture_default_str();
  run_app->add_option("--tolerance", run.tolerance, "max relative error ||got - ref|| / ||ref|| per tensor")
      ->capture_default_str();
  run_app->add_flag(
      "--biases", run.biases,
      "routed expert biases (b_gate, b_up, b_down) and their gradients; CPU backend only for now");
  run_app->add_option("--wgrad-dtype", run.wgrad_dtype, "fp32 | bf16 weight gradients")
      ->capture_default_str();
  run_app
      ->add_option(
          "--precision", run.precision,
          "bf16 | fp8 (routed experts in block-scaled E4M3, checked against the CPU reference in FP8 "
          "and within the FP8 error budget of BF16)")
      ->capture_default_str();
  run_app->add_option("--json", run.json, "write a JSON report to FILE ('-' = stdout)");

  // ---- info --------------------------------------------------------------------------------------------
  InfoOptions info;
  CLI::App* info_app = app.add_subcommand("info", "Build, devices, NCCL, and which backend `run` would use");
  info_app->add_option("--json", info.json, "also write JSON to FILE ('-' = stdout)");

  // ---- bench -------------------------------------------------------------------------------------------
  BenchOptions bench;
  CLI::App* bench_app = app.add_subcommand(
      "bench",
      "Sweep presets x tokens per rank on every visible GPU, with the PyTorch baseline measured in the "
      "same run; JSON records to $TMPDIR/<name>.json, or with --record into bench/results/ (the latest "
      "record "
      "per configuration)");
  bench_app->add_option("--preset", bench.presets, "presets to sweep, or custom:H:I:E:k[:Is] shapes")
      ->delimiter(',')
      ->capture_default_str();
  bench_app->add_option("--tokens", bench.tokens, "tokens per rank to sweep")
      ->delimiter(',')
      ->capture_default_str();
  bench_app
      ->add_option(
          "--impl", bench.impls,
          "fused (the defaults: fused forward, backward by shape) | fused-all | fused-staged (fused forward, "
          "staged backward) | staged (a list times each)")
      ->delimiter(',')
      ->capture_default_str();
  bench_app
      ->add_option("--pass", bench.passes,
                   "forward | backward | forward_backward | all (= forward,forward_backward); a list")
      ->delimiter(',')
      ->capture_default_str();
  bench_app
      ->add_option("--precision", bench.precision,
                   "bf16 | fp8 (also measures the BF16 layer on the same inputs: speedup_vs_bf16)")
      ->capture_default_str();
  bench_app
      ->add_option("--macrobatch", bench.macrobatch,
                   "rows of the routed activation ring (0 = the dropless worst case, -1 = the smallest: "
                   "ranks x tokens)")
      ->capture_default_str();
  bench_app->add_option("--ranks", bench.ranks, "GPUs (0 = every visible GPU)")->capture_default_str();
  bench_app
      ->add_option("--backend", bench.backend,
                   "auto (= gpu) | gpu | cpu (tests this tool; timings meaningless)")
      ->capture_default_str();
  bench_app
      ->add_option("--input-sets", bench.input_sets,
                   "input sets rotated over the runs (0 = enough to exceed twice the L2)")
      ->capture_default_str();
  bench_app->add_option("--warmup", bench.warmup, "untimed runs per configuration")->capture_default_str();
  bench_app->add_option("--iters", bench.iters, "timed runs per configuration")->capture_default_str();
  bench_app->add_option("--seed", bench.seed, "seed of every input")->capture_default_str();
  bench_app->add_flag("--no-baseline", bench.no_baseline, "skip the PyTorch baseline (and the peers)");
  bench_app
      ->add_option("--peers", bench.peers,
                   "also measure, in the baseline's process on its inputs: liger, transformers, floor, all")
      ->delimiter(',');
  bench_app
      ->add_option("--plot-script", bench.plot_script,
                   "charts the results as a PNG beside the JSON ('' = no chart; needs matplotlib)")
      ->capture_default_str();
  bench_app->add_option("--python", bench.python, "Python that runs the plot script")->capture_default_str();
  bench_app->add_option("--torchrun", bench.torchrun, "torchrun executable")->capture_default_str();
  bench_app->add_option("--baseline-script", bench.baseline_script, "the baseline script")
      ->capture_default_str();
  bench_app->add_option("--name", bench.name,
                        "results file name: $TMPDIR/<name>.json (default pounce-bench-<date>)");
  CLI::Option* out_option = bench_app->add_option(
      "--out", bench.out,
      "results FILE (overrides --name), or DIR/ to record into DIR's ep<R>_<precision>.json");
  bool record = false;
  bench_app
      ->add_flag(
          "--record", record,
          "record into bench/results/: replaces the records of the configurations measured, keeps the rest")
      ->excludes(out_option);
  std::string record_from;
  bench_app->add_option("--record-from", record_from,
                        "measure nothing: record the records of FILE (a finished run's) into bench/results/");

  // ---- plan --------------------------------------------------------------------------------------------
  PlanCommandOptions plan_options;
  OptionalValue<int64_t> plan_hidden, plan_intermediate, plan_experts, plan_topk, plan_shared;
  CLI::App* plan_app = app.add_subcommand(
      "plan",
      "Predict one layer's forward and backward time at an EP size, one node or several (cost model from the "
      "measured rates; no GPU needed); --validate checks the model against bench/results");
  plan_app->add_option("--preset", plan_options.preset, "a preset, or custom:H:I:E:k[:Is]")
      ->capture_default_str();
  add_optional(plan_app, plan_hidden, "--hidden", "H (overrides the preset's)");
  add_optional(plan_app, plan_intermediate, "--intermediate", "I, routed expert intermediate size");
  add_optional(plan_app, plan_experts, "--experts", "E, experts over the whole group");
  add_optional(plan_app, plan_topk, "--topk", "k, experts per token");
  add_optional(plan_app, plan_shared, "--shared-intermediate",
               "Is, shared expert intermediate size (0 = none)");
  plan_app->add_option("--tokens", plan_options.tokens, "tokens per rank")->capture_default_str();
  plan_app->add_option("--ep", plan_options.ep, "expert-parallel ranks")->capture_default_str();
  plan_app->add_option("--gpus-per-node", plan_options.gpus_per_node, "GPUs per node (the NVLink team)")
      ->capture_default_str();
  plan_app
      ->add_option("--nvlink-gbps", plan_options.nvlink_gbps,
                   "NVLink GB/s per GPU and direction (measured: 370)")
      ->capture_default_str();
  plan_app
      ->add_option("--nic-gbps", plan_options.nic_gbps,
                   "NIC GB/s per GPU and direction, line rate (400 Gb/s: 50)")
      ->capture_default_str();
  plan_app->add_option("--precision", plan_options.precision, "bf16 | fp8")->capture_default_str();
  plan_app
      ->add_option("--comm-sms", plan_options.comm_sms,
                   "communication SMs of both passes (0 = the suggested count)")
      ->capture_default_str();
  plan_app
      ->add_option("--combine-wire", plan_options.combine_wire,
                   "per-node partial sums on the NIC: bf16 | fp32")
      ->capture_default_str();
  plan_app
      ->add_option("--node-limit", plan_options.node_limit,
                   "nodes a token's experts may span (DeepSeek-V3: 4; 0 = no limit, uniform routing)")
      ->capture_default_str();
  plan_app->add_flag("--no-sweep", plan_options.no_sweep, "skip the table over EP sizes 1-256");
  plan_app->add_option("--json", plan_options.json,
                       "write the plan and the sweep as JSON to FILE ('-' = stdout)");
  plan_app->add_option("--chart", plan_options.chart, "chart the sweep into this PNG (needs matplotlib)");
  plan_app->add_option("--plot-script", plan_options.plot_script, "the chart script")->capture_default_str();
  plan_app->add_option("--python", plan_options.python, "Python that runs the chart script")
      ->capture_default_str();
  plan_app->add_option(
      "--validate", plan_options.validate,
      "a results folder (bench/results): the model against every record, as a Markdown table");
  plan_app->add_option("--validate-out", plan_options.validate_out,
                       "with --validate: also write the table to FILE");
  plan_app->add_flag(
      "--simulate", plan_options.simulate,
      "also run the discrete-event simulation of the schedule on uniform routing (up to EP64)");
  plan_app->add_option("--seed", plan_options.seed, "seed of the simulation's routing")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error);
  }

  try {
    if (*run_app) {
      run.hidden = hidden.get();
      run.intermediate = intermediate.get();
      run.experts = experts.get();
      run.topk = topk.get();
      run.shared_intermediate = shared.get();
      run.tokens = tokens.get();
      run.ranks = ranks.get();
      run.clamp = clamp.get();
      run.iters = iters.get();
      run.check_tokens = check_tokens.get();
      return run_command(run);
    }
    if (*info_app) return info_command(info);
    if (*plan_app) {
      plan_options.hidden = plan_hidden.get();
      plan_options.intermediate = plan_intermediate.get();
      plan_options.experts = plan_experts.get();
      plan_options.topk = plan_topk.get();
      plan_options.shared_intermediate = plan_shared.get();
      return plan_command(plan_options);
    }
    std::string command_line;
    for (int i = 0; i < argc; ++i) command_line += (i ? " " : "") + std::string(argv[i]);
    if (!record_from.empty()) return record_command(record_from, "bench/results/");
    if (record) bench.out = "bench/results/";
    return bench_command(bench, command_line);
  } catch (const pounce::Error& error) {
    std::cerr << "error: " << strip_prefix(error.what()) << "\n";
    return 2;
  } catch (const std::exception& error) {
    std::cerr << "error: " << error.what() << "\n";
    return 2;
  }
}
