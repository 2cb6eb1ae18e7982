#include "cli/reference_check.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "pounce/error.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce::cli {
namespace {

std::vector<double> to_double(const std::vector<uint16_t>& bits) {
  std::vector<double> out(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) out[i] = reference::bf16_bits_to_float(bits[i]);
  return out;
}

// `count` bf16 values from `bits` at `offset`, appended to `out` as double.
void append_bf16(const std::vector<uint16_t>& bits, int64_t offset, int64_t count, std::vector<double>& out) {
  for (int64_t i = 0; i < count; ++i) out.push_back(reference::bf16_bits_to_float(bits[offset + i]));
}

reference::Problem make_problem(const HostProblem& problem, Precision precision, int num_threads) {
  reference::Problem p = reference::Problem::of(problem.shape, problem.activation, precision);
  p.num_threads = num_threads;
  return p;
}

// Expert `local`'s weights (and biases, when given) of `from` into expert slot `slot` of `to`, which is
// sized for its experts (zeros elsewhere).
void copy_expert(const HostWeights& from, int64_t local, int64_t slot, int64_t H, int64_t I,
                 reference::Weights& to) {
  auto copy = [](const std::vector<uint16_t>& bits, int64_t src, int64_t dst, int64_t count,
                 std::vector<double>& out) {
    for (int64_t i = 0; i < count; ++i) out[dst + i] = reference::bf16_bits_to_float(bits[src + i]);
  };
  copy(from.gate, local * I * H, slot * I * H, I * H, to.gate);
  copy(from.up, local * I * H, slot * I * H, I * H, to.up);
  copy(from.down, local * H * I, slot * H * I, H * I, to.down);
  if (!from.b_gate.empty()) copy(from.b_gate, local * I, slot * I, I, to.b_gate);
  if (!from.b_up.empty()) copy(from.b_up, local * I, slot * I, I, to.b_up);
  if (!from.b_down.empty()) copy(from.b_down, local * H, slot * H, H, to.b_down);
}

// Zero weights (and biases, where `like` has them) for `num_experts` experts.
reference::Weights zero_weights(const HostWeights& like, int64_t num_experts, int64_t H, int64_t I) {
  reference::Weights w;
  w.gate.assign(num_experts * I * H, 0.0);
  w.up.assign(num_experts * I * H, 0.0);
  w.down.assign(num_experts * H * I, 0.0);
  if (!like.b_gate.empty()) w.b_gate.assign(num_experts * I, 0.0);
  if (!like.b_up.empty()) w.b_up.assign(num_experts * I, 0.0);
  if (!like.b_down.empty()) w.b_down.assign(num_experts * H, 0.0);
  return w;
}

// Experts per rank of a tokens problem: at least ceil(k / R) (so that num_topk <= num_experts) and 1.
int64_t min_experts_per_rank(const Shape& s) {
  return std::max<int64_t>(1, (s.num_topk + s.num_ranks - 1) / s.num_ranks);
}

// At most this many experts (R * m) in a tokens batch, from the byte budget.
int64_t batch_max_experts(const Shape& s, double batch_bytes) {
  const double expert_bytes =
      kReferenceBytesPerWeight * 3.0 * static_cast<double>(s.hidden) * static_cast<double>(s.intermediate);
  return std::max<int64_t>(1, static_cast<int64_t>(std::min(batch_bytes / expert_bytes, 1e15)));
}

// A batch of the tokens problem: a run of the plan's tokens in plan order (rank-major, so that the batches'
// values, concatenated, are in plan order), and the local experts they route to.
struct TokenBatch {
  std::vector<std::vector<int64_t>> tokens;   // [R] token indices of each rank, plan order
  std::vector<std::vector<int64_t>> experts;  // [R] the local experts they route to, ascending
  int64_t experts_per_rank = 0;               // m: the new ids of rank r's experts are r * m + i
};

// Greedy: a token joins the current batch unless that takes its R * m above max_experts.
std::vector<TokenBatch> make_token_batches(const HostProblem& problem, const CheckPlan& plan,
                                           int64_t max_experts) {
  const Shape& s = problem.shape;
  const int64_t R = s.num_ranks, k = s.num_topk, El = s.num_local_experts(), min_m = min_experts_per_rank(s);
  std::vector<TokenBatch> batches;
  std::vector<std::vector<char>> used;  // [R][El] of the current batch
  std::vector<int64_t> count;           // [R] used experts of the current batch
  int64_t batch_tokens = 0;
  auto close = [&] {
    if (batch_tokens == 0) return;
    TokenBatch& batch = batches.back();
    batch.experts.resize(R);
    int64_t m = min_m;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t le = 0; le < El; ++le)
        if (used[r][le]) batch.experts[r].push_back(le);
      m = std::max(m, count[r]);
    }
    batch.experts_per_rank = m;
  };
  auto open = [&] {
    batches.emplace_back();
    batches.back().tokens.resize(R);
    used.assign(R, std::vector<char>(El, 0));
    count.assign(R, 0);
    batch_tokens = 0;
  };
  open();
  for (int64_t r = 0; r < R; ++r) {
    const std::vector<int32_t>& idx = problem.ranks[r].topk_idx;
    for (int64_t t : plan.tokens[r]) {
      std::vector<int32_t> mine;  // this token's experts, each once
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = idx[t * k + j];
        if (e >= 0 && std::find(mine.begin(), mine.end(), e) == mine.end()) mine.push_back(e);
      }
      // The batch's experts per rank with this token's: at most R * m = max_experts unless it is alone.
      auto m_with_token = [&] {
        std::vector<int64_t> with = count;
        for (int32_t e : mine) with[e / El] += !used[e / El][e % El];
        return std::max(min_m, *std::max_element(with.begin(), with.end()));
      };
      if (batch_tokens > 0 && R * m_with_token() > max_experts) {
        close();
        open();
      }
      for (int32_t e : mine) {
        count[e / El] += !used[e / El][e % El];
        used[e / El][e % El] = 1;
      }
      batches.back().tokens[r].push_back(t);
      ++batch_tokens;
    }
  }
  close();
  if (batch_tokens == 0) batches.pop_back();
  return batches;
}

