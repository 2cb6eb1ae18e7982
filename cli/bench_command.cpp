// `pounce bench`: presets x tokens per rank x impls on every visible GPU, timed through the public API by
// the method of docs/design.md §7 (cli/bench.h), with the PyTorch baseline (bench/baselines/torch_moe.py
// under torchrun) and the --peers (Liger's fused MoE, transformers' grouped_mm experts, the compute-only
// floor: bench/baselines/peers.py, in the baseline's process, on its inputs) measured in the same run on the
// same GPUs, after ours so they never share them. Writes a list of records with the keys of docs/design.md
// §7 to $TMPDIR/<name>.json or --out FILE; with --out DIR/ (bench/results/ for the repository's record)
// merges them into DIR's results files instead, the latest record per configuration (cli/bench.h).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include "pounce/error.h"
#include "pounce/version.h"
#include "src/gpu_backend.h"
#include "cli/bench.h"
#include "cli/commands.h"
#include "cli/inputs.h"
#include "cli/progress.h"
#include "cli/report.h"
#include "cli/run_setup.h"
#include "cli/telemetry.h"

#ifdef POUNCE_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace pounce::cli {
namespace {

using nlohmann::json;

// The path of `program` if it is executable (as given when it has a '/', else searched on PATH).
std::string find_executable(const std::string& program) {
  if (program.find('/') != std::string::npos) return access(program.c_str(), X_OK) == 0 ? program : "";
  const char* path = std::getenv("PATH");
  std::string dirs = path != nullptr ? path : "";
  size_t begin = 0;
  while (begin <= dirs.size()) {
    const size_t end = std::min(dirs.find(':', begin), dirs.size());
    const std::string candidate = dirs.substr(begin, end - begin) + "/" + program;
    if (end > begin && access(candidate.c_str(), X_OK) == 0) return candidate;
    begin = end + 1;
  }
  return "";
}

// L2 bytes of GPU 0, or the H200's when no GPU answers.
int64_t l2_bytes() {
#ifdef POUNCE_HAS_CUDA
  int bytes = 0;
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, 0) == cudaSuccess && bytes > 0) return bytes;
#endif
  return kAssumedL2Bytes;
}

// NVLink SHARP / multicast stay off (docs/design.md §3) in our NCCL and in the baseline's processes, unless
// the caller chose otherwise; the baseline's records name our commit where the tree has no git metadata.
void set_default_environment(const std::string& commit) {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  setenv("NVSHMEM_DISABLE_NVLS", "1", 0);
  setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1", 0);
  setenv("POUNCE_COMMIT", commit.c_str(), 0);
  // Liger's Triton kernels autotune on their first call: cached on disk, it is paid once per shape, not per
  // run (and never in a timed run: the peers warm up first).
  setenv("TRITON_CACHE_AUTOTUNING", "1", 0);
}

// Runs the baseline (and the peers after it) once for every preset, token count and pass; returns its
// records. The script writes them after every configuration, so a process that fails part way still gives
// what it measured (with a warning on stderr).
json run_baseline(BaselineRun run) {
  char path[] = "/tmp/pounce_baseline_XXXXXX";
  const int fd = mkstemp(path);
  POUNCE_CHECK(fd >= 0, "cannot create a temporary file for the baseline's records in /tmp");
  close(fd);
  run.json_path = path;
  const std::string command = baseline_command(run);
  std::cerr << "baseline: " << command << "\n" << std::flush;
  const int status = std::system(command.c_str());
  json records = json::array();
  if (status != 0)
    std::cerr << "warning: the baseline's process failed (exit status " << status
              << "); keeping the records it wrote before\n";
  try {
    std::ifstream file(path);
    if (file.peek() != std::ifstream::traits_type::eof()) records = json::parse(file);
    if (!records.is_array()) records = json::array();
  } catch (const std::exception& error) {
    std::cerr << "warning: cannot read the baseline's records from " << path << ": " << error.what() << "\n";
  }
  std::filesystem::remove(path);
  return records;
}

