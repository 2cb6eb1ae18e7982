// The fused backward kernel (src/gpu/fused_backward.cu) against the staged chain, bitwise (docs/design.md §6:
// fused == staged): every fp32 run (including after recompute), the bf16 and the accumulate run of
// backward_harness.h, with both combines (push by the communication CTAs, scatter from the d_x epilogues),
// minibatches of one m-block (many handoffs, d_x tiles waiting on d_a tiles in flight, weight gradients
// waiting on units still being pulled) and the default; uniform routing, all tokens on one expert, T = 0 on
// a rank, shared expert and both activations (clamped). Both paths also meet the CPU reference. The small
// one-rank cases are the ones tools/gpu_sanitize.sh runs under compute-sanitizer.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "backward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {
namespace {

// One small case through the fused forward and backward kernels against the reference, small enough for
// compute-sanitizer (memcheck, racecheck, synccheck).
void check_one_rank_small(int64_t macrobatch_size, int64_t shared_intermediate = 128) {
  const Model m = make_model(make_shape(192, 256, 128, 8, 2, shared_intermediate, 1),
                             clamped(Activation::swiglu(), 1.5f), 151);
  Config config;
  config.kernel_path = config.backward_kernel_path = KernelPath::kFused;
  config.minibatch_size = kBlockM;
  config.macrobatch_size = macrobatch_size;
  check_backward(m, {random_routing({192}, 152)}, false, current_test_name(), config);
}

TEST(FusedBackward, OneRankSmall) {
  SKIP_UNLESS_GPUS(1);
  check_one_rank_small(0);
}

// Without a shared expert the fused kernels' tiles start on routed rows alone (no shared tiles cover the
// first pulls).
TEST(FusedBackward, OneRankSmallRoutedOnly) {
  SKIP_UNLESS_GPUS(1);
  check_one_rank_small(0, 0);
}

// The smallest macrobatch ring (256 rows: four macrobatches of two experts), so the sanitizers also see the
// macrobatch plan, the per-macrobatch launches and the fused backward's replay.
TEST(FusedBackward, OneRankSmallRing) {
  SKIP_UNLESS_GPUS(1);
  check_one_rank_small(2 * kBlockM);
}

TEST(FusedBackward, EqualsStagedBitwise) {
  SKIP_UNLESS_GPUS(1);
  for_each_fused_variant([](int R, const Config& tuning, const std::string& label) {
    const Model shared =
        make_model(make_shape(300, 256, 192, 8, 4, 128, R), clamped(Activation::gpt_oss(), 1.0f), 141);
    const Model routed =
        make_model(make_shape(500, 256, 128, 16, 8, 0, R), clamped(Activation::swiglu(), 1.5f), 142);
    auto tokens = [R](int64_t a, int64_t b) { return tokens_per_rank(R, a, b); };
    // The staged chain has no combine to choose: only the fused run takes tuning.combine.
    Config staged, fused = tuning;
    staged.kernel_path = staged.backward_kernel_path = KernelPath::kStaged;
    staged.minibatch_size = tuning.minibatch_size;
    fused.kernel_path = fused.backward_kernel_path = KernelPath::kFused;
    for (const Model* m : {&shared, &routed}) {
      const std::vector<Call> calls =
          m == &shared
              ? std::vector<Call>{random_routing(tokens(300, 255), 143),
                                  with_int64_idx(all_to_one_expert(tokens(0, 300), 144))}
              : std::vector<Call>{random_routing(tokens(500, 499), 145), few_experts(tokens(129, 0), 146)};
      const std::string name = (m == &shared ? "shared expert" : "routed only") + label;
      const BackwardResults a = check_backward(*m, calls, false, "staged, " + name, staged);
      const BackwardResults b = check_backward(*m, calls, false, "fused, " + name, fused);
      expect_same_backward(a, b, name);
    }
  });
}

}  // namespace
}  // namespace pounce::gpu_test
