#include "cli/reference_check.h"

#include <algorithm>
#include <cmath>

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
  const Shape& s = problem.shape;
  reference::Problem p;
  p.hidden = s.hidden;
  p.intermediate = s.intermediate;
  p.num_experts = s.num_experts;
  p.num_topk = s.num_topk;
  p.shared_intermediate = s.shared_intermediate;
  p.num_ranks = s.num_ranks;
  p.block_m = kBlockM;
  p.activation = problem.activation;
  p.numerics = reference::Numerics::kBf16;  // the layer's rounding points: the oracle
  p.precision = precision;
  p.num_threads = num_threads;
  return p;
}

reference::Weights to_weights(const HostWeights& w) {
  return {to_double(w.gate),   to_double(w.up),   to_double(w.down),
          to_double(w.b_gate), to_double(w.b_up), to_double(w.b_down)};
}

// The plan's tokens of every rank alone, with all their pairs and the shared expert: out, d_x and
// d_topk_weights in plan order.
void evaluate_tokens(const HostProblem& problem, const CheckPlan& plan, bool backward,
                     const reference::Problem& p, SampledTensors& result) {
  const Shape& s = problem.shape;
  const int64_t H = s.hidden, k = s.num_topk;
  std::vector<reference::RankInputs> inputs(s.num_ranks);
  std::vector<reference::Weights> routed;
  for (int64_t r = 0; r < s.num_ranks; ++r) {
    const HostRank& in = problem.ranks[r];
    reference::RankInputs& sub = inputs[r];
    sub.num_tokens = static_cast<int64_t>(plan.tokens[r].size());
    for (int64_t t : plan.tokens[r]) {
      append_bf16(in.x, t * H, H, sub.x);
      if (backward) append_bf16(in.d_out, t * H, H, sub.d_out);
      for (int64_t j = 0; j < k; ++j) {
        sub.topk_idx.push_back(in.topk_idx[t * k + j]);
        sub.topk_weights.push_back(in.topk_weights[t * k + j]);
      }
    }
    sub.routed_weight_grads = sub.shared_weight_grads = false;  // from the experts' problem
    routed.push_back(to_weights(in.routed));
  }
  const reference::Weights shared = to_weights(problem.shared);
  for (const reference::RankForward& rank : reference::forward(p, inputs, routed, shared))
    result[Field::kOut].insert(result[Field::kOut].end(), rank.out.begin(), rank.out.end());
  if (!backward) return;
  for (const reference::RankGradients& rank : reference::backward(p, inputs, routed, shared)) {
    result[Field::kDX].insert(result[Field::kDX].end(), rank.d_x.begin(), rank.d_x.end());
    result[Field::kDTopkWeights].insert(result[Field::kDTopkWeights].end(), rank.d_topk_weights.begin(),
                                        rank.d_topk_weights.end());
  }
}

// Every token, only its pairs routed to the plan's experts (renumbered: the i-th sampled expert of rank r
// is expert r * n + i of R * n), no shared expert: those experts' weight and bias gradients at the plan's
// rows, in plan order.
void evaluate_experts(const HostProblem& problem, const CheckPlan& plan, reference::Problem p,
                      SampledTensors& result) {
  const Shape& s = problem.shape;
  const int64_t R = s.num_ranks, H = s.hidden, I = s.intermediate;
  const int64_t El = s.num_local_experts(), n = static_cast<int64_t>(plan.experts[0].size());
  if (n == 0) return;
  for (const std::vector<int64_t>& experts : plan.experts)
    POUNCE_CHECK(static_cast<int64_t>(experts.size()) == n,
                 "check plan samples a different number of experts per rank");
  std::vector<int32_t> renumbered(s.num_experts, -1);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < n; ++i) renumbered[r * El + plan.experts[r][i]] = static_cast<int32_t>(r * n + i);
  p.num_experts = R * n;
  p.shared_intermediate = 0;

  std::vector<reference::RankInputs> inputs(R);
  std::vector<reference::Weights> routed(R);
  for (int64_t r = 0; r < R; ++r) {
    const HostRank& in = problem.ranks[r];
    reference::RankInputs& sub = inputs[r];
    sub.num_tokens = in.num_tokens;
    sub.x = to_double(in.x);
    sub.d_out = to_double(in.d_out);
    sub.topk_weights.assign(in.topk_weights.begin(), in.topk_weights.end());
    for (int32_t expert : in.topk_idx) sub.topk_idx.push_back(expert < 0 ? -1 : renumbered[expert]);
    sub.shared_weight_grads = false;
    reference::Weights& w = routed[r];
    for (int64_t local : plan.experts[r]) {
      append_bf16(in.routed.gate, local * I * H, I * H, w.gate);
      append_bf16(in.routed.up, local * I * H, I * H, w.up);
      append_bf16(in.routed.down, local * H * I, H * I, w.down);
      if (!in.routed.b_gate.empty()) append_bf16(in.routed.b_gate, local * I, I, w.b_gate);
      if (!in.routed.b_up.empty()) append_bf16(in.routed.b_up, local * I, I, w.b_up);
      if (!in.routed.b_down.empty()) append_bf16(in.routed.b_down, local * H, H, w.b_down);
    }
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
                                  Precision precision, int num_threads) {
  POUNCE_CHECK(static_cast<int64_t>(plan.tokens.size()) == problem.shape.num_ranks, "check plan has ",
               plan.tokens.size(), " ranks but the problem has ", problem.shape.num_ranks);
  const reference::Problem p = make_problem(problem, precision, num_threads);
  SampledTensors result;
  evaluate_tokens(problem, plan, backward, p, result);
  if (backward) evaluate_experts(problem, plan, p, result);
  return result;
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
