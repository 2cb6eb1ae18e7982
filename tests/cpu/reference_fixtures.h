// Shared helpers for the reference tests: random cases, splitting one global batch over ranks, and a
// plain per-token oracle that follows docs/design.md §1 literally (no schedule, no chunks, no threads).
// The GPU tests state their problems for the reference as this file's Case too (tests/gpu/gpu_fixtures.h).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "pounce/error.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce::reference::testing {

struct Case {
  Problem problem;
  std::vector<RankInputs> ranks;
  std::vector<Weights> routed;  // [R], each rank's local experts
  Weights shared;
};

// U(-scale, scale), rounded to bf16 when `bf16` so kBf16 numerics accept it.
inline std::vector<double> random_values(std::mt19937& rng, int64_t n, double scale, bool bf16) {
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<double> v(n);
  for (double& value : v) value = bf16 ? round_bf16(static_cast<float>(dist(rng))) : dist(rng);
  return v;
}

// Each slot an independent uniform expert (duplicates allowed) or -1 with probability unused_prob.
inline std::vector<int32_t> random_routing(std::mt19937& rng, int64_t num_tokens, int64_t k, int64_t E,
                                           double unused_prob) {
  std::uniform_int_distribution<int32_t> expert(0, static_cast<int32_t>(E - 1));
  std::bernoulli_distribution unused(unused_prob);
  std::vector<int32_t> idx(num_tokens * k);
  for (int32_t& e : idx) e = unused(rng) ? -1 : expert(rng);
  return idx;
}

inline Weights random_weights(std::mt19937& rng, int64_t count, int64_t H, int64_t I, bool bf16) {
  Weights w;
  w.gate = random_values(rng, count * I * H, 2.0 / std::sqrt(static_cast<double>(H)), bf16);
  w.up = random_values(rng, count * I * H, 2.0 / std::sqrt(static_cast<double>(H)), bf16);
  w.down = random_values(rng, count * H * I, 2.0 / std::sqrt(static_cast<double>(I)), bf16);
  return w;
}

// A random case over problem.num_ranks ranks with the given tokens per rank.
inline Case random_case(const Problem& problem, const std::vector<int64_t>& tokens_per_rank, uint32_t seed,
                        double unused_prob = 0.1) {
  std::mt19937 rng(seed);
  const bool bf16 = problem.numerics == Numerics::kBf16;
  const int64_t H = problem.hidden, k = problem.num_topk;
  Case c;
  c.problem = problem;
  for (int64_t r = 0; r < problem.num_ranks; ++r) {
    RankInputs in;
    in.num_tokens = tokens_per_rank[r];
    in.x = random_values(rng, in.num_tokens * H, 1.0, bf16);
    in.topk_idx = random_routing(rng, in.num_tokens, k, problem.num_experts, unused_prob);
    std::uniform_real_distribution<float> weight(0.0f, 1.0f);
    in.topk_weights.resize(in.num_tokens * k);
    for (double& w : in.topk_weights) w = weight(rng);
    in.d_out = random_values(rng, in.num_tokens * H, 1.0, bf16);
    c.ranks.push_back(in);
    c.routed.push_back(random_weights(rng, problem.num_local_experts(), H, problem.intermediate, bf16));
  }
  if (problem.shared_intermediate > 0) {
    c.shared = random_weights(rng, 1, H, problem.shared_intermediate, bf16);
  }
  return c;
}

// The same global batch and weights as `global` (one rank), split over num_ranks ranks: rank r takes the
// next tokens_per_rank[r] tokens and experts [r * El, (r + 1) * El).
inline Case split_case(const Case& global, int64_t num_ranks, const std::vector<int64_t>& tokens_per_rank) {
  const Problem& g = global.problem;
  const int64_t H = g.hidden, I = g.intermediate, k = g.num_topk, El = g.num_experts / num_ranks;
  Case c;
  c.problem = g;
  c.problem.num_ranks = num_ranks;
  c.shared = global.shared;
  const RankInputs& all = global.ranks[0];
  const Weights& w = global.routed[0];
  int64_t t0 = 0;
  for (int64_t r = 0; r < num_ranks; ++r) {
    const int64_t n = tokens_per_rank[r];
    RankInputs in;
    in.num_tokens = n;
    in.x.assign(all.x.begin() + t0 * H, all.x.begin() + (t0 + n) * H);
    in.topk_idx.assign(all.topk_idx.begin() + t0 * k, all.topk_idx.begin() + (t0 + n) * k);
    in.topk_weights.assign(all.topk_weights.begin() + t0 * k, all.topk_weights.begin() + (t0 + n) * k);
    in.d_out.assign(all.d_out.begin() + t0 * H, all.d_out.begin() + (t0 + n) * H);
    c.ranks.push_back(in);
    Weights local;
    local.gate.assign(w.gate.begin() + r * El * I * H, w.gate.begin() + (r + 1) * El * I * H);
    local.up.assign(w.up.begin() + r * El * I * H, w.up.begin() + (r + 1) * El * I * H);
    local.down.assign(w.down.begin() + r * El * H * I, w.down.begin() + (r + 1) * El * H * I);
    c.routed.push_back(local);
    t0 += n;
  }
  return c;
}

