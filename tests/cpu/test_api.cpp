// The public API on the CPU backend: end to end over several ranks (one thread each), results equal to
// the reference, and bad input rejected with a message that names the argument, touching no output.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <thread>

#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce {
namespace {

using reference::bf16_to_double;
using reference::float_to_bf16_bits;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // a NaN: any element left unwritten shows

// Host buffers of one rank, filled with random bf16-representable values; `views()` wraps them.
struct RankData {
  int64_t num_tokens = 0;
  std::vector<uint16_t> x, w_gate, w_up, w_down, ws_gate, ws_up, ws_down, out, d_out, d_x;
  std::vector<int32_t> topk_idx;
  std::vector<float> topk_weights, d_topk_weights, d_w_gate, d_w_up, d_w_down, d_ws_gate, d_ws_up, d_ws_down;

  RankData(const Shape& s, int64_t tokens, int rank, uint64_t seed) : num_tokens(tokens) {
    std::mt19937_64 rng(seed * 1000 + rank);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    auto fill = [&](std::vector<uint16_t>& v, int64_t n, float scale) {
      v.resize(n);
      for (auto& e : v) e = float_to_bf16_bits(normal(rng) * scale);
    };
    const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate;
    fill(x, tokens * H, 1.0f);
    fill(d_out, tokens * H, 1.0f);
    fill(w_gate, El * I * H, 1.0f / std::sqrt(float(H)));
    fill(w_up, El * I * H, 1.0f / std::sqrt(float(H)));
    fill(w_down, El * H * I, 1.0f / std::sqrt(float(I)));
    // Shared weights are replicas: the same seed on every rank.
    std::mt19937_64 shared_rng(seed);
    std::swap(rng, shared_rng);
    fill(ws_gate, Is * H, 1.0f / std::sqrt(float(H)));
    fill(ws_up, Is * H, 1.0f / std::sqrt(float(H)));
    fill(ws_down, H * Is, Is ? 1.0f / std::sqrt(float(Is)) : 0.0f);
    std::swap(rng, shared_rng);
    topk_idx.resize(tokens * s.num_topk);
    topk_weights.resize(tokens * s.num_topk);
    std::vector<int32_t> experts(s.num_experts);
    for (int64_t t = 0; t < tokens; ++t) {
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int64_t j = 0; j < s.num_topk; ++j) {
        topk_idx[t * s.num_topk + j] = experts[j];
        topk_weights[t * s.num_topk + j] = 0.1f + std::abs(normal(rng));
      }
    }
    out.assign(tokens * H, kPoisonBf16);
    d_x.assign(tokens * H, kPoisonBf16);
    d_topk_weights.assign(tokens * s.num_topk, NAN);
    d_w_gate.assign(w_gate.size(), NAN);
    d_w_up.assign(w_up.size(), NAN);
    d_w_down.assign(w_down.size(), NAN);
    d_ws_gate.assign(ws_gate.size(), NAN);
    d_ws_up.assign(ws_up.size(), NAN);
    d_ws_down.assign(ws_down.size(), NAN);
  }

  ForwardArgs forward_args(const Shape& s) {
    const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate;
    ForwardArgs args;
    args.x = {x.data(), DType::kBF16, {num_tokens, H}};
    args.topk_idx = {topk_idx.data(), DType::kInt32, {num_tokens, s.num_topk}};
    args.topk_weights = {topk_weights.data(), DType::kFP32, {num_tokens, s.num_topk}};
    args.routed = {{w_gate.data(), DType::kBF16, {El, I, H}},
                   {w_up.data(), DType::kBF16, {El, I, H}},
                   {w_down.data(), DType::kBF16, {El, H, I}}};
    if (Is > 0)
      args.shared = {{ws_gate.data(), DType::kBF16, {Is, H}},
                     {ws_up.data(), DType::kBF16, {Is, H}},
                     {ws_down.data(), DType::kBF16, {H, Is}}};
    args.out = {out.data(), DType::kBF16, {num_tokens, H}};
    return args;
  }

  BackwardArgs backward_args(const Shape& s) {
    const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts(), Is = s.shared_intermediate;
    BackwardArgs args;
    args.inputs = forward_args(s);
    args.d_out = {d_out.data(), DType::kBF16, {num_tokens, H}};
    args.d_x = {d_x.data(), DType::kBF16, {num_tokens, H}};
    args.d_topk_weights = {d_topk_weights.data(), DType::kFP32, {num_tokens, s.num_topk}};
    args.d_routed = {{d_w_gate.data(), DType::kFP32, {El, I, H}},
                     {d_w_up.data(), DType::kFP32, {El, I, H}},
                     {d_w_down.data(), DType::kFP32, {El, H, I}}};
    if (Is > 0)
      args.d_shared = {{d_ws_gate.data(), DType::kFP32, {Is, H}},
                       {d_ws_up.data(), DType::kFP32, {Is, H}},
                       {d_ws_down.data(), DType::kFP32, {H, Is}}};
    return args;
  }
};

