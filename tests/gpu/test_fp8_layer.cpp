// The FP8 layer (docs/design.md §1 "FP8 mode") through the public API on the GPU backend: workspaces of
// Config::precision = kFP8 on the staged kernel path, the routed weights passed both as bf16 and as
// ForwardArgs::routed_fp8, quantized on the GPU by pounce::quantize_weights_fp8 (gpu_fixtures.h's
// DeviceWeights), the shared expert in BF16. Every case runs on KernelPath::kStaged and on kAuto, and the
// two must agree bitwise; so must kFused and the default Config's paths (on GPUs FP8 runs the staged kernels
// whatever kernel_path says, include/pounce/config.h), and the smallest macrobatch ring. Each run goes
// through the forward and backward harnesses at Precision::kFP8 (forward_harness.h, backward_harness.h):
// fresh inputs per call, outputs poisoned before every run, every call twice and bitwise equal,
// recompute_forward_context bitwise, the schedule exactly the reference's; out, y, d_x, d_topk_weights and
// the routed and shared weight gradients (fp32, bf16 and accumulated into main_grad) within rounding-order
// noise of reference::forward / backward of the FP8 layer (max|gpu - ref64| <= 2 * max|ref_bf16 - ref64| +
// atol, ref64 the FP8 reference in kFp64 numerics: the same quantization points, no bf16 rounding), and
// within the FP8 error budget of the BF16 reference (relative error <= 0.1 per tensor, gradient cosine
// similarity >= 0.996).
//
// Cases: the BF16 staged tests' matrix (test_forward.cpp, test_backward.cpp) — 1 and 2 ranks, tokens 0, 1,
// 127, 4096 and T not a multiple of 128, unequal T per rank and a rank without tokens, top-k 1 to 8, with
// and without a shared expert, SwiGLU and GPT-OSS, clamped where the data reaches the limit, every routing
// (random with -1 slots, all tokens to one expert, few experts so that others are empty, sparse), int32 and
// int64 ids — with H and I multiples of 64 that leave partial 128-blocks (H = 192, I = 64 and 192); CUDA
// graph replay of the forward and of forward + backward (also with the smallest macrobatch ring) against
// eager; a missing routed_fp8 rejected.
//
// Clamps are 2.0 here, not the BF16 tests' 1.0 and 1.5: g is about N(0, 0.67) on this data, and where the
// FP8 and BF16 layers put g or u on different sides of the limit a gradient flips between 0 and its full
// value; at 1.5 that alone costs d_w_gate its 0.996 cosine with the BF16 layer, at 2.0 (0.3 % of g beyond
// it) the clamp is still reached and the budget holds (tests/cpu/test_reference_fp8_layer.cpp).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backward_harness.h"
#include "forward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {
namespace {

constexpr float kClamp = 2.0f;

Config fp8_config(KernelPath path) {
  Config config;
  config.precision = Precision::kFP8;
  config.kernel_path = config.backward_kernel_path = path;
  return config;
}

// The calls on the staged path, then on kAuto: each checked against the reference, the two bitwise equal.
void check_fp8_forward(const Model& m, const std::vector<Call>& calls,
                       const std::string& name = current_test_name()) {
  const ForwardResults staged =
      check_forward(m, calls, ForwardMode::kEagerTwice, name + " staged", fp8_config(KernelPath::kStaged));
  const ForwardResults automatic =
      check_forward(m, calls, ForwardMode::kEagerTwice, name + " auto", fp8_config(KernelPath::kAuto));
  expect_same_forward(staged, automatic, name + ": kAuto against kStaged");
}

void check_fp8_backward(const Model& m, const std::vector<Call>& calls,
                        const std::string& name = current_test_name()) {
  const BackwardResults staged =
      check_backward(m, calls, false, name + " staged", fp8_config(KernelPath::kStaged));
  const BackwardResults automatic =
      check_backward(m, calls, false, name + " auto", fp8_config(KernelPath::kAuto));
  expect_same_backward(staged, automatic, name + ": kAuto against kStaged");
}

// ---- forward ----------------------------------------------------------------------------------------------

// I = 64: the down GEMM's only K block and a's only 1x128 block are half full.
TEST(Fp8StagedForward, OneRankSmall) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(100, 128, 64, 4, 2, 0, 1), Activation::swiglu(), 211);
  check_fp8_forward(m, {random_routing({100}, 212), with_int64_idx(random_routing({37}, 213)),
                        random_routing({0}, 214), all_to_one_expert({1}, 215), few_experts({100}, 216)});
}

// H = 192, I = 192: a partial second block along both GEMM axes (x_q, a_q, the weights' 128x128 grid).
TEST(Fp8StagedForward, OneRankMediumSharedGptOssClamp) {
  SKIP_UNLESS_GPUS(1);
  const Model m =
      make_model(make_shape(600, 192, 192, 8, 4, 128, 1), clamped(Activation::gpt_oss(), kClamp), 221);
  check_fp8_forward(m, {with_int64_idx(random_routing({513}, 222)), sparse_routing({600}, 223),
                        all_to_one_expert({129}, 224), few_experts({600}, 225)});
}