template <typename Rank, typename Field>
std::vector<double> concat(const std::vector<Rank>& ranks, Field field) {
  std::vector<double> all;
  for (const Rank& r : ranks) all.insert(all.end(), (r.*field).begin(), (r.*field).end());
  return all;
}

// Bitwise equality, naming the tensor and the first differing element.
inline void expect_bitwise_equal(const std::vector<double>& got, const std::vector<double>& want,
                                 const std::string& name) {
  ASSERT_EQ(got.size(), want.size()) << name;
  for (size_t n = 0; n < got.size(); ++n) {
    if (!(got[n] == want[n]) && !(std::isnan(got[n]) && std::isnan(want[n]))) {
      ADD_FAILURE() << name << "[" << n << "]: got " << got[n] << ", want " << want[n] << " (bitwise)";
      return;
    }
  }
}

// |got - want| <= atol + rtol * |want|, naming the tensor and the first bad element.
inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rtol,
                         double atol, const std::string& name) {
  ASSERT_EQ(got.size(), want.size()) << name;
  for (size_t n = 0; n < got.size(); ++n) {
    if (!(std::abs(got[n] - want[n]) <= atol + rtol * std::abs(want[n]))) {
      ADD_FAILURE() << name << "[" << n << "]: got " << got[n] << ", want " << want[n] << " (rtol " << rtol
                    << ", atol " << atol << ")";
      return;
    }
  }
}

inline double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

// ---- gradient checks by central differences (fp64 cases) -------------------------------------------------

// The scalar whose gradients backward() returns: sum over ranks of out . d_out.
inline double output_loss(const Case& c) {
  const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
  double sum = 0;
  for (size_t r = 0; r < f.size(); ++r) {
    for (size_t n = 0; n < f[r].out.size(); ++n) sum += f[r].out[n] * c.ranks[r].d_out[n];
  }
  return sum;
}

inline constexpr double kFiniteDifferenceStep = 1e-5;
inline constexpr double kFiniteDifferenceRtol = 1e-6;

// Central differences of output_loss() with respect to every element of *values (which lives inside c).
inline std::vector<double> finite_differences(Case& c, std::vector<double>* values) {
  std::vector<double> grad(values->size());
  for (size_t n = 0; n < values->size(); ++n) {
    const double saved = (*values)[n];
    (*values)[n] = saved + kFiniteDifferenceStep;
    const double plus = output_loss(c);
    (*values)[n] = saved - kFiniteDifferenceStep;
    const double minus = output_loss(c);
    (*values)[n] = saved;
    grad[n] = (plus - minus) / (2 * kFiniteDifferenceStep);
  }
  return grad;
}

inline void expect_matches_fd(const std::vector<double>& analytic, const std::vector<double>& fd,
                              const std::string& name) {
  expect_close(analytic, fd, kFiniteDifferenceRtol, kFiniteDifferenceRtol * max_abs(fd), name);
}

