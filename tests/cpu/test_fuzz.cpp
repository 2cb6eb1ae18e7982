// Fuzz: random layers through the public API on the CPU backend (one thread per rank) against the
// reference. Each case draws ranks (1-4), a small shape (with or without a shared expert), tokens per rank
// (0, 1, 127, 129, any: T is rarely a multiple of 128, and unequal per rank), routing with duplicate ids,
// -1 slots, every token to one expert and empty experts, zero, negative and large top-k weights, both
// activations with and without clamps, BF16 or FP8, int32 or int64 ids, bf16 or fp32 gradients, overwrite
// or accumulate, forward or recompute_forward_context before backward. Every output must equal
//   - the bf16-emulating reference (reference::forward/backward on the same inputs), bitwise, and
//   - for BF16, the plain per-token oracle of reference_fixtures.h (docs/design.md §1 token by token),
//     bitwise: an implementation that shares no code with the reference's schedule, chunks or threads.
// A failure names the case's seed (replay it: POUNCE_FUZZ_SEED=<seed> ./pounce_cpu_tests
// --gtest_filter=Fuzz.ReplayOneCase), the case, the tensor and its first bad coordinate with both values.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <sstream>
#include <thread>

#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference_fixtures.h"

namespace pounce {
namespace {

using reference::bf16_to_double;
using reference::float_to_bf16_bits;
using reference::testing::Case;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // NaN: an element left unwritten shows
constexpr int kShards = 10;
constexpr int kCasesPerShard = 50;  // 500 cases in CI

// One drawn case: the reference's view (Case) and what the API call needs besides.
struct FuzzCase {
  uint64_t seed = 0;
  Shape shape;
  Config config;
  Case data;  // bf16-representable inputs of every rank
  bool idx_int64 = false;
  bool grads_fp32 = true;
  bool accumulate = false;
  bool recompute = false;
  std::string describe() const;
};

std::string FuzzCase::describe() const {
  std::ostringstream out;
  out << "seed " << seed << ": R " << shape.num_ranks << ", H " << shape.hidden << ", I "
      << shape.intermediate << ", E " << shape.num_experts << ", k " << shape.num_topk << ", Is "
      << shape.shared_intermediate << ", max_tokens " << shape.max_tokens << ", T [";
  for (size_t r = 0; r < data.ranks.size(); ++r) out << (r ? " " : "") << data.ranks[r].num_tokens;
  out << "], " << to_string(config.activation.kind) << " clamp "
      << (config.activation.clamp_limit ? std::to_string(*config.activation.clamp_limit) : "none") << ", "
      << to_string(config.precision) << ", ids " << (idx_int64 ? "int64" : "int32") << ", grads "
      << (grads_fp32 ? "fp32" : "bf16") << (accumulate ? " accumulated" : "")
      << (recompute ? ", recompute before backward" : "");
  return out.str();
}

double bf16_value(std::mt19937& rng, double scale) {
  return reference::round_bf16(
      static_cast<float>(std::uniform_real_distribution<double>(-scale, scale)(rng)));
}

FuzzCase draw_case(uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed * 2654435761u + 12345));
  auto pick = [&](std::initializer_list<int64_t> values) {
    return *(values.begin() + std::uniform_int_distribution<size_t>(0, values.size() - 1)(rng));
  };
  auto chance = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  FuzzCase c;
  c.seed = seed;
  Shape& s = c.shape;
  s.num_ranks = pick({1, 1, 2, 2, 3, 4});
  s.num_experts = s.num_ranks * pick({1, 2, 3});
  s.num_topk = std::uniform_int_distribution<int64_t>(1, std::min<int64_t>(s.num_experts, 6))(rng);
  s.hidden = pick({64, 64, 128});
  s.intermediate = pick({64, 64, 128});
  s.shared_intermediate = pick({0, 0, 64});
  std::vector<int64_t> tokens(s.num_ranks);
  for (int64_t& t : tokens)
    t = chance(0.3) ? pick({0, 1, 127, 129}) : std::uniform_int_distribution<int64_t>(0, 90)(rng);
  if (chance(0.05)) std::fill(tokens.begin(), tokens.end(), 0);
  s.max_tokens = *std::max_element(tokens.begin(), tokens.end()) + pick({0, 0, 1, 37});