// One batch of the plan's tokens alone, with all their pairs and the shared expert, only the experts they
// route to (renumbered: TokenBatch): out, d_x and d_topk_weights appended in plan order.
void evaluate_token_batch(const HostProblem& problem, const TokenBatch& batch, bool backward,
                          reference::Problem p, const reference::Weights& shared, SampledTensors& result) {
  const Shape& s = problem.shape;
  const int64_t R = s.num_ranks, H = s.hidden, I = s.intermediate, k = s.num_topk;
  const int64_t El = s.num_local_experts(), m = batch.experts_per_rank;
  std::vector<int32_t> renumbered(s.num_experts, -1);
  for (int64_t r = 0; r < R; ++r)
    for (size_t i = 0; i < batch.experts[r].size(); ++i)
      renumbered[r * El + batch.experts[r][i]] = static_cast<int32_t>(r * m + static_cast<int64_t>(i));
  p.num_experts = R * m;

  std::vector<reference::RankInputs> inputs(R);
  std::vector<reference::Weights> routed;
  for (int64_t r = 0; r < R; ++r) {
    const HostRank& in = problem.ranks[r];
    reference::RankInputs& sub = inputs[r];
    sub.num_tokens = static_cast<int64_t>(batch.tokens[r].size());
    for (int64_t t : batch.tokens[r]) {
      append_bf16(in.x, t * H, H, sub.x);
      if (backward) append_bf16(in.d_out, t * H, H, sub.d_out);
      for (int64_t j = 0; j < k; ++j) {  // slots stay where they are
        const int32_t e = in.topk_idx[t * k + j];
        sub.topk_idx.push_back(e < 0 ? -1 : renumbered[e]);
        sub.topk_weights.push_back(in.topk_weights[t * k + j]);
      }
    }
    sub.routed_weight_grads = sub.shared_weight_grads = false;  // from the experts' problem
    routed.push_back(zero_weights(in.routed, m, H, I));         // padding experts stay zero (FP8: scale 1)
    for (size_t i = 0; i < batch.experts[r].size(); ++i)
      copy_expert(in.routed, batch.experts[r][i], static_cast<int64_t>(i), H, I, routed.back());
  }
  for (const reference::RankForward& rank : reference::forward(p, inputs, routed, shared))
    result[Field::kOut].insert(result[Field::kOut].end(), rank.out.begin(), rank.out.end());
  if (!backward) return;
  for (const reference::RankGradients& rank : reference::backward(p, inputs, routed, shared)) {
    result[Field::kDX].insert(result[Field::kDX].end(), rank.d_x.begin(), rank.d_x.end());
    result[Field::kDTopkWeights].insert(result[Field::kDTopkWeights].end(), rank.d_topk_weights.begin(),
                                        rank.d_topk_weights.end());
  }
}

