// The same global batch over 1, 2, 4 and 8 ranks gives bitwise-equal out, y, ys, d_x and d_topk_weights
// (weight gradients sum in schedule order, so they agree within rounding), and adversarial routings:
// all tokens to one expert, empty experts, unused slots, ranks without tokens, T not a multiple of
// block_m, different T per rank. Every case is also checked bitwise against the plain oracle.
#include <gtest/gtest.h>

#include <algorithm>

#include "reference_fixtures.h"

namespace pounce::reference {
namespace {

using testing::Case;

Problem global_problem(Numerics numerics, const Activation& act, int64_t shared_intermediate) {
  Problem p;
  p.hidden = 16;
  p.intermediate = 8;
  p.num_experts = 8;
  p.num_topk = 3;
  p.shared_intermediate = shared_intermediate;
  p.num_ranks = 1;
  p.block_m = 5;
  p.activation = act;
  p.numerics = numerics;
  p.num_threads = 2;
  return p;
}

// Token splits of a 45-token global batch: uneven, with an empty rank, none a multiple of block_m.
const std::vector<std::vector<int64_t>>& splits() {
  static const std::vector<std::vector<int64_t>> kSplits = {
      {45}, {29, 16}, {11, 0, 21, 13}, {6, 7, 0, 9, 3, 8, 1, 11}};
  return kSplits;
}

// Global (rank 0 of a one-rank result) view of a per-rank weight gradient: expert e at rank e / El.
std::vector<double> gather_routed(const std::vector<RankGradients>& grads,
                                  std::vector<double> Weights::*field) {
  std::vector<double> all;
  for (const RankGradients& g : grads)
    all.insert(all.end(), (g.d_routed.*field).begin(), (g.d_routed.*field).end());
  return all;
}

std::vector<double> sum_shared(const std::vector<RankGradients>& grads, std::vector<double> Weights::*field) {
  std::vector<double> sum((grads[0].d_shared.*field).size(), 0.0);
  for (const RankGradients& g : grads) {
    for (size_t n = 0; n < sum.size(); ++n) sum[n] += (g.d_shared.*field)[n];
  }
  return sum;
}

// Runs `global` split over every rank count and compares with the one-rank run.
void check_rank_counts(const Case& global) {
  const bool bf16 = global.problem.numerics == Numerics::kBf16;
  const std::vector<RankForward> f1 = forward(global.problem, global.ranks, global.routed, global.shared);
  const std::vector<RankGradients> b1 = backward(global.problem, global.ranks, global.routed, global.shared);
  for (const std::vector<int64_t>& split : splits()) {
    const int64_t R = static_cast<int64_t>(split.size());
    SCOPED_TRACE(::testing::Message() << "R = " << R);
    const Case c = testing::split_case(global, R, split);
    const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
    testing::expect_bitwise_equal(testing::concat(f, &RankForward::out), f1[0].out, "out");
    testing::expect_bitwise_equal(testing::concat(f, &RankForward::y), f1[0].y, "y");
    testing::expect_bitwise_equal(testing::concat(f, &RankForward::ys), f1[0].ys, "ys");
    testing::expect_bitwise_equal(testing::concat(b, &RankGradients::d_x), b1[0].d_x, "d_x");
    testing::expect_bitwise_equal(testing::concat(b, &RankGradients::d_topk_weights), b1[0].d_topk_weights,
                                  "d_topk_weights");
    // Weight gradients: same terms, summed in another order (fp32 in kBf16, fp64 in kFp64).
    const double rel = bf16 ? 1e-5 : 1e-13;
    for (auto field : {&Weights::gate, &Weights::up, &Weights::down}) {
      const std::vector<double>& want = b1[0].d_routed.*field;
      testing::expect_close(gather_routed(b, field), want, 0.0, rel * testing::max_abs(want), "d_routed");
      if (global.problem.shared_intermediate > 0) {
        const std::vector<double>& want_shared = b1[0].d_shared.*field;
        testing::expect_close(sum_shared(b, field), want_shared, 0.0, rel * testing::max_abs(want_shared),
                              "d_shared");
      }
    }
    testing::expect_matches_oracle(c);
  }
}

TEST(ReferenceRanks, SameBatchOverOneTwoFourEightRanks) {
  uint32_t seed = 40;
  for (Numerics numerics : {Numerics::kBf16, Numerics::kFp64}) {
    Activation gpt_oss = Activation::gpt_oss();
    gpt_oss.clamp_limit = 0.8f;
    for (const Activation& act : {Activation::swiglu(), gpt_oss}) {
      for (int64_t Is : {0, 8}) {
        SCOPED_TRACE(::testing::Message() << "bf16 " << (numerics == Numerics::kBf16) << " Is " << Is);
        check_rank_counts(testing::random_case(global_problem(numerics, act, Is), {45}, ++seed));
      }
    }
  }
}

// Rewrites the routing of a one-rank case with `route(token, slot)`.
template <typename Route>
Case with_routing(Case c, Route route) {
  const int64_t k = c.problem.num_topk;
  for (int64_t t = 0; t < c.ranks[0].num_tokens; ++t) {
    for (int64_t j = 0; j < k; ++j) c.ranks[0].topk_idx[t * k + j] = route(t, j);
  }
  return c;
}

// Every routed weight gradient of an expert outside `used` is exactly zero, on every rank count.
void expect_zero_grads_outside(const Case& global, const std::vector<int32_t>& used) {
  for (const std::vector<int64_t>& split : splits()) {
    const Case c = testing::split_case(global, static_cast<int64_t>(split.size()), split);
    const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
    const int64_t El = c.problem.num_local_experts(), I = c.problem.intermediate, H = c.problem.hidden;
    for (int32_t e = 0; e < c.problem.num_experts; ++e) {
      const Weights& d = b[e / El].d_routed;
      const int64_t first = (e % El) * I * H;  // gate/up [I, H] and down [H, I] have the same size
      double largest = 0.0;
      for (int64_t n = first; n < first + I * H; ++n) {
        largest = std::max({largest, std::abs(d.gate[n]), std::abs(d.up[n]), std::abs(d.down[n])});
      }
      const bool is_used = std::find(used.begin(), used.end(), e) != used.end();
      if (is_used) {
        EXPECT_GT(largest, 0.0) << "expert " << e << " received tokens";
      } else {
        EXPECT_EQ(largest, 0.0) << "expert " << e << " received no tokens";
      }
    }
  }
}

TEST(ReferenceRanks, AllTokensToOneExpert) {
  for (Numerics numerics : {Numerics::kBf16, Numerics::kFp64}) {
    // Every slot of every token picks expert 5: each token visits it k times; 135 rows on one expert
    // span several row chunks.
    const Case c =
        with_routing(testing::random_case(global_problem(numerics, Activation::swiglu(), 8), {45}, 3),
                     [](int64_t, int64_t) { return 5; });
    check_rank_counts(c);
    expect_zero_grads_outside(c, {5});
  }
}

TEST(ReferenceRanks, EmptyExpertsAndUnusedSlots) {
  for (Numerics numerics : {Numerics::kBf16, Numerics::kFp64}) {
    // Only experts 0 and 6 are used, and every third token has no routed expert at all.
    const Case c =
        with_routing(testing::random_case(global_problem(numerics, Activation::gpt_oss(), 0), {45}, 4),
                     [](int64_t t, int64_t j) { return t % 3 == 0    ? -1
                                                       : (t + j) % 2 ? 0
                                                                     : 6; });
    check_rank_counts(c);
    expect_zero_grads_outside(c, {0, 6});
    // Without a shared expert a token with no routed expert has out = 0, d_x = 0, d_topk_weights = 0.
    const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
    for (int64_t h = 0; h < c.problem.hidden; ++h) {
      EXPECT_EQ(f[0].out[3 * c.problem.hidden + h], 0.0);
      EXPECT_EQ(b[0].d_x[3 * c.problem.hidden + h], 0.0);
    }
    for (int64_t j = 0; j < c.problem.num_topk; ++j)
      EXPECT_EQ(b[0].d_topk_weights[3 * c.problem.num_topk + j], 0.0);
  }
}

TEST(ReferenceRanks, NoTokensAnywhere) {
  for (int64_t Is : {0, 8}) {
    Problem p = global_problem(Numerics::kBf16, Activation::swiglu(), Is);
    p.num_ranks = 4;
    const Case c = testing::random_case(p, {0, 0, 0, 0}, 5);
    const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
    for (int64_t r = 0; r < 4; ++r) {
      EXPECT_TRUE(f[r].out.empty());
      EXPECT_TRUE(b[r].d_x.empty());
      EXPECT_EQ(b[r].d_routed.gate.size(), c.routed[r].gate.size());
      EXPECT_EQ(testing::max_abs(b[r].d_routed.gate) + testing::max_abs(b[r].d_routed.down), 0.0);
      EXPECT_EQ(b[r].d_shared.up.size(), c.shared.up.size());
      EXPECT_EQ(testing::max_abs(b[r].d_shared.up), 0.0);
    }
    testing::expect_matches_oracle(c);
  }
}

// k = E with every expert picked once per token, block_m = 1 (no padding) and block_m larger than any
// segment (all padding but the first rows).
TEST(ReferenceRanks, BlockMExtremes) {
  for (int64_t block_m : {1, 64}) {
    Problem p = global_problem(Numerics::kBf16, Activation::swiglu(), 8);
    p.num_topk = 8;
    p.block_m = block_m;
    const Case c = with_routing(testing::random_case(p, {45}, 6),
                                [](int64_t t, int64_t j) { return static_cast<int32_t>((t + j) % 8); });
    check_rank_counts(c);
  }
}

}  // namespace
}  // namespace pounce::reference