// The PNG chart beside the JSON (bench/plot_results.py: throughput against tokens per rank, or bars at one
// token count, Pounce, the baseline and the peers). Best effort: a machine without matplotlib still gets its
// JSON, and a line saying how to chart it.
void write_chart(const BenchOptions& options, const std::string& json_path) {
  if (options.plot_script.empty()) return;
  const std::string png_path = std::filesystem::path(json_path).replace_extension(".png").string();
  const std::string command = shell_quote(options.python) + " " + shell_quote(options.plot_script) + " " +
                              shell_quote(json_path) + " -o " + shell_quote(png_path);
  const bool have_script = std::filesystem::exists(options.plot_script);
  const int status = have_script ? std::system((command + " > /dev/null 2>&1").c_str()) : -1;
  if (status == 0) {
    std::cout << "wrote chart " << png_path << "\n";
  } else {
    std::cerr << "note: no chart written ("
              << (have_script ? "the plot script failed" : "plot script not found")
              << "); to draw it: " << command << "\n";
  }
}

// record[key] printed with `pattern`, or "-" when it is not a number.
std::string number(const json& record, const char* key, const char* pattern) {
  const auto found = record.find(key);
  return found != record.end() && found->is_number() ? format(pattern, found->get<double>()) : "-";
}

void print_table(std::ostream& out, const json& records) {
  int preset_width = 14;
  bool any_fp8 = false;  // then a precision column and the FP8 records' speed-up over BF16
  for (const json& r : records) {
    preset_width = std::max<int>(preset_width, r.value("preset", "").size());
    any_fp8 |= r.value("precision", "bf16") == "fp8";
  }
  out << format("%-12s %-17s %-*s %5s %6s %5s %10s %9s %8s %8s %7s %6s %6s %5s", "impl", "pass", preset_width,
                "preset", "ranks", "T/rank", "sets", "median ms", "TFLOP/s", "speedup", "late ms", "late x",
                "floor", "SM MHz", "W/GPU")
      << (any_fp8 ? format(" %4s %7s", "prec", "vs bf16") : "") << "\n";
  std::map<std::string, int> errors;  // error -> records it stopped
  for (const json& r : records) {
    out << format("%-12s %-17s %-*s %5lld %6lld %5s %10s %9s %8s %8s %7s %6s %6s %5s",
                  r.value("impl", "").c_str(), r.value("pass", "").c_str(), preset_width,
                  r.value("preset", "").c_str(), static_cast<long long>(r.value("ranks", int64_t{0})),
                  static_cast<long long>(r.value("tokens_per_rank", int64_t{0})),
                  number(r, "input_sets", "%.0f").c_str(), number(r, "median_ms", "%.3f").c_str(),
                  number(r, "tflops", "%.1f").c_str(), number(r, "speedup_vs_baseline", "%.2fx").c_str(),
                  number(r, "late_median_ms", "%.3f").c_str(),
                  number(r, "late_speedup_vs_baseline", "%.2fx").c_str(),
                  number(r, "floor_fraction", "%.2f").c_str(), number(r, "sm_clock_mhz", "%.0f").c_str(),
                  number(r, "power_w", "%.0f").c_str())
        << (any_fp8 ? format(" %4s %7s", r.value("precision", "bf16").c_str(),
                             number(r, "speedup_vs_bf16", "%.2fx").c_str())
                    : "")
        << "\n";
    if (r.contains("error")) ++errors[r["error"].get<std::string>()];
  }
  for (const auto& [error, count] : errors)
    out << "not measured (" << count << " record" << (count > 1 ? "s" : "") << "): " << error << "\n";
}

}  // namespace

