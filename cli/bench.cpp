#include "cli/bench.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

#include "pounce/error.h"
#include "cli/parallel.h"
#include "cli/report.h"

namespace pounce::cli {
namespace {

using nlohmann::json;

std::string without_prefix(const std::string& message) {
  const std::string prefix = "pounce: ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

std::string join(const std::vector<std::string>& parts) {
  std::string out;
  for (const std::string& part : parts) out += (out.empty() ? "" : ",") + part;
  return out;
}

// A record with a time: not one that stands for a failed or skipped measurement.
bool is_measured(const json& record) {
  const auto ms = record.find("median_ms");
  return ms != record.end() && ms->is_number();
}

// A JSON number, or null for "none".
json number_or_null(bool known, double value) {
  return known ? json(value) : json(nullptr);
}

}  // namespace

// ---- what is measured ----------------------------------------------------------------------------------

const char* to_string(BenchPass pass) {
  switch (pass) {
    case BenchPass::kForward:
      return "forward";
    case BenchPass::kBackward:
      return "backward";
    case BenchPass::kForwardBackward:
      return "forward_backward";
  }
  return "?";
}

std::vector<BenchPass> parse_passes(const std::vector<std::string>& names) {
  bool wanted[3] = {false, false, false};
  for (const std::string& name : names) {
    if (name == "all") {
      wanted[0] = wanted[2] = true;
    } else if (name == "forward") {
      wanted[0] = true;
    } else if (name == "backward") {
      wanted[1] = true;
    } else if (name == "forward_backward") {
      wanted[2] = true;
    } else {
      detail::fail("--pass ", name, " is unknown; choose forward, backward, forward_backward or all");
    }
  }
  std::vector<BenchPass> passes;
  for (BenchPass pass : {BenchPass::kForward, BenchPass::kBackward, BenchPass::kForwardBackward})
    if (wanted[static_cast<int>(pass)]) passes.push_back(pass);
  POUNCE_CHECK(!passes.empty(), "--pass is empty; choose forward, backward, forward_backward or all");
  return passes;
}

bool needs_backward(const std::vector<BenchPass>& passes) {
  return std::any_of(passes.begin(), passes.end(),
                     [](BenchPass pass) { return pass != BenchPass::kForward; });
}

double pass_flops(BenchPass pass, double forward_flops) {
  switch (pass) {
    case BenchPass::kForward:
      return forward_flops;
    case BenchPass::kBackward:
      return 2.0 * forward_flops;
    case BenchPass::kForwardBackward:
      return 3.0 * forward_flops;
  }
  return 0.0;
}

Preset bench_preset(const std::string& name) {
  const std::string prefix = "custom:";
  if (name.rfind(prefix, 0) != 0) return find_preset(name);
  std::vector<int64_t> fields;
  size_t begin = prefix.size();
  while (begin <= name.size()) {
    const size_t end = std::min(name.find(':', begin), name.size());
    const std::string field = name.substr(begin, end - begin);
    POUNCE_CHECK(!field.empty() && field.find_first_not_of("0123456789") == std::string::npos, "--preset ",
                 name, ": '", field, "' is not a size; write custom:H:I:E:k or custom:H:I:E:k:Is");
    fields.push_back(std::stoll(field));
    begin = end + 1;
  }
  POUNCE_CHECK(fields.size() == 4 || fields.size() == 5, "--preset ", name, " has ", fields.size(),
               " sizes; write custom:H:I:E:k or custom:H:I:E:k:Is");
  Preset preset;
  preset.name = name;
  preset.shape.hidden = fields[0];
  preset.shape.intermediate = fields[1];
  preset.shape.num_experts = fields[2];
  preset.shape.num_topk = fields[3];
  preset.shape.shared_intermediate = fields.size() == 5 ? fields[4] : 0;
  preset.activation = Activation::swiglu();
  return preset;
}

void select_impl(const std::string& impl, Config& config) {
  if (impl == "fused") {  // the defaults: the fused forward kernel, the backward chosen by shape
    config.kernel_path = KernelPath::kFused;
    config.backward_kernel_path = KernelPath::kAuto;
  } else if (impl == "fused-staged") {  // the fused forward kernel, the staged backward
    config.kernel_path = KernelPath::kFused;
    config.backward_kernel_path = KernelPath::kStaged;
  } else if (impl == "fused-all") {  // the fused forward and the fused backward kernel
    config.kernel_path = KernelPath::kFused;
    config.backward_kernel_path = KernelPath::kFused;
  } else if (impl == "staged") {  // the chains of standalone stage kernels
    config.kernel_path = KernelPath::kStaged;
    config.backward_kernel_path = KernelPath::kStaged;
  } else {
    detail::fail("--impl ", impl, " is unknown; choose fused, fused-all, fused-staged or staged");
  }
}

// ---- input rotation ------------------------------------------------------------------------------------

int64_t input_set_bytes(const Shape& shape) {
  const int64_t T = shape.max_tokens, H = shape.hidden, k = shape.num_topk;
  return 2 * (T * H * 2) + T * k * 4 + T * k * 4;
}

int rotation_sets(int64_t set_bytes, int64_t l2_bytes) {
  if (set_bytes <= 0) return kMinInputSets;
  const int64_t enough = std::max<int64_t>(kMinInputSets, 2 * l2_bytes / set_bytes + 1);
  const int64_t affordable = std::min<int64_t>(kMaxInputSets, kMaxRotationBytes / set_bytes);
  return static_cast<int>(std::max<int64_t>(2, std::min(enough, affordable)));
}

// ---- one measured configuration ------------------------------------------------------------------------

double forward_crossing_bytes_per_rank(const HostProblem& problem) {
  const Shape& s = problem.shape;
  const int64_t El = s.num_local_experts();
  int64_t crossing_pairs = 0;
  for (size_t rank = 0; rank < problem.ranks.size(); ++rank)
    for (int32_t expert : problem.ranks[rank].topk_idx)
      crossing_pairs += expert >= 0 && expert / El != static_cast<int64_t>(rank);
  // dispatch + combine, H bf16 values per row, averaged over the ranks
  return 2.0 * static_cast<double>(crossing_pairs) * static_cast<double>(s.hidden) * 2.0 /
         static_cast<double>(s.num_ranks);
}

std::vector<Measurement> take_measurements(const RunOutcome& outcome, const std::vector<BenchPass>& passes,
                                           const Measurement& common) {
  std::vector<Measurement> out;
  for (BenchPass pass : passes) {
    Measurement m = common;
    m.pass = pass;
    m.repeat_bitwise_equal = outcome.repeat_bitwise_equal;
    m.flops = pass_flops(pass, common.flops);
    m.crossing_bytes =
        pass == BenchPass::kForwardBackward ? 2.0 * common.crossing_bytes : common.crossing_bytes;
    if (pass == BenchPass::kForward) {
      m.times_ms = outcome.forward_ms;
    } else if (!outcome.backward_ran) {
      m.error = "backward did not run: " +
                (outcome.backward_error.empty() ? std::string("not requested") : outcome.backward_error);
    } else {
      m.times_ms = pass == BenchPass::kBackward ? outcome.backward_ms : outcome.forward_backward_ms;
    }
    if (m.error.empty() && m.times_ms.empty()) m.error = "no timed run";
    out.push_back(std::move(m));
  }
  return out;
}

std::vector<Measurement> failed_measurements(const std::vector<BenchPass>& passes, const Measurement& common,
                                             const std::string& error) {
  std::vector<Measurement> out = take_measurements(RunOutcome{}, passes, common);
  for (Measurement& m : out) {
    m.error = without_prefix(error);
    m.run_failed = true;
  }
  return out;
}

std::vector<Measurement> measure(const HostProblem& problem, const Measurement& setup,
                                 const std::vector<BenchPass>& passes, Progress* progress) {
  Measurement common = setup;
  common.shape = problem.shape;
  common.activation = problem.activation;
  common.flops = forward_flops_per_rank(problem);
  common.crossing_bytes = forward_crossing_bytes_per_rank(problem);
  try {
    RunRequest request;
    request.problem = &problem;
    request.config.activation = problem.activation;
    request.config.backend = setup.backend;
    select_impl(setup.impl, request.config);
    request.config.macrobatch_size = setup.macrobatch_size;
    request.config.precision = setup.precision;
    request.warmup = setup.warmup;
    request.iters = setup.iters;
    request.wgrad_fp32 = false;  // bf16 weight gradients, as the baseline's autograd produces
    request.run_backward = needs_backward(passes);
    request.num_input_sets = setup.input_sets;
    request.progress = progress;
    const RunOutcome outcome = setup.backend == Backend::kCpu ? run_on_cpu(request) : run_on_gpu(request);
    common.weight_quantize_ms = outcome.weight_quantize_ms;
    return take_measurements(outcome, passes, common);
  } catch (const std::exception& error) {
    return failed_measurements(passes, common, error.what());
  }
}

// ---- records -------------------------------------------------------------------------------------------

json make_record(const RecordContext& context, const Measurement& m) {
  const bool measured = !m.times_ms.empty() && m.error.empty();
  double median_ms = 0.0, min_ms = 0.0, max_ms = 0.0;
  if (measured) {
    median_ms = median(m.times_ms);
    min_ms = *std::min_element(m.times_ms.begin(), m.times_ms.end());
    max_ms = *std::max_element(m.times_ms.begin(), m.times_ms.end());
  }
  const Shape& s = m.shape;
  json record = {
      {"impl", m.impl},
      {"pass", to_string(m.pass)},
      {"preset", m.preset},
      {"ranks", s.num_ranks},
      {"tokens_per_rank", s.max_tokens},
      {"macrobatch_size", m.macrobatch_size},
      {"precision", to_string(m.precision)},
      {"median_ms", number_or_null(measured, median_ms)},
      {"tflops", number_or_null(measured, tflops(m.flops, median_ms))},
      {"speedup_vs_baseline", nullptr},
      {"late_median_ms", number_or_null(measured, late_half_median(m.times_ms))},
      {"late_speedup_vs_baseline", nullptr},
      {"gpu", context.gpu},
      {"driver", context.driver},
      {"cuda", context.cuda},
      {"nccl", context.nccl},
      {"commit", context.commit},
      {"command", context.command},
      {"date", context.date},
      // how it was measured, and on what
      {"backend", to_string(m.backend)},
      {"min_ms", number_or_null(measured, min_ms)},
      {"max_ms", number_or_null(measured, max_ms)},
      {"times_ms",
       measured ? json(m.times_ms) : json::array()},  // every timed run, in order (the slowest rank)
      {"flops_per_rank", m.flops},
      {"nvlink_gbps", number_or_null(measured && median_ms > 0 && s.num_ranks > 1,
                                     median_ms > 0 ? m.crossing_bytes / (median_ms * 1e-3) / 1e9 : 0.0)},
      {"iters", m.iters},
      {"warmup", m.warmup},
      {"input_sets", m.input_sets},
      {"hidden", s.hidden},
      {"intermediate", s.intermediate},
      {"experts", s.num_experts},
      {"topk", s.num_topk},
      {"shared_intermediate", s.shared_intermediate},
      {"activation", to_string(m.activation.kind)},
      {"repeat_bitwise_equal", m.repeat_bitwise_equal ? json(*m.repeat_bitwise_equal) : json(nullptr)},
  };
  if (m.precision == Precision::kFP8) {
    record["speedup_vs_bf16"] = nullptr;
    record["weight_quantize_ms"] = m.weight_quantize_ms ? json(*m.weight_quantize_ms) : json(nullptr);
    record["precision_notes"] =
        "routed experts in block-scaled E4M3 (docs/design.md §1), the shared expert BF16; speedup_vs_bf16: "
        "the BF16 layer of the same impl, measured just before in the same run on the same inputs; the "
        "baseline and the peers are BF16 (speedup_vs_baseline, speedup_vs compare with them); the weights "
        "are quantized once, outside the timed runs (weight_quantize_ms, one call, the slowest rank); on "
        "GPUs "
        "FP8 runs the stage kernels whatever the impl names (kernel_path)";
    if (m.backend == Backend::kGpu)
      record["kernel_path"] = "staged";  // the fused kernels are BF16 only so far
  }
  if (!measured) record["error"] = m.error.empty() ? "not measured" : m.error;
  return record;
}

namespace {

using ConfigKey = std::tuple<std::string, std::string, int64_t, int64_t>;  // preset, pass, ranks, tokens

ConfigKey config_key(const json& record) {
  return ConfigKey{record.value("preset", ""), record.value("pass", ""), record.value("ranks", int64_t{0}),
                   record.value("tokens_per_rank", int64_t{0})};
}

bool is_fp8(const json& record) {
  return record.value("precision", std::string(to_string(Precision::kBF16))) == to_string(Precision::kFP8);
}

double ms_of(const json& record, const char* field) {
  const auto found = record.find(field);
  return found != record.end() && found->is_number() ? found->get<double>() : 0.0;
}

}  // namespace

void apply_speedups(json& records) {
  // impl -> its time, per configuration; the median of all timed runs, and of their later half (both sides'
  // runs in the same regime of the power limiter; a baseline record without it leaves the late speedup null).
  // BF16 records only: FP8 records are the ones compared with them.
  std::map<ConfigKey, std::map<std::string, double>> median_ms, late_ms;
  for (const json& record : records) {
    const std::string impl = record.value("impl", "");
    if (is_fp8(record)) continue;
    if (ms_of(record, "median_ms") > 0) median_ms[config_key(record)][impl] = ms_of(record, "median_ms");
    if (ms_of(record, "late_median_ms") > 0)
      late_ms[config_key(record)][impl] = ms_of(record, "late_median_ms");
  }
  auto ratio = [](const std::map<ConfigKey, std::map<std::string, double>>& times, const ConfigKey& key,
                  const std::string& other, double own) {
    const auto config = times.find(key);
    if (config == times.end() || own <= 0) return json(nullptr);
    const auto found = config->second.find(other);
    return found != config->second.end() ? json(found->second / own) : json(nullptr);
  };
  for (json& record : records) {
    const ConfigKey key = config_key(record);
    const double own = ms_of(record, "median_ms");
    record["speedup_vs_baseline"] = ratio(median_ms, key, "baseline", own);
    record["late_speedup_vs_baseline"] = ratio(late_ms, key, "baseline", ms_of(record, "late_median_ms"));
    record["floor_fraction"] = ratio(median_ms, key, "floor", own);
    if (is_fp8(record)) record["speedup_vs_bf16"] = ratio(median_ms, key, record.value("impl", ""), own);
    if (is_peer_impl(record.value("impl", ""))) continue;
    json versus = json::object();
    const auto config = median_ms.find(key);
    if (config != median_ms.end() && own > 0)
      for (const auto& [impl, ms] : config->second)
        if (is_peer_impl(impl) && impl != "floor") versus[impl] = ms / own;
    record["speedup_vs"] = versus;
  }
}

bool is_recordable(const json& record) {
  return is_measured(record) || record.value("unsupported", false);
}

// ---- where the records go ------------------------------------------------------------------------------

bool is_record_dir(const std::string& out) {
  return !out.empty() && (out.back() == '/' || std::filesystem::is_directory(out));
}

std::string default_out_path(const std::string& name, const std::string& date, const char* tmpdir) {
  std::string stem = name;
  if (stem.empty()) {
    stem = "pounce-bench-" + date;
    for (char& c : stem) c = c == ':' ? '-' : c;
  }
  const std::string dir = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
  return (std::filesystem::path(dir) / (stem + ".json")).string();
}

RecordKey record_key(const json& record) {
  return RecordKey{record.value("impl", ""),
                   record.value("pass", ""),
                   record.value("preset", ""),
                   record.value("ranks", int64_t{0}),
                   record.value("tokens_per_rank", int64_t{0}),
                   record.value("precision", std::string(to_string(Precision::kBF16)))};
}

std::string results_file_name(int64_t ranks, const std::string& precision) {
  return "ep" + std::to_string(ranks) + "_" + precision + ".json";
}

json merge_records(const json& recorded, const json& run) {
  std::map<RecordKey, json> latest;
  for (const json& record : recorded) latest[record_key(record)] = record;
  for (const json& record : run)
    if (is_recordable(record)) latest[record_key(record)] = record;
  auto pass_rank = [](const std::string& pass) {
    for (BenchPass p : {BenchPass::kForward, BenchPass::kBackward, BenchPass::kForwardBackward})
      if (pass == to_string(p)) return static_cast<int>(p);
    return 3;
  };
  std::vector<std::pair<RecordKey, json>> sorted(latest.begin(), latest.end());
  std::stable_sort(sorted.begin(), sorted.end(), [&](const auto& a, const auto& b) {
    const RecordKey &x = a.first, &y = b.first;
    return std::tuple(x.preset, x.tokens_per_rank, pass_rank(x.pass), x.impl, x.ranks, x.precision) <
           std::tuple(y.preset, y.tokens_per_rank, pass_rank(y.pass), y.impl, y.ranks, y.precision);
  });
  json out = json::array();
  for (auto& [key, record] : sorted) out.push_back(std::move(record));
  return out;
}

std::vector<std::string> record_results(const std::string& dir, const json& run) {
  std::map<std::string, json> by_file;  // file name -> the run's records that go there
  for (const json& record : run) {
    if (!is_recordable(record)) continue;
    const RecordKey key = record_key(record);
    json& records = by_file[results_file_name(key.ranks, key.precision)];
    if (records.is_null()) records = json::array();
    records.push_back(record);
  }
  std::filesystem::create_directories(dir);
  std::vector<std::string> written;
  for (const auto& [name, records] : by_file) {
    const std::string path = (std::filesystem::path(dir) / name).string();
    json recorded = json::array();
    if (std::filesystem::exists(path)) {
      std::ifstream file(path);
      try {
        recorded = json::parse(file);
      } catch (const json::exception& error) {
        detail::fail("cannot read the records in '", path, "': ", error.what());
      }
      POUNCE_CHECK(recorded.is_array(), "'", path, "' is not a JSON list of records; move it away");
    }
    write_json(merge_records(recorded, records), path);
    written.push_back(path);
  }
  return written;
}

// ---- peers ---------------------------------------------------------------------------------------------

std::vector<std::string> parse_peers(const std::vector<std::string>& names) {
  std::set<std::string> wanted;
  for (const std::string& name : names) {
    if (name == "all") {
      wanted.insert(std::begin(kPeers), std::end(kPeers));
    } else if (name != "none") {
      POUNCE_CHECK(std::find(std::begin(kPeers), std::end(kPeers), name) != std::end(kPeers), "--peers ",
                   name, " is unknown; choose liger, transformers, floor, all or none");
      wanted.insert(name);
    }
  }
  std::vector<std::string> out;
  for (const char* peer : kPeers)
    if (wanted.count(peer) > 0) out.push_back(peer);
  return out;
}

bool is_peer_impl(const std::string& impl) {
  return impl == "baseline" || std::find(std::begin(kPeers), std::end(kPeers), impl) != std::end(kPeers);
}

void add_baseline_telemetry(json& records, const std::vector<TelemetrySample>& samples,
                            const TelemetrySummary& whole_run) {
  for (json& record : records) {
    if (!is_measured(record)) continue;
    const json window = record.value("timed_window_unix_s", json());
    TelemetrySummary within;
    if (window.is_array() && window.size() == 2 && window[0].is_number() && window[1].is_number())
      within = summarize_window(samples, window[0].get<double>(), window[1].get<double>());
    if (within.samples > 0) {
      add_telemetry(record, within);
      record["telemetry_scope"] = "the readings within this pass's timed runs";
    } else {
      add_telemetry(record, whole_run);
      record["telemetry_scope"] = "the baseline run's readings at >= half its highest power";
    }
  }
}

namespace {

std::string cell(const json& record, const char* key, const char* pattern, double scale = 1.0) {
  const auto found = record.find(key);
  return found != record.end() && found->is_number() ? format(pattern, found->get<double>() * scale) : "-";
}

}  // namespace

std::string side_by_side(const json& records) {
  std::vector<ConfigKey> order;
  std::map<ConfigKey, std::vector<const json*>> by_config;
  bool any_peer = false;
  for (const json& record : records) {
    const ConfigKey key = config_key(record);
    if (by_config.find(key) == by_config.end()) order.push_back(key);
    by_config[key].push_back(&record);
    const std::string impl = record.value("impl", "");
    any_peer |= is_peer_impl(impl) && impl != "baseline";
  }
  if (!any_peer) return "";
  std::string out =
      "side by side (x: the first Pounce impl's speed-up over the row, same run; floor: the compute-only "
      "floor's time / the row's):\n";
  for (const ConfigKey& key : order) {
    const std::vector<const json*>& group = by_config[key];
    const json* pounce = nullptr;
    for (const json* r : group)
      if (!is_peer_impl(r->value("impl", "")) && is_measured(*r)) {
        pounce = r;
        break;
      }
    const auto& [preset, pass, ranks, tokens] = key;
    out += format("%s, EP%lld, %lld tokens/rank, %s\n", preset.c_str(), static_cast<long long>(ranks),
                  static_cast<long long>(tokens), pass.c_str());
    out += format("  %-13s %10s %9s %8s %7s %6s %5s  %s\n", "impl", "median ms", "TFLOP/s", "x", "floor",
                  "SM MHz", "W/GPU", "version");
    std::string not_run;
    for (const json* r : group) {
      const std::string impl = r->value("impl", "") + (is_fp8(*r) ? " fp8" : "");
      if (!is_measured(*r)) {
        not_run += format("  %s did not run%s: %s\n", impl.c_str(),
                          r->value("unsupported", false) ? " (cannot)" : "", r->value("error", "").c_str());
        continue;
      }
      std::string versus = "-";
      if (pounce != nullptr && ms_of(*pounce, "median_ms") > 0)
        versus = format("%.2fx", ms_of(*r, "median_ms") / ms_of(*pounce, "median_ms"));
      out += format("  %-13s %10s %9s %8s %7s %6s %5s  %s\n", impl.c_str(),
                    cell(*r, "median_ms", "%.3f").c_str(), cell(*r, "tflops", "%.1f").c_str(), versus.c_str(),
                    cell(*r, "floor_fraction", "%.0f%%", 100.0).c_str(),
                    cell(*r, "sm_clock_mhz", "%.0f").c_str(), cell(*r, "power_w", "%.0f").c_str(),
                    r->value("peer_version", "").c_str());
    }
    out += not_run;
  }
  return out;
}

// ---- the baseline --------------------------------------------------------------------------------------

std::vector<BenchPass> baseline_passes(const std::vector<BenchPass>& passes) {
  std::vector<BenchPass> out;
  for (BenchPass pass : passes)
    if (pass != BenchPass::kBackward) out.push_back(pass);
  return out;
}

std::string baseline_command(const BaselineRun& run) {
  std::vector<std::string> tokens, passes;
  for (int64_t t : run.tokens) tokens.push_back(std::to_string(t));
  for (BenchPass pass : run.passes) passes.push_back(to_string(pass));
  return shell_quote(run.torchrun) + " --standalone --nproc-per-node=" + std::to_string(run.ranks) + " " +
         shell_quote(run.script) + " --preset " + shell_quote(join(run.presets)) + " --tokens " +
         join(tokens) + " --passes " + join(passes) + " --warmup " + std::to_string(run.warmup) +
         " --iters " + std::to_string(run.iters) + " --sets 0" +
         (run.peers.empty() ? std::string() : " --peers " + join(run.peers)) + " --json " +
         shell_quote(run.json_path);
}

std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

}  // namespace pounce::cli