// The large end of the shape matrix on one GPU: 4096 tokens in top-8, every token's slot 0 to one expert.
TEST(Fp8StagedForward, OneRankLargeTopEight) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(4096, 256, 128, 8, 8, 128, 1), Activation::swiglu(), 231);
  check_fp8_forward(m, {random_routing({4096}, 232), with_int64_idx(all_to_one_expert({4096}, 233))});
}

TEST(Fp8StagedForward, TwoRanksSmallShared) {
  SKIP_UNLESS_GPUS(2);
  const Model m = make_model(make_shape(200, 128, 64, 8, 2, 64, 2), Activation::swiglu(), 241);
  check_fp8_forward(
      m, {random_routing({100, 37}, 242), with_int64_idx(random_routing({200, 200}, 243)),
          random_routing({0, 130}, 244), random_routing({0, 0}, 245), sparse_routing({1, 127}, 246)});
}

TEST(Fp8StagedForward, TwoRanksMediumAdversarial) {
  SKIP_UNLESS_GPUS(2);
  const Model m =
      make_model(make_shape(1000, 256, 128, 16, 8, 0, 2), clamped(Activation::swiglu(), kClamp), 251);
  check_fp8_forward(m, {random_routing({1000, 777}, 252), all_to_one_expert({1000, 1000}, 253),
                        with_int64_idx(few_experts({300, 999}, 254)), sparse_routing({5, 1000}, 255)});
}

TEST(Fp8StagedForward, TwoRanksLargeTopOneAndTopEight) {
  SKIP_UNLESS_GPUS(2);
  for (int64_t k : {1, 8}) {
    const Model m = make_model(make_shape(4096, 256, 128, 16, k, 128, 2), Activation::swiglu(), 260 + k);
    check_fp8_forward(
        m, {random_routing({4096, 4096}, 271), with_int64_idx(all_to_one_expert({4096, 127}, 272))},
        "two ranks large k=" + std::to_string(k));
  }
}

// The graph captured on call 0 on the kAuto path, replayed with new routing, against eager
// (forward_harness.h).
TEST(Fp8StagedForward, CudaGraphReplaysNewRouting) {
  SKIP_UNLESS_GPUS(1);
  const int R = std::min(2, visible_gpus());
  const Model m = make_model(make_shape(256, 128, 128, 8, 4, 64, R), Activation::swiglu(), 281);
  check_forward(m, graph_calls(R, 282), ForwardMode::kGraphVsEager, current_test_name(),
                fp8_config(KernelPath::kAuto));
}

// ---- backward ---------------------------------------------------------------------------------------------

TEST(Fp8StagedBackward, OneRankSwiGLU) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(300, 256, 128, 8, 2, 0, 1), Activation::swiglu(), 311);
  check_fp8_backward(m, {random_routing({300}, 312), with_int64_idx(random_routing({1}, 313)),
                         random_routing({0}, 314), all_to_one_expert({127}, 315), few_experts({300}, 316)});
}

// H = 192, I = 192: partial 128-blocks in every quantized operand, both orientations of the weights and the
// token-axis copies' columns.
TEST(Fp8StagedBackward, OneRankSharedGptOssClamp) {
  SKIP_UNLESS_GPUS(1);
  const Model m =
      make_model(make_shape(300, 192, 192, 8, 4, 128, 1), clamped(Activation::gpt_oss(), kClamp), 321);
  check_fp8_backward(m, {random_routing({300}, 322), with_int64_idx(sparse_routing({127}, 323)),
                         all_to_one_expert({1}, 324)});
}

TEST(Fp8StagedBackward, TwoRanksSharedTopEightSwiGLUClamp) {
  SKIP_UNLESS_GPUS(2);
  const Model m =
      make_model(make_shape(300, 256, 128, 8, 8, 128, 2), clamped(Activation::swiglu(), kClamp), 331);
  check_fp8_backward(m, {random_routing({0, 300}, 332), with_int64_idx(random_routing({127, 1}, 333)),
                         all_to_one_expert({300, 127}, 334), few_experts({300, 300}, 335)});
}

TEST(Fp8StagedBackward, TwoRanksTopOneGptOssClamp) {
  SKIP_UNLESS_GPUS(2);
  const Model m =
      make_model(make_shape(300, 256, 192, 8, 1, 0, 2), clamped(Activation::gpt_oss(), kClamp), 341);
  check_fp8_backward(m, {random_routing({300, 127}, 342), sparse_routing({1, 0}, 343)});
}