// The plan's tokens, batch after batch (one batch's reference at a time).
void evaluate_tokens(const HostProblem& problem, const CheckPlan& plan, bool backward,
                     const reference::Problem& p, double batch_bytes, SampledTensors& result) {
  const reference::Weights shared = {to_double(problem.shared.gate), to_double(problem.shared.up),
                                     to_double(problem.shared.down)};
  for (const TokenBatch& batch :
       make_token_batches(problem, plan, batch_max_experts(problem.shape, batch_bytes)))
    evaluate_token_batch(problem, batch, backward, p, shared, result);
}

// Every token, only its pairs routed to the plan's experts (renumbered: the i-th sampled expert of rank r
// is expert r * n + i of R * n), no shared expert: those experts' weight and bias gradients at the plan's
// rows, in plan order.
//
// A token's pairs to the sampled experts are packed, in slot order, into its first k' = min(k, R * n)
// slots (their top-k weights with them; the other slots -1 with weight 0), so that num_topk <= num_experts.
// This leaves every receive-schedule segment as it was (reference/schedule.cpp build_schedule): an
// expert's rows from one source are in ascending (token, slot) order, and the sources are interleaved
// round-robin by each one's n-th row. Packing keeps the tokens and, within a token, the slots' order (a
// stable compaction), so each source's list holds the same (token) sequence and the interleave the same
// (source, token) rows in the same order; only the slot numbers change, which no operand of the weight
// gradients reads (the top-k weight moves with its pair). The 128-row token-axis blocks, cut from each
// segment's first row, hold the same rows.
void evaluate_experts(const HostProblem& problem, const CheckPlan& plan, reference::Problem p,
                      SampledTensors& result) {
  const Shape& s = problem.shape;
  const int64_t R = s.num_ranks, H = s.hidden, I = s.intermediate, k = s.num_topk;
  const int64_t El = s.num_local_experts(), n = static_cast<int64_t>(plan.experts[0].size());
  if (n == 0) return;
  for (const std::vector<int64_t>& experts : plan.experts)
    POUNCE_CHECK(static_cast<int64_t>(experts.size()) == n,
                 "check plan samples a different number of experts per rank");
  std::vector<int32_t> renumbered(s.num_experts, -1);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; ++i) renumbered[r * El + plan.experts[r][i]] = static_cast<int32_t>(r * n + i);
  const int64_t packed_k = std::min(k, R * n);
  p.num_experts = R * n;
  p.num_topk = packed_k;
  p.shared_intermediate = 0;

  std::vector<reference::RankInputs> inputs(R);
  std::vector<reference::Weights> routed(R);
  for (int64_t r = 0; r < R; ++r) {
    const HostRank& in = problem.ranks[r];
    reference::RankInputs& sub = inputs[r];
    sub.num_tokens = in.num_tokens;
    sub.x = to_double(in.x);
    sub.d_out = to_double(in.d_out);
    sub.topk_idx.assign(in.num_tokens * packed_k, -1);
    sub.topk_weights.assign(in.num_tokens * packed_k, 0.0);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      int64_t slot = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = in.topk_idx[t * k + j];
        if (e < 0 || renumbered[e] < 0) continue;
        POUNCE_CHECK(slot < packed_k, "FP8 check: token ", t, " of rank ", r, " routes more than ", packed_k,
                     " of its ", k, " pairs to the ", R * n,
                     " sampled experts, so its topk_idx repeats an expert; the reduced reference packs "
                     "them into min(k, ranks x --check-experts) = ",
                     packed_k,
                     " slots (fix: route each token to distinct experts, or raise --check-experts)");
        sub.topk_idx[t * packed_k + slot] = renumbered[e];
        sub.topk_weights[t * packed_k + slot] = in.topk_weights[t * k + j];
        ++slot;
      }
    }
    sub.shared_weight_grads = false;
    routed[r] = zero_weights(in.routed, n, H, I);
    for (int64_t i = 0; i < n; ++i) copy_expert(in.routed, plan.experts[r][i], i, H, I, routed[r]);
  }
  const std::vector<reference::RankGradients> grads = reference::backward(p, inputs, routed, {});
  for (int64_t r = 0; r < R; ++r) {
    const reference::Weights& d = grads[r].d_routed;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t row : plan.rows)
        for (int64_t h = 0; h < H; ++h) {
          result[Field::kDRoutedGate].push_back(d.gate[(i * I + row) * H + h]);
          result[Field::kDRoutedUp].push_back(d.up[(i * I + row) * H + h]);
        }
      for (int64_t h = 0; h < H; ++h)
        for (int64_t row : plan.rows) result[Field::kDRoutedDown].push_back(d.down[(i * H + h) * I + row]);
      for (int64_t row : plan.rows) {
        if (!d.b_gate.empty()) result[Field::kDRoutedBGate].push_back(d.b_gate[i * I + row]);
        if (!d.b_up.empty()) result[Field::kDRoutedBUp].push_back(d.b_up[i * I + row]);
      }
      if (!d.b_down.empty())
        for (int64_t h = 0; h < H; ++h) result[Field::kDRoutedBDown].push_back(d.b_down[i * H + h]);
    }
  }
}

}  // namespace