Shape small_shape(int64_t ranks) {
  return {.max_tokens = 40,
          .hidden = 64,
          .intermediate = 64,
          .num_experts = 8,
          .num_topk = 2,
          .shared_intermediate = 64,
          .num_ranks = ranks};
}

// Runs `body(rank)` on one thread per rank; returns each rank's exception message ("" = none).
std::vector<std::string> on_every_rank(int num_ranks, const std::function<void(int)>& body) {
  std::vector<std::string> errors(num_ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < num_ranks; ++rank)
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const std::exception& error) {
        errors[rank] = error.what();
      }
    });
  for (auto& thread : threads) thread.join();
  return errors;
}

// One rank's routed weights quantized by pounce::quantize_weights_fp8 (both orientations), as a caller
// passes them in ForwardArgs::routed_fp8.
struct RankFp8Weights {
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::vector<float>> scale;
  Fp8Weights views;

  RankFp8Weights(const Shape& s, RankData& rank) {
    const int64_t H = s.hidden, I = s.intermediate, El = s.num_local_experts();
    const std::vector<int64_t> shapes[6] = {{El, I, H}, {El, I, H}, {El, H, I},
                                            {El, H, I}, {El, H, I}, {El, I, H}};
    Fp8Tensor* tensors[6] = {&views.gate, &views.up, &views.down, &views.gate_t, &views.up_t, &views.down_t};
    data.resize(6);
    scale.resize(6);
    for (int i = 0; i < 6; ++i) {
      const int64_t bn = (shapes[i][1] + kFp8Block - 1) / kFp8Block,
                    bk = (shapes[i][2] + kFp8Block - 1) / kFp8Block;
      data[i].assign(El * shapes[i][1] * shapes[i][2], 0xFF);
      scale[i].assign(El * bn * bk, NAN);
      *tensors[i] = {TensorView(data[i].data(), DType::kUInt8, shapes[i]),
                     TensorView(scale[i].data(), DType::kFP32, {El, bn, bk})};
    }
    quantize_weights_fp8(rank.forward_args(s).routed, views);
  }
};

// The API over two ranks of the CPU backend, bitwise the reference at `precision` (FP8: the FP8 layer,
// its every quantization point).
void expect_api_equals_reference(Precision precision) {
  const int R = 2;
  const Shape shape = small_shape(R);
  std::vector<RankData> data;
  for (int r = 0; r < R; ++r) data.emplace_back(shape, r == 0 ? 37 : 21, r, 7);
  std::vector<RankFp8Weights> fp8;
  if (precision == Precision::kFP8)
    for (int r = 0; r < R; ++r) fp8.emplace_back(shape, data[r]);
  auto groups = Group::create_cpu(R);
  Config config;
  config.precision = precision;
  auto errors = on_every_rank(R, [&](int r) {
    Workspace workspace(groups[r], shape, config);
    ForwardArgs args = data[r].forward_args(shape);
    BackwardArgs grads = data[r].backward_args(shape);
    if (precision == Precision::kFP8) args.routed_fp8 = grads.inputs.routed_fp8 = &fp8[r].views;
    forward(workspace, args);
    backward(workspace, grads);
  });
  for (const auto& error : errors) ASSERT_EQ(error, "");

  reference::Problem problem{.hidden = shape.hidden,
                             .intermediate = shape.intermediate,
                             .num_experts = shape.num_experts,
                             .num_topk = shape.num_topk,
                             .shared_intermediate = shape.shared_intermediate,
                             .num_ranks = R,
                             .block_m = kBlockM,
                             .activation = {}};
  problem.precision = precision;
  std::vector<reference::RankInputs> inputs;
  std::vector<reference::Weights> routed;
  for (auto& rank : data) {
    reference::RankInputs in;
    in.num_tokens = rank.num_tokens;
    in.x = bf16_to_double(rank.x);
    in.topk_idx = rank.topk_idx;
    in.topk_weights.assign(rank.topk_weights.begin(), rank.topk_weights.end());
    in.d_out = bf16_to_double(rank.d_out);
    inputs.push_back(in);
    routed.push_back({bf16_to_double(rank.w_gate), bf16_to_double(rank.w_up), bf16_to_double(rank.w_down)});
  }
  const reference::Weights shared = {bf16_to_double(data[0].ws_gate), bf16_to_double(data[0].ws_up),
                                     bf16_to_double(data[0].ws_down)};
  const auto expected_out = reference::forward(problem, inputs, routed, shared);
  const auto expected_grads = reference::backward(problem, inputs, routed, shared);
  for (int r = 0; r < R; ++r) {
    EXPECT_EQ(bf16_to_double(data[r].out), expected_out[r].out) << "out of rank " << r;
    EXPECT_EQ(bf16_to_double(data[r].d_x), expected_grads[r].d_x) << "d_x of rank " << r;
    for (size_t i = 0; i < data[r].d_w_down.size(); ++i)
      ASSERT_EQ(data[r].d_w_down[i], static_cast<float>(expected_grads[r].d_routed.down[i]))
          << "d_w_down " << i;
    for (size_t i = 0; i < data[r].d_topk_weights.size(); ++i)
      ASSERT_EQ(data[r].d_topk_weights[i], static_cast<float>(expected_grads[r].d_topk_weights[i]));
  }
}

