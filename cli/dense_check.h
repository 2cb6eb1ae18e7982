// An independent fp64 check of one MoE layer forward + backward (docs/design.md §1, §6).
//
// Dense and per token: no schedule, no dispatch, no expert parallelism. For token t of rank r
//   out[t]  = MLP_shared(x[t]) + sum_j w[t,j] * MLP_e(x[t]),   e = topk_idx[t,j], weights from rank e / El
//   d_x[t]  = MLP_shared'(x[t])^T d_out[t] + sum_j MLP_e'(x[t])^T (w[t,j] d_out[t])
//   d_topk_weights[t,j] = <d_out[t], MLP_e(x[t])>
// and the weight gradients of an expert summed over every (token, slot) routed to it, all in double with
// reference::activation / activation_backward. With routed biases MLP_e adds b_gate, b_up to g, u and b_down
// to y; d_b_gate/d_b_up[e] sum the pairs' d_g/d_u, d_b_down[e] the pairs' w d_out.
//
// A CheckPlan picks what is evaluated: a sample of tokens per rank (out, d_x, d_topk_weights) and a sample
// of local experts per rank x intermediate indices i (rows i of d_gate and d_up, column i of d_down, whose
// cost is O(H) per routed pair each); the shared expert's rows the same way. Both the fp64 evaluation and
// the values a run produced are gathered into SampledTensors in one canonical order, then compared.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pounce/shape.h"
#include "cli/inputs.h"

namespace pounce::cli {

struct CheckPlan {
  std::vector<std::vector<int64_t>> tokens;   // [R] sampled token indices of each rank, ascending
  std::vector<std::vector<int64_t>> experts;  // [R] sampled local experts of each rank, ascending
  std::vector<int64_t> rows;                  // sampled routed intermediate indices, ascending
  std::vector<int64_t> shared_rows;           // sampled shared intermediate indices (empty when Is = 0)
};

struct PlanOptions {
  int64_t tokens_per_rank = 64;  // 0 = all
  int64_t experts_per_rank = 2;  // 0 = all
  int64_t rows_per_expert = 4;   // 0 = all (also used for the shared expert)
  uint64_t seed = 0;
};

CheckPlan make_check_plan(const HostProblem& problem, const PlanOptions& options);
// Every token, expert and row: the whole layer.
CheckPlan full_check_plan(const HostProblem& problem);

// Tensors of the check, with the names of the public API.
enum class Field {
  kOut,
  kDX,
  kDTopkWeights,
  kDRoutedGate,
  kDRoutedUp,
  kDRoutedDown,
  kDSharedGate,
  kDSharedUp,
  kDSharedDown,
  kDRoutedBGate,
  kDRoutedBUp,
  kDRoutedBDown,
};
inline constexpr int kNumFields = 12;
const char* field_name(Field field);
bool is_backward_field(Field field);

// Values at a plan's coordinates, ranks concatenated in order. Per rank:
//   out, d_x        [tokens, H]         d_topk_weights [tokens, k]
//   d_routed.gate/up [experts, rows, H]  d_routed.down  [experts, H, rows]
//   d_shared.gate/up [shared_rows, H]    d_shared.down  [H, shared_rows]
//   d_routed.b_gate/b_up [experts, rows] d_routed.b_down [experts, H]   (only when the problem has biases)
struct SampledTensors {
  std::array<std::vector<double>, kNumFields> values;
  std::vector<double>& operator[](Field field) { return values[static_cast<int>(field)]; }
  const std::vector<double>& operator[](Field field) const { return values[static_cast<int>(field)]; }
  void append(const SampledTensors& other);
};

// "d_routed.down[rank 1, expert 9, 17, 3]" for the `index`-th value of `field` in plan order.
std::string describe_coordinate(const CheckPlan& plan, const Shape& shape, Field field, int64_t index);

// The fp64 dense evaluation at the plan's coordinates; backward fields stay empty unless `backward`.
// `clamp_masks_at_bf16`: an activation clamp's gradient masks are decided where the layer decides them, on g
// and u rounded to bf16 (docs/design.md §1); false decides them on the unrounded fp64 values, as the
// reference's kFp64 numerics do. A mask is a step at the limit: an fp64 value within half a bf16 step of it
// would sit on the other side than the layer's bf16 value, a full-size gradient against none that no
// tolerance covers
// (`pounce run --clamp 1` failed on those).
SampledTensors dense_evaluate(const HostProblem& problem, const CheckPlan& plan, bool backward,
                              int num_threads = 0, bool clamp_masks_at_bf16 = true);

// Reads element `flat_index` of one rank's full-size tensor (row-major, any dtype or memory).
using ElementReader = std::function<double(int64_t flat_index)>;

// One rank's outputs as a run produced them, full size: out, d_x [T, H], d_topk_weights [T, k],
// d_routed [El, ...], d_shared [Is, ...]. Readers left empty skip their field (e.g. no backward).
struct RankOutputs {
  std::array<ElementReader, kNumFields> readers;
  ElementReader& operator[](Field field) { return readers[static_cast<int>(field)]; }
  const ElementReader& operator[](Field field) const { return readers[static_cast<int>(field)]; }
};

// Rank `rank`'s values at the plan's coordinates, in SampledTensors order.
SampledTensors gather_rank(const CheckPlan& plan, const Shape& shape, int64_t rank,
                           const RankOutputs& outputs);

// One line of the check table (docs/design.md §6 style).
struct TensorCheck {
  std::string name;
  int64_t count = 0;
  double max_abs_error = 0.0;
  double max_abs_ref = 0.0;
  double rel_error = 0.0;  // ||got - ref|| / ||ref||; 0 when both are zero, inf when only ref is zero
  double tolerance = 0.0;
  bool passed = false;
  std::string first_bad;  // "<coordinate>: got G, expected E" when failed
};

// Compares `got` with `ref` field by field (fields empty in `ref` are skipped). A field passes when its
// relative error is at most `tolerance` and every value is finite.
std::vector<TensorCheck> compare(const CheckPlan& plan, const Shape& shape, const SampledTensors& got,
                                 const SampledTensors& ref, double tolerance);

}  // namespace pounce::cli
