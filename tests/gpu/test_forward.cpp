// The forward through the public API, on Config's kernel path (the fused kernel), against the CPU reference
// of the whole EP group: the shape matrix of docs/design.md §6 (ranks 1, 2, 4, 8 where GPUs allow; tokens 0,
// 1, 127, 4096; top-k 1, 2, 4, 8; T not a multiple of BLOCK_M, unequal T per rank, a rank without tokens),
// every routing of gpu_fixtures.h (uniform with -1 slots, all tokens to one expert, few experts, sparse),
// int32 and int64 topk_idx, shared expert, SwiGLU and GPT-OSS activations with and without clamps, and CUDA
// graph replay against eager. Each call runs twice (bitwise equal) and recompute_forward_context rebuilds
// its context; the schedule must equal the reference's exactly, y and out within rounding-order noise
// (forward_harness.h). The staged chain against the fused kernel is test_fused_forward.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "forward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {
namespace {

constexpr ForwardMode kEager = ForwardMode::kEagerTwice;

TEST(StagedForward, OneRankSmall) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(100, 128, 64, 4, 2, 0, 1), Activation::swiglu(), 11);
  check_forward(m,
                {random_routing({100}, 1), with_int64_idx(random_routing({37}, 2)), random_routing({0}, 3),
                 all_to_one_expert({1}, 4), few_experts({100}, 5)},
                kEager);
}

TEST(StagedForward, OneRankMediumSharedGptOss) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(600, 256, 192, 8, 4, 128, 1), Activation::gpt_oss(), 12);
  check_forward(
      m, {with_int64_idx(random_routing({513}, 6)), sparse_routing({600}, 7), all_to_one_expert({129}, 8)},
      kEager);
}

TEST(StagedForward, TwoRanksSmallShared) {
  SKIP_UNLESS_GPUS(2);
  const Model m = make_model(make_shape(200, 128, 64, 8, 2, 64, 2), Activation::swiglu(), 13);
  check_forward(m,
                {random_routing({100, 37}, 9), with_int64_idx(random_routing({200, 200}, 10)),
                 random_routing({0, 130}, 11), random_routing({0, 0}, 12), sparse_routing({1, 127}, 13)},
                kEager);
}

TEST(StagedForward, TwoRanksMediumAdversarial) {
  SKIP_UNLESS_GPUS(2);
  const Model m =
      make_model(make_shape(1000, 256, 128, 16, 8, 0, 2), clamped(Activation::swiglu(), 1.5f), 14);
  check_forward(m,
                {random_routing({1000, 777}, 15), all_to_one_expert({1000, 1000}, 16),
                 with_int64_idx(few_experts({300, 999}, 17)), sparse_routing({5, 1000}, 18)},
                kEager);
}

// The large end of the docs/design.md §6 shape matrix: 4096 tokens per rank, top-1 and top-8, shared expert.
TEST(StagedForward, TwoRanksLargeTopOneAndTopEight) {
  SKIP_UNLESS_GPUS(2);
  for (int64_t k : {1, 8}) {
    const Model m = make_model(make_shape(4096, 256, 128, 16, k, 128, 2), Activation::swiglu(), 20 + k);
    check_forward(m, {random_routing({4096, 4096}, 21), with_int64_idx(all_to_one_expert({4096, 127}, 22))},
                  kEager, "two ranks large k=" + std::to_string(k));
  }
}

// Issue #7: 4 and 8 ranks where that many GPUs are visible: more peers in the routing exchange, schedule
// and transfers, unequal T per rank and a rank without tokens.
TEST(StagedForward, FourAndEightRanks) {
  SKIP_UNLESS_GPUS(4);
  for (int R : visible_rank_counts({4, 8})) {
    const Model m = make_model(make_shape(300, 256, 128, 2 * R, 4, 64, R), Activation::swiglu(), 40 + R);
    check_forward(m, many_rank_calls(R, 300, 1, 41), kEager, std::to_string(R) + " ranks");
  }
}

TEST(StagedForward, CudaGraphReplaysNewRouting) {
  SKIP_UNLESS_GPUS(1);
  const int R = std::min(2, visible_gpus());
  const Model m = make_model(make_shape(256, 128, 128, 8, 4, 64, R), Activation::swiglu(), 15);
  // Run 0 replays the graph captured on call 0 (same T per rank, new routing), run 1 is eager:
  // check_forward_call demands bitwise equality and the reference.
  check_forward(m, graph_calls(R, 21), ForwardMode::kGraphVsEager);
}

}  // namespace
}  // namespace pounce::gpu_test
