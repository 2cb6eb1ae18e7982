// Routed expert biases (docs/design.md §1): the reference's forward and every gradient against a dense fp64
// evaluation written here and against central finite differences of a tiny case; bias gradients exactly zero
// for experts without rows; zero biases bitwise the same as none; the API on the CPU backend bitwise the
// reference; bias tensors of wrong shape, dtype or place rejected by name; GPU and FP8 workspaces reject
// biases.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "api_fixtures.h"
#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference/reference.h"
#include "reference_fixtures.h"
#include "src/validation.h"

namespace pounce {
namespace {

using reference::Numerics;
using reference::RankForward;
using reference::RankGradients;
using reference::testing::Case;
using reference::testing::expect_matches_fd;
using reference::testing::finite_differences;

// Adds random biases to every rank's routed experts (bf16-representable when `bf16`).
void add_biases(Case& c, uint32_t seed, bool bf16) {
  std::mt19937 rng(seed);
  const int64_t El = c.problem.num_local_experts(), I = c.problem.intermediate, H = c.problem.hidden;
  for (reference::Weights& w : c.routed) {
    w.b_gate = reference::testing::random_values(rng, El * I, 0.5, bf16);
    w.b_up = reference::testing::random_values(rng, El * I, 0.5, bf16);
    w.b_down = reference::testing::random_values(rng, El * H, 0.5, bf16);
  }
}

Case tiny_case(ActivationKind kind, uint32_t seed) {
  reference::Problem p;
  p.hidden = 8;
  p.intermediate = 4;
  p.num_experts = 6;
  p.num_topk = 2;
  p.shared_intermediate = 4;
  p.num_ranks = 2;
  p.block_m = 4;
  p.activation.kind = kind;
  p.numerics = Numerics::kFp64;
  p.num_threads = 1;
  Case c = reference::testing::random_case(p, {3, 2}, seed, 0.0);
  // Expert 5 (rank 1's last) gets no rows; token 1 hits expert 2 twice; token 2 has an unused slot.
  c.ranks[0].topk_idx = {1, 3, 2, 2, 0, -1};
  c.ranks[1].topk_idx = {3, 1, -1, 4};
  add_biases(c, seed + 1, false);
  return c;
}

// The layer evaluated densely in fp64, token by token, straight from §1: out[t] = ys[t] + sum_j w[t, j] *
// (act(x Wg^T + bg, x Wu^T + bu) Wd^T + bd); also the bias gradients in closed form, d_b_down[e] = sum over
// e's pairs of w * d_out[t], d_b_gate/up[e] = sum over the pairs of the activation's gradients.
struct Dense {
  std::vector<std::vector<double>> out;                         // [R][T_r * H]
  std::vector<std::vector<double>> d_b_gate, d_b_up, d_b_down;  // [R][El * I], [R][El * H]
};

Dense dense_fp64(const Case& c) {
  const reference::Problem& p = c.problem;
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate, k = p.num_topk,
                El = p.num_local_experts(), R = p.num_ranks;
  Dense d;
  d.out.resize(R);
  d.d_b_gate.assign(R, std::vector<double>(El * I, 0.0));
  d.d_b_up.assign(R, std::vector<double>(El * I, 0.0));
  d.d_b_down.assign(R, std::vector<double>(El * H, 0.0));
  // y = mlp(x) of one expert; d_y given: the gate/up gradients of the pre-activations, summed into d_bg/d_bu.
  auto mlp = [&](const double* gate, const double* up, const double* down, const double* bg, const double* bu,
                 const double* bd, int64_t inter, const double* x, const double* d_y, double* y, double* d_bg,
                 double* d_bu) {
    std::vector<double> g(inter), u(inter), a(inter);
    for (int64_t i = 0; i < inter; ++i) {
      g[i] = bg ? bg[i] : 0.0, u[i] = bu ? bu[i] : 0.0;
      for (int64_t h = 0; h < H; ++h) g[i] += x[h] * gate[i * H + h], u[i] += x[h] * up[i * H + h];
      a[i] = reference::activation(p.activation, g[i], u[i]);
    }
    for (int64_t h = 0; h < H; ++h) {
      y[h] = bd ? bd[h] : 0.0;
      for (int64_t i = 0; i < inter; ++i) y[h] += a[i] * down[h * inter + i];
    }
    if (d_bg == nullptr) return;
    for (int64_t i = 0; i < inter; ++i) {
      double d_a = 0, d_g, d_u;
      for (int64_t h = 0; h < H; ++h) d_a += d_y[h] * down[h * inter + i];
      reference::activation_backward(p.activation, g[i], u[i], d_a, &d_g, &d_u);
      d_bg[i] += d_g, d_bu[i] += d_u;
    }
  };
  std::vector<double> y(H), d_y(H);
  for (int64_t r = 0; r < R; ++r) {
    const reference::RankInputs& in = c.ranks[r];
    d.out[r].assign(in.num_tokens * H, 0.0);
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      const double* x = in.x.data() + t * H;
      double* out = d.out[r].data() + t * H;
      if (Is > 0) {
        mlp(c.shared.gate.data(), c.shared.up.data(), c.shared.down.data(), nullptr, nullptr, nullptr, Is, x,
            nullptr, y.data(), nullptr, nullptr);
        for (int64_t h = 0; h < H; ++h) out[h] += y[h];
      }
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = in.topk_idx[t * k + j];
        if (e < 0) continue;
        const int64_t owner = e / El, le = e % El;
        const reference::Weights& w = c.routed[owner];
        const double weight = in.topk_weights[t * k + j];
        for (int64_t h = 0; h < H; ++h) d_y[h] = weight * in.d_out[t * H + h];
        mlp(w.gate.data() + le * I * H, w.up.data() + le * I * H, w.down.data() + le * H * I,
            w.b_gate.data() + le * I, w.b_up.data() + le * I, w.b_down.data() + le * H, I, x, d_y.data(),
            y.data(), d.d_b_gate[owner].data() + le * I, d.d_b_up[owner].data() + le * I);
        for (int64_t h = 0; h < H; ++h) {
          out[h] += weight * y[h];
          d.d_b_down[owner][le * H + h] += d_y[h];
        }
      }
    }
  }
  return d;
}