  Activation& act = c.config.activation;
  act = chance(0.5) ? Activation::swiglu() : Activation::gpt_oss();
  if (chance(0.6))
    act.clamp_limit = static_cast<float>(pick({1, 2, 7})) * 0.25f;  // active at these scales
  else
    act.clamp_limit.reset();
  if (act.kind == ActivationKind::kGptOss && chance(0.3)) act.alpha = 0.5f;
  c.config.precision = chance(0.12) ? Precision::kFP8 : Precision::kBF16;
  c.idx_int64 = chance(0.3);
  c.accumulate = chance(0.25);
  c.grads_fp32 = c.accumulate || chance(0.5);
  c.recompute = chance(0.25);

  reference::Problem& p = c.data.problem;
  p.hidden = s.hidden;
  p.intermediate = s.intermediate;
  p.num_experts = s.num_experts;
  p.num_topk = s.num_topk;
  p.shared_intermediate = s.shared_intermediate;
  p.num_ranks = s.num_ranks;
  p.block_m = kBlockM;
  p.activation = act;
  p.numerics = reference::Numerics::kBf16;
  p.precision = c.config.precision;
  const int64_t H = s.hidden, k = s.num_topk;
  const double unused = pick({0, 0, 1, 5, 10}) / 10.0;  // share of -1 slots (1.0: no routed work at all)
  const bool one_expert = chance(0.1);                  // every slot to one expert, the others empty
  const int32_t the_expert = std::uniform_int_distribution<int32_t>(0, int32_t(s.num_experts - 1))(rng);
  const double x_scale = pick({1, 1, 4});
  for (int64_t r = 0; r < s.num_ranks; ++r) {
    reference::RankInputs in;
    in.num_tokens = tokens[r];
    in.x = reference::testing::random_values(rng, in.num_tokens * H, x_scale, true);
    in.topk_idx = reference::testing::random_routing(rng, in.num_tokens, k, s.num_experts, unused);
    if (one_expert)
      for (int32_t& e : in.topk_idx) e = e < 0 ? e : the_expert;
    in.topk_weights.resize(in.num_tokens * k);
    for (double& w : in.topk_weights) {
      const int64_t kind = pick({0, 1, 2, 2, 2, 3});
      w = kind == 0   ? 0.0
          : kind == 1 ? -std::uniform_real_distribution<double>(0, 1)(rng)
          : kind == 2 ? std::uniform_real_distribution<double>(0, 1)(rng)
                      : 3.0;
      w = static_cast<float>(w);  // the API takes fp32 weights
    }
    in.d_out.resize(in.num_tokens * H);
    for (double& v : in.d_out) v = bf16_value(rng, 1.0);
    c.data.ranks.push_back(std::move(in));
    c.data.routed.push_back(
        reference::testing::random_weights(rng, s.num_local_experts(), H, s.intermediate, true));
  }
  if (s.has_shared_expert())
    c.data.shared = reference::testing::random_weights(rng, 1, H, s.shared_intermediate, true);
  return c;
}

std::vector<uint16_t> to_bf16(const std::vector<double>& values) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = float_to_bf16_bits(static_cast<float>(values[i]));
  return bits;
}

// A gradient tensor in the dtype the case asks for, prefilled (poison, or the accumulation's start).
struct GradBuffer {
  std::vector<uint16_t> bf16;
  std::vector<float> fp32;
  std::vector<float> start;  // accumulate: the values before backward
  TensorView view(std::vector<int64_t> shape) {
    if (!bf16.empty()) return TensorView(bf16.data(), DType::kBF16, std::move(shape));
    return TensorView(fp32.data(), DType::kFP32, std::move(shape));
  }
};