// backward() of c, with every rank's gradient of its own inputs and routed weights (biases, where the case
// has them) checked against finite differences; the shared expert's, a sum over ranks, is left to the caller.
inline std::vector<RankGradients> expect_rank_gradients_match_fd(Case& c) {
  const std::vector<RankGradients> grads = backward(c.problem, c.ranks, c.routed, c.shared);
  for (int64_t r = 0; r < c.problem.num_ranks; ++r) {
    const std::string rank = "[rank " + std::to_string(r) + "]";
    const RankGradients& g = grads[r];
    expect_matches_fd(g.d_x, finite_differences(c, &c.ranks[r].x), "d_x" + rank);
    expect_matches_fd(g.d_topk_weights, finite_differences(c, &c.ranks[r].topk_weights),
                      "d_topk_weights" + rank);
    expect_matches_fd(g.d_routed.gate, finite_differences(c, &c.routed[r].gate), "d_w_gate" + rank);
    expect_matches_fd(g.d_routed.up, finite_differences(c, &c.routed[r].up), "d_w_up" + rank);
    expect_matches_fd(g.d_routed.down, finite_differences(c, &c.routed[r].down), "d_w_down" + rank);
    expect_matches_fd(g.d_routed.b_gate, finite_differences(c, &c.routed[r].b_gate), "d_b_gate" + rank);
    expect_matches_fd(g.d_routed.b_up, finite_differences(c, &c.routed[r].b_up), "d_b_up" + rank);
    expect_matches_fd(g.d_routed.b_down, finite_differences(c, &c.routed[r].b_down), "d_b_down" + rank);
  }
  return grads;
}

// ---- the plain oracle ---------------------------------------------------------------------------------
// T = float with bf16 rounding emulates kBf16, T = double is kFp64. Each routed pair and each shared row
// is computed on its own with the §1 formulas; weight gradients sum over build_schedule()'s rows in order
// (the reference's contract), so every output is comparable bitwise.

template <typename T>
T oracle_round(T v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return round_bf16(v);
  } else {
    return v;
  }
}

// The activation in T, written from the formulas: sigmoid(v) = 1 / (1 + exp(-v)).
template <typename T>
T oracle_sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

template <typename T>
T oracle_act(const Activation& act, T g, T u) {
  if (act.clamp_limit) {
    const T limit = static_cast<T>(*act.clamp_limit);
    g = std::min(g, limit);
    u = std::max(-limit, std::min(u, limit));
  }
  if (act.kind == ActivationKind::kGptOss)
    return (u + T(1)) * (g * oracle_sigmoid(static_cast<T>(act.alpha) * g));
  return g * oracle_sigmoid(g) * u;
}

template <typename T>
void oracle_act_backward(const Activation& act, T g, T u, T d_a, T* d_g, T* d_u) {
  bool g_live = true, u_live = true;
  if (act.clamp_limit) {
    const T limit = static_cast<T>(*act.clamp_limit);
    g_live = g <= limit;
    u_live = std::abs(u) <= limit;
    g = std::min(g, limit);
    u = std::max(-limit, std::min(u, limit));
  }
  const T alpha = act.kind == ActivationKind::kGptOss ? static_cast<T>(act.alpha) : T(1);
  const T s = oracle_sigmoid(alpha * g);
  const T u_factor = act.kind == ActivationKind::kGptOss ? u + T(1) : u;
  *d_g = g_live ? d_a * u_factor * (s + alpha * g * s * (T(1) - s)) : T(0);
  *d_u = u_live ? d_a * (g * s) : T(0);
}

// One expert MLP on one row; gate, up [I, H], down [H, I].
template <typename T>
struct OracleRow {
  std::vector<T> g, u, a, y;     // forward
  std::vector<T> d_g, d_u, d_x;  // backward
};

template <typename T>
OracleRow<T> oracle_row(const Activation& act, const double* gate, const double* up, const double* down,
                        int64_t H, int64_t I, const double* x, const double* dy) {
  OracleRow<T> row;
  row.g.resize(I), row.u.resize(I), row.a.resize(I), row.y.resize(H);
  for (int64_t i = 0; i < I; ++i) {
    T acc_g = 0, acc_u = 0;
    for (int64_t h = 0; h < H; ++h) {
      acc_g += static_cast<T>(x[h]) * static_cast<T>(gate[i * H + h]);
      acc_u += static_cast<T>(x[h]) * static_cast<T>(up[i * H + h]);
    }
    row.g[i] = oracle_round(acc_g);
    row.u[i] = oracle_round(acc_u);
    row.a[i] = oracle_round(oracle_act(act, row.g[i], row.u[i]));
  }
  for (int64_t h = 0; h < H; ++h) {
    T acc = 0;
    for (int64_t i = 0; i < I; ++i) acc += row.a[i] * static_cast<T>(down[h * I + i]);
    row.y[h] = oracle_round(acc);
  }
  if (dy == nullptr) return row;
  row.d_g.resize(I), row.d_u.resize(I), row.d_x.resize(H);
  for (int64_t i = 0; i < I; ++i) {
    T acc = 0;
    for (int64_t h = 0; h < H; ++h) acc += static_cast<T>(dy[h]) * static_cast<T>(down[h * I + i]);
    T d_g, d_u;
    oracle_act_backward(act, row.g[i], row.u[i], oracle_round(acc), &d_g, &d_u);
    row.d_g[i] = oracle_round(d_g);
    row.d_u[i] = oracle_round(d_u);
  }
  for (int64_t h = 0; h < H; ++h) {
    T acc = 0;
    for (int64_t i = 0; i < I; ++i) {
      acc += row.d_g[i] * static_cast<T>(gate[i * H + h]);
      acc += row.d_u[i] * static_cast<T>(up[i * H + h]);
    }
    row.d_x[h] = oracle_round(acc);
  }
  return row;
}

