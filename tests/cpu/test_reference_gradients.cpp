// Every gradient of backward() in kFp64 against central finite differences of forward()'s loss
//   loss = sum_r sum_{t, h} out_r[t, h] * d_out_r[t, h]
// on a tiny shape (H 8, I 4, E 4, k 2, R 2, Is 4), for SwiGLU and GPT-OSS with the clamp active on some
// entries; the clamp limit is placed in a wide gap between the g and |u| values so no difference
// straddles a kink.
#include <gtest/gtest.h>

#include <algorithm>

#include "reference_fixtures.h"

namespace pounce::reference {
namespace {

using testing::Case;
using testing::expect_matches_fd;
using testing::finite_differences;
constexpr double kStep = testing::kFiniteDifferenceStep;
constexpr double kRtol = testing::kFiniteDifferenceRtol;

// Every g and u the layer computes (routed pairs and shared rows), in fp64.
std::vector<double> pre_activations(const Case& c) {
  const Problem& p = c.problem;
  const int64_t H = p.hidden, k = p.num_topk, El = p.num_local_experts();
  std::vector<double> values;
  auto add_row = [&](const double* gate, const double* up, int64_t I, const double* x) {
    for (int64_t i = 0; i < I; ++i) {
      double g = 0, u = 0;
      for (int64_t h = 0; h < H; ++h) g += x[h] * gate[i * H + h], u += x[h] * up[i * H + h];
      values.push_back(g);
      values.push_back(u);
    }
  };
  for (const RankInputs& in : c.ranks) {
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = in.topk_idx[t * k + j];
        if (e < 0) continue;
        const Weights& w = c.routed[e / El];
        const int64_t offset = (e % El) * p.intermediate * H;
        add_row(w.gate.data() + offset, w.up.data() + offset, p.intermediate, in.x.data() + t * H);
      }
      if (p.shared_intermediate > 0) {
        add_row(c.shared.gate.data(), c.shared.up.data(), p.shared_intermediate, in.x.data() + t * H);
      }
    }
  }
  return values;
}

// A limit in the widest gap of the upper third of {g, |u|}: some entries clamp, none sits near the kink.
float pick_clamp_limit(const Case& c) {
  std::vector<double> values;
  const std::vector<double> gu = pre_activations(c);
  for (size_t n = 0; n < gu.size(); ++n) values.push_back(n % 2 ? std::abs(gu[n]) : gu[n]);
  std::sort(values.begin(), values.end());
  size_t best = values.size() * 2 / 3;
  for (size_t n = best; n + 1 < values.size() * 9 / 10; ++n) {
    if (values[n + 1] - values[n] > values[best + 1] - values[best]) best = n;
  }
  const float limit = static_cast<float>((values[best] + values[best + 1]) / 2);
  double margin = 1e9;
  for (double v : values) margin = std::min(margin, std::abs(v - limit));
  EXPECT_GT(margin, 1e-3) << "no clean gap for the clamp limit";
  return limit;
}

Case tiny_case(const Activation& act, bool clamp, uint32_t seed) {
  Problem p;
  p.hidden = 8;
  p.intermediate = 4;
  p.num_experts = 4;
  p.num_topk = 2;
  p.shared_intermediate = 4;
  p.num_ranks = 2;
  p.block_m = 4;
  p.activation = act;
  p.activation.clamp_limit.reset();
  p.numerics = Numerics::kFp64;
  p.num_threads = 1;
  Case c = testing::random_case(p, {3, 2}, seed, 0.0);
  c.ranks[0].topk_idx = {1, 3, 2, 2, 0, -1};  // token 1 hits expert 2 twice; token 2 has an unused slot
  c.ranks[1].topk_idx = {3, 1, -1, 0};
  c.ranks[1].topk_weights[0] = 0.0;  // a zero weight still gets its true gradient
  if (clamp) c.problem.activation.clamp_limit = pick_clamp_limit(c);
  return c;
}