int record_command(const std::string& run_file, const std::string& dir) {
  std::ifstream file(run_file);
  POUNCE_CHECK(file.good(), "--record-from ", run_file,
               ": cannot open it; pass a records file of pounce bench");
  json run;
  try {
    run = json::parse(file);
  } catch (const json::exception& error) {
    detail::fail("--record-from ", run_file, " is not JSON: ", error.what());
  }
  POUNCE_CHECK(run.is_array(), "--record-from ", run_file, " is not a JSON list of records");
  for (const std::string& written : record_results(dir, run))
    std::cout << "recorded into " << written << " (the latest record per configuration)\n";
  return 0;
}

int bench_command(const BenchOptions& options, const std::string& command_line) {
  const Machine machine = probe_machine();
  const bool have_gpu = machine.cuda_compiled && machine.num_gpus > 0;
  if (options.backend == "auto" && !have_gpu) {
    std::cerr << "pounce bench needs a GPU, and " << choose_backend("auto", machine).reason
              << ".\nNothing to measure here; `pounce run` checks the layer on the CPU reference backend "
              << "(`pounce bench --backend cpu` exercises this tool on it, with meaningless timings).\n";
    return 2;
  }
  const Backend backend =
      choose_backend(options.backend == "auto" ? "gpu" : options.backend, machine).backend;
  const bool on_gpu = backend == Backend::kGpu;

  // Everything that can be wrong with the options fails here, before any GPU work.
  const std::vector<BenchPass> passes = parse_passes(options.passes);
  const Precision precision = parse_precision(options.precision);
  // FP8: the BF16 layer too, just before, on the same inputs (speedup_vs_bf16); its records are BF16 records.
  const std::vector<Precision> precisions = precision == Precision::kFP8
                                                ? std::vector<Precision>{Precision::kBF16, Precision::kFP8}
                                                : std::vector<Precision>{Precision::kBF16};
  const std::vector<std::string> peers = parse_peers(options.peers);
  POUNCE_CHECK(!options.impls.empty(), "--impl is empty; choose fused, fused-all or staged");
  for (const std::string& impl : options.impls) {
    Config config;
    select_impl(impl, config);
  }
  std::vector<Preset> presets;
  for (const std::string& name : options.presets) presets.push_back(bench_preset(name));
  POUNCE_CHECK(!presets.empty() && !options.tokens.empty(), "--preset and --tokens must name at least one");
  for (int64_t tokens : options.tokens) POUNCE_CHECK(tokens > 0, "--tokens ", tokens, " must be positive");
  const int R = options.ranks > 0 ? options.ranks : (on_gpu ? machine.num_gpus : 2);
  POUNCE_CHECK(!on_gpu || R <= machine.num_gpus, "--ranks ", R, " needs that many GPUs but ",
               machine.num_gpus, " are visible");
  POUNCE_CHECK(options.iters >= 1 && options.warmup >= 0, "--iters must be >= 1 and --warmup >= 0");
  POUNCE_CHECK(options.input_sets >= 0, "--input-sets must be >= 0 (0 = enough to exceed twice the L2)");
  const bool record = is_record_dir(options.out);
  POUNCE_CHECK(on_gpu || !record, "--out ", options.out,
               " records into a folder of benchmark records, and the CPU reference backend's timings are "
               "not benchmarks; write them to a file (--out FILE.json)");
  // The smallest ring one expert's rows fit (src/config.cpp): ranks x tokens, padded to 128.
  auto smallest_ring = [R](int64_t tokens) { return (R * tokens + kBlockM - 1) / kBlockM * kBlockM; };
  POUNCE_CHECK(options.macrobatch >= -1, "--macrobatch ", options.macrobatch,
               " must be 0 (the worst case), -1 (the smallest ring) or a row count");
  for (int64_t tokens : options.tokens) {
    POUNCE_CHECK(options.macrobatch <= 0 || options.macrobatch >= smallest_ring(tokens), "--macrobatch ",
                 options.macrobatch, " is below the ", smallest_ring(tokens),
                 " rows one expert can receive at ", tokens, " tokens per rank on ", R,
                 " ranks; raise it, or pass -1 for the smallest ring");
  }

  set_default_environment(build_info().commit);
  const GpuFacts facts = gpu_facts();
  RecordContext context;
  context.gpu = on_gpu ? facts.name : "none (CPU reference backend; timings are not benchmarks)";
  context.driver = facts.driver;
  context.cuda = facts.cuda;
  context.nccl =
      gpu::nccl_runtime_version().empty() ? build_info().nccl_version : gpu::nccl_runtime_version();
  context.commit = build_info().commit;
  context.command = command_line;
  context.date = utc_now_iso();
  const std::string out_path =
      options.out.empty() ? default_out_path(options.name, context.date, std::getenv("TMPDIR")) : options.out;
  const int64_t l2 = on_gpu ? l2_bytes() : kAssumedL2Bytes;
  const std::string rotation =
      options.input_sets > 0
          ? std::to_string(options.input_sets) + " input sets rotate"
          : format("inputs rotate over enough sets to exceed 2 x %.0f MiB of L2 (within %d sets, %lld GiB)",
                   static_cast<double>(l2) / (1 << 20), kMaxInputSets,
                   static_cast<long long>(kMaxRotationBytes >> 30));
  std::cout
      << format(
             "%d rank%s on %s; median of %d timed runs after %d warm-up, per run the slowest rank (late: "
             "the median of their later half); %s\n",
             R, R > 1 ? "s" : "", on_gpu ? facts.name.c_str() : "the CPU reference backend", options.iters,
             options.warmup, rotation.c_str())
      << (precision == Precision::kFP8
              ? "fp8: each configuration's BF16 layer is measured too, just before, on the same inputs "
                "(speedup_vs_bf16); the weights are quantized once, outside the timed runs "
                "(weight_quantize_ms); "
                "the baseline and the peers are BF16\n"
              : "")
      << std::flush;

  json records = json::array();
  Progress progress(true);
  int failures = 0;
  const size_t num_configs = presets.size() * options.tokens.size();
  size_t config_idx = 0;
  for (const Preset& preset : presets) {
    for (int64_t tokens : options.tokens) {
      Shape shape = preset.shape;
      shape.max_tokens = tokens;
      shape.num_ranks = R;
      Measurement setup;
      setup.preset = preset.name;
      setup.shape = shape;
      setup.activation = preset.activation;
      setup.backend = backend;
      setup.warmup = options.warmup;
      setup.iters = options.iters;
      setup.macrobatch_size = options.macrobatch < 0 ? smallest_ring(tokens) : options.macrobatch;
      setup.input_sets =
          options.input_sets > 0 ? options.input_sets : rotation_sets(input_set_bytes(shape), l2);
      const std::string what = preset.name + ", " + std::to_string(tokens) + " tokens/rank";
      progress.line(format("configuration %zu/%zu: %s on %d rank%s", ++config_idx, num_configs, what.c_str(),
                           R, R > 1 ? "s" : ""));
      progress.stage(what + ": generating inputs");
      HostProblem problem;
      std::string problem_error;
      try {
        if (!on_gpu) check_cpu_memory(shape);
        problem = generate_problem(shape, preset.activation, options.seed, 0, [&](double done) {
          progress.update(format("%s: generating inputs, %.0f %%", what.c_str(), 100.0 * done));
        });
      } catch (const std::exception& error) {
        problem_error = error.what();
      }
      for (const std::string& impl : options.impls) {
        for (Precision p : precisions) {
          setup.impl = impl;
          setup.precision = p;
          progress.stage(what + ", " + impl + " " + to_string(p) + ": " + std::to_string(setup.input_sets) +
                         " input sets");
          GpuTelemetry telemetry(on_gpu ? R : 0);
          const std::vector<Measurement> measured = problem_error.empty()
                                                        ? measure(problem, setup, passes, &progress)
                                                        : failed_measurements(passes, setup, problem_error);
          const TelemetrySummary ran_at = telemetry.stop();
          bool failed = false;
          for (const Measurement& m : measured) {
            failed |= m.run_failed;
            records.push_back(make_record(context, m));
            add_telemetry(records.back(), ran_at);
          }
          failures += failed;
        }
      }
    }
  }
  progress.finish();

  const std::vector<BenchPass> base_passes = baseline_passes(passes);
  const std::string torchrun = find_executable(options.torchrun);
  if (!on_gpu) {
    std::cerr << "note: no baseline and no peers on the CPU reference backend\n";
  } else if (options.no_baseline) {
    std::cerr << "warning: --no-baseline: records have no speedup_vs_baseline"
              << (peers.empty() ? "" : ", and the peers (run in the baseline's process) are not measured")
              << "\n";
  } else if (base_passes.empty()) {
    std::cerr << "note: the baseline and the peers measure forward and forward_backward; neither asked\n";
  } else if (torchrun.empty()) {
    std::cerr << "warning: '" << options.torchrun << "' not found; skipping the baseline (records have no "
              << "speedup_vs_baseline); pass --torchrun PATH or --no-baseline\n";
  } else if (!std::filesystem::exists(options.baseline_script)) {
    std::cerr << "warning: baseline script '" << options.baseline_script << "' not found; skipping the "
              << "baseline; pass --baseline-script PATH (run from the repository root)\n";
  } else {
    BaselineRun run;
    run.torchrun = torchrun;
    run.script = options.baseline_script;
    run.ranks = R;
    run.presets = options.presets;
    run.tokens = options.tokens;
    run.passes = base_passes;
    run.peers = peers;
    run.warmup = options.warmup;
    run.iters = options.iters;
    // One process measures every baseline configuration, its setup included: its records share that run's
    // telemetry, the readings at half its highest power or more (on the GPU its setup and checks read
    // 170-180 W, its timed runs several hundred).
    GpuTelemetry telemetry(R);
    json baseline = [&] {
      const TimedWork baseline_process(true);
      return run_baseline(run);
    }();
    constexpr double kBaselineBusyFraction = 0.5;
    const TelemetrySummary ran_at = telemetry.stop(kBaselineBusyFraction);
    add_baseline_telemetry(baseline, telemetry.samples(), ran_at);
    for (json& record : baseline) records.push_back(record);
  }
  apply_speedups(records);

  print_table(std::cout, records);
  std::cout << side_by_side(records);
  if (record) {
    std::vector<std::string> files;
    try {
      files = record_results(out_path, records);
    } catch (const Error&) {  // keep what was measured, then say why it was not recorded
      const std::string kept = default_out_path(options.name, context.date, std::getenv("TMPDIR"));
      write_json(records, kept);
      std::cerr << "not recorded; the run's records are in " << kept << "\n";
      throw;
    }
    for (const std::string& file : files)
      std::cout << "recorded into " << file << " (the latest record per configuration)\n";
    // The run's own records beside its chart, outside the source tree: one PNG per sweep.
    const std::string run_path = default_out_path(options.name, context.date, std::getenv("TMPDIR"));
    write_json(records, run_path);
    std::cout << "wrote the run's " << records.size() << " records to " << run_path << "\n";
    write_chart(options, run_path);
    for (const json& r : records)
      if (!is_recordable(r))
        std::cerr << "not recorded (not measured): " << r.value("impl", "") << " " << r.value("pass", "")
                  << " " << r.value("preset", "") << " " << r.value("tokens_per_rank", int64_t{0})
                  << " tokens/rank\n";
    std::cout << "README.md's table is written from bench/results/: python3 bench/results_table.py --write "
                 "README.md\n";
  } else {
    const std::filesystem::path parent = std::filesystem::path(out_path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    write_json(records, out_path);
    std::cout << "wrote " << records.size() << " records to " << out_path << "\n";
    write_chart(options, out_path);
  }
  return failures > 0 ? 2 : 0;
}

}  // namespace pounce::cli