TEST(Api, ForwardBackwardOverTwoRanksEqualsReference) {
  expect_api_equals_reference(Precision::kBF16);
}

TEST(Api, Fp8ForwardBackwardOverTwoRanksEqualsTheFp8Reference) {
  expect_api_equals_reference(Precision::kFP8);
}

TEST(Api, Fp8WithoutQuantizedWeightsIsRejected) {
  const Shape shape = small_shape(1);
  RankData data(shape, 16, 0, 3);
  Config config;
  config.precision = Precision::kFP8;
  Workspace workspace(Group::create_cpu(1)[0], shape, config);
  try {
    forward(workspace, data.forward_args(shape));
    FAIL() << "an fp8 forward without routed_fp8 was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("routed_fp8"), std::string::npos) << error.what();
  }
  for (uint16_t bits : data.out) ASSERT_EQ(bits, kPoisonBf16) << "out was written";
}

// One rank passes a bad argument: every rank fails with a message naming it, and no output is written.
void expect_rejected(const std::function<void(ForwardArgs&)>& corrupt, const std::string& needle) {
  const int R = 2;
  const Shape shape = small_shape(R);
  std::vector<RankData> data;
  for (int r = 0; r < R; ++r) data.emplace_back(shape, 16, r, 3);
  auto groups = Group::create_cpu(R);
  auto errors = on_every_rank(R, [&](int r) {
    Workspace workspace(groups[r], shape, Config{});
    ForwardArgs args = data[r].forward_args(shape);
    if (r == 1) corrupt(args);
    forward(workspace, args);
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_NE(errors[r].find(needle), std::string::npos) << "rank " << r << " said: " << errors[r];
    for (uint16_t bits : data[r].out)
      ASSERT_EQ(bits, kPoisonBf16) << "an output was written despite the error";
  }
}

TEST(Api, RejectsExpertIdOutOfRange) {
  expect_rejected([](ForwardArgs& args) { args.topk_idx.as<int32_t>()[5] = 8; }, "'topk_idx'[2, 1] = 8");
}
TEST(Api, RejectsWrongDtype) {
  expect_rejected([](ForwardArgs& args) { args.topk_weights.dtype = DType::kBF16; }, "'topk_weights'");
}
TEST(Api, RejectsWrongShape) {
  expect_rejected([](ForwardArgs& args) { args.routed.down.shape = {4, 64, 32}; }, "'routed.down'");
}
TEST(Api, RejectsMisalignedPointer) {
  expect_rejected([](ForwardArgs& args) { args.x.data = static_cast<char*>(args.x.data) + 2; }, "16-byte");
}
TEST(Api, RejectsTooManyTokens) {
  expect_rejected([](ForwardArgs& args) { args.x.shape[0] = 41; }, "max_tokens = 40");
}
TEST(Api, RejectsMissingSharedWeights) {
  expect_rejected([](ForwardArgs& args) { args.shared = {}; }, "'shared.gate' is missing");
}
TEST(Api, RejectsAliasedOutput) {
  expect_rejected([](ForwardArgs& args) { args.out.data = args.x.data; }, "'out' overlaps");
}

TEST(Api, RejectsBadShapesWithTheFieldNamed) {
  Shape shape = small_shape(1);
  shape.num_topk = 9;
  EXPECT_THROW(
      {
        try {
          validate(shape);
        } catch (const Error& error) {
          EXPECT_NE(std::string(error.what()).find("shape.num_topk = 9"), std::string::npos) << error.what();
          throw;
        }
      },
      Error);
  shape = small_shape(3);
  EXPECT_THROW(validate(shape), Error);  // 8 experts over 3 ranks
  shape = small_shape(1);
  shape.hidden = 100;
  EXPECT_THROW(validate(shape), Error);  // not a multiple of 64
}

TEST(Api, MismatchedShapesAcrossRanksFailOnEveryRank) {
  auto groups = Group::create_cpu(2);
  auto errors = on_every_rank(2, [&](int r) {
    Shape shape = small_shape(2);
    if (r == 1) shape.hidden = 128;
    Workspace workspace(groups[r], shape, Config{});
  });
  for (const auto& error : errors) EXPECT_NE(error.find("same Shape and Config"), std::string::npos) << error;
}

TEST(Api, BackwardBeforeForwardIsRejected) {
  const Shape shape = small_shape(1);
  RankData data(shape, 8, 0, 1);
  auto groups = Group::create_cpu(1);
  Workspace workspace(groups[0], shape, Config{});
  try {
    backward(workspace, data.backward_args(shape));
    FAIL() << "backward without forward must throw";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("run forward first"), std::string::npos) << error.what();
  }
  for (uint16_t bits : data.d_x) ASSERT_EQ(bits, kPoisonBf16);
}