GradBuffer grad_buffer(size_t n, const FuzzCase& c, std::mt19937& rng) {
  GradBuffer g;
  if (!c.grads_fp32) {
    g.bf16.assign(n, kPoisonBf16);
    return g;
  }
  g.fp32.assign(n, NAN);
  if (c.accumulate) {
    std::uniform_real_distribution<float> start(-1.0f, 1.0f);
    for (float& v : g.fp32) v = start(rng);
    g.start = g.fp32;
  }
  return g;
}

// The buffers of one rank: inputs from the case, outputs poisoned.
struct RankBuffers {
  std::vector<uint16_t> x, d_out, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, out, d_x;
  std::vector<int32_t> idx32;
  std::vector<int64_t> idx64;
  std::vector<float> topk_weights, d_topk_weights;
  GradBuffer d_gate, d_up, d_down, d_sgate, d_sup, d_sdown;
  std::vector<std::vector<uint8_t>> fp8_data;
  std::vector<std::vector<float>> fp8_scale;
  Fp8Weights fp8;
};

RankBuffers make_buffers(const FuzzCase& c, int64_t r) {
  const Shape& s = c.shape;
  const reference::RankInputs& in = c.data.ranks[r];
  const reference::Weights& w = c.data.routed[r];
  RankBuffers b;
  b.x = to_bf16(in.x);
  b.d_out = to_bf16(in.d_out);
  b.w_gate = to_bf16(w.gate), b.w_up = to_bf16(w.up), b.w_down = to_bf16(w.down);
  if (s.has_shared_expert())
    b.ws_gate = to_bf16(c.data.shared.gate), b.ws_up = to_bf16(c.data.shared.up),
    b.ws_down = to_bf16(c.data.shared.down);
  b.idx32 = in.topk_idx;
  b.idx64.assign(in.topk_idx.begin(), in.topk_idx.end());
  b.topk_weights.assign(in.topk_weights.begin(), in.topk_weights.end());
  b.out.assign(in.x.size(), kPoisonBf16);
  b.d_x.assign(in.x.size(), kPoisonBf16);
  b.d_topk_weights.assign(in.topk_weights.size(), NAN);
  std::mt19937 rng(static_cast<uint32_t>(c.seed * 31 + r));
  b.d_gate = grad_buffer(w.gate.size(), c, rng);
  b.d_up = grad_buffer(w.up.size(), c, rng);
  b.d_down = grad_buffer(w.down.size(), c, rng);
  b.d_sgate = grad_buffer(c.data.shared.gate.size(), c, rng);
  b.d_sup = grad_buffer(c.data.shared.up.size(), c, rng);
  b.d_sdown = grad_buffer(c.data.shared.down.size(), c, rng);
  return b;
}

ForwardArgs forward_args(const FuzzCase& c, RankBuffers& b, int64_t T) {
  const Shape& s = c.shape;
  const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate,
                k = s.num_topk;
  ForwardArgs args;
  args.x = {b.x.data(), DType::kBF16, {T, H}};
  args.topk_idx = c.idx_int64 ? TensorView(b.idx64.data(), DType::kInt64, {T, k})
                              : TensorView(b.idx32.data(), DType::kInt32, {T, k});
  args.topk_weights = {b.topk_weights.data(), DType::kFP32, {T, k}};
  args.routed = {{b.w_gate.data(), DType::kBF16, {El, I, H}},
                 {b.w_up.data(), DType::kBF16, {El, I, H}},
                 {b.w_down.data(), DType::kBF16, {El, H, I}}};
  if (Is > 0)
    args.shared = {{b.ws_gate.data(), DType::kBF16, {Is, H}},
                   {b.ws_up.data(), DType::kBF16, {Is, H}},
                   {b.ws_down.data(), DType::kBF16, {H, Is}}};
  args.out = {b.out.data(), DType::kBF16, {T, H}};
  if (c.config.precision == Precision::kFP8) {
    const std::vector<int64_t> shapes[6] = {{El, I, H}, {El, I, H}, {El, H, I},
                                            {El, H, I}, {El, H, I}, {El, I, H}};
    Fp8Tensor* tensors[6] = {&b.fp8.gate, &b.fp8.up, &b.fp8.down, &b.fp8.gate_t, &b.fp8.up_t, &b.fp8.down_t};
    b.fp8_data.resize(6);
    b.fp8_scale.resize(6);
    for (int i = 0; i < 6; ++i) {
      const int64_t bn = (shapes[i][1] + kFp8Block - 1) / kFp8Block,
                    bk = (shapes[i][2] + kFp8Block - 1) / kFp8Block;
      b.fp8_data[i].assign(El * shapes[i][1] * shapes[i][2], 0);
      b.fp8_scale[i].assign(El * bn * bk, 1.0f);
      *tensors[i] = {TensorView(b.fp8_data[i].data(), DType::kUInt8, shapes[i]),
                     TensorView(b.fp8_scale[i].data(), DType::kFP32, {El, bn, bk})};
    }
    quantize_weights_fp8(args.routed, b.fp8);
    args.routed_fp8 = &b.fp8;
  }
  return args;
}

