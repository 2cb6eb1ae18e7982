// The macrobatch ring (docs/design.md, "Macrobatch ring"): with the smallest ring
// (Config::macrobatch_size = num_ranks * max_tokens, padded to BLOCK_M) the routed experts run in several
// macrobatches. Forward: staged then fused, both against the CPU reference and fused == staged bitwise
// (forward_harness.h). Backward: the backward replays every macrobatch but the resident last (pull x,
// gate/up + activation), and every output and gradient (fp32, bf16, accumulated, after recompute) must be
// bitwise the worst-case workspace's, on both paths, both also meeting the reference (backward_harness.h).
// Routing: uniform top-4 over 16 experts (several macrobatches, experts without rows), one expert filling
// the ring, few experts, T = 0 on a rank. A ring too small for one expert's rows is test_faults.cpp's.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backward_harness.h"
#include "forward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {
namespace {

TEST(MacrobatchRing, ForwardMatchesReference) {
  SKIP_UNLESS_GPUS(1);
  for (int R : visible_rank_counts({1, 2})) {
    const Model m = make_model(make_shape(300, 128, 64, 16, 4, 64, R), Activation::swiglu(), 17);
    const std::vector<int64_t> tokens = tokens_per_rank(R, 300, 255);
    Config ringed;
    ringed.macrobatch_size = smallest_ring(m.shape);
    check_forward(
        m,
        {random_routing(tokens, 33), with_int64_idx(all_to_one_expert(tokens, 34)), few_experts(tokens, 35)},
        ForwardMode::kStagedVsFused, "ring of " + std::to_string(ringed.macrobatch_size) + " rows", ringed);
  }
}

TEST(MacrobatchRing, BackwardEqualsWorstCaseBitwise) {
  SKIP_UNLESS_GPUS(1);
  for (int R : visible_rank_counts({1, 2})) {
    const Model m =
        make_model(make_shape(300, 256, 128, 16, 4, 128, R), clamped(Activation::swiglu(), 1.5f), 161);
    const std::vector<Call> calls = {random_routing(tokens_per_rank(R, 300, 255), 162),
                                     all_to_one_expert(tokens_per_rank(R, 300, 300), 163),
                                     with_int64_idx(few_experts(tokens_per_rank(R, 0, 300), 164))};
    const int64_t ring = smallest_ring(m.shape);
    for (const KernelPath path : {KernelPath::kStaged, KernelPath::kFused}) {
      Config worst;
      worst.kernel_path = worst.backward_kernel_path = path;
      Config ringed = worst;
      ringed.macrobatch_size = ring;
      const std::string name = std::string(to_string(path)) + " ranks " + std::to_string(R);
      const BackwardResults a = check_backward(m, calls, false, "worst case, " + name, worst);
      const BackwardResults b =
          check_backward(m, calls, false, "ring of " + std::to_string(ring) + ", " + name, ringed);
      expect_same_backward(a, b, name);
    }
  }
}

}  // namespace
}  // namespace pounce::gpu_test
