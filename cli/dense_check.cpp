#include "cli/dense_check.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <sstream>

#include "pounce/error.h"
#include "reference/bf16.h"
#include "reference/reference.h"
#include "cli/parallel.h"

namespace pounce::cli {
namespace {

using reference::bf16_bits_to_float;

// ---- plan ----------------------------------------------------------------------------------------------

// `count` distinct values of [0, n) ascending (all of them when count is 0 or >= n).
std::vector<int64_t> sample(int64_t n, int64_t count, std::mt19937_64& engine) {
  std::vector<int64_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  if (count <= 0 || count >= n) return all;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pick = i + static_cast<int64_t>(engine() % static_cast<uint64_t>(n - i));
    std::swap(all[i], all[pick]);
  }
  all.resize(count);
  std::sort(all.begin(), all.end());
  return all;
}

// ---- sizes of a rank's block in SampledTensors ---------------------------------------------------------

int64_t rank_field_size(const CheckPlan& plan, const Shape& shape, Field field, int64_t rank) {
  const int64_t tokens = static_cast<int64_t>(plan.tokens[rank].size());
  const int64_t experts = static_cast<int64_t>(plan.experts[rank].size());
  const int64_t rows = static_cast<int64_t>(plan.rows.size());
  const int64_t shared_rows = static_cast<int64_t>(plan.shared_rows.size());
  switch (field) {
    case Field::kOut:
    case Field::kDX:
      return tokens * shape.hidden;
    case Field::kDTopkWeights:
      return tokens * shape.num_topk;
    case Field::kDRoutedGate:
    case Field::kDRoutedUp:
    case Field::kDRoutedDown:
      return experts * rows * shape.hidden;
    case Field::kDSharedGate:
    case Field::kDSharedUp:
    case Field::kDSharedDown:
      return shared_rows * shape.hidden;
    case Field::kDRoutedBGate:
    case Field::kDRoutedBUp:
      return experts * rows;
    case Field::kDRoutedBDown:
      return experts * shape.hidden;
  }
  return 0;
}

// ---- fp64 kernels on bf16 weights ----------------------------------------------------------------------

// sum_n w[n] * v[n] with four independent accumulators (the order is fixed, so results are reproducible).
double dot(const uint16_t* w, const double* v, int64_t n) {
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int64_t l = 0; l < 4; ++l) acc[l] += static_cast<double>(bf16_bits_to_float(w[i + l])) * v[i + l];
  for (; i < n; ++i) acc[0] += static_cast<double>(bf16_bits_to_float(w[i])) * v[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// acc[n] += alpha * w[n]
void axpy(double alpha, const uint16_t* w, double* acc, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += alpha * static_cast<double>(bf16_bits_to_float(w[i]));
}

void to_double(const uint16_t* bits, int64_t n, double* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(bits[i]);
}

// One expert's weights: gate/up [inter, hidden], down [hidden, inter], bf16 bits.
// Optional biases b_gate, b_up [inter], b_down [hidden] (null: none).
struct Mlp {
  const uint16_t* gate;
  const uint16_t* up;
  const uint16_t* down;
  int64_t inter;
  int64_t hidden;
  const uint16_t* b_gate = nullptr;
  const uint16_t* b_up = nullptr;
  const uint16_t* b_down = nullptr;
};

double bias(const uint16_t* b, int64_t i) {
  return b == nullptr ? 0.0 : static_cast<double>(bf16_bits_to_float(b[i]));
}

Mlp routed_mlp(const HostProblem& problem, int64_t expert) {
  const Shape& s = problem.shape;
  const int64_t El = s.num_local_experts();
  const HostWeights& w = problem.ranks[expert / El].routed;
  const int64_t local = expert % El, size = s.intermediate * s.hidden;
  auto at = [&](const std::vector<uint16_t>& b, int64_t n) {
    return b.empty() ? nullptr : b.data() + local * n;
  };
  return {w.gate.data() + local * size,
          w.up.data() + local * size,
          w.down.data() + local * size,
          s.intermediate,
          s.hidden,
          at(w.b_gate, s.intermediate),
          at(w.b_up, s.intermediate),
          at(w.b_down, s.hidden)};
}

Mlp shared_mlp(const HostProblem& problem) {
  const HostWeights& w = problem.shared;
  return {w.gate.data(), w.up.data(), w.down.data(), problem.shape.shared_intermediate, problem.shape.hidden};
}

struct Scratch {
  std::vector<double> g, u, a, y, d_a;
};

// act'(g, u) d_a in fp64 (dense_evaluate's clamp_masks_at_bf16): with `masks_at_bf16`, a g or u whose bf16
// value is on the other side of a clamp limit than its fp64 value moves to the limit on the bf16 value's side
// (the activation is continuous there), so the mask is the layer's.
void activation_backward_checked(const Activation& act, bool masks_at_bf16, double g, double u, double d_a,
                                 double* d_g, double* d_u) {
  if (masks_at_bf16 && act.clamp_limit) {
    const double limit = *act.clamp_limit;
    auto to_side = [limit](double value, double bf16_value) {
      return bf16_value <= limit ? std::min(value, limit) : std::max(value, std::nextafter(limit, INFINITY));
    };
    g = to_side(g, reference::round_bf16(static_cast<float>(g)));
    u = std::copysign(to_side(std::abs(u), std::abs(reference::round_bf16(static_cast<float>(u)))), u);
  }
  reference::activation_backward(act, g, u, d_a, d_g, d_u);
}

// g = W_gate x + b_gate, u = W_up x + b_up, a = act(g, u), y = W_down a + b_down.
void mlp_forward(const Mlp& w, const Activation& act, const double* x, Scratch& s) {
  s.g.resize(w.inter);
  s.u.resize(w.inter);
  s.a.resize(w.inter);
  s.y.assign(w.hidden, 0.0);
  for (int64_t i = 0; i < w.inter; ++i) {
    s.g[i] = dot(w.gate + i * w.hidden, x, w.hidden) + bias(w.b_gate, i);
    s.u[i] = dot(w.up + i * w.hidden, x, w.hidden) + bias(w.b_up, i);
    s.a[i] = reference::activation(act, s.g[i], s.u[i]);
  }
  for (int64_t h = 0; h < w.hidden; ++h)
    s.y[h] = dot(w.down + h * w.inter, s.a.data(), w.inter) + bias(w.b_down, h);
}

// d_x += W_gate^T d_g + W_up^T d_u, with d_a = W_down^T d_y; needs s.g, s.u from mlp_forward.
void mlp_backward(const Mlp& w, const Activation& act, bool masks_at_bf16, const double* d_y, Scratch& s,
                  double* d_x) {
  s.d_a.assign(w.inter, 0.0);
  for (int64_t h = 0; h < w.hidden; ++h) axpy(d_y[h], w.down + h * w.inter, s.d_a.data(), w.inter);
  for (int64_t i = 0; i < w.inter; ++i) {
    double d_g = 0.0, d_u = 0.0;
    activation_backward_checked(act, masks_at_bf16, s.g[i], s.u[i], s.d_a[i], &d_g, &d_u);
    axpy(d_g, w.gate + i * w.hidden, d_x, w.hidden);
    axpy(d_u, w.up + i * w.hidden, d_x, w.hidden);
  }
}

// One sampled token of rank `rank`: its rows of out, d_x and d_topk_weights.
void evaluate_token(const HostProblem& problem, int64_t rank, int64_t token, bool backward,
                    bool masks_at_bf16, double* out, double* d_x, double* d_topk_weights) {
  const Shape& s = problem.shape;
  const int64_t H = s.hidden, k = s.num_topk;
  const HostRank& in = problem.ranks[rank];
  std::vector<double> x(H), d_out(H);
  to_double(in.x.data() + token * H, H, x.data());
  if (backward) to_double(in.d_out.data() + token * H, H, d_out.data());
  std::fill(out, out + H, 0.0);
  if (backward) std::fill(d_x, d_x + H, 0.0);
  Scratch scratch;
  if (s.has_shared_expert()) {
    const Mlp w = shared_mlp(problem);
    mlp_forward(w, problem.activation, x.data(), scratch);
    for (int64_t h = 0; h < H; ++h) out[h] += scratch.y[h];
    if (backward) mlp_backward(w, problem.activation, masks_at_bf16, d_out.data(), scratch, d_x);
  }
  std::vector<double> d_y(H);
  for (int64_t j = 0; j < k; ++j) {
    const int32_t expert = in.topk_idx[token * k + j];
    if (backward) d_topk_weights[j] = 0.0;
    if (expert < 0) continue;
    const double weight = in.topk_weights[token * k + j];
    const Mlp w = routed_mlp(problem, expert);
    mlp_forward(w, problem.activation, x.data(), scratch);
    for (int64_t h = 0; h < H; ++h) out[h] += weight * scratch.y[h];
    if (!backward) continue;
    double dot_y = 0.0;
    for (int64_t h = 0; h < H; ++h) dot_y += d_out[h] * scratch.y[h];
    d_topk_weights[j] = dot_y;
    for (int64_t h = 0; h < H; ++h) d_y[h] = weight * d_out[h];
    mlp_backward(w, problem.activation, masks_at_bf16, d_y.data(), scratch, d_x);
  }
}

struct Pair {
  int64_t rank, token;
  double weight;  // topk weight (1 for the shared expert)
};

// Sampled rows of one expert's weight gradients over `pairs`:
//   d_gate[ri, :] (+)= d_g_i x,  d_up[ri, :] (+)= d_u_i x,  d_down[:, ri] (+)= w a_i d_out
// with d_a_i = w <d_out, W_down[:, i]>. Outputs gate/up [rows, H], down [H, rows]; with `d_b` (biases):
// d_b[0] b_gate [rows] (+)= d_g_i, d_b[1] b_up [rows] (+)= d_u_i, d_b[2] b_down [H] (+)= w d_out.
void evaluate_weight_rows(const HostProblem& problem, bool masks_at_bf16, const Mlp& w,
                          const std::vector<Pair>& pairs, const std::vector<int64_t>& rows, double* d_gate,
                          double* d_up, double* d_down, const std::array<double*, 3>& d_b = {}) {
  const int64_t H = w.hidden, num_rows = static_cast<int64_t>(rows.size());
  std::fill(d_gate, d_gate + num_rows * H, 0.0);
  std::fill(d_up, d_up + num_rows * H, 0.0);
  std::fill(d_down, d_down + num_rows * H, 0.0);
  for (int b = 0; b < 3; ++b)
    if (d_b[b] != nullptr) std::fill(d_b[b], d_b[b] + (b == 2 ? H : num_rows), 0.0);
  std::vector<double> x(H), d_out(H);
  for (const Pair& pair : pairs) {
    const HostRank& in = problem.ranks[pair.rank];
    to_double(in.x.data() + pair.token * H, H, x.data());
    to_double(in.d_out.data() + pair.token * H, H, d_out.data());
    if (d_b[2] != nullptr)
      for (int64_t h = 0; h < H; ++h) d_b[2][h] += pair.weight * d_out[h];
    for (int64_t ri = 0; ri < num_rows; ++ri) {
      const int64_t i = rows[ri];
      const double g = dot(w.gate + i * H, x.data(), H) + bias(w.b_gate, i);
      const double u = dot(w.up + i * H, x.data(), H) + bias(w.b_up, i);
      const double a = reference::activation(problem.activation, g, u);
      double d_a = 0.0;
      for (int64_t h = 0; h < H; ++h)
        d_a += static_cast<double>(bf16_bits_to_float(w.down[h * w.inter + i])) * d_out[h];
      d_a *= pair.weight;
      double d_g = 0.0, d_u = 0.0;
      activation_backward_checked(problem.activation, masks_at_bf16, g, u, d_a, &d_g, &d_u);
      if (d_b[0] != nullptr) d_b[0][ri] += d_g;
      if (d_b[1] != nullptr) d_b[1][ri] += d_u;
      for (int64_t h = 0; h < H; ++h) {
        d_gate[ri * H + h] += d_g * x[h];
        d_up[ri * H + h] += d_u * x[h];
        d_down[h * num_rows + ri] += pair.weight * a * d_out[h];
      }
    }
  }
}

std::string format_value(double value) {
  std::ostringstream out;
  out.precision(9);
  out << value;
  return out.str();
}

}  // namespace

// ---- plan ----------------------------------------------------------------------------------------------

CheckPlan make_check_plan(const HostProblem& problem, const PlanOptions& options) {
  const Shape& s = problem.shape;
  std::mt19937_64 engine(options.seed ^ 0x5eed0fc4ec4ull);
  CheckPlan plan;
  for (const HostRank& rank : problem.ranks) {
    plan.tokens.push_back(sample(rank.num_tokens, options.tokens_per_rank, engine));
    plan.experts.push_back(sample(s.num_local_experts(), options.experts_per_rank, engine));
  }
  plan.rows = sample(s.intermediate, options.rows_per_expert, engine);
  if (s.has_shared_expert())
    plan.shared_rows = sample(s.shared_intermediate, options.rows_per_expert, engine);
  return plan;
}

CheckPlan full_check_plan(const HostProblem& problem) {
  return make_check_plan(problem, PlanOptions{0, 0, 0, 0});
}

// ---- fields --------------------------------------------------------------------------------------------

const char* field_name(Field field) {
  static constexpr const char* kNames[kNumFields] = {"out",
                                                     "d_x",
                                                     "d_topk_weights",
                                                     "d_routed.gate",
                                                     "d_routed.up",
                                                     "d_routed.down",
                                                     "d_shared.gate",
                                                     "d_shared.up",
                                                     "d_shared.down",
                                                     "d_routed.b_gate",
                                                     "d_routed.b_up",
                                                     "d_routed.b_down"};
  return kNames[static_cast<int>(field)];
}

bool is_backward_field(Field field) {
  return field != Field::kOut;
}

void SampledTensors::append(const SampledTensors& other) {
  for (int f = 0; f < kNumFields; ++f)
    values[f].insert(values[f].end(), other.values[f].begin(), other.values[f].end());
}

std::string describe_coordinate(const CheckPlan& plan, const Shape& shape, Field field, int64_t index) {
  const int64_t R = static_cast<int64_t>(plan.tokens.size()), H = shape.hidden;
  int64_t rank = 0;
  while (rank < R && index >= rank_field_size(plan, shape, field, rank)) {
    index -= rank_field_size(plan, shape, field, rank);
    ++rank;
  }
  if (rank == R) return std::string(field_name(field)) + "[out of range]";
  const int64_t rows = static_cast<int64_t>(plan.rows.size());
  const int64_t shared_rows = static_cast<int64_t>(plan.shared_rows.size());
  std::ostringstream out;
  out << field_name(field) << "[rank " << rank << ", ";
  switch (field) {
    case Field::kOut:
    case Field::kDX:
      out << "token " << plan.tokens[rank][index / H] << ", " << index % H;
      break;
    case Field::kDTopkWeights:
      out << "token " << plan.tokens[rank][index / shape.num_topk] << ", slot " << index % shape.num_topk;
      break;
    case Field::kDRoutedGate:
    case Field::kDRoutedUp: {
      const int64_t expert = plan.experts[rank][index / (rows * H)];
      out << "local expert " << expert << " (global " << rank * shape.num_local_experts() + expert << "), "
          << plan.rows[index / H % rows] << ", " << index % H;
      break;
    }
    case Field::kDRoutedDown: {
      const int64_t expert = plan.experts[rank][index / (rows * H)];
      out << "local expert " << expert << " (global " << rank * shape.num_local_experts() + expert << "), "
          << index / rows % H << ", " << plan.rows[index % rows];
      break;
    }
    case Field::kDSharedGate:
    case Field::kDSharedUp:
      out << plan.shared_rows[index / H] << ", " << index % H;
      break;
    case Field::kDSharedDown:
      out << index / shared_rows << ", " << plan.shared_rows[index % shared_rows];
      break;
    case Field::kDRoutedBGate:
    case Field::kDRoutedBUp:
    case Field::kDRoutedBDown: {
      const int64_t per_expert = field == Field::kDRoutedBDown ? H : rows;
      const int64_t expert = plan.experts[rank][index / per_expert];
      out << "local expert " << expert << " (global " << rank * shape.num_local_experts() + expert << "), "
          << (field == Field::kDRoutedBDown ? index % H : plan.rows[index % rows]);
      break;
    }
  }
  out << "]";
  return out.str();
}

// ---- fp64 evaluation -----------------------------------------------------------------------------------

SampledTensors dense_evaluate(const HostProblem& problem, const CheckPlan& plan, bool backward,
                              int num_threads, bool clamp_masks_at_bf16) {
  const Shape& s = problem.shape;
  const int64_t R = s.num_ranks, H = s.hidden, k = s.num_topk, El = s.num_local_experts();
  POUNCE_CHECK(static_cast<int64_t>(plan.tokens.size()) == R, "check plan has ", plan.tokens.size(),
               " ranks but the problem has ", R);
  SampledTensors result;
  std::vector<int64_t> token_offset(R + 1, 0);
  for (int64_t r = 0; r < R; ++r)
    token_offset[r + 1] = token_offset[r] + static_cast<int64_t>(plan.tokens[r].size());
  const int64_t num_tokens = token_offset[R];
  result[Field::kOut].resize(num_tokens * H);
  if (backward) {
    result[Field::kDX].resize(num_tokens * H);
    result[Field::kDTopkWeights].resize(num_tokens * k);
  }

  // Weight tasks: (rank, sampled expert) for routed experts, then one per rank for the shared expert.
  std::vector<std::pair<int64_t, int64_t>> weight_tasks;  // (rank, local expert or -1 = shared)
  std::vector<int64_t> routed_offset(R + 1, 0);
  if (backward) {
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t expert : plan.experts[r]) weight_tasks.emplace_back(r, expert);
      routed_offset[r + 1] = routed_offset[r] + static_cast<int64_t>(plan.experts[r].size());
    }
    if (s.has_shared_expert())
      for (int64_t r = 0; r < R; ++r) weight_tasks.emplace_back(r, -1);
  }
  const int64_t rows = static_cast<int64_t>(plan.rows.size());
  const int64_t shared_rows = static_cast<int64_t>(plan.shared_rows.size());
  for (Field field : {Field::kDRoutedGate, Field::kDRoutedUp, Field::kDRoutedDown})
    if (backward) result[field].resize(routed_offset[R] * rows * H);
  for (Field field : {Field::kDSharedGate, Field::kDSharedUp, Field::kDSharedDown})
    if (backward && s.has_shared_expert()) result[field].resize(R * shared_rows * H);
  const HostWeights& biases = problem.ranks[0].routed;
  const bool has[3] = {!biases.b_gate.empty(), !biases.b_up.empty(), !biases.b_down.empty()};
  const Field bias_fields[3] = {Field::kDRoutedBGate, Field::kDRoutedBUp, Field::kDRoutedBDown};
  for (int b = 0; b < 3; ++b)
    if (backward && has[b]) result[bias_fields[b]].resize(routed_offset[R] * (b == 2 ? H : rows));

  // Expensive tasks first so the threads finish together: weight tasks, then tokens.
  const int64_t num_weight_tasks = static_cast<int64_t>(weight_tasks.size());
  parallel_for(num_weight_tasks + num_tokens, num_threads, [&](int64_t task) {
    if (task >= num_weight_tasks) {
      const int64_t flat = task - num_weight_tasks;
      const int64_t rank =
          std::upper_bound(token_offset.begin(), token_offset.end(), flat) - token_offset.begin() - 1;
      const int64_t token = plan.tokens[rank][flat - token_offset[rank]];
      evaluate_token(problem, rank, token, backward, clamp_masks_at_bf16,
                     result[Field::kOut].data() + flat * H,
                     backward ? result[Field::kDX].data() + flat * H : nullptr,
                     backward ? result[Field::kDTopkWeights].data() + flat * k : nullptr);
      return;
    }
    const auto [rank, local_expert] = weight_tasks[task];
    std::vector<Pair> pairs;
    if (local_expert < 0) {
      for (int64_t t = 0; t < problem.ranks[rank].num_tokens; ++t) pairs.push_back({rank, t, 1.0});
      const int64_t offset = rank * shared_rows * H;
      evaluate_weight_rows(problem, clamp_masks_at_bf16, shared_mlp(problem), pairs, plan.shared_rows,
                           result[Field::kDSharedGate].data() + offset,
                           result[Field::kDSharedUp].data() + offset,
                           result[Field::kDSharedDown].data() + offset);
      return;
    }
    const int64_t expert = rank * El + local_expert;
    for (int64_t src = 0; src < R; ++src) {
      const HostRank& in = problem.ranks[src];
      for (int64_t i = 0; i < in.num_tokens * k; ++i)
        if (in.topk_idx[i] == expert) pairs.push_back({src, i / k, in.topk_weights[i]});
    }
    const int64_t slot =
        routed_offset[rank] + (std::find(plan.experts[rank].begin(), plan.experts[rank].end(), local_expert) -
                               plan.experts[rank].begin());
    const int64_t offset = slot * rows * H;
    std::array<double*, 3> d_b = {};
    for (int b = 0; b < 3; ++b)
      if (has[b]) d_b[b] = result[bias_fields[b]].data() + slot * (b == 2 ? H : rows);
    evaluate_weight_rows(problem, clamp_masks_at_bf16, routed_mlp(problem, expert), pairs, plan.rows,
                         result[Field::kDRoutedGate].data() + offset,
                         result[Field::kDRoutedUp].data() + offset,
                         result[Field::kDRoutedDown].data() + offset, d_b);
  });
  return result;
}