void check_gradients(Case c) {
  const std::vector<RankGradients> grads = reference::testing::expect_rank_gradients_match_fd(c);
  std::vector<double> d_ws_gate(c.shared.gate.size());
  for (const RankGradients& g : grads)
    for (size_t n = 0; n < d_ws_gate.size(); ++n) d_ws_gate[n] += g.d_shared.gate[n];
  expect_matches_fd(d_ws_gate, finite_differences(c, &c.shared.gate), "d_ws_gate");
  // Expert 5 (rank 1, local 2) has no rows: its bias gradients are exactly zero.
  const int64_t I = c.problem.intermediate, H = c.problem.hidden;
  for (int64_t i = 0; i < I; ++i) {
    EXPECT_EQ(grads[1].d_routed.b_gate[2 * I + i], 0.0);
    EXPECT_EQ(grads[1].d_routed.b_up[2 * I + i], 0.0);
  }
  for (int64_t h = 0; h < H; ++h) EXPECT_EQ(grads[1].d_routed.b_down[2 * H + h], 0.0);
}

TEST(ExpertBiases, SwiGluGradientsMatchFiniteDifferences) {
  check_gradients(tiny_case(ActivationKind::kSwiGLU, 11));
}

TEST(ExpertBiases, GptOssGradientsMatchFiniteDifferences) {
  check_gradients(tiny_case(ActivationKind::kGptOss, 12));
}

