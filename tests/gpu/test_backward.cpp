// The backward through the public API, on Config's kernel paths, against reference::backward of the whole EP
// group: one to eight ranks, top-1 to top-8, tokens 0, 1, 127, 300 with unequal T per rank, every routing
// of gpu_fixtures.h, int32 and int64 topk_idx, shared expert, SwiGLU and GPT-OSS with clamps the data
// reaches; CUDA graph replay of forward + backward (also with the smallest macrobatch ring on both paths);
// and scheduling knobs (chunks of local experts, communication SM counts) that must not change a bit. Each
// call runs every step of backward_harness.h: fp32, bf16 and accumulated weight gradients, repeated runs
// and recompute_forward_context bitwise equal, every tensor within the §6 bound of the reference. The fused
// kernel against the staged chain is test_fused_backward.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "backward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {
namespace {

TEST(StagedBackward, OneRankSwiGLU) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(300, 256, 128, 8, 2, 0, 1), Activation::swiglu(), 51);
  check_backward(m, {random_routing({300}, 52), with_int64_idx(random_routing({1}, 53)),
                     random_routing({0}, 54), all_to_one_expert({127}, 55), few_experts({300}, 56)});
}

// I = 192: the weight gradients' second 128-row tile is half empty.
TEST(StagedBackward, OneRankSharedGptOssClamp) {
  SKIP_UNLESS_GPUS(1);
  const Model m =
      make_model(make_shape(300, 256, 192, 8, 4, 128, 1), clamped(Activation::gpt_oss(), 1.0f), 61);
  check_backward(
      m, {random_routing({300}, 62), with_int64_idx(sparse_routing({127}, 63)), all_to_one_expert({1}, 64)});
}

TEST(StagedBackward, TwoRanksSharedTopEightSwiGLUClamp) {
  SKIP_UNLESS_GPUS(2);
  const Model m =
      make_model(make_shape(300, 256, 128, 8, 8, 128, 2), clamped(Activation::swiglu(), 1.5f), 71);
  check_backward(m, {random_routing({0, 300}, 72), with_int64_idx(random_routing({127, 1}, 73)),
                     all_to_one_expert({300, 127}, 74), few_experts({300, 300}, 75)});
}

TEST(StagedBackward, TwoRanksTopOneGptOssClamp) {
  SKIP_UNLESS_GPUS(2);
  const Model m = make_model(make_shape(300, 256, 192, 8, 1, 0, 2), clamped(Activation::gpt_oss(), 1.0f), 81);
  check_backward(m, {random_routing({300, 127}, 82), sparse_routing({1, 0}, 83)});
}

// Issue #7: 4 and 8 ranks where that many GPUs are visible.
TEST(StagedBackward, FourAndEightRanks) {
  SKIP_UNLESS_GPUS(4);
  for (int R : visible_rank_counts({4, 8})) {
    const Model m =
        make_model(make_shape(300, 256, 128, 2 * R, 4, 128, R), clamped(Activation::swiglu(), 1.5f), 130 + R);
    check_backward(m, many_rank_calls(R, 300, 127, 131), false, std::to_string(R) + " ranks");
  }
}

TEST(StagedBackward, CudaGraphReplaysForwardAndBackward) {
  SKIP_UNLESS_GPUS(1);
  const int R = std::min(2, visible_gpus());
  const Model m = make_model(make_shape(256, 256, 128, 8, 4, 128, R), Activation::swiglu(), 91);
  const std::vector<Call> calls = graph_calls(R, 92);  // same T per rank, new routing and data each call
  check_backward(m, calls, true);
  // With the smallest macrobatch ring, on both paths: every possible macrobatch's launches are in the graph,
  // those past the call's count find no rows.
  for (const KernelPath path : {KernelPath::kStaged, KernelPath::kFused}) {
    Config ringed;
    ringed.kernel_path = ringed.backward_kernel_path = path;
    ringed.macrobatch_size = smallest_ring(m.shape);
    check_backward(m, calls, true, std::string("cuda graph, macrobatch ring, ") + to_string(path), ringed);
  }
}

// Chunks of local experts (config.minibatch_size) and the communication SM counts only schedule the work:
// one chunk on 1 comm SM and one chunk per expert on 7 give bitwise-equal outputs and gradients.
TEST(StagedBackward, ChunksAndCommSmsDoNotChangeResults) {
  SKIP_UNLESS_GPUS(1);
  const int R = std::min(2, visible_gpus());
  const Model m = make_model(make_shape(300, 256, 128, 8, 4, 128, R), Activation::swiglu(), 121);
  const std::vector<int64_t> tokens = tokens_per_rank(R, 300, 127);
  const std::vector<Call> calls = {random_routing(tokens, 122), few_experts(tokens, 123)};
  Config one_chunk, many_chunks;
  one_chunk.minibatch_size = 10 * kBlockM;  // >= max_tokens * k: a single chunk
  one_chunk.forward_comm_sms = one_chunk.backward_comm_sms = 1;
  many_chunks.minibatch_size = kBlockM;  // clamped to one chunk per local expert
  many_chunks.forward_comm_sms = many_chunks.backward_comm_sms = 7;
  const BackwardResults a = check_backward(m, calls, false, "one chunk", one_chunk);
  const BackwardResults b = check_backward(m, calls, false, "a chunk per expert", many_chunks);
  for (size_t c = 0; c < calls.size(); ++c) {
    for (int r = 0; r < R; ++r) {
      const std::string where = "call " + std::to_string(c) + " rank " + std::to_string(r);
      ASSERT_FALSE(a[c][r].fp32_runs.empty() || b[c][r].fp32_runs.empty()) << where;
      EXPECT_EQ(bitwise_difference("out", a[c][r].out[0], b[c][r].out[0]), "")
          << where << ": forward outputs differ";
      EXPECT_EQ(snapshot_difference(a[c][r].fp32_runs[0].second, b[c][r].fp32_runs[0].second), "") << where;
    }
  }
}

}  // namespace
}  // namespace pounce::gpu_test
