// The fused forward kernel (src/gpu/fused_forward.cu) against the staged chain, bitwise (docs/design.md §6:
// fused == staged), with both combines (push by the communication CTAs, scatter from the down epilogues),
// over minibatches of one m-block (many handoffs, down tiles waiting on gate/up tiles in flight) and the
// default; routing from uniform to all tokens on one expert, T = 0 on a rank, shared expert and both
// activations. Every call runs the staged chain first and the fused kernel second; both also meet the CPU
// reference (forward_harness.h).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "forward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {
namespace {

TEST(FusedForward, EqualsStagedBitwise) {
  SKIP_UNLESS_GPUS(1);
  for_each_fused_variant([](int R, const Config& tuning, const std::string& label) {
    const Model shared =
        make_model(make_shape(700, 256, 192, 8, 4, 128, R), clamped(Activation::gpt_oss(), 2.0f), 31);
    const Model routed = make_model(make_shape(1000, 256, 128, 16, 8, 0, R), Activation::swiglu(), 32);
    auto tokens = [R](int64_t a, int64_t b) { return tokens_per_rank(R, a, b); };
    check_forward(shared,
                  {random_routing(tokens(700, 513), 33),
                   with_int64_idx(all_to_one_expert(tokens(0, 700), 34)), sparse_routing(tokens(129, 1), 35)},
                  ForwardMode::kStagedVsFused, "fused vs staged, shared expert" + label, tuning);
    check_forward(routed,
                  {random_routing(tokens(1000, 999), 36), all_to_one_expert(tokens(1000, 1000), 37),
                   with_int64_idx(few_experts(tokens(300, 0), 38))},
                  ForwardMode::kStagedVsFused, "fused vs staged" + label, tuning);
  });
}

}  // namespace
}  // namespace pounce::gpu_test