TEST(ExpertBiases, Fp64MatchesDenseEvaluation) {
  const Case c = tiny_case(ActivationKind::kGptOss, 13);
  const Dense dense = dense_fp64(c);
  const std::vector<RankForward> f = reference::forward(c.problem, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> g = reference::backward(c.problem, c.ranks, c.routed, c.shared);
  for (int64_t r = 0; r < c.problem.num_ranks; ++r) {
    const std::string rank = "[rank " + std::to_string(r) + "]";
    reference::testing::expect_close(f[r].out, dense.out[r], 1e-12, 1e-12, "out" + rank);
    reference::testing::expect_close(g[r].d_routed.b_gate, dense.d_b_gate[r], 1e-12, 1e-12,
                                     "d_b_gate" + rank);
    reference::testing::expect_close(g[r].d_routed.b_up, dense.d_b_up[r], 1e-12, 1e-12, "d_b_up" + rank);
    reference::testing::expect_close(g[r].d_routed.b_down, dense.d_b_down[r], 1e-12, 1e-12,
                                     "d_b_down" + rank);
  }
}

// A moderate case in kBf16 (the emulation the GPUs will match) against the same case in kFp64.
Case bf16_case(uint32_t seed) {
  reference::Problem p;
  p.hidden = 64;
  p.intermediate = 64;
  p.num_experts = 8;
  p.num_topk = 2;
  p.shared_intermediate = 0;
  p.num_ranks = 2;
  p.block_m = 16;
  p.activation.kind = ActivationKind::kGptOss;
  p.numerics = Numerics::kBf16;
  Case c = reference::testing::random_case(p, {24, 17}, seed, 0.1);
  for (int64_t r = 0; r < 2; ++r)  // expert 7 gets no rows
    for (int32_t& e : c.ranks[r].topk_idx) e = e == 7 ? 6 : e;
  add_biases(c, seed + 1, true);
  return c;
}

TEST(ExpertBiases, Bf16CloseToFp64AndZeroForExpertsWithoutRows) {
  Case c = bf16_case(21);
  const std::vector<RankForward> f16 = reference::forward(c.problem, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> g16 = reference::backward(c.problem, c.ranks, c.routed, c.shared);
  c.problem.numerics = Numerics::kFp64;
  const std::vector<RankForward> f64 = reference::forward(c.problem, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> g64 = reference::backward(c.problem, c.ranks, c.routed, c.shared);
  const int64_t I = c.problem.intermediate, H = c.problem.hidden, El = c.problem.num_local_experts();
  for (int64_t r = 0; r < 2; ++r) {
    const std::string rank = "[rank " + std::to_string(r) + "]";
    auto close = [&](const std::vector<double>& got, const std::vector<double>& want,
                     const std::string& name) {
      reference::testing::expect_close(got, want, 0.05, 0.05 * reference::testing::max_abs(want),
                                       name + rank);
    };
    close(f16[r].out, f64[r].out, "out");
    close(g16[r].d_x, g64[r].d_x, "d_x");
    close(g16[r].d_routed.b_gate, g64[r].d_routed.b_gate, "d_b_gate");
    close(g16[r].d_routed.b_up, g64[r].d_routed.b_up, "d_b_up");
    close(g16[r].d_routed.b_down, g64[r].d_routed.b_down, "d_b_down");
  }
  for (int64_t i = 0; i < I; ++i) {
    EXPECT_EQ(g16[1].d_routed.b_gate[(El - 1) * I + i], 0.0);
    EXPECT_EQ(g16[1].d_routed.b_up[(El - 1) * I + i], 0.0);
  }
  for (int64_t h = 0; h < H; ++h) EXPECT_EQ(g16[1].d_routed.b_down[(El - 1) * H + h], 0.0);
}

TEST(ExpertBiases, ZeroBiasesAreBitwiseNoBiases) {
  Case with = bf16_case(22);
  for (reference::Weights& w : with.routed) {
    std::fill(w.b_gate.begin(), w.b_gate.end(), 0.0);
    std::fill(w.b_up.begin(), w.b_up.end(), 0.0);
    std::fill(w.b_down.begin(), w.b_down.end(), 0.0);
  }
  Case without = with;
  for (reference::Weights& w : without.routed) w.b_gate.clear(), w.b_up.clear(), w.b_down.clear();
  const auto fw = reference::forward(with.problem, with.ranks, with.routed, with.shared);
  const auto fo = reference::forward(without.problem, without.ranks, without.routed, without.shared);
  const auto gw = reference::backward(with.problem, with.ranks, with.routed, with.shared);
  const auto go = reference::backward(without.problem, without.ranks, without.routed, without.shared);
  for (int64_t r = 0; r < 2; ++r) {
    reference::testing::expect_bitwise_equal(fw[r].out, fo[r].out, "out");
    reference::testing::expect_bitwise_equal(gw[r].d_x, go[r].d_x, "d_x");
    reference::testing::expect_bitwise_equal(gw[r].d_routed.gate, go[r].d_routed.gate, "d_w_gate");
    EXPECT_TRUE(go[r].d_routed.b_gate.empty());
  }
}

TEST(ExpertBiases, ReferenceRejectsBadBiases) {
  Case c = bf16_case(23);
  c.routed[1].b_up.pop_back();
  EXPECT_THROW(
      {
        try {
          reference::forward(c.problem, c.ranks, c.routed, c.shared);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("routed_per_rank[1].b_up"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  c = bf16_case(23);
  c.problem.precision = Precision::kFP8;
  c.problem.block_m = 128;
  EXPECT_THROW(reference::forward(c.problem, c.ranks, c.routed, c.shared), Error);
}

// ---- the API on the CPU backend -------------------------------------------------------------------------

// One rank's bias buffers and their gradients (fp32 or bf16).
struct RankBiases {
  std::vector<uint16_t> b_gate, b_up, b_down;
  std::vector<float> d_b_gate, d_b_up, d_b_down;
  std::vector<uint16_t> d_b_gate_bf16, d_b_up_bf16, d_b_down_bf16;

  RankBiases(const Shape& s, int rank) {
    std::mt19937 rng(100 + rank);
    std::normal_distribution<float> normal(0.0f, 0.5f);
    const int64_t El = s.num_local_experts();
    auto fill = [&](std::vector<uint16_t>& v, int64_t n) {
      v.resize(n);
      for (uint16_t& e : v) e = reference::float_to_bf16_bits(normal(rng));
    };
    fill(b_gate, El * s.intermediate);
    fill(b_up, El * s.intermediate);
    fill(b_down, El * s.hidden);
    d_b_gate.assign(b_gate.size(), 1.0f);  // 1: accumulation adds onto it
    d_b_up.assign(b_up.size(), 1.0f);
    d_b_down.assign(b_down.size(), 1.0f);
    d_b_gate_bf16.assign(b_gate.size(), api_testing::kPoisonBf16);
    d_b_up_bf16.assign(b_up.size(), api_testing::kPoisonBf16);
    d_b_down_bf16.assign(b_down.size(), api_testing::kPoisonBf16);
  }
  void attach(const Shape& s, ExpertWeights& routed) {
    const int64_t El = s.num_local_experts();
    routed.b_gate = {b_gate.data(), DType::kBF16, {El, s.intermediate}};
    routed.b_up = {b_up.data(), DType::kBF16, {El, s.intermediate}};
    routed.b_down = {b_down.data(), DType::kBF16, {El, s.hidden}};
  }
  void attach_grads(const Shape& s, ExpertWeights& d_routed, bool bf16) {
    const int64_t El = s.num_local_experts();
    if (bf16) {
      d_routed.b_gate = {d_b_gate_bf16.data(), DType::kBF16, {El, s.intermediate}};
      d_routed.b_up = {d_b_up_bf16.data(), DType::kBF16, {El, s.intermediate}};
      d_routed.b_down = {d_b_down_bf16.data(), DType::kBF16, {El, s.hidden}};
    } else {
      d_routed.b_gate = {d_b_gate.data(), DType::kFP32, {El, s.intermediate}};
      d_routed.b_up = {d_b_up.data(), DType::kFP32, {El, s.intermediate}};
      d_routed.b_down = {d_b_down.data(), DType::kFP32, {El, s.hidden}};
    }
  }
};

std::vector<double> as_double(const std::vector<uint16_t>& bits) {
  return reference::bf16_to_double(bits.data(), static_cast<int64_t>(bits.size()));
}

TEST(ExpertBiases, ApiEqualsReference) {
  const int R = 2;
  const Shape shape = api_testing::small_shape(R);
  Config config;
  config.activation.kind = ActivationKind::kGptOss;
  auto groups = Group::create_cpu(R);
  std::vector<api_testing::RankData> data;
  std::vector<RankBiases> biases;
  for (int r = 0; r < R; ++r) {
    data.emplace_back(shape, 20 + 3 * r, r, 5);
    biases.emplace_back(shape, r);
  }
  const std::vector<std::string> errors = api_testing::on_every_rank(R, [&](int rank) {
    Workspace ws(groups[rank], shape, config);
    BackwardArgs args = data[rank].backward_args(shape);
    biases[rank].attach(shape, args.inputs.routed);
    biases[rank].attach_grads(shape, args.d_routed, /*bf16=*/false);
    forward(ws, args.inputs);
    args.accumulate_weight_grads = true;
    backward(ws, args);
    BackwardArgs bf16_args = args;
    bf16_args.accumulate_weight_grads = false;
    bf16_args.d_routed = {};  // bias gradients alone, in bf16
    biases[rank].attach_grads(shape, bf16_args.d_routed, /*bf16=*/true);
    backward(ws, bf16_args);
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  reference::Problem p;
  p.hidden = shape.hidden;
  p.intermediate = shape.intermediate;
  p.num_experts = shape.num_experts;
  p.num_topk = shape.num_topk;
  p.shared_intermediate = shape.shared_intermediate;
  p.num_ranks = R;
  p.block_m = kBlockM;
  p.activation = config.activation;
  std::vector<reference::RankInputs> inputs(R);
  std::vector<reference::Weights> routed(R);
  reference::Weights shared;
  for (int r = 0; r < R; ++r) {
    api_testing::RankData& d = data[r];
    inputs[r].num_tokens = d.num_tokens;
    inputs[r].x = as_double(d.x);
    inputs[r].topk_idx = d.topk_idx;
    inputs[r].topk_weights.assign(d.topk_weights.begin(), d.topk_weights.end());
    inputs[r].d_out = as_double(d.d_out);
    routed[r] = {as_double(d.w_gate),         as_double(d.w_up),         as_double(d.w_down),
                 as_double(biases[r].b_gate), as_double(biases[r].b_up), as_double(biases[r].b_down)};
    if (r == 0) shared = {as_double(d.ws_gate), as_double(d.ws_up), as_double(d.ws_down)};
  }
  const auto f = reference::forward(p, inputs, routed, shared);
  const auto g = reference::backward(p, inputs, routed, shared);
  for (int r = 0; r < R; ++r) {
    const std::string rank = "[rank " + std::to_string(r) + "]";
    reference::testing::expect_bitwise_equal(as_double(data[r].out), f[r].out, "out" + rank);
    auto check = [&](const std::vector<float>& got, const std::vector<uint16_t>& got_bf16,
                     const std::vector<double>& want, const std::string& name) {
      std::vector<double> got_fp32, want_fp32, want_bf16;
      for (size_t n = 0; n < want.size(); ++n) {
        got_fp32.push_back(got[n]);
        want_fp32.push_back(1.0f + static_cast<float>(want[n]));  // accumulated onto 1
        want_bf16.push_back(reference::round_bf16(static_cast<float>(want[n])));
      }
      reference::testing::expect_bitwise_equal(got_fp32, want_fp32, name + rank + " (fp32, accumulated)");
      reference::testing::expect_bitwise_equal(as_double(got_bf16), want_bf16, name + rank + " (bf16)");
    };
    check(biases[r].d_b_gate, biases[r].d_b_gate_bf16, g[r].d_routed.b_gate, "d_b_gate");
    check(biases[r].d_b_up, biases[r].d_b_up_bf16, g[r].d_routed.b_up, "d_b_up");
    check(biases[r].d_b_down, biases[r].d_b_down_bf16, g[r].d_routed.b_down, "d_b_down");
  }
}

// Runs a forward (or backward) of one rank on a 1-rank CPU group after `edit` and returns the error.
std::string error_with(const std::function<void(const Shape&, BackwardArgs&, RankBiases&)>& edit,
                       bool run_backward, Precision precision = Precision::kBF16) {
  const Shape shape = api_testing::small_shape(1);
  Config config;
  config.precision = precision;
  auto groups = Group::create_cpu(1);
  api_testing::RankData data(shape, 16, 0, 3);
  RankBiases biases(shape, 0);
  const std::vector<std::string> errors = api_testing::on_every_rank(1, [&](int rank) {
    Workspace ws(groups[rank], shape, config);
    BackwardArgs args = data.backward_args(shape);
    biases.attach(shape, args.inputs.routed);
    biases.attach_grads(shape, args.d_routed, false);
    edit(shape, args, biases);
    if (!run_backward) {
      forward(ws, args.inputs);
      return;
    }
    BackwardArgs plain = args;
    forward(ws, plain.inputs);
    backward(ws, args);
  });
  return errors[0];
}

void expect_error(const std::string& error, const std::string& needle) {
  EXPECT_NE(error.find(needle), std::string::npos) << "error: '" << error << "', expected to name " << needle;
}

TEST(ExpertBiases, ApiRejectsBadBiases) {
  expect_error(error_with(
                   [](const Shape& s, BackwardArgs& a, RankBiases&) {
                     a.inputs.routed.b_gate.shape = {s.num_local_experts(), s.hidden + 1};
                   },
                   false),
               "'routed.b_gate'");
  expect_error(error_with([](const Shape&, BackwardArgs& a,
                             RankBiases&) { a.inputs.routed.b_down.dtype = DType::kFP32; },
                          false),
               "'routed.b_down'");
  expect_error(
      error_with(
          [](const Shape& s, BackwardArgs& a, RankBiases& b) {
            a.inputs.shared.b_up = {b.b_up.data(), DType::kBF16, {s.num_local_experts(), s.intermediate}};
          },
          false),
      "'shared.b_up'");
  expect_error(error_with(
                   [](const Shape& s, BackwardArgs& a, RankBiases&) {
                     a.d_routed.b_up.shape = {s.num_local_experts(), s.intermediate, 1};
                   },
                   true),
               "'d_routed.b_up'");
  expect_error(
      error_with([](const Shape&, BackwardArgs& a, RankBiases&) { a.d_routed.b_down.dtype = DType::kInt32; },
                 true),
      "'d_routed.b_down'");
  // A bias gradient without its bias (forward and backward both see no b_gate).
  expect_error(
      error_with([](const Shape&, BackwardArgs& a, RankBiases&) { a.inputs.routed.b_gate = {}; }, true),
      "'d_routed.b_gate'");
  // An output bias gradient may not alias an input.
  expect_error(
      error_with([](const Shape&, BackwardArgs& a, RankBiases& b) { a.d_routed.b_up.data = b.b_up.data(); },
                 true),
      "'d_routed.b_up'");
}

TEST(ExpertBiases, Fp8WorkspaceRejectsBiases) {
  const std::string error =
      error_with([](const Shape&, BackwardArgs&, RankBiases&) {}, false, Precision::kFP8);
  expect_error(error, "not supported with config.precision = fp8");
}

TEST(ExpertBiases, GpuRejectsBiasesWithTheFix) {
  std::vector<uint16_t> bias(8 * 64);
  ExpertWeights routed;
  routed.b_down = {bias.data(), DType::kBF16, {8, 64}};
  try {
    check_expert_biases_supported(Backend::kGpu, Precision::kBF16, routed, nullptr);
    ADD_FAILURE() << "biases on a GPU workspace were accepted";
  } catch (const Error& e) {
    expect_error(e.what(), "expert biases are not supported on GPUs yet");
    expect_error(e.what(), "fix:");
  }
  ExpertWeights none, d_routed;
  d_routed.b_gate = {bias.data(), DType::kFP32, {8, 64}};
  EXPECT_THROW(check_expert_biases_supported(Backend::kGpu, Precision::kBF16, none, &d_routed), Error);
  EXPECT_NO_THROW(check_expert_biases_supported(Backend::kGpu, Precision::kBF16, none, &none));
  EXPECT_NO_THROW(check_expert_biases_supported(Backend::kCpu, Precision::kBF16, routed, nullptr));
}

}  // namespace
}  // namespace pounce
