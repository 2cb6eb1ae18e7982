// Native weight layouts read in place and frozen experts, on the CPU backend (docs/design.md §5):
//   - transformers' fused gate_up [El, 2I, H] passed as two row-strided views (gate = [:, :I], up = [:, I:]),
//     its gradient written into the caller's [El, 2I, H] buffer through the same views;
//   - interleaved rows (gate = [:, 0::2], up = [:, 1::2]) as weights;
//   - layouts the kernels cannot write or read (strided gradients other than the halves, transposed views)
//     rejected with the argument named;
//   - weight gradients left empty are not computed, and d_x is bitwise what a full backward gives.
// Every result is compared bitwise with the same call on dense separate tensors: a backend that ignored a
// stride would read or write other rows.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "api_fixtures.h"
#include "pounce/pounce.h"
#include "reference/reference.h"

namespace pounce {
namespace {

using api_testing::on_every_rank;
using api_testing::RankData;
using api_testing::small_shape;

// [El, 2I, H] from gate and up [El, I, H]: gate rows then up rows per expert (transformers' gate_up_proj), or
// alternating rows (interleaved).
template <typename T>
std::vector<T> fuse_gate_up(const std::vector<T>& gate, const std::vector<T>& up, int64_t El, int64_t I,
                            int64_t H, bool interleaved) {
  std::vector<T> fused(2 * El * I * H);
  for (int64_t e = 0; e < El; ++e)
    for (int64_t i = 0; i < I; ++i)
      for (int64_t h = 0; h < H; ++h) {
        const int64_t gate_row = interleaved ? 2 * i : i, up_row = interleaved ? 2 * i + 1 : I + i;
        fused[(e * 2 * I + gate_row) * H + h] = gate[(e * I + i) * H + h];
        fused[(e * 2 * I + up_row) * H + h] = up[(e * I + i) * H + h];
      }
  return fused;
}

// The gate and up views of a fused [El, 2I, H] buffer.
std::pair<TensorView, TensorView> gate_up_views(void* fused, DType dtype, int64_t El, int64_t I, int64_t H,
                                                bool interleaved) {
  char* base = static_cast<char*>(fused);
  const int64_t element = size_of(dtype);
  TensorView gate(base, dtype, {El, I, H});
  TensorView up(base + (interleaved ? H : I * H) * element, dtype, {El, I, H});
  gate.strides = up.strides =
      interleaved ? std::vector<int64_t>{2 * I * H, 2 * H, 1} : std::vector<int64_t>{2 * I * H, H, 1};
  return {gate, up};
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return {};
}

// Forward and backward over `ranks` CPU ranks twice: dense separate weights (`baseline`), then the fused
// layout's views of the same values (`fused`); returns nothing, compares bitwise.
void check_fused_gate_up(int ranks, bool interleaved_weights, bool accumulate) {
  const Shape shape = small_shape(ranks);
  const int64_t El = shape.num_local_experts(), I = shape.intermediate, H = shape.hidden;
  std::vector<RankData> baseline, fused;
  for (int r = 0; r < ranks; ++r) {
    baseline.emplace_back(shape, 30 + r, r, 21);
    fused.emplace_back(shape, 30 + r, r, 21);
  }
  std::vector<std::vector<uint16_t>> w_gate_up(ranks);
  std::vector<std::vector<float>> d_gate_up(ranks);
  for (int r = 0; r < ranks; ++r) {
    w_gate_up[r] = fuse_gate_up(fused[r].w_gate, fused[r].w_up, El, I, H, interleaved_weights);
    d_gate_up[r].assign(2 * El * I * H, accumulate ? 0.5f : NAN);
    if (accumulate) {
      baseline[r].d_w_gate.assign(El * I * H, 0.5f);
      baseline[r].d_w_up.assign(El * I * H, 0.5f);
      baseline[r].d_w_down.assign(El * H * I, 0.5f);
      fused[r].d_w_down.assign(El * H * I, 0.5f);
      baseline[r].d_ws_gate.assign(baseline[r].d_ws_gate.size(), 0.5f);
      baseline[r].d_ws_up.assign(baseline[r].d_ws_up.size(), 0.5f);
      baseline[r].d_ws_down.assign(baseline[r].d_ws_down.size(), 0.5f);
      fused[r].d_ws_gate.assign(fused[r].d_ws_gate.size(), 0.5f);
      fused[r].d_ws_up.assign(fused[r].d_ws_up.size(), 0.5f);
      fused[r].d_ws_down.assign(fused[r].d_ws_down.size(), 0.5f);
    }
  }
  for (bool use_fused : {false, true}) {
    auto groups = Group::create_cpu(ranks);
    const auto errors = on_every_rank(ranks, [&](int r) {
      Workspace workspace(groups[r], shape, Config{});
      RankData& data = use_fused ? fused[r] : baseline[r];
      BackwardArgs args = data.backward_args(shape);
      args.accumulate_weight_grads = accumulate;
      if (use_fused) {
        std::tie(args.inputs.routed.gate, args.inputs.routed.up) =
            gate_up_views(w_gate_up[r].data(), DType::kBF16, El, I, H, interleaved_weights);
        std::tie(args.d_routed.gate, args.d_routed.up) =
            gate_up_views(d_gate_up[r].data(), DType::kFP32, El, I, H, /*interleaved=*/false);
      }
      ForwardArgs forward_args = args.inputs;
      forward_args.out = TensorView(data.out.data(), DType::kBF16, {data.num_tokens, H});
      forward(workspace, forward_args);
      backward(workspace, args);
    });
    for (const std::string& error : errors) ASSERT_EQ(error, "");
  }
  for (int r = 0; r < ranks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_EQ(fused[r].out, baseline[r].out) << "out through the strided weight views differs";
    EXPECT_EQ(fused[r].d_x, baseline[r].d_x);
    EXPECT_EQ(fused[r].d_w_down, baseline[r].d_w_down);
    const std::vector<float> expected =
        fuse_gate_up(baseline[r].d_w_gate, baseline[r].d_w_up, El, I, H, /*interleaved=*/false);
    for (size_t n = 0; n < expected.size(); ++n)
      ASSERT_EQ(d_gate_up[r][n], expected[n]) << "d_gate_up element " << n << " (expert " << n / (2 * I * H)
                                              << ", row " << n / H % (2 * I) << ")";
  }
}

TEST(WeightLayouts, FusedGateUpReadAndWrittenInPlace) {
  check_fused_gate_up(1, /*interleaved_weights=*/false, /*accumulate=*/false);
}

TEST(WeightLayouts, FusedGateUpOverTwoRanksAccumulatingIntoMainGrad) {
  check_fused_gate_up(2, /*interleaved_weights=*/false, /*accumulate=*/true);
}

TEST(WeightLayouts, InterleavedRowsReadInPlace) {
  check_fused_gate_up(1, /*interleaved_weights=*/true, /*accumulate=*/false);
}

// A one-rank workspace and its call's arguments, for the rejection tests.
struct OneRank {
  Shape shape = small_shape(1);
  RankData data{shape, 16, 0, 3};
  std::vector<Group> groups = Group::create_cpu(1);
  Workspace workspace{groups[0], shape, Config{}};
  std::vector<uint16_t> w_gate_up;
  std::vector<float> d_gate_up;
  int64_t El = shape.num_local_experts(), I = shape.intermediate, H = shape.hidden;