// ---- gathering a run's outputs -------------------------------------------------------------------------

SampledTensors gather_rank(const CheckPlan& plan, const Shape& shape, int64_t rank,
                           const RankOutputs& outputs) {
  const int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate, k = shape.num_topk;
  SampledTensors result;
  for (Field field : {Field::kOut, Field::kDX}) {
    if (!outputs[field]) continue;
    for (int64_t token : plan.tokens[rank])
      for (int64_t h = 0; h < H; ++h) result[field].push_back(outputs[field](token * H + h));
  }
  if (outputs[Field::kDTopkWeights])
    for (int64_t token : plan.tokens[rank])
      for (int64_t j = 0; j < k; ++j)
        result[Field::kDTopkWeights].push_back(outputs[Field::kDTopkWeights](token * k + j));
  for (Field field : {Field::kDRoutedGate, Field::kDRoutedUp}) {
    if (!outputs[field]) continue;
    for (int64_t expert : plan.experts[rank])
      for (int64_t i : plan.rows)
        for (int64_t h = 0; h < H; ++h) result[field].push_back(outputs[field]((expert * I + i) * H + h));
  }
  if (outputs[Field::kDRoutedDown])
    for (int64_t expert : plan.experts[rank])
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i : plan.rows)
          result[Field::kDRoutedDown].push_back(outputs[Field::kDRoutedDown]((expert * H + h) * I + i));
  for (Field field : {Field::kDRoutedBGate, Field::kDRoutedBUp}) {
    if (!outputs[field]) continue;
    for (int64_t expert : plan.experts[rank])
      for (int64_t i : plan.rows) result[field].push_back(outputs[field](expert * I + i));
  }
  if (outputs[Field::kDRoutedBDown])
    for (int64_t expert : plan.experts[rank])
      for (int64_t h = 0; h < H; ++h)
        result[Field::kDRoutedBDown].push_back(outputs[Field::kDRoutedBDown](expert * H + h));
  if (Is == 0) return result;
  for (Field field : {Field::kDSharedGate, Field::kDSharedUp}) {
    if (!outputs[field]) continue;
    for (int64_t i : plan.shared_rows)
      for (int64_t h = 0; h < H; ++h) result[field].push_back(outputs[field](i * H + h));
  }
  if (outputs[Field::kDSharedDown])
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i : plan.shared_rows)
        result[Field::kDSharedDown].push_back(outputs[Field::kDSharedDown](h * Is + i));
  return result;
}