TEST(Api, PeerThatNeverArrivesTimesOut) {
  setenv("POUNCE_PEER_TIMEOUT_S", "0.5", 1);
  auto groups = Group::create_cpu(2);
  const Shape shape = small_shape(2);
  try {
    Workspace workspace(groups[0], shape, Config{});  // rank 1 never calls
    FAIL() << "a missing peer must end the call";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("a peer never called"), std::string::npos) << error.what();
  }
  unsetenv("POUNCE_PEER_TIMEOUT_S");
}

TEST(Api, RecomputeThenBackwardMatchesForwardThenBackward) {
  const Shape shape = small_shape(1);
  RankData first(shape, 30, 0, 11), second(shape, 30, 0, 11);
  auto groups = Group::create_cpu(1);
  Workspace workspace(groups[0], shape, Config{});
  forward(workspace, first.forward_args(shape));
  backward(workspace, first.backward_args(shape));
  recompute_forward_context(workspace, second.forward_args(shape));
  backward(workspace, second.backward_args(shape));
  EXPECT_EQ(first.d_x, second.d_x);
  for (uint16_t bits : second.out) ASSERT_EQ(bits, kPoisonBf16) << "recompute must not write out";
}

TEST(Api, AccumulatesWeightGradsIntoMainGrad) {
  const Shape shape = small_shape(1);
  RankData data(shape, 24, 0, 5);
  auto groups = Group::create_cpu(1);
  Workspace workspace(groups[0], shape, Config{});
  forward(workspace, data.forward_args(shape));
  BackwardArgs args = data.backward_args(shape);
  backward(workspace, args);
  const std::vector<float> once = data.d_w_up;
  args.accumulate_weight_grads = true;
  backward(workspace, args);
  for (size_t i = 0; i < once.size(); ++i) ASSERT_EQ(data.d_w_up[i], once[i] + once[i]);
}

TEST(Api, WorkspaceSizeGrowsWithTokens) {
  Shape shape = small_shape(2);
  shape.max_tokens = 4096;  // large enough that the per-token regions dominate the per-expert padding
  const int64_t small = Workspace::bytes_required(shape, Config{}).total();
  shape.max_tokens *= 4;
  EXPECT_GT(Workspace::bytes_required(shape, Config{}).total(), 3 * small);
}

TEST(Api, WrapsDlpackTensorsAndRejectsStrided) {
  int64_t shape[2] = {4, 64};
  int64_t strides[2] = {128, 1};
  std::vector<uint16_t> storage(4 * 128);
  DLTensor tensor{storage.data(), {kDLCPU, 0}, 2, {kDLBfloat, 16, 1}, shape, nullptr, 0};
  TensorView view = TensorView::from_dlpack(tensor, "x");
  EXPECT_EQ(view.dtype, DType::kBF16);
  EXPECT_EQ(view.shape, (std::vector<int64_t>{4, 64}));
  tensor.strides = strides;
  EXPECT_THROW(TensorView::from_dlpack(tensor, "x"), Error);
  // No elements, any strides (numpy reports 0 tokens x 64 with strides {0, 1}): nothing to lay out.
  int64_t empty_shape[2] = {0, 64};
  int64_t empty_strides[2] = {0, 1};
  tensor.shape = empty_shape;
  tensor.strides = empty_strides;
  EXPECT_EQ(TensorView::from_dlpack(tensor, "x").shape, (std::vector<int64_t>{0, 64}));
}

}  // namespace
}  // namespace pounce