void check_all_gradients(Case c) {
  const std::vector<RankGradients> grads = testing::expect_rank_gradients_match_fd(c);
  std::vector<double> d_ws_gate(c.shared.gate.size()), d_ws_up(c.shared.up.size()),
      d_ws_down(c.shared.down.size());
  for (const RankGradients& g : grads) {
    // The shared weights are one tensor used by every rank: its gradient is the sum of the ranks'.
    for (size_t n = 0; n < d_ws_gate.size(); ++n) {
      d_ws_gate[n] += g.d_shared.gate[n], d_ws_up[n] += g.d_shared.up[n], d_ws_down[n] += g.d_shared.down[n];
    }
  }
  expect_matches_fd(d_ws_gate, finite_differences(c, &c.shared.gate), "d_ws_gate");
  expect_matches_fd(d_ws_up, finite_differences(c, &c.shared.up), "d_ws_up");
  expect_matches_fd(d_ws_down, finite_differences(c, &c.shared.down), "d_ws_down");
  // Unused slots get exactly 0.
  EXPECT_EQ(grads[0].d_topk_weights[5], 0.0);
  EXPECT_EQ(grads[1].d_topk_weights[2], 0.0);
}

TEST(ReferenceGradients, SwiGluMatchesFiniteDifferences) {
  check_all_gradients(tiny_case(Activation::swiglu(), /*clamp=*/false, 11));
}

TEST(ReferenceGradients, ClampedSwiGluMatchesFiniteDifferences) {
  check_all_gradients(tiny_case(Activation::swiglu(), /*clamp=*/true, 12));
}

TEST(ReferenceGradients, ClampedGptOssMatchesFiniteDifferences) {
  check_all_gradients(tiny_case(Activation::gpt_oss(), /*clamp=*/true, 13));
}

// The clamp really is active in the clamped cases: some g above the limit and some |u| above it.
TEST(ReferenceGradients, ClampIsExercised) {
  const Case c = tiny_case(Activation::gpt_oss(), /*clamp=*/true, 13);
  const double limit = *c.problem.activation.clamp_limit;
  const std::vector<double> gu = pre_activations(c);
  int g_clamped = 0, u_clamped = 0;
  for (size_t n = 0; n < gu.size(); n += 2)
    g_clamped += gu[n] > limit, u_clamped += std::abs(gu[n + 1]) > limit;
  EXPECT_GT(g_clamped, 0);
  EXPECT_GT(u_clamped, 0);
}

// activation_backward against central differences of activation() at points on both sides of the clamps.
TEST(ReferenceGradients, ActivationBackwardMatchesFiniteDifferences) {
  std::vector<Activation> acts = {Activation::swiglu(), Activation::gpt_oss()};
  Activation clamped_swiglu = Activation::swiglu();
  clamped_swiglu.clamp_limit = 1.5f;
  acts.push_back(clamped_swiglu);
  Activation tight_gpt_oss = Activation::gpt_oss();
  tight_gpt_oss.clamp_limit = 1.5f;
  acts.push_back(tight_gpt_oss);
  const double points[] = {-3.0, -1.7, -0.6, -0.1, 0.0, 0.3, 1.2, 1.7, 4.0};
  for (const Activation& act : acts) {
    for (double g : points) {
      for (double u : points) {
        double d_g, d_u;
        activation_backward(act, g, u, 0.75, &d_g, &d_u);
        const double fd_g =
            0.75 * (activation(act, g + kStep, u) - activation(act, g - kStep, u)) / (2 * kStep);
        const double fd_u =
            0.75 * (activation(act, g, u + kStep) - activation(act, g, u - kStep)) / (2 * kStep);
        EXPECT_NEAR(d_g, fd_g, 1e-8 + kRtol * std::abs(fd_g)) << "g " << g << " u " << u;
        EXPECT_NEAR(d_u, fd_u, 1e-8 + kRtol * std::abs(fd_u)) << "g " << g << " u " << u;
        if (act.clamp_limit && g > *act.clamp_limit) {
          EXPECT_EQ(d_g, 0.0);
        }
        if (act.clamp_limit && std::abs(u) > *act.clamp_limit) {
          EXPECT_EQ(d_u, 0.0);
        }
      }
    }
  }
}

}  // namespace
}  // namespace pounce::reference
