// The CLI's input generator and flop counter (cli/inputs.h).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>

#include "pounce/error.h"
#include "cli/inputs.h"

namespace pounce::cli {
namespace {

Shape test_shape() {
  Shape shape;
  shape.max_tokens = 37;
  shape.hidden = 128;
  shape.intermediate = 64;
  shape.num_experts = 8;
  shape.num_topk = 3;
  shape.shared_intermediate = 64;
  shape.num_ranks = 2;
  return shape;
}

bool same(const HostWeights& a, const HostWeights& b) {
  return a.gate == b.gate && a.up == b.up && a.down == b.down;
}

bool same(const HostProblem& a, const HostProblem& b) {
  if (a.ranks.size() != b.ranks.size() || !same(a.shared, b.shared)) return false;
  for (size_t r = 0; r < a.ranks.size(); ++r) {
    const HostRank &x = a.ranks[r], &y = b.ranks[r];
    if (x.x != y.x || x.d_out != y.d_out || x.topk_idx != y.topk_idx || x.topk_weights != y.topk_weights ||
        !same(x.routed, y.routed))
      return false;
  }
  return true;
}

void expect_no_zero(const std::vector<uint16_t>& bits, const char* name) {
  for (size_t i = 0; i < bits.size(); ++i) ASSERT_NE(bits[i] & 0x7fff, 0) << name << "[" << i << "] is zero";
}

TEST(CliInputs, DeterministicPerSeedAndIndependentOfThreads) {
  const HostProblem a = generate_problem(test_shape(), Activation::swiglu(), 42, 1);
  const HostProblem b = generate_problem(test_shape(), Activation::swiglu(), 42, 4);
  const HostProblem c = generate_problem(test_shape(), Activation::swiglu(), 43, 2);
  EXPECT_TRUE(same(a, b));
  EXPECT_FALSE(same(a, c));
  EXPECT_NE(a.ranks[0].x, a.ranks[1].x) << "ranks must not share their tokens";
  EXPECT_NE(a.ranks[0].routed.gate, a.ranks[1].routed.gate) << "ranks must not share their experts";
}

TEST(CliInputs, NeverZeroAndShapedAsTheApiExpects) {
  const Shape s = test_shape();
  const HostProblem p = generate_problem(s, Activation::swiglu(), 7);
  ASSERT_EQ(p.ranks.size(), 2u);
  expect_no_zero(p.shared.gate, "shared.gate");
  expect_no_zero(p.shared.up, "shared.up");
  expect_no_zero(p.shared.down, "shared.down");
  EXPECT_EQ(p.shared.down.size(), static_cast<size_t>(s.hidden * s.shared_intermediate));
  for (const HostRank& rank : p.ranks) {
    EXPECT_EQ(rank.x.size(), static_cast<size_t>(s.max_tokens * s.hidden));
    EXPECT_EQ(rank.routed.gate.size(),
              static_cast<size_t>(s.num_local_experts() * s.intermediate * s.hidden));
    expect_no_zero(rank.x, "x");
    expect_no_zero(rank.d_out, "d_out");
    expect_no_zero(rank.routed.gate, "routed.gate");
    expect_no_zero(rank.routed.up, "routed.up");
    expect_no_zero(rank.routed.down, "routed.down");
    for (int64_t t = 0; t < rank.num_tokens; ++t) {
      std::set<int32_t> experts;
      double total = 0.0;
      for (int64_t j = 0; j < s.num_topk; ++j) {
        const int32_t e = rank.topk_idx[t * s.num_topk + j];
        const float w = rank.topk_weights[t * s.num_topk + j];
        EXPECT_GE(e, 0);
        EXPECT_LT(e, s.num_experts);
        EXPECT_GT(w, 0.0f);
        experts.insert(e);
        total += w;
      }
      EXPECT_EQ(experts.size(), static_cast<size_t>(s.num_topk)) << "token " << t << " repeats an expert";
      EXPECT_NEAR(total, 1.0, 1e-5);
    }
  }
}

TEST(CliInputs, WeightScaleFollowsFanIn) {
  Shape s = test_shape();
  s.hidden = 1024;
  s.max_tokens = 4;
  const HostProblem p = generate_problem(s, Activation::swiglu(), 3);
  auto rms = [](const std::vector<uint16_t>& bits) {
    double sum = 0.0;
    for (uint16_t b : bits) {
      uint32_t word = static_cast<uint32_t>(b) << 16;
      float v;
      std::memcpy(&v, &word, 4);
      sum += static_cast<double>(v) * v;
    }
    return std::sqrt(sum / static_cast<double>(bits.size()));
  };
  EXPECT_NEAR(rms(p.ranks[0].x), 1.0, 0.05);
  EXPECT_NEAR(rms(p.ranks[0].routed.gate), 1.0 / 32.0, 0.05 / 32.0);  // fan_in H = 1024
  EXPECT_NEAR(rms(p.ranks[0].routed.down), 1.0 / 8.0, 0.05 / 8.0);    // fan_in I = 64
}

TEST(CliInputs, RejectsBadShapes) {
  Shape s = test_shape();
  s.num_experts = 7;  // not divisible by 2 ranks
  EXPECT_THROW(generate_problem(s, Activation::swiglu(), 1), Error);
}

TEST(CliFlops, CountsDesignSection7) {
  // 6 * pairs * H * I + 6 * tokens * H * Is, per rank.
  EXPECT_DOUBLE_EQ(forward_flops_per_rank(16, 8, 128, 64, 32, 2),
                   (6.0 * 16 * 128 * 64 + 6.0 * 8 * 128 * 32) / 2);
  EXPECT_DOUBLE_EQ(forward_flops_per_rank(0, 8, 128, 64, 0, 1), 0.0);
  const Shape s = test_shape();
  const HostProblem p = generate_problem(s, Activation::swiglu(), 9);
  EXPECT_EQ(count_routed_pairs(p), s.num_ranks * s.max_tokens * s.num_topk);
  const double expected = (6.0 * s.num_ranks * s.max_tokens * s.num_topk * s.hidden * s.intermediate +
                           6.0 * s.num_ranks * s.max_tokens * s.hidden * s.shared_intermediate) /
                          static_cast<double>(s.num_ranks);
  EXPECT_DOUBLE_EQ(forward_flops_per_rank(p), expected);
  // 1e12 flops in 1000 ms is 1 TFLOP/s.
  EXPECT_DOUBLE_EQ(tflops(1e12, 1000.0), 1.0);
  EXPECT_DOUBLE_EQ(tflops(1e12, 0.0), 0.0);
}

}  // namespace
}  // namespace pounce::cli
