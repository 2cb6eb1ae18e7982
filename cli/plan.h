// `pounce plan`: a cost model of one MoE layer's forward and backward pass on an expert-parallel group of
// one node or several (docs/internode.md §7). Pure functions, unit-tested without a GPU
// (tests/cpu/test_plan.cpp); validated against every measured record in bench/results/ (--validate).
//
// The model, per rank and pass, with balanced (uniform top-k) routing as the benchmarks draw it:
//
//   time = prologue + max(fill + tensor, NVLink + tail, comm SMs + tail, NIC + tail, HBM) + drain + epilogue
//
//   tensor     sum over the pass's GEMM tiles of (K blocks x clocks per K block / clock + the tile's fixed
//              cost), spread over the compute SMs, over (1 - the share of time tiles wait for a task); the
//              rows are each expert's expected rows padded to BLOCK_M (an exact binomial expectation)
//   NVLink     bytes crossing this GPU's NVLink per direction / NVLink bandwidth
//   comm SMs   bytes the communication CTAs move / (CTAs x bytes per CTA and second)
//   NIC        bytes crossing this GPU's NIC per direction / (line rate x efficiency); hierarchical
//              dispatch sends a token at most once per node (docs/internode.md §3)
//   HBM        weights and routed activations read and written / HBM bandwidth
//   fill       the first minibatch's rows, less what the shared expert's tiles cover; tail: the last
//              minibatch's tiles, which follow its rows when a transfer is the longest path
//   prologue   staging, the schedule, the first barrier; drain: the last rows' return and the combine
//              barrier; epilogue: the weighted sum (or d_x sum), its own memory-bound kernel
//
// Backward: the rows in must arrive before its data-gradient tiles end, the weight-gradient tiles follow
// them in the task list (docs/design.md "Fused backward") while the rows out may still leave, so the pass is
// max(max(fill + data tiles, inward transfers + tail) + weight-gradient tiles, each link's whole traffic).
// Every rate is a named constant below with the measurement it comes from; the few that no machine here
// could measure say "assumed".
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pounce/config.h"
#include "pounce/shape.h"
#include "reference/internode_sim.h"