  OneRank() {
    w_gate_up = fuse_gate_up(data.w_gate, data.w_up, El, I, H, false);
    d_gate_up.assign(2 * El * I * H, NAN);
    forward(workspace, data.forward_args(shape));
  }
  std::string backward_error(const BackwardArgs& args) {
    return error_of([&] { backward(workspace, args); });
  }
};

TEST(WeightLayouts, RejectsStridedGradientsOtherThanTheHalves) {
  OneRank one;
  BackwardArgs args = one.data.backward_args(one.shape);
  // Interleaved rows: the kernels write each gradient as dense matrices, or gate and up as the two halves.
  std::tie(args.d_routed.gate, args.d_routed.up) =
      gate_up_views(one.d_gate_up.data(), DType::kFP32, one.El, one.I, one.H, /*interleaved=*/true);
  std::string error = one.backward_error(args);
  EXPECT_NE(error.find("'d_routed.gate'"), std::string::npos) << error;
  EXPECT_NE(error.find("two halves of one [8, 128, 64] tensor"), std::string::npos) << error;
  // The halves swapped: up before gate.
  std::tie(args.d_routed.up, args.d_routed.gate) =
      gate_up_views(one.d_gate_up.data(), DType::kFP32, one.El, one.I, one.H, false);
  EXPECT_NE(one.backward_error(args).find("two halves"), std::string::npos);
  // Only the gate half strided, up dense elsewhere.
  args = one.data.backward_args(one.shape);
  args.d_routed.gate = gate_up_views(one.d_gate_up.data(), DType::kFP32, one.El, one.I, one.H, false).first;
  EXPECT_NE(one.backward_error(args).find("two halves"), std::string::npos);
  // A strided down gradient.
  args = one.data.backward_args(one.shape);
  std::vector<float> wide_down(2 * one.El * one.H * one.I, NAN);
  args.d_routed.down.data = wide_down.data();
  args.d_routed.down.strides = {2 * one.H * one.I, one.I, 1};
  error = one.backward_error(args);
  EXPECT_NE(error.find("d_routed.down"), std::string::npos) << error;
  for (float v : one.d_gate_up) ASSERT_TRUE(std::isnan(v)) << "a rejected call wrote a gradient";
}

TEST(WeightLayouts, RejectsStridedActivationsAndBadWeightStrides) {
  OneRank one;
  ForwardArgs args = one.data.forward_args(one.shape);
  args.x.strides = {2 * one.H, 1};
  args.x.shape = {8, one.H};
  std::string error = error_of([&] { forward(one.workspace, args); });
  EXPECT_NE(error.find("argument 'x'"), std::string::npos) << error;
  EXPECT_NE(error.find("only weights and their gradients may be strided"), std::string::npos) << error;

  args = one.data.forward_args(one.shape);
  args.routed.gate.strides = {one.I * one.H, 1, one.I};  // transposed: columns contiguous
  error = error_of([&] { forward(one.workspace, args); });
  EXPECT_NE(error.find("'routed.gate'"), std::string::npos) << error;
  EXPECT_NE(error.find("last dimension"), std::string::npos) << error;

  args = one.data.forward_args(one.shape);
  args.routed.up.strides = {one.I * one.H / 2, one.H, 1};  // experts overlap each other
  error = error_of([&] { forward(one.workspace, args); });
  EXPECT_NE(error.find("'routed.up'"), std::string::npos) << error;
  EXPECT_NE(error.find("overlap"), std::string::npos) << error;

  args = one.data.forward_args(one.shape);
  args.routed.up.strides = {one.I * one.H + 4, one.H, 1};  // 8 bytes: not a 16-byte step
  error = error_of([&] { forward(one.workspace, args); });
  EXPECT_NE(error.find("16-byte"), std::string::npos) << error;
}

// Aliasing is judged row by row for row-strided views: a buffer in the gap between a view's rows is free,
// one that touches a row is not.
TEST(WeightLayouts, OutputsInTheGapsOfStridedWeightsAreNotAliases) {
  OneRank one;
  const int64_t T = one.data.num_tokens, H = one.H, I = one.I;
  std::vector<uint16_t> storage(2 * one.El * I * H, 0);  // gate rows of expert 0 then a gap of I rows
  ForwardArgs args = one.data.forward_args(one.shape);
  args.routed.gate = gate_up_views(storage.data(), DType::kBF16, one.El, I, H, false).first;
  ASSERT_LE(T, I);
  args.out = TensorView(storage.data() + I * H, DType::kBF16, {T, H});  // inside the gap
  EXPECT_EQ(error_of([&] { forward(one.workspace, args); }), "");
  args.out = TensorView(storage.data() + (I - 1) * H, DType::kBF16, {T, H});  // starts on gate's last row
  const std::string error = error_of([&] { forward(one.workspace, args); });
  EXPECT_NE(error.find("'out' overlaps an input, argument 'routed.gate'"), std::string::npos) << error;
  BackwardArgs backward_args = one.data.backward_args(one.shape);
  std::tie(backward_args.d_routed.gate, backward_args.d_routed.up) =
      gate_up_views(one.d_gate_up.data(), DType::kFP32, one.El, I, H, false);
  EXPECT_EQ(one.backward_error(backward_args), "") << "the two halves share no element";
  backward_args.d_routed.down.data = one.d_gate_up.data() + 3 * I * H;  // on expert 1's up half
  EXPECT_NE(one.backward_error(backward_args).find("overlap"), std::string::npos);
}

TEST(WeightLayouts, DlpackRowStridedViews) {
  int64_t shape[3] = {4, 8, 64};
  int64_t halves[3] = {2 * 8 * 64, 64, 1};
  int64_t dense[3] = {8 * 64, 64, 1};
  int64_t transposed[3] = {8 * 64, 1, 8};
  std::vector<uint16_t> storage(2 * 4 * 8 * 64);
  DLTensor tensor{storage.data(), {kDLCPU, 0}, 3, {kDLBfloat, 16, 1}, shape, halves, 0};
  EXPECT_THROW(TensorView::from_dlpack(tensor, "w"), Error) << "strided views only where the caller allows";
  TensorView view = TensorView::from_dlpack(tensor, "w", StridePolicy::kRowStrided);
  EXPECT_EQ(view.strides, (std::vector<int64_t>{2 * 8 * 64, 64, 1}));
  EXPECT_EQ(view.span_bytes(), ((4 - 1) * 2 * 8 * 64 + 8 * 64) * 2);
  EXPECT_EQ(view.offset_of(8 * 64 + 65), 2 * 8 * 64 + 65);  // expert 1, row 1, column 1
  tensor.strides = dense;
  EXPECT_TRUE(TensorView::from_dlpack(tensor, "w", StridePolicy::kRowStrided).is_dense());
  tensor.strides = transposed;
  try {
    TensorView::from_dlpack(tensor, "w", StridePolicy::kRowStrided);
    FAIL() << "a transposed view must be rejected";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("transpose"), std::string::npos) << error.what();
  }
}

// ---- frozen experts
// ----------------------------------------------------------------------------------------

TEST(FrozenExperts, ReferenceSkipsTheWeightGradientsAndKeepsDx) {
  reference::Problem p;
  p.hidden = 64, p.intermediate = 64, p.num_experts = 4, p.num_topk = 2, p.shared_intermediate = 64;
  p.num_ranks = 2, p.activation = Activation::gpt_oss();
  const Shape shape = {.max_tokens = 20,
                       .hidden = 64,
                       .intermediate = 64,
                       .num_experts = 4,
                       .num_topk = 2,
                       .shared_intermediate = 64,
                       .num_ranks = 2};
  std::vector<reference::RankInputs> ranks(2);
  std::vector<reference::Weights> routed(2);
  reference::Weights shared;
  for (int r = 0; r < 2; ++r) {
    RankData data(shape, 20, r, 7);
    auto to_double = [](const std::vector<uint16_t>& bits) { return reference::bf16_to_double(bits); };
    ranks[r].num_tokens = 20;
    ranks[r].x = to_double(data.x);
    ranks[r].d_out = to_double(data.d_out);
    ranks[r].topk_idx = data.topk_idx;
    ranks[r].topk_weights.assign(data.topk_weights.begin(), data.topk_weights.end());
    routed[r] = {to_double(data.w_gate), to_double(data.w_up), to_double(data.w_down)};
    if (r == 0) shared = {to_double(data.ws_gate), to_double(data.ws_up), to_double(data.ws_down)};
  }
  const std::vector<reference::RankGradients> full = reference::backward(p, ranks, routed, shared);
  for (auto& rank : ranks) rank.routed_weight_grads = rank.shared_weight_grads = false;
  ranks[1].shared_weight_grads = true;  // rank 1 still trains its shared expert
  const std::vector<reference::RankGradients> frozen = reference::backward(p, ranks, routed, shared);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(frozen[r].d_x, full[r].d_x);
    EXPECT_EQ(frozen[r].d_topk_weights, full[r].d_topk_weights);
    EXPECT_TRUE(frozen[r].d_routed.gate.empty() && frozen[r].d_routed.up.empty() &&
                frozen[r].d_routed.down.empty())
        << "routed weight gradients were computed on rank " << r;
  }
  EXPECT_TRUE(frozen[0].d_shared.gate.empty());
  EXPECT_EQ(frozen[1].d_shared.gate, full[1].d_shared.gate);
  EXPECT_EQ(frozen[1].d_shared.down, full[1].d_shared.down);
}

