// The checks of `pounce run --precision fp8` (docs/design.md §1 "FP8 mode", §6): the CPU reference
// (reference/reference.h, kBf16 numerics) evaluated at a check plan's coordinates, in FP8 (the oracle the
// run is compared with, at the tolerance rule of cli/dense_check.h) and in BF16 (the FP8 error budget:
// relative error <= 0.1 per tensor, cosine similarity >= 0.996 per gradient).
//
// The reference runs the whole layer, so it is given smaller problems that yield exactly the values it
// would give at the plan's coordinates on the whole one:
//   tokens  the plan's tokens of each rank, in batches, with all their pairs and the shared expert, and only
//           the experts they route to: every FP8 quantization of out, d_x and d_topk_weights is row-local
//           (1x128 blocks along a token's row) and each pair's y depends only on its expert's weights and
//           the token's row, so a token's values depend neither on the other tokens nor on the experts it
//           does not route to. Per owning rank, a batch's used experts keep their order (and owner) under
//           new ids r * m + i, m the most any rank uses (ranks with fewer padded with zero-weight experts);
//           the slots are not moved. A batch holds at most `batch_bytes` of the reference's routed weights
//           (a batch of one token may hold more);
//   experts all tokens, but only their pairs routed to the plan's experts (renumbered, the same number per
//           rank, each on its own rank), packed in slot order into the first min(k, R * n) slots, no shared
//           expert: an expert's receive-schedule segment, and with it the 128-row token-axis blocks of its
//           weight-gradient operands, holds the same rows in the same order.
// The shared expert's weight gradients are not evaluated here (their fields stay empty): the shared expert
// stays BF16 in FP8 mode and its gradients do not depend on the routed experts, so dense_evaluate's fp64
// values are their reference in either precision.
#pragma once

#include <string>
#include <vector>

#include "pounce/config.h"
#include "cli/dense_check.h"
#include "cli/inputs.h"

namespace pounce::cli {

// Bytes the reference holds per routed weight element in FP8 mode (the larger precision): the double copy
// it is given (8) and one quantization serving both orientations (reference/fp8_detail.h Fp8Matrix): the
// e4m3 bits (1), their decoded floats (4) and the decoded floats transposed (4). BF16 holds 8 + 2 x 4.
inline constexpr double kReferenceBytesPerWeight = 17.0;

// The most routed-weight bytes (kReferenceBytesPerWeight per element) one batch of the tokens problem
// gives the reference, in either precision: 42 of deepseek-v3's experts; qwen3-30b-a3b's 128 fit in one.
inline constexpr double kReferenceBatchBytes = 32e9;

// The reference in `precision` at the plan's coordinates: out (and with `backward` d_x, d_topk_weights,
// the routed weight and bias gradients), in SampledTensors order. Shared-expert fields stay empty. The
// values do not depend on num_threads or batch_bytes.
SampledTensors reference_evaluate(const HostProblem& problem, const CheckPlan& plan, bool backward,
                                  Precision precision, int num_threads = 0,
                                  double batch_bytes = kReferenceBatchBytes);

// Host memory of `pounce run --precision fp8`'s check, bytes, before any input exists (an upper bound over
// the routing): the run's host inputs (bf16, every expert) plus the larger of the reduced problems above
// (a tokens batch, the experts problem) in the reference's FP8 backward, the larger precision. The FP8 and
// BF16 evaluations, and the problems of each, run one after the other. check_tokens and check_experts as
// PlanOptions (per rank, 0 = all); num_threads 0 = hardware concurrency (its weight quantization scratch).
double estimate_reference_check_bytes(const Shape& shape, int64_t check_tokens, int64_t check_experts,
                                      int num_threads = 0, double batch_bytes = kReferenceBatchBytes);

// `base`'s empty fields filled from `from` (e.g. the shared expert's gradients from dense_evaluate).
SampledTensors fill_missing(SampledTensors base, const SampledTensors& from);

// The FP8 error budget of docs/design.md §1 against the BF16 layer's values.
inline constexpr double kFp8MaxRelError = 0.1;
inline constexpr double kFp8MinGradCosine = 0.996;

struct BudgetCheck {
  std::string name;
  int64_t count = 0;
  double rel_error = 0.0;  // ||fp8 - bf16|| / ||bf16||
  double cosine = 1.0;     // <fp8, bf16> / (||fp8|| ||bf16||)
  bool gradient = false;   // the cosine counts (every field but out)
  bool passed = false;
};

// One line per field of `bf16_ref` that has values; non-finite values fail.
std::vector<BudgetCheck> check_fp8_budget(const SampledTensors& fp8, const SampledTensors& bf16_ref);

}  // namespace pounce::cli
