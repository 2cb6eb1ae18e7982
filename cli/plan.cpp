// The cost model of cli/plan.h: traffic, the fused and staged passes, the comm-SM suggestion, the sweep, and
// the simulation's configuration from the same costs. Validation against records: cli/plan_validation.cpp.
#include "cli/plan.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "pounce/error.h"
#include "cli/bench.h"

namespace pounce::cli {
namespace {

using nlohmann::json;

constexpr double kUs = 1e-3;  // ms per us

double bytes_ms(double bytes, double gbps) {
  return gbps > 0 ? bytes / (gbps * 1e6) : 0.0;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Tiles of 256 columns over n columns; an edge tile of at most 64 columns runs 64-wide wgmmas (docs/design.md
// "Padding and edge tiles"), so it counts by its 64-column groups.
double wide_tiles(int64_t n) {
  return static_cast<double>(ceil_div(n, 64)) / 4.0;
}

// A tile's mainloop, us, over `k_blocks` 64-deep K blocks.
double mainloop_us(double k_blocks, double speedup) {
  return k_blocks * kClocksPerKBlock / (kGemmClockGhz * 1e3) / speedup;
}
double weight_grad_mainloop_us(double k_blocks, double speedup) {
  return k_blocks * kWeightGradClocksPerKBlock / (kWeightGradClockGhz * 1e3) / speedup;
}

// Static persistent schedule of one GEMM: ceil(tiles / SMs) waves of one tile time.
double waves(double tiles, int sms) {
  return tiles > 0 ? std::ceil(tiles / sms - 1e-9) : 0.0;
}

struct Dims {
  int64_t R, T, H, I, E, k, Is, El, G, N;
  bool fp8;
  double speedup;       // routed GEMMs' tensor rate over BF16
  double weight_bytes;  // per routed weight element
  double act_bytes;     // per element of `a` as the down GEMM reads it
};

Dims dims_of(const PlanProblem& p) {
  const Shape& s = p.shape;
  Dims d{};
  d.R = s.num_ranks;
  d.T = s.max_tokens;
  d.H = s.hidden;
  d.I = s.intermediate;
  d.E = s.num_experts;
  d.k = s.num_topk;
  d.Is = s.shared_intermediate;
  d.El = s.num_experts / s.num_ranks;
  d.G = p.node_size();
  d.N = p.num_nodes();
  d.fp8 = p.precision == Precision::kFP8;
  d.speedup = d.fp8 ? kFp8TensorSpeedup : 1.0;
  d.weight_bytes = d.fp8 ? 1.0 + 4.0 / (128.0 * 128.0) : 2.0;
  d.act_bytes = d.fp8 ? 1.0 + 4.0 / 128.0 : 2.0;
  return d;
}

// The nodes a token's experts may span: the node limit, or every node.
int64_t limited_nodes(const PlanProblem& p) {
  return p.node_limit > 0 ? std::min<int64_t>(p.node_limit, p.num_nodes()) : p.num_nodes();
}

bool push_combine(const Dims& d) {
  return d.R > 1 && d.I < 1024;
}  // fused_push_combine's kAuto rule

// Minibatch rows of the fused kernels' handoff: 16 m-blocks with push, 8 otherwise (fused_forward.cu).
double minibatch_rows(const Dims& d, double routed_rows) {
  return std::min(routed_rows, static_cast<double>((push_combine(d) ? 16 : 8) * kPlanBlockM));
}

// Link and SM rates of one pass's transfers.
struct CommRates {
  double nvlink_gbps, comm_nvlink_gbps, comm_local_gbps, nic_gbps;
};
CommRates comm_rates(const PlanProblem& p, int comm_sms) {
  return {p.nvlink_gbps, std::min(p.nvlink_gbps, comm_sms * kNvlinkPerCommSmGbps),
          comm_sms * kLocalCopyPerCommSmGbps, p.nic_gbps * kNicEfficiency};
}

// Bytes of the weighted sum (or the d_x sum): the owner reads its own node's pair slots, the other nodes'
// partial rows and ys, and writes out.
double sum_bytes(const Dims& d, const PlanTraffic& tr, int partial_bytes) {
  const double own_node_slots = static_cast<double>(d.k) * d.G / d.R;
  const double partial_rows = d.T > 0 ? tr.nic_tokens / d.T : 0.0;
  return d.T * d.H * (2.0 * (1 + (d.Is > 0 ? 1 : 0) + own_node_slots) + partial_rows * partial_bytes);
}

// The longest of the pass's critical paths and the resource it runs through: the tiles after the first
// rows (tensor_path), each link's or the comm CTAs' traffic followed by the last minibatch's tiles
// (transfer_tail), the HBM traffic.
Resource largest(const PassPrediction& p, double tensor_path, double transfer_tail, double* value) {
  const std::pair<double, Resource> terms[] = {{tensor_path, Resource::kTensorCores},
                                               {p.nvlink_ms + transfer_tail, Resource::kNvlink},
                                               {p.comm_sm_ms + transfer_tail, Resource::kCommSms},
                                               {p.nic_ms + transfer_tail, Resource::kNic},
                                               {p.hbm_ms, Resource::kHbm}};
  auto best = terms[0];
  for (const auto& term : terms)
    if (term.first > best.first) best = term;
  *value = best.first;
  return best.second;
}

// ---- the staged path (one node; the validation's staged records) -------------------------------------

struct StagedLayout {
  int comm_sms, chunks, gemm_sms;
  double chunk_m_blocks;
};
StagedLayout staged_layout(const Dims& d, double padded_rows, int comm_sms) {
  StagedLayout s{};
  s.comm_sms = comm_sms;
  s.chunks = static_cast<int>(std::clamp<int64_t>(d.El, 1, 8));  // overlap.h: min(El, 8)
  s.gemm_sms = s.chunks > 1 ? kPlanNumSms - comm_sms : kPlanNumSms;
  s.chunk_m_blocks = static_cast<double>(d.El) / s.chunks * padded_rows / kPlanBlockM;
  return s;
}

// One chunk's rows over the comm SMs (the first pull and the last push are not overlapped).
double staged_chunk_transfer_ms(const Dims& d, const CommRates& rates, double row_bytes, int chunks) {
  const double rows = static_cast<double>(d.T) * d.k / chunks;
  if (d.R == 1) return bytes_ms(rows * row_bytes, rates.comm_local_gbps);
  return bytes_ms(rows * row_bytes * (d.R - 1) / d.R, rates.comm_nvlink_gbps);
}

}  // namespace

const char* to_string(Resource resource) {
  switch (resource) {
    case Resource::kTensorCores:
      return "tensor cores";
    case Resource::kNvlink:
      return "NVLink";
    case Resource::kCommSms:
      return "comm SMs";
    case Resource::kNic:
      return "NIC";
    case Resource::kHbm:
      return "HBM";
  }
  return "?";
}

int PlanProblem::num_nodes() const {
  return static_cast<int>(ceil_div(shape.num_ranks, std::max(1, gpus_per_node)));
}
int PlanProblem::node_size() const {
  return static_cast<int>(std::min<int64_t>(shape.num_ranks, std::max(1, gpus_per_node)));
}

void validate(const PlanProblem& p) {
  const Shape& s = p.shape;
  POUNCE_CHECK(s.hidden > 0 && s.intermediate > 0 && s.num_experts > 0 && s.num_topk > 0, "the shape needs ",
               "positive hidden, intermediate, experts and topk (got H ", s.hidden, ", I ", s.intermediate,
               ", E ", s.num_experts, ", k ", s.num_topk, ")");
  POUNCE_CHECK(s.num_topk <= s.num_experts, "topk = ", s.num_topk, " exceeds experts = ", s.num_experts);
  POUNCE_CHECK(s.shared_intermediate >= 0, "shared intermediate = ", s.shared_intermediate, " is negative");
  POUNCE_CHECK(s.max_tokens > 0, "--tokens = ", s.max_tokens, " must be positive");
  POUNCE_CHECK(s.num_ranks >= 1 && s.num_experts % s.num_ranks == 0, "--ep = ", s.num_ranks,
               " must divide the ", s.num_experts, " experts");
  POUNCE_CHECK(p.gpus_per_node >= 1, "--gpus-per-node = ", p.gpus_per_node, " must be at least 1");
  POUNCE_CHECK(s.num_ranks <= p.gpus_per_node || s.num_ranks % p.gpus_per_node == 0, "--ep = ", s.num_ranks,
               " spans nodes of ", p.gpus_per_node, " GPUs: it must be a multiple of --gpus-per-node");
  POUNCE_CHECK(p.nvlink_gbps > 0, "--nvlink-gbps = ", p.nvlink_gbps, " must be positive");
  POUNCE_CHECK(p.num_nodes() == 1 || p.nic_gbps > 0, "--nic-gbps = ", p.nic_gbps,
               " must be positive when the group spans nodes");
  POUNCE_CHECK(p.node_limit >= 0, "--node-limit = ", p.node_limit, " must be >= 0 (0: no limit)");
  POUNCE_CHECK(s.num_topk <= limited_nodes(p) * (s.num_experts / p.num_nodes()),
               "--node-limit = ", p.node_limit, " leaves ",
               limited_nodes(p) * (s.num_experts / p.num_nodes()), " experts for top-", s.num_topk);
  POUNCE_CHECK(p.combine_partial_bytes == 2 || p.combine_partial_bytes == 4,
               "the combine's partial sums travel as bf16 (2 bytes) or fp32 (4), not ",
               p.combine_partial_bytes);
  POUNCE_CHECK(p.forward_comm_sms >= 0 && p.forward_comm_sms <= kPlanNumSms / 2 && p.backward_comm_sms >= 0 &&
                   p.backward_comm_sms <= kPlanNumSms / 2,
               "--comm-sms must be in [0, ", kPlanNumSms / 2, "] (0: the heuristic)");
}

// ---- traffic -----------------------------------------------------------------------------------------

double expected_padded_rows(int64_t n, double p, int64_t block) {
  if (n <= 0 || p <= 0) return 0.0;
  if (p >= 1) return static_cast<double>(ceil_div(n, block) * block);
  const double mean = n * p, sd = std::sqrt(n * p * (1 - p));
  const int64_t lo = std::max<int64_t>(0, static_cast<int64_t>(mean - 12 * sd) - 1);
  const int64_t hi = std::min<int64_t>(n, static_cast<int64_t>(mean + 12 * sd) + 2);
  const double log_p = std::log(p), log_q = std::log1p(-p), log_n = std::lgamma(n + 1.0);
  double total = 0, sum = 0;
  for (int64_t c = lo; c <= hi; ++c) {
    const double weight =
        std::exp(log_n - std::lgamma(c + 1.0) - std::lgamma(n - c + 1.0) + c * log_p + (n - c) * log_q);
    total += weight;
    sum += weight * static_cast<double>(ceil_div(c, block) * block);
  }
  return sum / total;
}

double hit_probability(int64_t num_experts, int64_t subset, int64_t k) {
  double miss = 1.0;  // C(E - S, k) / C(E, k)
  for (int64_t i = 0; i < k; ++i)
    miss *= std::max<double>(0.0, static_cast<double>(num_experts - subset - i)) / (num_experts - i);
  return 1.0 - miss;
}

PlanTraffic plan_traffic(const PlanProblem& problem) {
  validate(problem);
  const Dims d = dims_of(problem);
  PlanTraffic t;
  const int64_t n = d.R * d.T;
  const double p = static_cast<double>(d.k) / d.E;
  t.rows_per_expert = n * p;
  t.padded_rows_per_expert = expected_padded_rows(n, p, kPlanBlockM);
  t.padded64_rows_per_expert = expected_padded_rows(n, p, 64);
  t.routed_rows = d.El * t.padded_rows_per_expert;
  const double pairs = static_cast<double>(d.T) * d.k;  // received per rank = sent per rank, balanced
  t.nvlink_pairs = pairs * (d.G - 1) / d.G;
  t.local_pairs = pairs - t.nvlink_pairs;
  // A remote node is among the token's M chosen nodes with probability M / N, and then named by at least one
  // of its k experts drawn from the M nodes' experts (M = N: uniform routing).
  const int64_t M = limited_nodes(problem);
  t.nic_tokens = d.N > 1 ? d.T * (d.N - 1) * (static_cast<double>(M) / d.N) *
                               hit_probability(M * (d.E / d.N), d.E / d.N, d.k)
                         : 0.0;
  t.nic_pairs_without_dedup = pairs * (d.R - d.G) / d.R;
  t.pairs_per_remote_token = t.nic_tokens > 0 ? t.nic_pairs_without_dedup / t.nic_tokens : 0.0;
  t.x_row_bytes = d.H * d.act_bytes;
  return t;
}

// ---- prediction --------------------------------------------------------------------------------------

int heuristic_comm_sms(const PlanProblem& problem, bool backward, PlanPath path) {
  const Dims d = dims_of(problem);
  if (path == PlanPath::kStaged) return push_combine(d) ? 20 : 12;  // overlap.h
  if (push_combine(d)) return 20;                                   // fused_forward.cu
  if (d.R == 1) return 8;
  return backward ? 8 : 4;
}

namespace {

// A pass's prediction before its terms: the path, comm SMs and combine it runs with.
PassPrediction pass_on(PlanPath path, int comm_sms, bool push_combine) {
  PassPrediction out;
  out.path = path;
  out.comm_sms = comm_sms;
  out.push_combine = push_combine;
  return out;
}

// The time factor of work spread over `compute_sms` SMs that also wait for their tasks part of the time.
double compute_share(int compute_sms) {
  return 1.0 / compute_sms / (1 - kTaskWaitFraction);
}

PassPrediction predict_staged_forward(const PlanProblem& problem, int comm_sms) {
  const Dims d = dims_of(problem);
  const PlanTraffic tr = plan_traffic(problem);
  POUNCE_CHECK(d.N == 1, "the staged path is modelled on one node only (the internode design is fused)");
  PassPrediction out = pass_on(PlanPath::kStaged, comm_sms, true);
  const StagedLayout s = staged_layout(d, tr.padded_rows_per_expert, comm_sms);
  const CommRates rates = comm_rates(problem, comm_sms);
  const double gate_up = mainloop_us(d.H / 64.0, d.speedup) + kGateUpTileUs;
  const double down = mainloop_us(d.I / 64.0, d.speedup) + kStoreTileUs;
  double chunks_us = 0;
  for (int c = 0; c < s.chunks; ++c) {
    chunks_us += waves(s.chunk_m_blocks * ceil_div(d.I, 128), s.gemm_sms) * gate_up +
                 waves(s.chunk_m_blocks * wide_tiles(d.H), s.gemm_sms) * down + 2 * kStagedLaunchGapUs;
  }
  double shared_us = 0;
  if (d.Is > 0) {
    const double m_blocks = ceil_div(d.T, kPlanBlockM);
    shared_us =
        waves(m_blocks * ceil_div(d.Is, 128), kPlanNumSms) * (mainloop_us(d.H / 64.0, 1) + kGateUpTileUs) +
        waves(m_blocks * wide_tiles(d.H), kPlanNumSms) * (mainloop_us(d.Is / 64.0, 1) + kStoreTileUs);
  }
  const double first_pull = staged_chunk_transfer_ms(d, rates, tr.x_row_bytes, s.chunks);
  const double last_push = staged_chunk_transfer_ms(d, rates, 2.0 * d.H, s.chunks);
  out.tensor_ms = chunks_us * kUs;
  out.prologue_ms = kStagedForwardSetupUs * kUs;
  out.fill_ms = std::max(shared_us * kUs, first_pull);
  out.drain_ms = last_push;
  out.epilogue_ms = bytes_ms(sum_bytes(d, tr, problem.combine_partial_bytes), kHbmGbps) + kStagedJoinUs * kUs;
  out.nvlink_bytes = tr.nvlink_pairs * (tr.x_row_bytes + 2.0 * d.H);
  out.ms = out.prologue_ms + out.fill_ms + out.tensor_ms + out.drain_ms + out.epilogue_ms;
  out.binding = Resource::kTensorCores;
  return out;
}

PassPrediction predict_staged_backward(const PlanProblem& problem, int comm_sms) {
  const Dims d = dims_of(problem);
  const PlanTraffic tr = plan_traffic(problem);
  POUNCE_CHECK(d.N == 1, "the staged path is modelled on one node only (the internode design is fused)");
  PassPrediction out = pass_on(PlanPath::kStaged, comm_sms, true);
  const StagedLayout s = staged_layout(d, tr.padded_rows_per_expert, comm_sms);
  const CommRates rates = comm_rates(problem, comm_sms);
  const double d_a = mainloop_us(d.H / 64.0, d.speedup) + kActivationBackwardTileUs;
  const double d_x = mainloop_us(2.0 * d.I / 64.0, d.speedup) + kStoreTileUs;
  double chunks_us = 0;
  for (int c = 0; c < s.chunks; ++c) {
    chunks_us += waves(s.chunk_m_blocks * wide_tiles(d.I), s.gemm_sms) * d_a +
                 waves(s.chunk_m_blocks * wide_tiles(d.H), s.gemm_sms) * d_x + 2 * kStagedLaunchGapUs;
  }
  const double wgrad_tile =
      weight_grad_mainloop_us(tr.padded64_rows_per_expert / 64.0, d.speedup) + kWeightGradTileUs;
  const double wgrad_us = 3 * waves(d.El * ceil_div(d.I, 128) * wide_tiles(d.H), kPlanNumSms) * wgrad_tile;
  double shared_us = 0;
  if (d.Is > 0) {
    const double m_blocks = ceil_div(d.T, kPlanBlockM);
    shared_us =
        waves(m_blocks * wide_tiles(d.Is), kPlanNumSms) *
            (mainloop_us(d.H / 64.0, 1) + kActivationBackwardTileUs) +
        waves(m_blocks * wide_tiles(d.H), kPlanNumSms) * (mainloop_us(2.0 * d.Is / 64.0, 1) + kStoreTileUs) +
        3 * waves(ceil_div(d.Is, 128) * wide_tiles(d.H), kPlanNumSms) *
            (weight_grad_mainloop_us(ceil_div(d.T, 64), 1) + kWeightGradTileUs);
  }
  const double first_pull = staged_chunk_transfer_ms(d, rates, 2.0 * d.H, s.chunks);
  const double sum = bytes_ms(sum_bytes(d, tr, problem.combine_partial_bytes), kHbmGbps);
  out.tensor_ms = (chunks_us + wgrad_us) * kUs;
  out.weight_grad_ms = wgrad_us * kUs;
  out.prologue_ms = kStagedBackwardSetupUs * kUs + sum;  // staging d_out, the router gradient: as the sum
  out.fill_ms = std::max(shared_us * kUs, first_pull);
  out.drain_ms = first_pull;
  out.epilogue_ms = sum;
  out.nvlink_bytes = tr.nvlink_pairs * 4.0 * d.H;
  out.ms = out.prologue_ms + out.fill_ms + out.tensor_ms + out.drain_ms + out.epilogue_ms;
  out.binding = Resource::kTensorCores;
  return out;
}

// What the fused passes share: the transfers of one direction's rows in and the other's out.
struct FusedTransfers {
  double nvlink_in_bytes;   // rows pulled over NVLink per direction
  double nvlink_out_bytes;  // rows returned over NVLink per direction
  double local_bytes;       // rows the comm CTAs copy within HBM (own tokens, own landing buffer)
  double relay_bytes;       // the relay's per-node reduction: the node's slots read, the partial written
  double nic_bytes;         // per direction
  double in_row_bytes, out_row_bytes, nic_in_row_bytes, nic_out_row_bytes;
};

FusedTransfers fused_transfers(const PlanProblem& problem, const Dims& d, const PlanTraffic& tr,
                               bool backward) {
  FusedTransfers f{};
  // Forward pulls x (FP8 on the wire in FP8 mode) and returns y; backward pulls d_out (BF16: dy is
  // quantized where pulled) and returns d_x. Token metadata (k ids + weights) rides with each NIC row; the
  // backward's return also carries the pairs' router-gradient scalars.
  f.in_row_bytes = backward ? 2.0 * d.H : tr.x_row_bytes;
  f.out_row_bytes = 2.0 * d.H;
  f.nic_in_row_bytes = f.in_row_bytes + 8.0 * d.k;
  f.nic_out_row_bytes =
      static_cast<double>(d.H) * problem.combine_partial_bytes + (backward ? 4.0 * d.k : 0.0);
  f.nvlink_in_bytes = tr.nvlink_pairs * f.in_row_bytes;
  f.nvlink_out_bytes = tr.nvlink_pairs * f.out_row_bytes;
  f.local_bytes = tr.local_pairs * f.in_row_bytes;
  f.relay_bytes =
      tr.nic_tokens * (tr.pairs_per_remote_token * f.out_row_bytes + problem.combine_partial_bytes * d.H);
  f.nic_bytes = tr.nic_tokens * (f.nic_in_row_bytes + f.nic_out_row_bytes);
  return f;
}

// One minibatch's two GEMMs on the compute SMs once its rows are in: at least one tile of each.
double last_minibatch_ms(double m_blocks, double first_tiles, double first_us, double second_tiles,
                         double second_us, int compute_sms) {
  const double wait = 1.0 / (1 - kTaskWaitFraction);
  const double first = std::max(first_us, m_blocks * first_tiles * first_us / compute_sms);
  const double second = std::max(second_us, m_blocks * second_tiles * second_us / compute_sms);
  return (first + second) * wait * kUs;
}

// Fill in the fused pass's transfer terms and the exposed first/last rows.
void fused_comm_terms(const PlanProblem& problem, const Dims& d, const PlanTraffic& tr,
                      const FusedTransfers& f, int comm_sms, bool push, double cover_ms,
                      PassPrediction& out) {
  const CommRates rates = comm_rates(problem, comm_sms);
  out.nvlink_bytes = f.nvlink_in_bytes + f.nvlink_out_bytes;
  out.nic_bytes = f.nic_bytes;
  out.nvlink_ms = bytes_ms(out.nvlink_bytes, rates.nvlink_gbps);
  out.comm_sm_ms = bytes_ms(f.nvlink_in_bytes + (push ? f.nvlink_out_bytes : 0.0), rates.comm_nvlink_gbps) +
                   bytes_ms(f.local_bytes + f.relay_bytes, rates.comm_local_gbps);
  out.nic_ms = bytes_ms(f.nic_bytes, rates.nic_gbps);

  // The first minibatch: its NVLink share over the comm CTAs' rate, its local share over theirs, and where
  // the group spans nodes its remote rows' first NIC put (a token is sent at its earliest need, and feeds
  // pairs_per_remote_token pairs); covered by the shared expert's tiles, which need no rows.
  const double rows = minibatch_rows(d, tr.routed_rows);
  const double nvlink_share = static_cast<double>(d.G - 1) / d.G;
  double first = bytes_ms(rows * nvlink_share * f.in_row_bytes, rates.comm_nvlink_gbps) +
                 bytes_ms(rows * (1 - nvlink_share) * f.in_row_bytes, rates.comm_local_gbps);
  double last = push ? bytes_ms(rows * nvlink_share * f.out_row_bytes, rates.comm_nvlink_gbps)
                     : bytes_ms(rows * nvlink_share * f.out_row_bytes, rates.nvlink_gbps);
  if (d.N > 1) {
    const double remote_tokens = rows * (d.R - d.G) / d.R / std::max(1.0, tr.pairs_per_remote_token);
    first += kNicLatencyUs * kUs + bytes_ms(remote_tokens * f.nic_in_row_bytes, rates.nic_gbps);
    last += kNicLatencyUs * kUs + bytes_ms(remote_tokens * f.nic_out_row_bytes, rates.nic_gbps);
  }
  out.fill_ms = std::max(0.0, first - cover_ms);
  out.drain_ms = last + (d.R > 1 ? kNvlinkBarrierUs * kUs : 0.0) + (d.N > 1 ? kNicLatencyUs * kUs : 0.0);
}

PassPrediction predict_fused_forward(const PlanProblem& problem, int comm_sms) {
  const Dims d = dims_of(problem);
  const PlanTraffic tr = plan_traffic(problem);
  PassPrediction out = pass_on(PlanPath::kFused, comm_sms, push_combine(d));
  const int compute_sms = kPlanNumSms - comm_sms;
  const double per_sm = compute_share(compute_sms);

  const double m_blocks = tr.routed_rows / kPlanBlockM;
  const double routed_us =
      m_blocks * ceil_div(d.I, 128) * (mainloop_us(d.H / 64.0, d.speedup) + kGateUpTileUs) +
      m_blocks * wide_tiles(d.H) * (mainloop_us(d.I / 64.0, d.speedup) + kStoreTileUs);
  double shared_us = 0;
  if (d.Is > 0) {
    const double shared_blocks = ceil_div(d.T, kPlanBlockM);
    shared_us = shared_blocks * ceil_div(d.Is, 128) * (mainloop_us(d.H / 64.0, 1) + kGateUpTileUs) +
                shared_blocks * wide_tiles(d.H) * (mainloop_us(d.Is / 64.0, 1) + kStoreTileUs);
  }
  out.tensor_ms = (routed_us + shared_us) * per_sm * kUs;

  const FusedTransfers f = fused_transfers(problem, d, tr, false);
  fused_comm_terms(problem, d, tr, f, comm_sms, out.push_combine, shared_us * per_sm * kUs, out);

  // HBM: the local experts' weights once, each routed row's x in and out of the routed buffer, g, u, a
  // written, a and y; the shared expert's rows; x staged; the NIC's landing rows.
  const double Tp = ceil_div(d.T, kPlanBlockM) * kPlanBlockM;
  out.hbm_bytes = d.El * 3.0 * d.H * d.I * d.weight_bytes + 3.0 * d.H * d.Is * 2 +
                  tr.routed_rows * (2 * tr.x_row_bytes + 2.0 * 2 * d.I + 2 * d.act_bytes * d.I + 2.0 * d.H) +
                  (d.Is > 0 ? Tp * (2.0 * d.H + 4.0 * 2 * d.Is + 2.0 * d.H) : 0.0) + 4.0 * d.T * d.H +
                  tr.nic_tokens * (f.nic_in_row_bytes + f.nic_out_row_bytes);
  out.hbm_ms = bytes_ms(out.hbm_bytes, kHbmGbps);

  out.prologue_ms = bytes_ms(4.0 * d.T * d.H, kHbmGbps) + kScheduleUs * kUs +
                    (d.R > 1 ? kNvlinkBarrierUs * kUs : 0.0) + (d.N > 1 ? kNicLatencyUs * kUs : 0.0);
  out.epilogue_ms = bytes_ms(sum_bytes(d, tr, problem.combine_partial_bytes), kHbmGbps);
  // The tiles start after the first rows; a transfer's path ends with the last minibatch's tiles.
  const double blocks = minibatch_rows(d, tr.routed_rows) / kPlanBlockM;
  const double tail =
      last_minibatch_ms(blocks, ceil_div(d.I, 128), mainloop_us(d.H / 64.0, d.speedup) + kGateUpTileUs,
                        wide_tiles(d.H), mainloop_us(d.I / 64.0, d.speedup) + kStoreTileUs, compute_sms);
  double body = 0;
  out.binding = largest(out, out.fill_ms + out.tensor_ms, tail, &body);
  out.ms = out.prologue_ms + body + out.drain_ms + out.epilogue_ms;
  return out;
}

PassPrediction predict_fused_backward(const PlanProblem& problem, int comm_sms) {
  const Dims d = dims_of(problem);
  const PlanTraffic tr = plan_traffic(problem);
  PassPrediction out = pass_on(PlanPath::kFused, comm_sms, push_combine(d));
  const int compute_sms = kPlanNumSms - comm_sms;
  const double per_sm = compute_share(compute_sms);

  const double m_blocks = tr.routed_rows / kPlanBlockM;
  const double data_us =
      m_blocks * wide_tiles(d.I) * (mainloop_us(d.H / 64.0, d.speedup) + kActivationBackwardTileUs) +
      m_blocks * wide_tiles(d.H) * (mainloop_us(2.0 * d.I / 64.0, d.speedup) + kStoreTileUs);
  const double wgrad_us =
      d.El * 3.0 * ceil_div(d.I, 128) * wide_tiles(d.H) *
      (weight_grad_mainloop_us(tr.padded64_rows_per_expert / 64.0, d.speedup) + kWeightGradTileUs);
  double shared_data_us = 0, shared_wgrad_us = 0;
  if (d.Is > 0) {
    const double shared_blocks = ceil_div(d.T, kPlanBlockM);
    shared_data_us =
        shared_blocks * wide_tiles(d.Is) * (mainloop_us(d.H / 64.0, 1) + kActivationBackwardTileUs) +
        shared_blocks * wide_tiles(d.H) * (mainloop_us(2.0 * d.Is / 64.0, 1) + kStoreTileUs);
    shared_wgrad_us = 3.0 * ceil_div(d.Is, 128) * wide_tiles(d.H) *
                      (weight_grad_mainloop_us(ceil_div(d.T, 64), 1) + kWeightGradTileUs);
  }
  const double data_ms = (data_us + shared_data_us) * per_sm * kUs;
  out.weight_grad_ms = (wgrad_us + shared_wgrad_us) * per_sm * kUs;
  out.tensor_ms = data_ms + out.weight_grad_ms;

  const FusedTransfers f = fused_transfers(problem, d, tr, true);
  fused_comm_terms(problem, d, tr, f, comm_sms, out.push_combine, shared_data_us * per_sm * kUs, out);

  // HBM: weights read again, weight gradients written (bf16), each routed row's dy in and out, g and u,
  // d_g and d_u written and read twice, a and x read by the weight gradients, d_x written.
  out.hbm_bytes = d.El * 3.0 * d.H * d.I * (d.weight_bytes + 2.0) + 6.0 * d.H * d.Is * 2 +
                  tr.routed_rows * (8.0 * d.H + 18.0 * d.I) + 4.0 * d.T * d.H +
                  tr.nic_tokens * (f.nic_in_row_bytes + f.nic_out_row_bytes);
  out.hbm_ms = bytes_ms(out.hbm_bytes, kHbmGbps);

  const double sum = bytes_ms(sum_bytes(d, tr, problem.combine_partial_bytes), kHbmGbps);
  // Staging d_out and the router gradient read d_out and the forward's slots once: the sum's bytes.
  out.prologue_ms = sum + (d.R > 1 ? kNvlinkBarrierUs * kUs : 0.0) + (d.N > 1 ? kNicLatencyUs * kUs : 0.0);
  out.epilogue_ms = sum;
  // The rows in (d_out for dy) must arrive before the data-gradient tiles end; the weight-gradient tiles
  // follow those in the task list, and the rows out (d_x) may still leave while they run. So the pass is the
  // longer of (the data tiles' paths) + the weight-gradient tiles, and of each link's whole traffic.
  const CommRates rates = comm_rates(problem, comm_sms);
  PassPrediction inward = out;
  inward.nvlink_ms = bytes_ms(f.nvlink_in_bytes, rates.nvlink_gbps);
  inward.comm_sm_ms =
      bytes_ms(f.nvlink_in_bytes, rates.comm_nvlink_gbps) + bytes_ms(f.local_bytes, rates.comm_local_gbps);
  inward.nic_ms = bytes_ms(tr.nic_tokens * f.nic_in_row_bytes, rates.nic_gbps);
  inward.hbm_ms = 0;
  const double blocks = minibatch_rows(d, tr.routed_rows) / kPlanBlockM;
  const double tail = last_minibatch_ms(
      blocks, wide_tiles(d.I), mainloop_us(d.H / 64.0, d.speedup) + kActivationBackwardTileUs,
      wide_tiles(d.H), mainloop_us(2.0 * d.I / 64.0, d.speedup) + kStoreTileUs, compute_sms);
  double first_phase = 0, whole = 0;
  const Resource first_binding = largest(inward, out.fill_ms + data_ms, tail, &first_phase);
  const Resource total_binding = largest(out, 0.0, 0.0, &whole);
  double body = first_phase + out.weight_grad_ms;
  out.binding = first_binding;
  if (whole > body) {
    body = whole;
    out.binding = total_binding;
  }
  out.ms = out.prologue_ms + body + out.drain_ms + out.epilogue_ms;
  return out;
}

double useful_forward_flops(const Dims& d) {
  return 6.0 * d.T * (static_cast<double>(d.k) * d.H * d.I + static_cast<double>(d.H) * d.Is);
}

PlanPath resolved_backward_path(const PlanProblem& problem, PlanPath path) {
  if (path != PlanPath::kAuto) return path;
  // KernelPath::kAuto: the stage kernels where I < 1024; across nodes only the fused design exists.
  if (problem.num_nodes() > 1) return PlanPath::kFused;
  return problem.shape.intermediate >= 1024 ? PlanPath::kFused : PlanPath::kStaged;
}

}  // namespace

PassPrediction predict_forward(const PlanProblem& problem, int comm_sms, PlanPath path) {
  validate(problem);
  if (path == PlanPath::kAuto) path = PlanPath::kFused;
  const int c = comm_sms > 0 ? comm_sms : heuristic_comm_sms(problem, false, path);
  PassPrediction out =
      path == PlanPath::kStaged ? predict_staged_forward(problem, c) : predict_fused_forward(problem, c);
  out.useful_flops = useful_forward_flops(dims_of(problem));
  return out;
}

PassPrediction predict_backward(const PlanProblem& problem, int comm_sms, PlanPath path) {
  validate(problem);
  path = resolved_backward_path(problem, path);
  const int c = comm_sms > 0 ? comm_sms : heuristic_comm_sms(problem, true, path);
  PassPrediction out =
      path == PlanPath::kStaged ? predict_staged_backward(problem, c) : predict_fused_backward(problem, c);
  out.useful_flops = 2 * useful_forward_flops(dims_of(problem));
  return out;
}

int suggest_comm_sms(const PlanProblem& problem, bool backward) {
  std::vector<double> ms(kPlanNumSms / 2 + 1, 0.0);
  double best = 0;
  for (int c = 1; c <= kPlanNumSms / 2; ++c) {
    ms[c] = backward ? predict_backward(problem, c, PlanPath::kFused).ms
                     : predict_forward(problem, c, PlanPath::kFused).ms;
    if (c == 1 || ms[c] < best) best = ms[c];
  }
  // The fewest within 1 % of the best whose transfers do not bind the pass; else the fewest within 1 %.
  int fewest = 0;
  for (int c = 1; c <= kPlanNumSms / 2; ++c) {
    if (ms[c] > best * 1.01) continue;
    if (fewest == 0) fewest = c;
    const PassPrediction p = backward ? predict_backward(problem, c, PlanPath::kFused)
                                      : predict_forward(problem, c, PlanPath::kFused);
    if (p.binding != Resource::kCommSms) return c;
  }
  return fewest > 0 ? fewest : 1;
}

LayerPlan plan_layer(const PlanProblem& problem) {
  validate(problem);
  LayerPlan plan;
  plan.problem = problem;
  plan.traffic = plan_traffic(problem);
  plan.forward = predict_forward(problem, problem.forward_comm_sms, problem.forward_path);
  plan.backward = predict_backward(problem, problem.backward_comm_sms, problem.backward_path);
  plan.suggested_forward_comm_sms = suggest_comm_sms(problem, false);
  plan.suggested_backward_comm_sms = suggest_comm_sms(problem, true);
  plan.forward_suggested = predict_forward(problem, plan.suggested_forward_comm_sms, PlanPath::kFused);
  plan.backward_suggested = predict_backward(problem, plan.suggested_backward_comm_sms, PlanPath::kFused);
  return plan;
}

std::vector<int> sweep_ep_sizes(int64_t num_experts) {
  std::vector<int> sizes;
  for (int ep = 1; ep <= 256; ep *= 2)
    if (num_experts % ep == 0) sizes.push_back(ep);
  return sizes;
}

std::vector<LayerPlan> plan_sweep(const PlanProblem& problem, const std::vector<int>& ep_sizes) {
  std::vector<LayerPlan> plans;
  for (int ep : ep_sizes) {
    PlanProblem p = problem;
    p.shape.num_ranks = ep;
    plans.push_back(plan_layer(p));
  }
  return plans;
}

json to_json(const PassPrediction& p) {
  return {{"ms", p.ms},
          {"tflops", p.tflops()},
          {"binding", to_string(p.binding)},
          {"path", p.path == PlanPath::kStaged ? "staged" : "fused"},
          {"comm_sms", p.comm_sms},
          {"push_combine", p.push_combine},
          {"tensor_ms", p.tensor_ms},
          {"weight_grad_ms", p.weight_grad_ms},
          {"nvlink_ms", p.nvlink_ms},
          {"comm_sm_ms", p.comm_sm_ms},
          {"nic_ms", p.nic_ms},
          {"hbm_ms", p.hbm_ms},
          {"prologue_ms", p.prologue_ms},
          {"fill_ms", p.fill_ms},
          {"drain_ms", p.drain_ms},
          {"epilogue_ms", p.epilogue_ms},
          {"nvlink_bytes", p.nvlink_bytes},
          {"nic_bytes", p.nic_bytes},
          {"hbm_bytes", p.hbm_bytes},
          {"useful_flops", p.useful_flops}};
}

json to_json(const LayerPlan& plan) {
  const PlanProblem& p = plan.problem;
  const Shape& s = p.shape;
  const PlanTraffic& t = plan.traffic;
  return {{"hidden", s.hidden},
          {"intermediate", s.intermediate},
          {"experts", s.num_experts},
          {"topk", s.num_topk},
          {"shared_intermediate", s.shared_intermediate},
          {"tokens_per_rank", s.max_tokens},
          {"ep", s.num_ranks},
          {"gpus_per_node", p.gpus_per_node},
          {"nodes", p.num_nodes()},
          {"precision", p.precision == Precision::kFP8 ? "fp8" : "bf16"},
          {"nvlink_gbps", p.nvlink_gbps},
          {"nic_gbps", p.nic_gbps},
          {"combine_partial_bytes", p.combine_partial_bytes},
          {"node_limit", p.node_limit},
          {"traffic",
           {{"rows_per_expert", t.rows_per_expert},
            {"padded_rows_per_expert", t.padded_rows_per_expert},
            {"routed_rows", t.routed_rows},
            {"local_pairs", t.local_pairs},
            {"nvlink_pairs", t.nvlink_pairs},
            {"nic_tokens", t.nic_tokens},
            {"nic_pairs_without_dedup", t.nic_pairs_without_dedup},
            {"pairs_per_remote_token", t.pairs_per_remote_token}}},
          {"forward", to_json(plan.forward)},
          {"backward", to_json(plan.backward)},
          {"suggested_forward_comm_sms", plan.suggested_forward_comm_sms},
          {"suggested_backward_comm_sms", plan.suggested_backward_comm_sms},
          {"forward_suggested", to_json(plan.forward_suggested)},
          {"backward_suggested", to_json(plan.backward_suggested)}};
}

// ---- the simulation with the model's costs ------------------------------------------------------------

reference::Problem sim_problem(const PlanProblem& problem) {
  validate(problem);
  reference::Problem p;
  p.hidden = problem.shape.hidden;
  p.intermediate = problem.shape.intermediate;
  p.num_experts = problem.shape.num_experts;
  p.num_topk = problem.shape.num_topk;
  p.shared_intermediate = problem.shape.shared_intermediate;
  p.num_ranks = problem.shape.num_ranks;
  p.block_m = kPlanBlockM;
  p.activation = problem.activation;
  p.precision = problem.precision;
  return p;
}

reference::SimConfig sim_config(const PlanProblem& problem, bool backward, int comm_sms) {
  validate(problem);
  const Dims d = dims_of(problem);
  const PlanTraffic tr = plan_traffic(problem);
  const int c = comm_sms > 0 ? comm_sms : heuristic_comm_sms(problem, backward, PlanPath::kFused);
  const PassPrediction pass = backward ? predict_backward(problem, c, PlanPath::kFused)
                                       : predict_forward(problem, c, PlanPath::kFused);
  const double wait = 1.0 / (1 - kTaskWaitFraction);
  reference::SimConfig s;
  s.gpus_per_node = problem.gpus_per_node;
  s.compute_sms = kPlanNumSms - c;
  s.comm_sms = c;
  s.push_combine = push_combine(d);
  s.minibatch_m_blocks = s.push_combine ? 16 : 8;
  // Integral tiles per m-block carrying the model's SM-us per m-block.
  const auto tiles = [&](double model_tiles, double tile_us, int64_t* count, double* us) {
    *count = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(model_tiles - 1e-9)));
    *us = model_tiles * tile_us * wait / *count;
  };
  const double shared_blocks = d.Is > 0 ? ceil_div(d.T, kPlanBlockM) : 0;
  double shared_us = 0, tail_us = 0;
  int64_t shared_count = 0, tail_count = 0;
  if (!backward) {
    tiles(ceil_div(d.I, 128), mainloop_us(d.H / 64.0, d.speedup) + kGateUpTileUs, &s.in_tiles, &s.in_tile_us);
    tiles(wide_tiles(d.H), mainloop_us(d.I / 64.0, d.speedup) + kStoreTileUs, &s.out_tiles, &s.out_tile_us);
    if (d.Is > 0) {
      shared_count = static_cast<int64_t>(shared_blocks) * (ceil_div(d.Is, 128) + ceil_div(d.H, 256));
      shared_us = shared_blocks * (ceil_div(d.Is, 128) * (mainloop_us(d.H / 64.0, 1) + kGateUpTileUs) +
                                   wide_tiles(d.H) * (mainloop_us(d.Is / 64.0, 1) + kStoreTileUs));
    }
  } else {
    tiles(wide_tiles(d.I), mainloop_us(d.H / 64.0, d.speedup) + kActivationBackwardTileUs, &s.in_tiles,
          &s.in_tile_us);
    tiles(wide_tiles(d.H), mainloop_us(2.0 * d.I / 64.0, d.speedup) + kStoreTileUs, &s.out_tiles,
          &s.out_tile_us);
    const double wgrad_tile =
        weight_grad_mainloop_us(tr.padded64_rows_per_expert / 64.0, d.speedup) + kWeightGradTileUs;
    tail_count = d.El * 3 * ceil_div(d.I, 128) * ceil_div(d.H, 256);
    tail_us = d.El * 3.0 * ceil_div(d.I, 128) * wide_tiles(d.H) * wgrad_tile;
    if (d.Is > 0) {
      shared_count = static_cast<int64_t>(shared_blocks) * (ceil_div(d.Is, 256) + ceil_div(d.H, 256));
      shared_us =
          shared_blocks * (wide_tiles(d.Is) * (mainloop_us(d.H / 64.0, 1) + kActivationBackwardTileUs) +
                           wide_tiles(d.H) * (mainloop_us(2.0 * d.Is / 64.0, 1) + kStoreTileUs));
      const int64_t shared_wgrad = 3 * ceil_div(d.Is, 128) * ceil_div(d.H, 256);
      tail_count += shared_wgrad;
      tail_us += 3.0 * ceil_div(d.Is, 128) * wide_tiles(d.H) *
                 (weight_grad_mainloop_us(ceil_div(d.T, 64), 1) + kWeightGradTileUs);
    }
  }
  s.shared_tiles = shared_count;
  s.shared_tile_us = shared_count > 0 ? shared_us * wait / shared_count : 0.0;
  s.tail_tiles = tail_count;
  s.tail_tile_us = tail_count > 0 ? tail_us * wait / tail_count : 0.0;
  const FusedTransfers f = fused_transfers(problem, d, tr, backward);
  s.nvlink_gbps = problem.nvlink_gbps;
  s.nvlink_per_comm_sm_gbps = kNvlinkPerCommSmGbps;
  s.local_per_comm_sm_gbps = kLocalCopyPerCommSmGbps;
  s.nic_gbps = problem.nic_gbps * kNicEfficiency;
  s.nic_latency_us = kNicLatencyUs;
  s.nvlink_latency_us = 1.0;
  s.in_row_bytes = f.in_row_bytes;
  s.out_row_bytes = f.out_row_bytes;
  s.nic_in_row_bytes = f.nic_in_row_bytes;
  s.nic_out_row_bytes = f.nic_out_row_bytes;
  s.partial_row_bytes = static_cast<double>(d.H) * problem.combine_partial_bytes;
  s.prologue_us = pass.prologue_ms * 1e3;
  s.combine_barrier_us = (d.R > 1 ? kNvlinkBarrierUs : 0.0) + (d.N > 1 ? kNicLatencyUs : 0.0);
  s.epilogue_us = pass.epilogue_ms * 1e3;
  return s;
}

std::vector<reference::RankInputs> plan_routing(const PlanProblem& problem, uint64_t seed) {
  validate(problem);
  const Shape& shape = problem.shape;
  const int64_t k = shape.num_topk, E = shape.num_experts, N = problem.num_nodes(),
                M = limited_nodes(problem);
  const int64_t per_node = E / N;
  std::vector<reference::RankInputs> ranks(shape.num_ranks);
  for (int64_t r = 0; r < shape.num_ranks; ++r) {
    std::mt19937_64 rng(seed * 1000003u + static_cast<uint64_t>(r));
    reference::RankInputs& in = ranks[r];
    in.num_tokens = shape.max_tokens;
    in.topk_idx.resize(shape.max_tokens * k);
    std::vector<int64_t> nodes(M);
    for (int64_t t = 0; t < shape.max_tokens; ++t) {
      // M distinct nodes (all of them without a limit), then k distinct experts among their experts.
      for (int64_t i = 0; i < M; ++i) {
        if (M == N) {
          nodes[i] = i;
          continue;
        }
        int64_t node;
        do node = std::uniform_int_distribution<int64_t>(0, N - 1)(rng);
        while (std::find(nodes.begin(), nodes.begin() + i, node) != nodes.begin() + i);
        nodes[i] = node;
      }
      std::uniform_int_distribution<int64_t> pick(0, M * per_node - 1);
      int32_t* slots = &in.topk_idx[t * k];
      for (int64_t j = 0; j < k; ++j) {
        int32_t e;
        do {
          const int64_t index = pick(rng);
          e = static_cast<int32_t>(nodes[index / per_node] * per_node + index % per_node);
        } while (std::find(slots, slots + j, e) != slots + j);
        slots[j] = e;
      }
    }
  }
  return ranks;
}

// ---- options -----------------------------------------------------------------------------------------

PlanProblem plan_problem(const PlanCommandOptions& o) {
  const Preset preset = bench_preset(o.preset);
  PlanProblem p;
  p.shape = preset.shape;
  if (o.hidden) p.shape.hidden = *o.hidden;
  if (o.intermediate) p.shape.intermediate = *o.intermediate;
  if (o.experts) p.shape.num_experts = *o.experts;
  if (o.topk) p.shape.num_topk = *o.topk;
  if (o.shared_intermediate) p.shape.shared_intermediate = *o.shared_intermediate;
  p.shape.max_tokens = o.tokens;
  p.shape.num_ranks = o.ep;
  p.activation = preset.activation;
  POUNCE_CHECK(o.precision == "bf16" || o.precision == "fp8", "--precision ", o.precision,
               " is unknown; choose bf16 or fp8");
  p.precision = o.precision == "fp8" ? Precision::kFP8 : Precision::kBF16;
  POUNCE_CHECK(o.combine_wire == "bf16" || o.combine_wire == "fp32", "--combine-wire ", o.combine_wire,
               " is unknown; choose bf16 or fp32");
  p.combine_partial_bytes = o.combine_wire == "fp32" ? 4 : 2;
  p.node_limit = o.node_limit;
  p.gpus_per_node = o.gpus_per_node;
  p.nvlink_gbps = o.nvlink_gbps;
  p.nic_gbps = o.nic_gbps;
  p.forward_comm_sms = o.comm_sms;
  p.backward_comm_sms = o.comm_sms;
  validate(p);
  return p;
}

}  // namespace pounce::cli
