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

#include "api_fixtures.h"
#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce {
namespace {

using reference::bf16_to_double;
using reference::float_to_bf16_bits;

using namespace pounce::api_testing;

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

// Two ranks of small_shape(2), 16 tokens each into `data`: `call(workspace, rank's data, rank)` on each
// rank's thread; returns each rank's error ("" = none).
std::vector<std::string> on_two_ranks(std::vector<RankData>& data,
                                      const std::function<void(Workspace&, RankData&, int)>& call) {
  const int R = 2;
  const Shape shape = small_shape(R);
  for (int r = 0; r < R; ++r) data.emplace_back(shape, 16, r, 3);
  auto groups = Group::create_cpu(R);
  return on_every_rank(R, [&](int r) {
    Workspace workspace(groups[r], shape, Config{});
    call(workspace, data[r], r);
  });
}

// One rank passes a bad argument: every rank fails with a message naming it, and no output is written.
void expect_rejected(const std::function<void(ForwardArgs&)>& corrupt, const std::string& needle) {
  const int R = 2;
  std::vector<RankData> data;
  auto errors = on_two_ranks(data, [&](Workspace& workspace, RankData& rank, int r) {
    ForwardArgs args = rank.forward_args(small_shape(R));
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

TEST(Api, RejectsOutputOverlappingRoutedWeights) {
  expect_rejected([](ForwardArgs& args) { args.out.data = args.routed.down.data; },
                  "'out' overlaps an input, argument 'routed.down'");
}
TEST(Api, RejectsOutputOverlappingSharedWeights) {
  expect_rejected([](ForwardArgs& args) { args.out.data = static_cast<uint16_t*>(args.shared.up.data) + 64; },
                  "'out' overlaps an input, argument 'shared.up'");
}
TEST(Api, RejectsOutputOverlappingTopkWeights) {
  expect_rejected([](ForwardArgs& args) { args.out.data = args.topk_weights.data; },
                  "'out' overlaps an input, argument 'topk_weights'");
}
TEST(Api, RejectsHostTensorWithAnotherDeviceIndex) {
  expect_rejected([](ForwardArgs& args) { args.topk_weights.device_id = 1; },
                  "'topk_weights' is fp32[16, 2] on cpu (device index 1)");
}
TEST(Api, RejectsCudaTensorOnTheCpuBackend) {
  expect_rejected([](ForwardArgs& args) { args.routed.up.device = DeviceKind::kCuda; },
                  "'routed.up' is bf16[4, 64, 64] on cuda:0 but the workspace runs on cpu");
}

// One rank passes a bad backward argument: every rank fails naming it, and no gradient is written.
void expect_backward_rejected(const std::function<void(BackwardArgs&)>& corrupt, const std::string& needle) {
  const int R = 2;
  const Shape shape = small_shape(R);
  std::vector<RankData> data;
  auto errors = on_two_ranks(data, [&](Workspace& workspace, RankData& rank, int r) {
    forward(workspace, rank.forward_args(shape));
    BackwardArgs args = rank.backward_args(shape);
    if (r == 1) corrupt(args);
    backward(workspace, args);
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_NE(errors[r].find(needle), std::string::npos) << "rank " << r << " said: " << errors[r];
    for (uint16_t bits : data[r].d_x) ASSERT_EQ(bits, kPoisonBf16) << "d_x was written despite the error";
    for (float value : data[r].d_topk_weights) ASSERT_TRUE(std::isnan(value)) << "d_topk_weights was written";
    for (const auto* grad : {&data[r].d_w_gate, &data[r].d_w_up, &data[r].d_w_down, &data[r].d_ws_down})
      for (float value : *grad) ASSERT_TRUE(std::isnan(value)) << "a weight gradient was written";
  }
}

TEST(Api, RejectsInputGradientOverlappingRoutedWeightGradient) {
  expect_backward_rejected([](BackwardArgs& args) { args.d_x.data = args.d_routed.gate.data; },
                           "arguments 'd_x' and 'd_routed.gate' overlap");
}
TEST(Api, RejectsInputGradientOverlappingSharedWeightGradient) {
  expect_backward_rejected([](BackwardArgs& args) { args.d_shared.up.data = args.d_x.data; },
                           "arguments 'd_x' and 'd_shared.up' overlap");
}
TEST(Api, RejectsTopkWeightGradientOverlappingInputGradient) {
  expect_backward_rejected([](BackwardArgs& args) { args.d_topk_weights.data = args.d_x.data; },
                           "arguments 'd_x' and 'd_topk_weights' overlap");
}
TEST(Api, RejectsWeightGradientsOverlappingEachOther) {
  expect_backward_rejected(
      [](BackwardArgs& args) { args.d_routed.up.data = static_cast<float*>(args.d_routed.gate.data) + 4; },
      "arguments 'd_routed.gate' and 'd_routed.up' overlap");
}
TEST(Api, RejectsSharedGradientOverlappingRoutedGradient) {
  expect_backward_rejected([](BackwardArgs& args) { args.d_shared.down.data = args.d_routed.down.data; },
                           "arguments 'd_routed.down' and 'd_shared.down' overlap");
}
TEST(Api, RejectsWeightGradientOverlappingItsWeight) {
  expect_backward_rejected(
      [](BackwardArgs& args) {
        args.d_routed.down.data = args.inputs.routed.down.data;
        args.d_routed.down.dtype = DType::kBF16;
      },
      "'d_routed.down' overlaps an input, argument 'routed.down'");
}
TEST(Api, RejectsInputGradientOverlappingOutputGradient) {
  expect_backward_rejected([](BackwardArgs& args) { args.d_x.data = args.d_out.data; },
                           "'d_x' overlaps an input, argument 'd_out'");
}
TEST(Api, RejectsGradientOnAnotherDeviceIndex) {
  expect_backward_rejected([](BackwardArgs& args) { args.d_routed.up.device_id = 2; },
                           "'d_routed.up' is fp32[4, 64, 64] on cpu (device index 2)");
}
TEST(Api, RejectsBackwardWithOtherTokensThanItsForward) {
  expect_backward_rejected(
      [](BackwardArgs& args) {
        for (TensorView* view : {&args.inputs.x, &args.inputs.topk_idx, &args.inputs.topk_weights,
                                 &args.d_out, &args.d_x, &args.d_topk_weights})
          view->shape[0] = 8;
      },
      "backward got 8 tokens but the saved forward had 16");
}

// Inputs may share memory (they are only read): x passed as d_out too is accepted.
TEST(Api, AcceptsInputsSharingMemory) {
  const Shape shape = small_shape(1);
  RankData data(shape, 16, 0, 3);
  Workspace workspace(Group::create_cpu(1)[0], shape, Config{});
  forward(workspace, data.forward_args(shape));
  BackwardArgs args = data.backward_args(shape);
  args.d_out.data = args.inputs.x.data;
  backward(workspace, args);
  for (uint16_t bits : data.d_x) ASSERT_NE(bits, kPoisonBf16);
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

// The CPU backend defers nothing: a failing call has already thrown, so check_errors (with or without
// synchronize, on any stream) finds nothing and is not collective (one rank alone may call it).
TEST(Api, CheckErrorsOnTheCpuBackendReturns) {
  const Shape shape = small_shape(2);
  auto groups = Group::create_cpu(2);
  auto errors = on_every_rank(2, [&](int r) {
    Workspace workspace(groups[r], shape, Config{});
    if (r == 0) {
      check_errors(workspace);
      check_errors(workspace, nullptr, /*synchronize=*/true);
    }
  });
  for (const auto& error : errors) ASSERT_EQ(error, "");
  const Shape one = small_shape(1);
  RankData data(one, 8, 0, 1);
  auto group = Group::create_cpu(1);
  Workspace workspace(group[0], one, Config{});
  EXPECT_THROW(backward(workspace, data.backward_args(one)), Error);  // reported by the call itself
  check_errors(workspace, nullptr, /*synchronize=*/true);
  forward(workspace, data.forward_args(one));
  check_errors(workspace);
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
