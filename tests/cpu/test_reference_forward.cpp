// forward()/backward() against the plain per-token oracle (bitwise, both numerics), bf16 against fp64,
// thread-count independence, the activations' values, bad-input errors, and the performance shape.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <functional>

#include "reference/parallel.h"
#include "reference_fixtures.h"

namespace pounce::reference {
namespace {

using testing::Case;

Problem problem(Numerics numerics, const Activation& act, int64_t num_ranks, int64_t shared_intermediate) {
  Problem p;
  p.hidden = 24;
  p.intermediate = 12;
  p.num_experts = 8;
  p.num_topk = 3;
  p.shared_intermediate = shared_intermediate;
  p.num_ranks = num_ranks;
  p.block_m = 8;
  p.activation = act;
  p.numerics = numerics;
  p.num_threads = 2;
  return p;
}

Activation clamped(Activation act, float limit) {
  act.clamp_limit = limit;
  return act;
}

// Every output, both numerics, both activations (clamp active on some entries), with and without the
// shared expert: equal bitwise to the oracle, which follows docs/design.md §1 token by token.
TEST(ReferenceForward, MatchesPlainOracleBitwise) {
  uint32_t seed = 100;
  for (Numerics numerics : {Numerics::kBf16, Numerics::kFp64}) {
    for (const Activation& act : {clamped(Activation::swiglu(), 0.75f), clamped(Activation::gpt_oss(), 0.75f),
                                  Activation::swiglu()}) {
      for (int64_t Is : {0, 16}) {
        SCOPED_TRACE(::testing::Message() << "bf16 " << (numerics == Numerics::kBf16) << " gpt_oss "
                                          << (act.kind == ActivationKind::kGptOss) << " Is " << Is);
        testing::expect_matches_oracle(testing::random_case(problem(numerics, act, 2, Is), {37, 21}, ++seed));
      }
    }
  }
}

// kBf16 and kFp64 on the same (bf16-representable) inputs agree to bf16 precision.
TEST(ReferenceForward, Bf16CloseToFp64) {
  for (const Activation& act : {Activation::swiglu(), Activation::gpt_oss()}) {
    Case c = testing::random_case(problem(Numerics::kBf16, act, 2, 16), {50, 30}, 7);
    const std::vector<RankForward> f16 = forward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankGradients> b16 = backward(c.problem, c.ranks, c.routed, c.shared);
    c.problem.numerics = Numerics::kFp64;
    const std::vector<RankForward> f64 = forward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankGradients> b64 = backward(c.problem, c.ranks, c.routed, c.shared);
    auto expect_near = [](const std::vector<double>& got, const std::vector<double>& want, double rel,
                          const std::string& name) {
      testing::expect_close(got, want, 0.0, rel * testing::max_abs(want), name);
    };
    for (size_t r = 0; r < f16.size(); ++r) {
      expect_near(f16[r].out, f64[r].out, 2e-2, "out");
      expect_near(b16[r].d_x, b64[r].d_x, 3e-2, "d_x");
      expect_near(b16[r].d_topk_weights, b64[r].d_topk_weights, 3e-2, "d_topk_weights");
      expect_near(b16[r].d_routed.gate, b64[r].d_routed.gate, 3e-2, "d_w_gate");
      expect_near(b16[r].d_routed.up, b64[r].d_routed.up, 3e-2, "d_w_up");
      expect_near(b16[r].d_routed.down, b64[r].d_routed.down, 3e-2, "d_w_down");
      expect_near(b16[r].d_shared.gate, b64[r].d_shared.gate, 3e-2, "d_ws_gate");
    }
  }
}

// 1, 2, 3 and 8 threads give bitwise-equal results, and so does running twice.
TEST(ReferenceForward, ThreadCountDoesNotChangeResults) {
  Case c = testing::random_case(problem(Numerics::kBf16, Activation::swiglu(), 4, 16), {90, 0, 150, 33}, 3);
  c.problem.num_threads = 1;
  const std::vector<RankForward> f1 = forward(c.problem, c.ranks, c.routed, c.shared);
  const std::vector<RankGradients> b1 = backward(c.problem, c.ranks, c.routed, c.shared);
  for (int threads : {2, 3, 8, 8}) {
    c.problem.num_threads = threads;
    const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
    const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
    for (size_t r = 0; r < f.size(); ++r) {
      testing::expect_bitwise_equal(f[r].out, f1[r].out, "out");
      testing::expect_bitwise_equal(b[r].d_x, b1[r].d_x, "d_x");
      testing::expect_bitwise_equal(b[r].d_topk_weights, b1[r].d_topk_weights, "d_topk_weights");
      testing::expect_bitwise_equal(b[r].d_routed.gate, b1[r].d_routed.gate, "d_w_gate");
      testing::expect_bitwise_equal(b[r].d_routed.up, b1[r].d_routed.up, "d_w_up");
      testing::expect_bitwise_equal(b[r].d_routed.down, b1[r].d_routed.down, "d_w_down");
      testing::expect_bitwise_equal(b[r].d_shared.down, b1[r].d_shared.down, "d_ws_down");
    }
  }
}

TEST(ReferenceForward, ActivationValues) {
  auto sigmoid = [](double v) { return 1 / (1 + std::exp(-v)); };
  const Activation swiglu = Activation::swiglu();
  EXPECT_DOUBLE_EQ(activation(swiglu, 1.0, 2.0), 1.0 * sigmoid(1.0) * 2.0);
  EXPECT_DOUBLE_EQ(activation(swiglu, -3.0, 0.5), -3.0 * sigmoid(-3.0) * 0.5);
  const Activation clamped_swiglu = clamped(swiglu, 2.0f);
  EXPECT_DOUBLE_EQ(activation(clamped_swiglu, 5.0, 9.0), 2.0 * sigmoid(2.0) * 2.0);       // g and u clamped
  EXPECT_DOUBLE_EQ(activation(clamped_swiglu, -5.0, -9.0), -5.0 * sigmoid(-5.0) * -2.0);  // g has no floor
  const Activation gpt_oss = Activation::gpt_oss();  // limit 7, alpha 1.702
  const double alpha = static_cast<double>(1.702f);
  EXPECT_DOUBLE_EQ(activation(gpt_oss, 1.0, 2.0), 3.0 * 1.0 * sigmoid(alpha));
  EXPECT_DOUBLE_EQ(activation(gpt_oss, 8.0, -10.0), (-7.0 + 1.0) * 7.0 * sigmoid(alpha * 7.0));
  Activation unclamped_gpt_oss = gpt_oss;
  unclamped_gpt_oss.clamp_limit.reset();
  EXPECT_DOUBLE_EQ(activation(unclamped_gpt_oss, 8.0, -10.0), (-10.0 + 1.0) * 8.0 * sigmoid(alpha * 8.0));
}

// ---- bad input --------------------------------------------------------------------------------------

void expect_error_mentions(const std::function<void()>& call, const std::string& text) {
  try {
    call();
    ADD_FAILURE() << "expected pounce::Error mentioning '" << text << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(ReferenceForward, RejectsBadInput) {
  const Case good = testing::random_case(problem(Numerics::kBf16, Activation::swiglu(), 2, 16), {5, 4}, 9);
  auto run_forward = [](const Case& c) { return [c] { forward(c.problem, c.ranks, c.routed, c.shared); }; };
  auto run_backward = [](const Case& c) { return [c] { backward(c.problem, c.ranks, c.routed, c.shared); }; };

  Case c = good;
  c.ranks[1].topk_idx[3 * 3 + 2] = 300;
  expect_error_mentions(run_forward(c), "topk_idx[rank 1][3, 2] = 300 is out of range [-1, 8)");
  c.ranks[1].topk_idx[3 * 3 + 2] = -2;
  expect_error_mentions(run_backward(c), "topk_idx[rank 1][3, 2] = -2");

  c = good;
  c.problem.num_topk = 9;
  expect_error_mentions(run_forward(c), "problem.num_topk = 9");
  c = good;
  c.problem.num_ranks = 3;
  expect_error_mentions(run_forward(c), "problem.num_experts = 8 is not a multiple of problem.num_ranks = 3");
  c = good;
  c.ranks[0].x.pop_back();
  expect_error_mentions(run_forward(c), "x[rank 0] has 119 elements, expected 120");
  c = good;
  c.ranks[1].topk_weights.push_back(0.5);
  expect_error_mentions(run_forward(c), "topk_weights[rank 1]");
  c = good;
  c.ranks[1].d_out.clear();
  forward(c.problem, c.ranks, c.routed, c.shared);  // forward needs no d_out
  expect_error_mentions(run_backward(c), "d_out[rank 1]");
  c = good;
  c.routed[1].down.resize(5);
  expect_error_mentions(run_forward(c), "routed_per_rank[1].down");
  c = good;
  c.routed.pop_back();
  expect_error_mentions(run_forward(c), "routed_per_rank has 1 entries");
  c = good;
  c.shared.up.resize(3);
  expect_error_mentions(run_forward(c), "shared.up");
  c = good;
  c.problem.shared_intermediate = 0;
  expect_error_mentions(run_forward(c), "shared_intermediate = 0");
  c = good;
  c.ranks[0].x[7] = 0.1;  // not a bf16 value
  expect_error_mentions(run_forward(c), "x[rank 0][0, 7] = 0.1 is not a bf16 value");
  c.problem.numerics = Numerics::kFp64;  // fp64 takes any value
  forward(c.problem, c.ranks, c.routed, c.shared);
  c = good;
  c.ranks[0].num_tokens = -1;
  expect_error_mentions(run_forward(c), "num_tokens[rank 0] = -1");
  c = good;
  c.problem.block_m = 0;
  expect_error_mentions(run_forward(c), "problem.block_m = 0");
}

// The performance shape of the brief (qwen3-like, small): H 512, I 256, E 16, k 4, 2 ranks x 1024
// tokens, forward + backward in kBf16. Prints the time; the target is a few seconds on 2 cores.
TEST(ReferenceForward, PerformanceShape) {
  Problem p;
  p.hidden = 512;
  p.intermediate = 256;
  p.num_experts = 16;
  p.num_topk = 4;
  p.num_ranks = 2;
  p.block_m = 128;
  p.numerics = Numerics::kBf16;
  const Case c = testing::random_case(p, {1024, 1024}, 5, 0.0);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<RankForward> f = forward(c.problem, c.ranks, c.routed, c.shared);
  const auto middle = std::chrono::steady_clock::now();
  const std::vector<RankGradients> b = backward(c.problem, c.ranks, c.routed, c.shared);
  const auto end = std::chrono::steady_clock::now();
  const double forward_s = std::chrono::duration<double>(middle - start).count();
  const double backward_s = std::chrono::duration<double>(end - middle).count();
  std::printf(
      "[ perf     ] H 512 I 256 E 16 k 4, 2 x 1024 tokens, %d threads: forward %.2f s, backward %.2f s\n",
      resolve_num_threads(0), forward_s, backward_s);
  EXPECT_GT(testing::max_abs(f[0].out), 0.0);
  EXPECT_GT(testing::max_abs(b[1].d_routed.down), 0.0);
}

}  // namespace
}  // namespace pounce::reference
