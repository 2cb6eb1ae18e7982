// The checks of `pounce run --precision fp8` (docs/design.md §1 "FP8 mode", §6): the CPU reference
// (reference/reference.h, kBf16 numerics) evaluated at a check plan's coordinates, in FP8 (the oracle the
// run is compared with, at the tolerance rule of cli/dense_check.h) and in BF16 (the FP8 error budget:
// relative error <= 0.1 per tensor, cosine similarity >= 0.996 per gradient).
//
// The reference runs the whole layer, so it is given two smaller problems that yield exactly the values it
// would give at the plan's coordinates on the whole one:
//   tokens  the plan's tokens of each rank alone, all experts: every FP8 quantization of out, d_x and
//           d_topk_weights is row-local (1x128 blocks along a token's row), so a token's values do not
//           depend on the other tokens;
//   experts all tokens, but only their pairs routed to the plan's experts (renumbered, the same number per
//           rank), no shared expert: an expert's receive-schedule segment, and with it the 128-row
//           token-axis blocks of its weight-gradient operands, holds the same rows in the same order.
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

// The reference in `precision` at the plan's coordinates: out (and with `backward` d_x, d_topk_weights,
// the routed weight and bias gradients), in SampledTensors order. Shared-expert fields stay empty.
SampledTensors reference_evaluate(const HostProblem& problem, const CheckPlan& plan, bool backward,
                                  Precision precision, int num_threads = 0);

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
