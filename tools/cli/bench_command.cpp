// `pounce bench`: presets x tokens per rank on every visible GPU, timed through the public API, with the
// PyTorch baseline (bench/baselines/torch_moe.py under torchrun) measured in the same run on the same GPUs.
// Writes bench/results/<name>.json: a list of records with the keys of DESIGN.md §7.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <tuple>

#include "pounce/error.h"
#include "pounce/version.h"
#include "src/gpu_backend.h"
#include "tools/cli/commands.h"
#include "tools/cli/inputs.h"
#include "tools/cli/parallel.h"
#include "tools/cli/progress.h"
#include "tools/cli/report.h"
#include "tools/cli/runner.h"

namespace pounce::cli {
namespace {

using nlohmann::json;
using BaselineKey = std::tuple<std::string, std::string, int64_t, int64_t>;  // preset, pass, ranks, tokens

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

std::string join(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& part : parts) out += (out.empty() ? "" : ",") + part;
  return out;
}

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// Runs the baseline once for every preset and token count; returns its records (empty on failure, with
// a warning on stderr).
json run_baseline(const BenchOptions& options, const std::string& torchrun, int num_ranks) {
  char path[] = "/tmp/pounce_baseline_XXXXXX";
  const int fd = mkstemp(path);
  POUNCE_CHECK(fd >= 0, "cannot create a temporary file for the baseline's records in /tmp");
  close(fd);
  std::vector<std::string> tokens;
  for (int64_t t : options.tokens) tokens.push_back(std::to_string(t));
  const std::string command = shell_quote(torchrun) + " --nproc-per-node=" + std::to_string(num_ranks) + " " +
                              shell_quote(options.baseline_script) + " --preset " +
                              shell_quote(join(options.presets)) + " --tokens " + join(tokens) +
                              " --passes forward,forward_backward --iters " + std::to_string(options.iters) +
                              " --json " + path;
  std::cerr << "baseline: " << command << "\n" << std::flush;
  const int status = std::system(command.c_str());
  json records = json::array();
  if (status != 0) {
    std::cerr << "warning: the baseline failed (exit status " << status << "); records have no speedup\n";
  } else {
    try {
      std::ifstream file(path);
      records = json::parse(file);
      if (!records.is_array()) records = json::array();
    } catch (const std::exception& error) {
      std::cerr << "warning: cannot read the baseline's records from " << path << ": " << error.what()
                << "\n";
    }
  }
  std::filesystem::remove(path);
  return records;
}

}  // namespace