BackwardArgs backward_args(const FuzzCase& c, RankBuffers& b, int64_t T) {
  const Shape& s = c.shape;
  const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate;
  BackwardArgs args;
  args.inputs = forward_args(c, b, T);
  args.d_out = {b.d_out.data(), DType::kBF16, {T, H}};
  args.d_x = {b.d_x.data(), DType::kBF16, {T, H}};
  args.d_topk_weights = {b.d_topk_weights.data(), DType::kFP32, {T, s.num_topk}};
  args.d_routed = {b.d_gate.view({El, I, H}), b.d_up.view({El, I, H}), b.d_down.view({El, H, I})};
  if (Is > 0) args.d_shared = {b.d_sgate.view({Is, H}), b.d_sup.view({Is, H}), b.d_sdown.view({H, Is})};
  args.accumulate_weight_grads = c.accumulate;
  return args;
}

// Names the first element of `got` that differs bitwise from `want`, with its coordinate in `shape`.
std::string first_difference(const std::vector<double>& got, const std::vector<double>& want,
                             const std::vector<int64_t>& shape) {
  if (got.size() != want.size())
    return "has " + std::to_string(got.size()) + " elements, want " + std::to_string(want.size());
  for (size_t n = 0; n < got.size(); ++n) {
    if (got[n] == want[n] || (std::isnan(got[n]) && std::isnan(want[n]))) continue;
    std::string coordinate;
    int64_t rest = static_cast<int64_t>(n);
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      coordinate = std::to_string(rest % shape[d]) + (coordinate.empty() ? "" : ", ") + coordinate;
      rest /= shape[d];
    }
    std::ostringstream out;
    out.precision(9);
    out << " at [" << coordinate << "]: got " << got[n] << ", want " << want[n];
    return out.str();
  }
  return "";
}

// What the API wrote for a gradient, as doubles; `want` rounded as the API stores it.
std::vector<double> grad_values(const GradBuffer& g) {
  if (!g.bf16.empty()) return bf16_to_double(g.bf16);
  return std::vector<double>(g.fp32.begin(), g.fp32.end());
}
std::vector<double> stored(const std::vector<double>& ref, const GradBuffer& g) {
  std::vector<double> want(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    const float value = static_cast<float>(ref[i]);
    want[i] = !g.bf16.empty()   ? reference::bf16_bits_to_float(float_to_bf16_bits(value))
              : g.start.empty() ? value
                                : static_cast<double>(g.start[i] + value);
  }
  return want;
}
std::vector<double> as_float(const std::vector<double>& ref) {
  std::vector<double> out(ref.size());
  for (size_t i = 0; i < ref.size(); ++i) out[i] = static_cast<float>(ref[i]);
  return out;
}