SampledTensors reference_evaluate(const HostProblem& problem, const CheckPlan& plan, bool backward,
                                  Precision precision, int num_threads, double batch_bytes) {
  POUNCE_CHECK(static_cast<int64_t>(plan.tokens.size()) == problem.shape.num_ranks, "check plan has ",
               plan.tokens.size(), " ranks but the problem has ", problem.shape.num_ranks);
  const reference::Problem p = make_problem(problem, precision, num_threads);
  SampledTensors result;
  evaluate_tokens(problem, plan, backward, p, batch_bytes, result);
  if (backward) evaluate_experts(problem, plan, p, result);
  return result;
}

double estimate_reference_check_bytes(const Shape& shape, int64_t check_tokens, int64_t check_experts,
                                      int num_threads, double batch_bytes) {
  const Shape& s = shape;
  const int64_t R = s.num_ranks, T = s.max_tokens, k = s.num_topk, El = s.num_local_experts();
  const int64_t tokens = check_tokens <= 0 || check_tokens >= T ? T : check_tokens;  // per rank
  const int64_t n = check_experts <= 0 || check_experts >= El ? El : check_experts;
  const double H = static_cast<double>(s.hidden), I = static_cast<double>(s.intermediate);
  const double Is = static_cast<double>(s.shared_intermediate), expert = 3.0 * H * I;
  const double threads = num_threads > 0 ? num_threads : std::max(1u, std::thread::hardware_concurrency());

  // The run's host inputs, alive throughout: bf16 weights (every expert, the shared one), x and d_out
  // (bf16), the top-k ids and weights.
  const double inputs = 2.0 * (static_cast<double>(s.num_experts) * expert + 3.0 * H * Is) +
                        static_cast<double>(R * T) * (4.0 * H + 8.0 * static_cast<double>(k));
  // One reduced problem in the reference's FP8 backward (its forward, and BF16, hold less): the weights
  // (kReferenceBytesPerWeight; the experts problem's fp64 gradients 8 more) and, while they are quantized,
  // two float copies of one matrix per thread; per token its inputs here and in the reference (double,
  // float, e4m3), its per-pair d_x and y slots and its results; per receive-schedule row FP8 mode's row
  // tensors (reference/fp8_detail.h Fp8Rows: 44 B per H, 62 per I, and the scales); the shared expert.
  auto reference_bytes = [&](int64_t num_experts, int64_t num_tokens, int64_t topk, int64_t pairs,
                             bool experts_problem) {
    const double E = static_cast<double>(num_experts), kk = static_cast<double>(topk);
    const double rows = static_cast<double>(pairs + (kBlockM - 1) * std::min(num_experts, pairs));
    const double weights = E * expert * (kReferenceBytesPerWeight + (experts_problem ? 8.0 : 0.0)) +
                           std::min(threads, E) * 8.0 * H * I;
    const double per_token = (experts_problem ? (44.0 + 4.0 * kk) : (48.0 + 12.0 * kk)) * H + 32.0 * kk +
                             (experts_problem ? 0.0 : 24.0 * Is);
    const double shared = experts_problem ? 0.0 : 16.0 * 3.0 * H * Is;
    return weights + static_cast<double>(num_tokens) * per_token + rows * (48.0 * H + 64.0 * I) + shared;
  };
  // A tokens batch: R * m experts, m at most the most one rank's experts the plan's pairs reach, and at
  // most the batch budget unless one token alone needs more.
  const int64_t plan_pairs = R * tokens * k, min_m = min_experts_per_rank(s);
  const int64_t whole = R * std::max(min_m, std::min(El, plan_pairs));
  const int64_t alone = R * std::max(min_m, std::min(El, k));
  const int64_t batch = std::min(whole, std::max(batch_max_experts(s, batch_bytes), alone));
  const double tokens_problem = reference_bytes(batch, R * tokens, k, plan_pairs, false);
  // The experts problem: R * n experts, every token, its pairs packed into min(k, R * n) slots.
  const int64_t packed_k = std::min(k, R * n);
  const double experts_problem = reference_bytes(R * n, R * T, packed_k, R * T * packed_k, true);
  return inputs + std::max(tokens_problem, experts_problem);
}