// ---- comparison ----------------------------------------------------------------------------------------

std::vector<TensorCheck> compare(const CheckPlan& plan, const Shape& shape, const SampledTensors& got,
                                 const SampledTensors& ref, double tolerance) {
  std::vector<TensorCheck> checks;
  for (int f = 0; f < kNumFields; ++f) {
    const Field field = static_cast<Field>(f);
    const std::vector<double>& expected = ref[field];
    const std::vector<double>& actual = got[field];
    // Fields the reference left empty (forward only, no shared expert, an empty sample) are not checked.
    if (expected.empty()) continue;
    TensorCheck check;
    check.name = field_name(field);
    check.count = static_cast<int64_t>(expected.size());
    check.tolerance = tolerance;
    if (actual.size() != expected.size()) {
      check.rel_error = INFINITY;
      check.first_bad = "the run produced " + std::to_string(actual.size()) + " values, the check expected " +
                        std::to_string(expected.size());
      checks.push_back(check);
      continue;
    }
    double err2 = 0.0, ref2 = 0.0;
    int64_t first_nonfinite = -1, max_idx = 0;
    for (size_t i = 0; i < expected.size(); ++i) {
      const double diff = actual[i] - expected[i];
      if (!std::isfinite(actual[i])) {
        if (first_nonfinite < 0) first_nonfinite = static_cast<int64_t>(i);
        continue;
      }
      err2 += diff * diff;
      ref2 += expected[i] * expected[i];
      if (std::abs(diff) > check.max_abs_error) {
        check.max_abs_error = std::abs(diff);
        max_idx = static_cast<int64_t>(i);
      }
      check.max_abs_ref = std::max(check.max_abs_ref, std::abs(expected[i]));
    }
    if (first_nonfinite >= 0) {
      check.max_abs_error = check.rel_error = NAN;
    } else {
      check.rel_error = ref2 > 0.0 ? std::sqrt(err2 / ref2) : (err2 > 0.0 ? INFINITY : 0.0);
    }
    check.passed = first_nonfinite < 0 && check.rel_error <= tolerance;
    if (!check.passed) {
      // The first value off by more than tolerance * max|ref|, else the largest error.
      int64_t bad = first_nonfinite;
      for (size_t i = 0; bad < 0 && i < expected.size(); ++i)
        if (std::abs(actual[i] - expected[i]) > tolerance * check.max_abs_ref) bad = static_cast<int64_t>(i);
      if (bad < 0) bad = max_idx;
      check.first_bad = describe_coordinate(plan, shape, field, bad) + ": got " + format_value(actual[bad]) +
                        ", expected " + format_value(expected[bad]);
    }
    checks.push_back(check);
  }
  return checks;
}

}  // namespace pounce::cli