int bench_command(const BenchOptions& options, const std::string& command_line) {
  const Machine machine = probe_machine();
  if (!(machine.cuda_compiled && machine.num_gpus > 0)) {
    std::cerr << "pounce bench needs a GPU, and " << choose_backend("auto", machine).reason
              << ".\nNothing to measure here; `pounce run` checks the layer on the CPU reference backend.\n";
    return 2;
  }
  for (const std::string& impl : options.impls) {
    POUNCE_CHECK(impl == "fused" || impl == "staged", "--impl ", impl, " is unknown; choose fused or staged");
    POUNCE_CHECK(impl == "staged", "--impl fused: the GPU backend runs the staged path until the fused ",
                 "kernel lands (issue #4); bench --impl staged");
  }
  const int R = options.ranks > 0 ? options.ranks : machine.num_gpus;
  POUNCE_CHECK(R <= machine.num_gpus, "--ranks ", R, " needs that many GPUs but ", machine.num_gpus,
               " are visible");
  POUNCE_CHECK(options.iters >= 1 && options.warmup >= 0, "--iters must be >= 1 and --warmup >= 0");
  const GpuFacts facts = gpu_facts();
  const std::string nccl =
      gpu::nccl_runtime_version().empty() ? build_info().nccl_version : gpu::nccl_runtime_version();
  const std::string date = utc_now_iso();
  std::string name = options.name;
  if (name.empty()) {
    name = "pounce-" + date;
    for (char& c : name) c = c == ':' ? '-' : c;
  }
  const std::string out_path = options.out.empty() ? "bench/results/" + name + ".json" : options.out;

  json records = json::array();
  auto record = [&](const std::string& impl, const std::string& pass, const std::string& preset,
                    int64_t tokens, double ms, double flops) {
    records.push_back({{"impl", impl},
                       {"pass", pass},
                       {"preset", preset},
                       {"ranks", R},
                       {"tokens_per_rank", tokens},
                       {"precision", "bf16"},
                       {"median_ms", ms},
                       {"tflops", tflops(flops, ms)},
                       {"speedup_vs_baseline", nullptr},
                       {"gpu", facts.name},
                       {"driver", facts.driver},
                       {"cuda", facts.cuda},
                       {"nccl", nccl},
                       {"commit", build_info().commit},
                       {"command", command_line},
                       {"date", date}});
  };

  Progress progress(true);
  int failures = 0;
  const std::string impl = options.impls.front();
  for (const std::string& preset_name : options.presets) {
    const Preset& preset = find_preset(preset_name);
    for (int64_t tokens : options.tokens) {
      progress.stage(preset_name + ", " + std::to_string(tokens) + " tokens/rank: generating inputs");
      try {
        Shape shape = preset.shape;
        shape.max_tokens = tokens;
        shape.num_ranks = R;
        const HostProblem problem = generate_problem(shape, preset.activation, options.seed);
        RunRequest request;
        request.problem = &problem;
        request.config.activation = preset.activation;
        request.config.backend = Backend::kGpu;
        request.warmup = options.warmup;
        request.iters = options.iters;
        request.wgrad_fp32 = false;  // bf16 weight gradients, as the baseline's autograd produces
        request.progress = &progress;
        const RunOutcome outcome = run_on_gpu(request);
        const double flops = forward_flops_per_rank(problem);
        record(impl, "forward", preset_name, tokens, median(outcome.forward_ms), flops);
        if (outcome.backward_ran) {
          std::vector<double> both;
          for (size_t i = 0; i < outcome.backward_ms.size(); ++i)
            both.push_back(outcome.forward_ms[i] + outcome.backward_ms[i]);
          record(impl, "backward", preset_name, tokens, median(outcome.backward_ms), 2.0 * flops);
          record(impl, "forward_backward", preset_name, tokens, median(both), 3.0 * flops);
        } else {
          progress.finish();
          std::cerr << "warning: " << preset_name << " T=" << tokens
                    << ": backward did not run: " << outcome.backward_error << "\n";
        }
      } catch (const Error& error) {
        progress.finish();
        std::cerr << "warning: " << preset_name << " T=" << tokens << " failed: " << error.what() << "\n";
        ++failures;
      }
    }
  }
  progress.finish();

  // The baseline, same GPUs, after ours so the two never share them.
  const std::string torchrun = find_executable(options.torchrun);
  std::map<BaselineKey, double> baseline_ms;
  if (options.no_baseline) {
    std::cerr << "warning: --no-baseline: records have no speedup_vs_baseline\n";
  } else if (torchrun.empty()) {
    std::cerr << "warning: '" << options.torchrun << "' not found; skipping the baseline (records have no "
              << "speedup_vs_baseline); pass --torchrun PATH or --no-baseline\n";
  } else if (!std::filesystem::exists(options.baseline_script)) {
    std::cerr << "warning: baseline script '" << options.baseline_script << "' not found; skipping the "
              << "baseline; pass --baseline-script PATH (run from the repository root)\n";
  } else {
    for (json& baseline : run_baseline(options, torchrun, R)) {
      baseline["speedup_vs_baseline"] = 1.0;
      baseline_ms[{baseline.value("preset", ""), baseline.value("pass", ""),
                   baseline.value("ranks", int64_t{0}), baseline.value("tokens_per_rank", int64_t{0})}] =
          baseline.value("median_ms", 0.0);
      records.push_back(baseline);
    }
  }
  for (json& rec : records) {
    if (rec["impl"] == "baseline") continue;
    const auto found = baseline_ms.find({rec["preset"], rec["pass"], rec["ranks"], rec["tokens_per_rank"]});
    if (found != baseline_ms.end() && rec["median_ms"].get<double>() > 0)
      rec["speedup_vs_baseline"] = found->second / rec["median_ms"].get<double>();
  }

  std::cout << format("%-8s %-17s %-14s %6s %5s %11s %9s %9s\n", "impl", "pass", "preset", "ranks", "T/rk",
                      "median ms", "TFLOP/s", "speedup");
  for (const json& rec : records) {
    const std::string speedup = rec["speedup_vs_baseline"].is_number()
                                    ? format("%.2fx", rec["speedup_vs_baseline"].get<double>())
                                    : "-";
    std::cout << format("%-8s %-17s %-14s %6lld %5lld %11.3f %9.1f %9s\n", rec.value("impl", "").c_str(),
                        rec.value("pass", "").c_str(), rec.value("preset", "").c_str(),
                        static_cast<long long>(rec.value("ranks", int64_t{0})),
                        static_cast<long long>(rec.value("tokens_per_rank", int64_t{0})),
                        rec.value("median_ms", 0.0), rec.value("tflops", 0.0), speedup.c_str());
  }
  const std::filesystem::path parent = std::filesystem::path(out_path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  write_json(records, out_path);
  std::cout << "wrote " << records.size() << " records to " << out_path << "\n";
  return failures > 0 ? 2 : 0;
}

}  // namespace pounce::cli