SampledTensors fill_missing(SampledTensors base, const SampledTensors& from) {
  for (int f = 0; f < kNumFields; ++f)
    if (base.values[f].empty()) base.values[f] = from.values[f];
  return base;
}

std::vector<BudgetCheck> check_fp8_budget(const SampledTensors& fp8, const SampledTensors& bf16_ref) {
  std::vector<BudgetCheck> checks;
  for (int f = 0; f < kNumFields; ++f) {
    const Field field = static_cast<Field>(f);
    const std::vector<double>& want = bf16_ref[field];
    const std::vector<double>& got = fp8[field];
    if (want.empty()) continue;
    BudgetCheck check;
    check.name = field_name(field);
    check.count = static_cast<int64_t>(want.size());
    check.gradient = is_backward_field(field);
    if (got.size() != want.size()) {
      check.rel_error = INFINITY;
      check.cosine = NAN;
      checks.push_back(check);
      continue;
    }
    double diff2 = 0.0, got2 = 0.0, want2 = 0.0, dot = 0.0;
    bool finite = true;
    for (size_t i = 0; i < want.size(); ++i) {
      finite &= std::isfinite(got[i]);
      diff2 += (got[i] - want[i]) * (got[i] - want[i]);
      got2 += got[i] * got[i];
      want2 += want[i] * want[i];
      dot += got[i] * want[i];
    }
    if (!finite) {
      check.rel_error = check.cosine = NAN;
    } else {
      check.rel_error = want2 > 0.0 ? std::sqrt(diff2 / want2) : (diff2 > 0.0 ? INFINITY : 0.0);
      // Both zero (an expert no token chose) agree; one zero does not.
      check.cosine = got2 > 0.0 && want2 > 0.0 ? dot / std::sqrt(got2 * want2) : (got2 == want2 ? 1.0 : 0.0);
    }
    check.passed = finite && check.rel_error <= kFp8MaxRelError &&
                   (!check.gradient || check.cosine >= kFp8MinGradCosine);
    checks.push_back(check);
  }
  return checks;
}

}  // namespace pounce::cli
