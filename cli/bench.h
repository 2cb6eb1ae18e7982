// The method of `pounce bench` (docs/design.md §7), apart from the command that drives it: which passes are
// timed, how many input sets rotate so that L2 holds none of them, the useful flops and crossing bytes a
// pass counts, the records and their same-run speed-ups, where the records go (the latest per configuration
// when recorded), the baseline's command line. All of it is unit-tested without a GPU
// (tests/cpu/test_cli_bench.cpp); all but measure() and record_results() is pure.
#pragma once

#include <nlohmann/json.hpp>

#include <compare>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pounce/config.h"
#include "pounce/shape.h"
#include "cli/inputs.h"
#include "cli/progress.h"
#include "cli/runner.h"
#include "cli/telemetry.h"

namespace pounce::cli {

// ---- what is measured ----------------------------------------------------------------------------------

enum class BenchPass { kForward, kBackward, kForwardBackward };
const char* to_string(BenchPass pass);  // "forward" | "backward" | "forward_backward", as in the records

// `names` hold forward, backward, forward_backward or all (= forward, forward_backward); the result is in
// that order, without repeats. Throws pounce::Error on any other name or an empty list.
std::vector<BenchPass> parse_passes(const std::vector<std::string>& names);
bool needs_backward(const std::vector<BenchPass>& passes);

// Useful work of `pass` (docs/design.md §7): the forward's flops once, backward twice, forward + backward
// three times. No padding rows, no recompute.
double pass_flops(BenchPass pass, double forward_flops);

// A model preset by name, or a custom shape "custom:H:I:E:k[:Is]" (SwiGLU), named by that string.
// Throws pounce::Error naming the known presets or the bad field.
Preset bench_preset(const std::string& name);

// Sets `config` up for `impl` (fused, fused-all, fused-staged, staged). Throws pounce::Error naming the
// known ones for an unknown impl.
void select_impl(const std::string& impl, Config& config);

// ---- input rotation ------------------------------------------------------------------------------------

inline constexpr int64_t kAssumedL2Bytes = int64_t{60} << 20;  // H200 (60 MB), when no GPU says
inline constexpr int kMinInputSets = 3;                        // as the baseline's minimum
inline constexpr int kMaxInputSets = 256;
inline constexpr int64_t kMaxRotationBytes = int64_t{2} << 30;  // all sets of one rank together

// One rank's rotated inputs: x and d_out [T,H] bf16, topk_idx [T,k] int32, topk_weights [T,k] fp32.
int64_t input_set_bytes(const Shape& shape);

// Input sets to rotate: the fewest (at least kMinInputSets) that together exceed twice the L2, so no run
// finds the previous use of its inputs in L2; at most kMaxInputSets and kMaxRotationBytes, but never
// fewer than 2 (then the sets alone are already far larger than L2).
int rotation_sets(int64_t set_bytes, int64_t l2_bytes);

// ---- one measured configuration ------------------------------------------------------------------------

struct Measurement {
  std::string impl;    // staged | fused (| baseline, for records read back)
  std::string preset;  // preset name or custom spec
  BenchPass pass = BenchPass::kForward;
  Shape shape;  // max_tokens = tokens per rank, num_ranks = R
  Activation activation;
  Backend backend = Backend::kGpu;
  int warmup = 0;
  int iters = 0;
  int input_sets = 1;
  int64_t macrobatch_size = 0;  // Config::macrobatch_size of the runs (0 = the worst case)
  Precision precision = Precision::kBF16;
  std::optional<double> weight_quantize_ms;  // FP8: quantize_weights_fp8 once, outside the timed runs
  double flops = 0.0;                        // useful work per rank (docs/design.md §7), averaged over ranks
  double crossing_bytes = 0.0;               // bytes of token rows that cross to another rank, per rank
  std::vector<double> times_ms;              // per timed run, the slowest rank; empty when not measured
  std::string error;                         // why it was not measured
  bool run_failed = false;  // the runs themselves failed (not only a backward that did not run)
  std::optional<bool> repeat_bitwise_equal;  // the last run == the first on its input set (runner.h)
};

// Bytes of token rows that one forward moves between ranks, per rank: every routed pair whose expert lives
// on another rank is pulled there (dispatch) and its output pushed back (combine), H bf16 values each way.
// Backward moves as much again. The same count as the baseline's a2a_gbps.
double forward_crossing_bytes_per_rank(const HostProblem& problem);

// The measurements of `passes` from one outcome of forward (+ backward) runs: forward times, backward
// times, and each run's slowest forward + backward. A backward pass whose backward did not run gets the
// reason as its error. `common` holds the forward's flops and crossing bytes, and every other field.
std::vector<Measurement> take_measurements(const RunOutcome& outcome, const std::vector<BenchPass>& passes,
                                           const Measurement& common);

// The measurements of `passes` when the runs could not happen: each carries `error` and run_failed.
std::vector<Measurement> failed_measurements(const std::vector<BenchPass>& passes, const Measurement& common,
                                             const std::string& error);

// Times every pass of `passes` for `problem` with `setup`'s impl, backend, warmup, iters and input sets,
// in one series of runs (backward runs after every forward when a pass needs it). Never throws
// pounce::Error: a failure becomes the error of every pass, so a sweep goes on.
std::vector<Measurement> measure(const HostProblem& problem, const Measurement& setup,
                                 const std::vector<BenchPass>& passes, Progress* progress);

// ---- records -------------------------------------------------------------------------------------------

// What every record of one `pounce bench` run shares.
struct RecordContext {
  std::string gpu, driver, cuda, nccl, commit, command, date;
};

// A record with every key of docs/design.md §7 (median_ms, tflops null when not measured, with "error" then),
// speedup_vs_baseline null until apply_speedups, and the shape, timing method and crossing bandwidth. An FP8
// record also has speedup_vs_bf16 (null until apply_speedups), weight_quantize_ms and precision_notes.
nlohmann::json make_record(const RecordContext& context, const Measurement& measurement);

// Same-run ratios between the records of one configuration (the same preset, pass, ranks and tokens per
// rank), each a time ratio, so > 1 means faster than the other:
//   speedup_vs_baseline       the baseline's median_ms / its own; 1 for baseline records; null without one.
//   late_speedup_vs_baseline  likewise from late_median_ms, the median of the later half of the timed runs.
//   speedup_vs                Pounce's records only: {peer: the peer's median_ms / its own} for every
//   measured
//                             peer record but the floor's (baseline, liger, transformers); {} without any.
//   floor_fraction            every measured record: the compute-only floor's median_ms / its own (the
//                             fraction of the floor's speed it reaches; 1 for the floor); null without one.
//   speedup_vs_bf16           FP8 records only: the same impl's BF16 record's median_ms / its own; null
//                             without one.
// The baseline and the peers are BF16 implementations, so an FP8 record's speedup_vs_baseline and speedup_vs
// compare the FP8 layer with them.
void apply_speedups(nlohmann::json& records);

// A record that goes into a results folder: a measured one, or one whose peer cannot run the configuration
// by its design ("unsupported": true, with its "error"), which stays true until the peer changes.
bool is_recordable(const nlohmann::json& record);

// ---- where the records go ------------------------------------------------------------------------------

// A run's records go to one file outside the source tree (default_out_path), unless `--out` names a folder:
// then they are recorded there, the latest per configuration (record_results). bench/results/ is the
// repository's record; README.md's table is written from it (bench/results_table.py).

// `--out` asks to record when it names an existing folder or ends with '/'.
bool is_record_dir(const std::string& out);

// Where a run's records go without `--out`: <tmpdir>/<name>.json, tmpdir being $TMPDIR or /tmp when that is
// unset or empty, name "pounce-bench-<date>" (':' -> '-') when empty.
std::string default_out_path(const std::string& name, const std::string& date, const char* tmpdir);

// The configuration a record measures: impl, pass, preset (or custom spec), ranks, tokens per rank,
// precision (bf16 when absent). Recording replaces the records of the same configuration.
struct RecordKey {
  std::string impl, pass, preset;
  int64_t ranks = 0, tokens_per_rank = 0;
  std::string precision;
  auto operator<=>(const RecordKey&) const = default;
};
RecordKey record_key(const nlohmann::json& record);

// The file of a record folder that holds the records of `ranks` and `precision`: "ep<R>_<precision>.json".
std::string results_file_name(int64_t ranks, const std::string& precision);

// `recorded` with each record of `run` in place of the record of its configuration, the others kept; the
// last of `run` wins where it repeats one. Sorted by preset, tokens per rank, pass (forward, backward,
// forward_backward), impl, so that a file's diff shows only what was measured again. Records that are not
// recordable (not measured, and not a peer's "unsupported") are not taken from `run`: they would replace a
// measurement by none.
nlohmann::json merge_records(const nlohmann::json& recorded, const nlohmann::json& run);

// Merges `run`'s measured records into `dir`'s results files (one per ranks x precision, created when
// missing) and returns the files written. Throws pounce::Error when a file there is not a JSON list.
std::vector<std::string> record_results(const std::string& dir, const nlohmann::json& run);

// ---- peers ---------------------------------------------------------------------------------------------
// The public implementations measured beside the baseline, in its process, on its inputs and routing
// (bench/baselines/peers.py): Liger's fused MoE, transformers' grouped_mm experts, the compute-only floor.

inline constexpr const char* kPeers[] = {"liger", "transformers", "floor"};

// `names` hold liger, transformers, floor, all or none; the result is in kPeers' order without repeats
// (empty for none or no names). Throws pounce::Error naming the known peers on any other name.
std::vector<std::string> parse_peers(const std::vector<std::string>& names);

// The impls that are not Pounce: baseline and the peers.
bool is_peer_impl(const std::string& impl);

// The telemetry of the baseline process's records: a record that names its timed window
// (timed_window_unix_s: [begin, end], Unix seconds) gets the readings within it; one without, or whose
// window holds none, gets `whole_run` (the process's busy readings). Records not measured get none.
// telemetry_scope says which.
void add_baseline_telemetry(nlohmann::json& records, const std::vector<TelemetrySample>& samples,
                            const TelemetrySummary& whole_run);

// Per configuration that has a peer besides the baseline, the records side by side: each impl's time,
// TFLOP/s, the first Pounce impl's speed-up over it, its fraction of the floor, SM clock and power, then the
// peers that did not run and why. "" when no record is a peer's but the baseline's.
std::string side_by_side(const nlohmann::json& records);

// ---- the baseline (bench/baselines/torch_moe.py under torchrun) ----------------------------------------

struct BaselineRun {
  std::string torchrun;  // executable path
  std::string script;
  int ranks = 1;
  std::vector<std::string> presets;  // preset names or custom:H:I:E:k[:Is] specs, as bench_preset takes them
  std::vector<int64_t> tokens;
  std::vector<BenchPass> passes;
  std::vector<std::string> peers;  // parse_peers' result; measured after the baseline, same inputs
  int warmup = 0;
  int iters = 1;
  std::string json_path;  // where the script writes its records
};

// The passes of `passes` that the baseline measures (forward, forward_backward).
std::vector<BenchPass> baseline_passes(const std::vector<BenchPass>& passes);
// The shell command line; --sets 0 lets the script rotate enough input sets by the rule above. Every preset
// goes through: the script reads custom:H:I:E:k[:Is] specs as bench_preset does (SwiGLU, no clamp).
std::string baseline_command(const BaselineRun& run);

std::string shell_quote(const std::string& text);

}  // namespace pounce::cli