// Runs one case through the API and compares; returns "" or the first mismatch, naming the case.
std::string run_case(const FuzzCase& c) {
  const Shape& s = c.shape;
  const int R = static_cast<int>(s.num_ranks);
  std::vector<RankBuffers> buffers;
  for (int r = 0; r < R; ++r) buffers.push_back(make_buffers(c, r));
  auto groups = Group::create_cpu(R);
  std::vector<std::string> errors(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      try {
        const int64_t T = c.data.ranks[r].num_tokens;
        Workspace workspace(groups[r], s, c.config);
        forward(workspace, forward_args(c, buffers[r], T));
        if (c.recompute) recompute_forward_context(workspace, forward_args(c, buffers[r], T));
        backward(workspace, backward_args(c, buffers[r], T));
      } catch (const std::exception& error) {
        errors[r] = error.what();
      }
    });
  for (auto& thread : threads) thread.join();
  for (int r = 0; r < R; ++r)
    if (!errors[r].empty()) return c.describe() + ": rank " + std::to_string(r) + " threw: " + errors[r];

  const auto f = reference::forward(c.data.problem, c.data.ranks, c.data.routed, c.data.shared);
  const auto g = reference::backward(c.data.problem, c.data.ranks, c.data.routed, c.data.shared);
  reference::testing::OracleResult oracle;
  const bool with_oracle = c.config.precision == Precision::kBF16;
  if (with_oracle) oracle = reference::testing::oracle<float>(c.data);
  const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate;
  for (int r = 0; r < R; ++r) {
    const int64_t T = c.data.ranks[r].num_tokens;
    RankBuffers& b = buffers[r];
    struct Check {
      const char* name;
      std::vector<double> got, want, oracle;
      std::vector<int64_t> shape;
    };
    std::vector<Check> checks = {
        {"out",
         bf16_to_double(b.out),
         f[r].out,
         with_oracle ? oracle.forward[r].out : std::vector<double>{},
         {T, H}},
        {"d_x",
         bf16_to_double(b.d_x),
         g[r].d_x,
         with_oracle ? oracle.backward[r].d_x : std::vector<double>{},
         {T, H}},
        {"d_topk_weights",
         {b.d_topk_weights.begin(), b.d_topk_weights.end()},
         as_float(g[r].d_topk_weights),
         with_oracle ? as_float(oracle.backward[r].d_topk_weights) : std::vector<double>{},
         {T, s.num_topk}},
        {"d_routed.gate",
         grad_values(b.d_gate),
         stored(g[r].d_routed.gate, b.d_gate),
         with_oracle ? stored(oracle.backward[r].d_routed.gate, b.d_gate) : std::vector<double>{},
         {El, I, H}},
        {"d_routed.up",
         grad_values(b.d_up),
         stored(g[r].d_routed.up, b.d_up),
         with_oracle ? stored(oracle.backward[r].d_routed.up, b.d_up) : std::vector<double>{},
         {El, I, H}},
        {"d_routed.down",
         grad_values(b.d_down),
         stored(g[r].d_routed.down, b.d_down),
         with_oracle ? stored(oracle.backward[r].d_routed.down, b.d_down) : std::vector<double>{},
         {El, H, I}},
    };
    if (Is > 0) {
      checks.push_back(
          {"d_shared.gate",
           grad_values(b.d_sgate),
           stored(g[r].d_shared.gate, b.d_sgate),
           with_oracle ? stored(oracle.backward[r].d_shared.gate, b.d_sgate) : std::vector<double>{},
           {Is, H}});
      checks.push_back({"d_shared.up",
                        grad_values(b.d_sup),
                        stored(g[r].d_shared.up, b.d_sup),
                        with_oracle ? stored(oracle.backward[r].d_shared.up, b.d_sup) : std::vector<double>{},
                        {Is, H}});
      checks.push_back(
          {"d_shared.down",
           grad_values(b.d_sdown),
           stored(g[r].d_shared.down, b.d_sdown),
           with_oracle ? stored(oracle.backward[r].d_shared.down, b.d_sdown) : std::vector<double>{},
           {H, Is}});
    }
    for (const Check& check : checks) {
      const std::string where = std::string(check.name) + " of rank " + std::to_string(r);
      std::string bad = first_difference(check.got, check.want, check.shape);
      if (!bad.empty()) return c.describe() + ": " + where + bad + " (the bf16 reference, bitwise)";
      if (!with_oracle) continue;
      bad = first_difference(check.got, check.oracle, check.shape);
      if (!bad.empty()) return c.describe() + ": " + where + bad + " (the plain oracle, bitwise)";
    }
  }
  return "";
}