namespace pounce::cli {

// ---- measured rates (H200 microbenchmarks, 2026-11-29..12-01, and docs/experiments/)
// -------------------------------------------

inline constexpr int kPlanNumSms = 132;  // H200 SMs
// Tensor work: a 128 x 256 x 64 cooperative tile's K block takes ~1040 SM clocks against the 1024 of the
// tensor peak (4096 bf16 FLOP per SM and clock), at the 1.45-1.6 GHz the power limit holds the SMs to through
// the GEMM phases (experiment 025: gate/up 1030-1040 clocks per K block at 1.48-1.55 GHz).
inline constexpr double kClocksPerKBlock = 1040.0;
inline constexpr double kGemmClockGhz = 1.5;
// Weight-gradient tiles are fed from L2 at ~45 bytes per SM clock: ~1360 clocks per K block (experiment 025:
// deepseek 6.75 us per 8 K blocks at 1.61 GHz; experiment 020: tensor pipe 69-74 %), at 1.61-1.76 GHz.
inline constexpr double kWeightGradClocksPerKBlock = 1360.0;
inline constexpr double kWeightGradClockGhz = 1.65;
// A tile's fixed cost beside its mainloop, us: first stage + epilogue + count (experiment 025).
inline constexpr double kGateUpTileUs = 5.7;               // deepseek 1.3 + 4.4, gpt-oss 1.0 + 4.7
inline constexpr double kStoreTileUs = 2.6;                // down and d_x: 0.45-0.9 + 1.95-2.0
inline constexpr double kActivationBackwardTileUs = 17.0;  // d_a: gpt-oss 1.15 + 15.6, deepseek 1.4 + 16.6
inline constexpr double kWeightGradTileUs = 2.25;          // deepseek 0.57 + 1.68
// Share of the consumers' time spent waiting for a task in the fused kernels (experiment 021: 9-12 %).
inline constexpr double kTaskWaitFraction = 0.10;
// FP8 over BF16 tensor rate on this board: cuBLAS blockwise FP8 (1x128 x 128x128) 1134 TFLOP/s against bf16
// dense 773 (measured on one H200, 2026-12-01). No FP8 kernel of ours is measured yet: FP8 predictions are
// unvalidated.
inline constexpr double kFp8TensorSpeedup = 1134.0 / 773.0;
// Memory and links.
inline constexpr double kHbmGbps = 3930.0;  // device copy, read + write (H200 microbenchmark)
inline constexpr double kNvlinkGbps =
    370.0;  // SM loads/stores to the peer, per direction (H200 microbenchmark)
inline constexpr double kNvlinkPerCommSmGbps = 19.0;     // 305 GB/s with 16 CTAs (H200, NCCL LSA test)
inline constexpr double kLocalCopyPerCommSmGbps = 50.0;  // assumed: HBM's shorter latency, ~2.5x NVLink's
inline constexpr double kNicGbps = 50.0;                 // 400 Gb/s ConnectX-7 per GPU, per direction
inline constexpr double kNicEfficiency = 0.9;            // assumed; DeepEP V1 reports 43-58 GB/s on it
inline constexpr double kNicLatencyUs = 10.0;            // assumed: one GIN put + signal, then its poll
inline constexpr double kNvlinkBarrierUs = 5.0;          // routing barrier 2-14 us (experiment 031)
inline constexpr double kScheduleUs = 35.0;              // count + scan + place, 27-36 us (experiment 031)
// The staged path (validation only): setup + routing + schedule 0.11-0.12 ms forward, 0.16-0.18 ms
// backward, join + barrier 0.15-0.18 ms with the sum inside (experiment 003); a gap per launch, assumed.
inline constexpr double kStagedForwardSetupUs = 110.0;
inline constexpr double kStagedBackwardSetupUs = 100.0;
inline constexpr double kStagedJoinUs = 50.0;
inline constexpr double kStagedLaunchGapUs = 5.0;
inline constexpr int64_t kPlanBlockM = 128;

// ---- the problem -------------------------------------------------------------------------------------

// kAuto: the backward's choice by shape (I >= 1024: fused; across nodes always fused: the internode design).
enum class PlanPath { kFused, kStaged, kAuto };
enum class Resource { kTensorCores, kNvlink, kCommSms, kNic, kHbm };
const char* to_string(Resource resource);  // "tensor cores" | "NVLink" | "comm SMs" | "NIC" | "HBM"

struct PlanProblem {
  Shape shape;            // max_tokens = tokens per rank, num_ranks = the EP size
  Activation activation;  // (kept for reports; the model's tile costs do not depend on it)
  Precision precision = Precision::kBF16;
  int gpus_per_node = 8;  // the load/store (NVLink) team; ranks beyond it are reached over the NIC
  double nvlink_gbps = kNvlinkGbps;
  double nic_gbps = kNicGbps;  // per GPU and direction, line rate
  int forward_comm_sms = 0;    // 0: the kernels' heuristic (as the benchmarks ran)
  int backward_comm_sms = 0;
  PlanPath forward_path = PlanPath::kFused;
  PlanPath backward_path = PlanPath::kAuto;
  int combine_partial_bytes = 2;  // per element of a per-node partial sum over the NIC: 2 (bf16) or 4 (fp32)
  // Node-limited routing (DeepSeek-V3: each token's experts on at most 4 nodes): a token picks this many
  // nodes uniformly, then its k experts uniformly among theirs; 0: no limit (uniform over every expert).
  int node_limit = 0;