struct OracleResult {
  std::vector<RankForward> forward;
  std::vector<RankGradients> backward;
};

template <typename T>
OracleResult oracle(const Case& c) {
  const Problem& p = c.problem;
  const int64_t R = p.num_ranks, El = p.num_local_experts(), H = p.hidden, I = p.intermediate,
                Is = p.shared_intermediate, k = p.num_topk;
  OracleResult result;
  result.forward.resize(R);
  result.backward.resize(R);
  auto routed_row = [&](int64_t src, int64_t t, int64_t j, std::vector<double>* dy_out) {
    const RankInputs& in = c.ranks[src];
    const int64_t e = in.topk_idx[t * k + j];
    const Weights& w = c.routed[e / El];
    const int64_t le = e % El;
    std::vector<double> dy(H);
    const T weight = static_cast<T>(in.topk_weights[t * k + j]);
    for (int64_t h = 0; h < H; ++h) dy[h] = oracle_round(weight * static_cast<T>(in.d_out[t * H + h]));
    if (dy_out) *dy_out = dy;
    return oracle_row<T>(p.activation, w.gate.data() + le * I * H, w.up.data() + le * I * H,
                         w.down.data() + le * H * I, H, I, in.x.data() + t * H, dy.data());
  };
  for (int64_t r = 0; r < R; ++r) {
    const RankInputs& in = c.ranks[r];
    const int64_t T_r = in.num_tokens;
    RankForward& f = result.forward[r];
    RankGradients& b = result.backward[r];
    f.out.assign(T_r * H, 0), f.y.assign(T_r * k * H, 0), f.ys.assign(T_r * H, 0);
    b.d_x.assign(T_r * H, 0), b.d_topk_weights.assign(T_r * k, 0);
    for (int64_t t = 0; t < T_r; ++t) {
      std::vector<T> out(H, T(0)), d_x(H, T(0));
      if (Is > 0) {
        OracleRow<T> s =
            oracle_row<T>(p.activation, c.shared.gate.data(), c.shared.up.data(), c.shared.down.data(), H, Is,
                          in.x.data() + t * H, in.d_out.data() + t * H);
        for (int64_t h = 0; h < H; ++h) f.ys[t * H + h] = s.y[h], out[h] = s.y[h], d_x[h] = s.d_x[h];
      }
      for (int64_t j = 0; j < k; ++j) {
        if (in.topk_idx[t * k + j] < 0) continue;
        OracleRow<T> row = routed_row(r, t, j, nullptr);
        const T weight = static_cast<T>(in.topk_weights[t * k + j]);
        T dot = 0;
        for (int64_t h = 0; h < H; ++h) {
          f.y[(t * k + j) * H + h] = row.y[h];
          out[h] += weight * row.y[h];
          d_x[h] += row.d_x[h];
          dot += static_cast<T>(in.d_out[t * H + h]) * row.y[h];
        }
        b.d_topk_weights[t * k + j] = dot;
      }
      for (int64_t h = 0; h < H; ++h)
        f.out[t * H + h] = oracle_round(out[h]), b.d_x[t * H + h] = oracle_round(d_x[h]);
    }
    // Routed weight gradients: the expert's rows in receive-schedule order.
    const RankSchedule schedule = build_schedule(p, c.ranks, r);
    b.d_routed.gate.assign(El * I * H, 0), b.d_routed.up.assign(El * I * H, 0),
        b.d_routed.down.assign(El * H * I, 0);
    for (int64_t le = 0; le < El; ++le) {
      std::vector<T> d_gate(I * H, T(0)), d_up(I * H, T(0)), d_down(H * I, T(0));
      for (int64_t m = 0; m < schedule.expert_num_rows[le]; ++m) {
        const ScheduleRow& s = schedule.rows[schedule.expert_row_offset[le] + m];
        std::vector<double> dy;
        OracleRow<T> row = routed_row(s.src_rank, s.src_token, s.slot, &dy);
        const double* x = c.ranks[s.src_rank].x.data() + s.src_token * H;
        for (int64_t i = 0; i < I; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            d_gate[i * H + h] += row.d_g[i] * static_cast<T>(x[h]);
            d_up[i * H + h] += row.d_u[i] * static_cast<T>(x[h]);
            d_down[h * I + i] += static_cast<T>(dy[h]) * row.a[i];
          }
        }
      }
      for (int64_t n = 0; n < I * H; ++n) {
        b.d_routed.gate[le * I * H + n] = d_gate[n];
        b.d_routed.up[le * I * H + n] = d_up[n];
        b.d_routed.down[le * H * I + n] = d_down[n];
      }
    }
    // Shared weight gradients: this rank's tokens ascending.
    if (Is > 0) {
      std::vector<T> d_gate(Is * H, T(0)), d_up(Is * H, T(0)), d_down(H * Is, T(0));
      for (int64_t t = 0; t < T_r; ++t) {
        const double* x = in.x.data() + t * H;
        const double* dy = in.d_out.data() + t * H;
        OracleRow<T> s = oracle_row<T>(p.activation, c.shared.gate.data(), c.shared.up.data(),
                                       c.shared.down.data(), H, Is, x, dy);
        for (int64_t i = 0; i < Is; ++i) {
          for (int64_t h = 0; h < H; ++h) {
            d_gate[i * H + h] += s.d_g[i] * static_cast<T>(x[h]);
            d_up[i * H + h] += s.d_u[i] * static_cast<T>(x[h]);
            d_down[h * Is + i] += static_cast<T>(dy[h]) * s.a[i];
          }
        }
      }
      b.d_shared.gate.assign(d_gate.begin(), d_gate.end());
      b.d_shared.up.assign(d_up.begin(), d_up.end());
      b.d_shared.down.assign(d_down.begin(), d_down.end());
    }
  }
  return result;
}