// Forward + backward captured once, replayed with each call's routing (backward_harness.h): on the kAuto path
// with the worst-case ring, and on the staged path with the smallest macrobatch ring (every possible
// macrobatch's launches are in the graph, those past the call's count find no rows), which must give the
// worst case's bits (FP8 rows replay like BF16 ones; the token-axis blocks start at segment starts either
// way).
TEST(Fp8StagedBackward, CudaGraphReplaysForwardAndBackward) {
  SKIP_UNLESS_GPUS(1);
  const int R = std::min(2, visible_gpus());
  const Model m = make_model(make_shape(256, 256, 128, 8, 4, 128, R), Activation::swiglu(), 351);
  const std::vector<Call> calls = graph_calls(R, 352);
  const BackwardResults worst = check_backward(m, calls, true, "cuda graph", fp8_config(KernelPath::kAuto));
  Config ringed = fp8_config(KernelPath::kStaged);
  ringed.macrobatch_size = smallest_ring(m.shape);
  const BackwardResults ring = check_backward(m, calls, true, "cuda graph, macrobatch ring", ringed);
  expect_same_backward(worst, ring, "smallest macrobatch ring against the worst case");
}

// kFused, and the default Config's paths (kFused forward, kAuto backward), give the staged chain's bits.
TEST(Fp8Layer, EveryKernelPathGivesTheStagedBits) {
  SKIP_UNLESS_GPUS(1);
  const int R = std::min(2, visible_gpus());
  const Model m = make_model(make_shape(300, 256, 128, 8, 4, 128, R), Activation::swiglu(), 371);
  const std::vector<int64_t> tokens = tokens_per_rank(R, 300, 127);
  const std::vector<Call> calls = {random_routing(tokens, 372), few_experts(tokens, 373)};
  const BackwardResults staged = check_backward(m, calls, false, "staged", fp8_config(KernelPath::kStaged));
  Config defaults;
  defaults.precision = Precision::kFP8;
  expect_same_backward(staged, check_backward(m, calls, false, "default paths", defaults),
                       "default kernel paths against kStaged");
  expect_same_backward(staged, check_backward(m, calls, false, "fused", fp8_config(KernelPath::kFused)),
                       "kFused against kStaged");
}

// ---- arguments --------------------------------------------------------------------------------------------

// An FP8 workspace without ForwardArgs::routed_fp8: forward, recompute_forward_context and backward each
// throw a pounce::Error that names the argument and the fix, and write no output.
TEST(Fp8Layer, MissingRoutedFp8IsRejected) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 128, 64, 4, 2, 64, 1), Activation::swiglu(), 361);
  const Shape& s = m.shape;
  const Call call = random_routing({50}, 362);
  const RankData data = make_rank_data(s, call, 0);
  const int64_t T = call.num_tokens[0];
  run_ranks(1, [&](const Group& group, int rank) {
    Workspace workspace(group, s, fp8_config(KernelPath::kStaged));
    DeviceWeights weights(m, rank, rank, Precision::kFP8);
    DeviceInputs in(s);
    DeviceBackward grads(s, rank);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    in.upload(s, data, false, stream);
    grads.upload_d_out(data.d_out, stream);
    ForwardArgs missing = in.args(s, T, false, rank);
    missing.routed = weights.routed;
    missing.shared = weights.shared;
    auto expect_rejected = [&](const std::string& what, const std::function<void()>& launch) {
      try {
        launch();
        ADD_FAILURE() << what << " accepted an fp8 workspace's call without routed_fp8";
      } catch (const Error& error) {
        const std::string message = error.what();
        EXPECT_NE(message.find("routed_fp8"), std::string::npos) << what << ": " << message;
        EXPECT_NE(message.find("quantize_weights_fp8"), std::string::npos) << what << ": " << message;
      }
    };
    in.out.poison(stream);
    expect_rejected("forward", [&] { forward(workspace, missing, stream); });
    expect_rejected("recompute_forward_context",
                    [&] { recompute_forward_context(workspace, missing, stream); });
    CUDA_OK(cudaStreamSynchronize(stream));
    const std::vector<uint16_t> out = download<uint16_t>(in.out.ptr, T * s.hidden);
    EXPECT_EQ(count_unpoisoned(out.data(), out.data() + out.size()), 0) << "a rejected forward wrote out";

    // With the quantized weights the forward runs; the backward's inputs need them as well.
    ForwardArgs quantized = missing;
    quantized.routed_fp8 = weights.routed_fp8;
    forward(workspace, quantized, stream);
    CUDA_OK(cudaStreamSynchronize(stream));
    grads.prepare(GradMode::kStoreF32, {}, stream);
    expect_rejected("backward",
                    [&] { backward(workspace, grads.args(missing, T, GradMode::kStoreF32), stream); });
    CUDA_OK(cudaStreamSynchronize(stream));
    const Snapshot untouched = grads.read(GradMode::kStoreF32, T);
    for (int o = 0; o < kNumOutputs; ++o) {
      const std::vector<uint8_t>& bytes = untouched.outputs[o];
      EXPECT_EQ(count_unpoisoned(bytes.data(), bytes.data() + bytes.size()), 0)
          << "a rejected backward wrote output " << o;
    }
    CUDA_OK(cudaStreamDestroy(stream));
  });
}

}  // namespace
}  // namespace pounce::gpu_test