  int num_nodes() const;  // ceil(R / gpus_per_node)
  int node_size() const;  // GPUs of one node in the group: min(R, gpus_per_node)
};

// Throws pounce::Error naming the field: E % R, R % gpus_per_node beyond one node, positive rates, ...
void validate(const PlanProblem& problem);

// ---- traffic -----------------------------------------------------------------------------------------

// E[ceil(c / block) * block] for c ~ Binomial(n, p): an expert's rows padded to a tile, exactly.
double expected_padded_rows(int64_t n, double p, int64_t block);
// P(a token names at least one of `subset` experts) when it names k distinct of E uniformly.
double hit_probability(int64_t num_experts, int64_t subset, int64_t k);

// Expected per-rank counts of one pass (forward; backward moves the same rows the other way).
struct PlanTraffic {
  double rows_per_expert = 0;           // true rows an expert receives
  double padded_rows_per_expert = 0;    // padded to BLOCK_M
  double padded64_rows_per_expert = 0;  // padded to 64 (the weight gradients' K range)
  double routed_rows = 0;               // padded rows of this rank's local experts
  double local_pairs = 0;              // pairs this rank receives from its own tokens or its own landing rows
  double nvlink_pairs = 0;             // pairs pulled over NVLink (incl. rows relayed by a peer of the node)
  double nic_tokens = 0;               // token rows this rank's NIC sends (= receives), once per node
  double nic_pairs_without_dedup = 0;  // what a put per pair would send instead
  double pairs_per_remote_token = 0;   // pairs a relayed token feeds on its destination node
  double x_row_bytes = 0;              // H * bytes per element of x on the wire (FP8: + 1x128 scales)
};
PlanTraffic plan_traffic(const PlanProblem& problem);

// ---- prediction --------------------------------------------------------------------------------------

struct PassPrediction {
  double ms = 0;
  Resource binding = Resource::kTensorCores;  // the largest of the overlapped terms
  int comm_sms = 0;
  PlanPath path = PlanPath::kFused;
  bool push_combine = false;
  // overlapped terms, ms
  double tensor_ms = 0, nvlink_ms = 0, comm_sm_ms = 0, nic_ms = 0, hbm_ms = 0;
  double weight_grad_ms = 0;  // backward: the weight-gradient tiles after the overlapped body (in tensor_ms)
  // the tiles' wait for the first rows, and the exposed terms, ms
  double prologue_ms = 0, fill_ms = 0, drain_ms = 0, epilogue_ms = 0;
  // bytes per rank and direction
  double nvlink_bytes = 0, nic_bytes = 0, hbm_bytes = 0;
  double useful_flops = 0;  // docs/design.md §7, per rank
  double tflops() const { return ms > 0 ? useful_flops / (ms * 1e9) : 0; }
};

// The comm-SM count the kernels' heuristics choose today (src/gpu/fused_forward.cu, overlap.h).
int heuristic_comm_sms(const PlanProblem& problem, bool backward, PlanPath path);
// One pass with `comm_sms` communication SMs (0: the heuristic) on `path`.
PassPrediction predict_forward(const PlanProblem& problem, int comm_sms, PlanPath path);
PassPrediction predict_backward(const PlanProblem& problem, int comm_sms, PlanPath path);
// The fewest communication SMs in [1, kPlanNumSms / 2] within 1 % of the least predicted time (and, where
// one exists, with the transfers not binding the pass).
int suggest_comm_sms(const PlanProblem& problem, bool backward);

struct LayerPlan {
  PlanProblem problem;
  PlanTraffic traffic;
  PassPrediction forward, backward;  // with the problem's comm SMs (0: the heuristic)
  int suggested_forward_comm_sms = 0, suggested_backward_comm_sms = 0;
  PassPrediction forward_suggested, backward_suggested;  // with the suggested counts
};
LayerPlan plan_layer(const PlanProblem& problem);

// EP sizes 1, 2, 4, ... 256 that divide E; the others are left out.
std::vector<int> sweep_ep_sizes(int64_t num_experts);
// The layer at each EP size, tokens per rank held (weak scaling), the rest of `problem` kept.
std::vector<LayerPlan> plan_sweep(const PlanProblem& problem, const std::vector<int>& ep_sizes);

nlohmann::json to_json(const PassPrediction& pass);
nlohmann::json to_json(const LayerPlan& plan);

// ---- validation against measured records -------------------------------------------------------------

struct ValidationRow {
  std::string impl, pass, preset, precision;
  int64_t ranks = 0, tokens_per_rank = 0;
  double measured_ms = 0;
  bool modelled = false;
  std::string reason;  // why not modelled
  double predicted_ms = 0;
  double error = 0;  // (predicted - measured) / measured
  std::string binding;
};

// One row per record of `records` (a bench/results list): Pounce's impls (fused, fused-all, fused-staged,
// staged) are modelled with the paths each impl runs and the kernels' heuristic comm SMs; the PyTorch
// baseline and unmeasured records are listed as not modelled, with the reason.
std::vector<ValidationRow> validate_records(const nlohmann::json& records);
// Every *.json list under `dir` (bench/results/), in file-name order.
std::vector<ValidationRow> validate_results_dir(const std::string& dir);

struct ValidationGroup {
  std::string preset, pass;
  int count = 0;
  double mean_error = 0, mean_abs_error = 0, max_abs_error = 0;
};
// Per (preset, pass) over the modelled rows, then one group with preset "all" and pass "all".
std::vector<ValidationGroup> summarize(const std::vector<ValidationRow>& rows);
// The table of every row, then the summary, as Markdown (docs/internode.md cites it).
std::string validation_markdown(const std::vector<ValidationRow>& rows, const std::string& command);

// ---- the discrete-event simulation (reference/internode_sim.h) with the model's costs --------------------

// The reference problem (shapes, BLOCK_M) of `problem`'s group.
reference::Problem sim_problem(const PlanProblem& problem);
// The simulation's configuration for one fused pass of `problem` with `comm_sms` communication SMs (0: the
// heuristic): the model's tile costs (waits included), rates, row sizes, prologue and epilogue, so that the
// simulated time tests the model's overlap formula on real routing rather than its constants.
reference::SimConfig sim_config(const PlanProblem& problem, bool backward, int comm_sms);
// Every rank's routing as the model assumes it, seeded per rank: k distinct experts per token uniform over E
// (as the benchmarks draw it), or with a node limit among that many uniformly chosen nodes. Only num_tokens
// and topk_idx are filled.
std::vector<reference::RankInputs> plan_routing(const PlanProblem& problem, uint64_t seed);

// ---- the command -------------------------------------------------------------------------------------

struct PlanCommandOptions {
  std::string preset = "deepseek-v3";  // a preset or custom:H:I:E:k[:Is]
  std::optional<int64_t> hidden, intermediate, experts, topk, shared_intermediate;
  int64_t tokens = 8192;  // per rank
  int ep = 16;
  int gpus_per_node = 8;
  double nvlink_gbps = kNvlinkGbps;
  double nic_gbps = kNicGbps;
  std::string precision = "bf16";     // bf16 | fp8
  int comm_sms = 0;                   // 0: the suggested count
  std::string combine_wire = "bf16";  // per-node partial sums on the NIC: bf16 | fp32
  int node_limit = 0;                 // nodes per token (0: no limit)
  bool no_sweep = false;
  std::string json;   // "" none, "-" stdout
  std::string chart;  // PNG path: runs plot_script on the sweep's JSON
  std::string plot_script = "bench/plot_plan.py";
  std::string python = "python3";
  std::string validate;      // a results folder: prints prediction vs measurement instead
  std::string validate_out;  // with validate: also write the Markdown table there
  bool simulate = false;     // also run the discrete-event simulation (reference/internode_sim.h)
  uint64_t seed = 2026;
};

// The problem the options describe (preset, overrides, rates). Throws pounce::Error on bad options.
PlanProblem plan_problem(const PlanCommandOptions& options);

}  // namespace pounce::cli
