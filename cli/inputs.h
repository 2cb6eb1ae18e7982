// The inputs of one `pounce run`: a whole expert-parallel group's tensors on the host, generated from a
// seed, and the flop count of docs/design.md §7.
//
//   x, d_out            ~ N(0, 1)                 rounded to bf16, never zero
//   routed/shared W     ~ N(0, 1/sqrt(fan_in))    rounded to bf16, never zero (fan_in = H for gate/up,
//                                                 I or Is for down)
//   topk_idx            k distinct experts per token, uniform over [0, E)
//   topk_weights        softmax over k N(0, 1) logits (fp32, > 0)
//   routed biases       ~ N(0, 0.5)               only when asked for (GPT-OSS-like), rounded to bf16
//
// Every tensor is cut into fixed chunks whose generators are seeded from (seed, rank, tensor, chunk), so
// the values depend only on the seed and the shape, never on the number of threads that made them.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "pounce/shape.h"

namespace pounce::cli {

struct HostWeights {
  std::vector<uint16_t> gate;  // bf16 bits; routed [El, I, H] / shared [Is, H]
  std::vector<uint16_t> up;    // routed [El, I, H] / shared [Is, H]
  std::vector<uint16_t> down;  // routed [El, H, I] / shared [H, Is]
  // Routed expert biases (`pounce run --biases`), empty = none: b_gate, b_up [El, I], b_down [El, H].
  std::vector<uint16_t> b_gate = {}, b_up = {}, b_down = {};
};

struct HostRank {
  int64_t num_tokens = 0;           // T
  std::vector<uint16_t> x;          // [T, H] bf16 bits
  std::vector<int32_t> topk_idx;    // [T, k] global expert ids
  std::vector<float> topk_weights;  // [T, k]
  std::vector<uint16_t> d_out;      // [T, H] bf16 bits
  HostWeights routed;               // this rank's El experts
};

struct HostProblem {
  Shape shape;  // max_tokens = T of every rank
  Activation activation;
  std::vector<HostRank> ranks;  // [R]
  HostWeights shared;           // data-parallel replica: every rank passes the same shared weights
};

// The fraction of the inputs generated so far, in (0, 1], called from the generating threads (one at a
// time) each time another 1/kProgressSteps is done, so that a large shape (a minute of generation) shows it.
using GenerationProgress = std::function<void(double fraction_done)>;
inline constexpr int kProgressSteps = 20;

// Validates `shape` (pounce::Error on bad fields) and generates every rank's inputs. The values do not depend
// on num_threads or on_progress.
HostProblem generate_problem(const Shape& shape, const Activation& activation, uint64_t seed,
                             int num_threads = 0, const GenerationProgress& on_progress = {},
                             bool biases = false);

// Routed (token, slot) pairs with an expert id >= 0, summed over ranks.
int64_t count_routed_pairs(const HostProblem& problem);

// docs/design.md §7 forward flops per GPU: (6 * pairs * H * I + 6 * tokens * H * Is) / R, with pairs and
// tokens summed over the R ranks. Backward counts twice that.
double forward_flops_per_rank(int64_t routed_pairs, int64_t total_tokens, int64_t hidden,
                              int64_t intermediate, int64_t shared_intermediate, int64_t num_ranks);
double forward_flops_per_rank(const HostProblem& problem);

// TFLOP/s of `flops` done in `milliseconds` (0 when the time is not positive).
double tflops(double flops, double milliseconds);

}  // namespace pounce::cli