class Fuzz : public ::testing::TestWithParam<int> {};

TEST_P(Fuzz, ApiEqualsReferenceAndOracle) {
  for (int n = 0; n < kCasesPerShard; ++n) {
    const uint64_t seed = static_cast<uint64_t>(GetParam()) * kCasesPerShard + n + 1;
    const std::string failure = run_case(draw_case(seed));
    ASSERT_EQ(failure, "") << "replay: POUNCE_FUZZ_SEED=" << seed
                           << " ./pounce_cpu_tests --gtest_filter=Fuzz.ReplayOneCase";
  }
}
INSTANTIATE_TEST_SUITE_P(Shards, Fuzz, ::testing::Range(0, kShards));

TEST(Fuzz, ReplayOneCase) {
  const char* seed = std::getenv("POUNCE_FUZZ_SEED");
  if (seed == nullptr) GTEST_SKIP() << "set POUNCE_FUZZ_SEED=<seed> to replay one fuzz case";
  const FuzzCase c = draw_case(std::strtoull(seed, nullptr, 10));
  std::printf("%s\n", c.describe().c_str());
  EXPECT_EQ(run_case(c), "");
}

// The draws cover what the fuzz promises (so a change to draw_case cannot quietly narrow it).
TEST(Fuzz, CasesCoverTheCorners) {
  int ranks[5] = {}, zero_tokens = 0, odd_tokens = 0, duplicates = 0, unused = 0, zero_w = 0, negative_w = 0,
      gpt_oss = 0, clamped = 0, fp8 = 0, shared = 0, accumulate = 0, recompute = 0, int64_ids = 0;
  for (uint64_t seed = 1; seed <= kShards * kCasesPerShard; ++seed) {
    const FuzzCase c = draw_case(seed);
    ++ranks[c.shape.num_ranks];
    gpt_oss += c.config.activation.kind == ActivationKind::kGptOss;
    clamped += c.config.activation.clamp_limit.has_value();
    fp8 += c.config.precision == Precision::kFP8;
    shared += c.shape.has_shared_expert();
    accumulate += c.accumulate;
    recompute += c.recompute;
    int64_ids += c.idx_int64;
    bool dup = false, minus = false, zero = false, negative = false, no_tokens = false, odd = false;
    for (const auto& in : c.data.ranks) {
      no_tokens |= in.num_tokens == 0;
      odd |= in.num_tokens % kBlockM != 0;
      for (int64_t t = 0; t < in.num_tokens; ++t)
        for (int64_t j = 0; j < c.shape.num_topk; ++j) {
          const int32_t e = in.topk_idx[t * c.shape.num_topk + j];
          minus |= e < 0;
          for (int64_t i = 0; i < j; ++i) dup |= e >= 0 && in.topk_idx[t * c.shape.num_topk + i] == e;
        }
      for (double w : in.topk_weights) zero |= w == 0, negative |= w < 0;
    }
    zero_tokens += no_tokens, odd_tokens += odd, duplicates += dup, unused += minus, zero_w += zero,
        negative_w += negative;
  }
  for (int r = 1; r <= 4; ++r) EXPECT_GE(ranks[r], 40) << "cases with " << r << " ranks";
  for (int count : {zero_tokens, odd_tokens, duplicates, unused, zero_w, negative_w, gpt_oss, clamped, fp8,
                    shared, accumulate, recompute, int64_ids})
    EXPECT_GE(count, 25);
}

}  // namespace
}  // namespace pounce