TEST(FrozenExperts, BackwardWithoutWeightGradientOutputsWritesOnlyTheDataGradients) {
  const Shape shape = small_shape(2);
  std::vector<RankData> full, frozen;
  for (int r = 0; r < 2; ++r) {
    full.emplace_back(shape, 25, r, 9);
    frozen.emplace_back(shape, 25, r, 9);
  }
  for (bool freeze : {false, true}) {
    auto groups = Group::create_cpu(2);
    const auto errors = on_every_rank(2, [&](int r) {
      Workspace workspace(groups[r], shape, Config{});
      RankData& data = freeze ? frozen[r] : full[r];
      forward(workspace, data.forward_args(shape));
      BackwardArgs args = data.backward_args(shape);
      if (freeze) {
        args.d_routed = {};                          // frozen routed experts
        args.d_shared.gate = args.d_shared.up = {};  // only the shared down projection trains
      }
      backward(workspace, args);
    });
    for (const std::string& error : errors) ASSERT_EQ(error, "");
  }
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(frozen[r].d_x, full[r].d_x);
    EXPECT_EQ(frozen[r].d_topk_weights, full[r].d_topk_weights);
    EXPECT_EQ(frozen[r].d_ws_down, full[r].d_ws_down);
    for (float v : frozen[r].d_w_gate) ASSERT_TRUE(std::isnan(v)) << "a frozen gradient was written";
    for (float v : frozen[r].d_ws_up) ASSERT_TRUE(std::isnan(v)) << "a frozen gradient was written";
  }
}

}  // namespace
}  // namespace pounce