inline OracleResult oracle(const Case& c) {
  return c.problem.numerics == Numerics::kBf16 ? oracle<float>(c) : oracle<double>(c);
}

// Every output of forward() and backward() on `c` equals the oracle bitwise.
inline void expect_matches_oracle(const Case& c) {
  const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
  const OracleResult want = oracle(c);
  for (int64_t r = 0; r < c.problem.num_ranks; ++r) {
    const std::string rank = "[rank " + std::to_string(r) + "]";
    expect_bitwise_equal(f[r].out, want.forward[r].out, "out" + rank);
    expect_bitwise_equal(f[r].y, want.forward[r].y, "y" + rank);
    expect_bitwise_equal(f[r].ys, want.forward[r].ys, "ys" + rank);
    expect_bitwise_equal(b[r].d_x, want.backward[r].d_x, "d_x" + rank);
    expect_bitwise_equal(b[r].d_topk_weights, want.backward[r].d_topk_weights, "d_topk_weights" + rank);
    expect_bitwise_equal(b[r].d_routed.gate, want.backward[r].d_routed.gate, "d_w_gate" + rank);
    expect_bitwise_equal(b[r].d_routed.up, want.backward[r].d_routed.up, "d_w_up" + rank);
    expect_bitwise_equal(b[r].d_routed.down, want.backward[r].d_routed.down, "d_w_down" + rank);
    expect_bitwise_equal(b[r].d_shared.gate, want.backward[r].d_shared.gate, "d_ws_gate" + rank);
    expect_bitwise_equal(b[r].d_shared.up, want.backward[r].d_shared.up, "d_ws_up" + rank);
    expect_bitwise_equal(b[r].d_shared.down, want.backward[r].d_shared.down, "d_ws_down" + rank);
  }
}

}  // namespace pounce::reference::testing
