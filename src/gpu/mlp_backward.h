// The MLP backward of one set of experts, as both backward paths describe it (src/gpu/staged_backward.cu
// launches its GEMMs one by one, src/gpu/fused_backward.cu hands their operands to the fused kernel):
//   [d_g, d_u] = act'(g, u) * (dy . w_down)      d_x = [d_g, d_u] . [w_gate; w_up]
//   d_w_down = dy^T act    d_w_gate = d_g^T x    d_w_up = d_u^T x
// on expert-grouped rows: routed, El groups of received rows; shared, one group of the rank's own rows.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "src/gpu/grouped_gemm.h"
#include "pounce/error.h"
#include "src/gpu/gpu_state.h"

namespace pounce::gpu {

struct MlpBackward {
  kernels::GroupedRows rows;
  int64_t intermediate;
  const void *x, *dy, *g, *u, *act;  // [rows][H], [rows][H], [rows][I] x3
  void *d_gu, *dx;                   // [rows][2I] (d_g then d_u), [rows][H]
  ExpertWeights weights;             // [groups, ., .] (the shared expert's 2-D weights as one group)
  const ExpertWeights* grads;
  // The staged weight gradients' tiles, from the rows a group holds on average (the fused backward runs its
  // own cooperative tiles).
  kernels::TileSchedule weight_grad_schedule;
};

// The tokens of this backward call (x's rows).
inline int64_t num_tokens_of(const BackwardArgs& args) {
  return args.inputs.x.shape.empty() ? 0 : args.inputs.x.shape[0];
}

inline kernels::WeightGradMode weight_grad_mode(const TensorView& grad, bool accumulate) {
  if (accumulate) return kernels::WeightGradMode::kAccumulateF32;
  return grad.dtype == DType::kFP32 ? kernels::WeightGradMode::kStoreF32
                                    : kernels::WeightGradMode::kStoreBf16;
}

// The shared expert's [1, Is, H] / [1, H, Is] view of its 2-D weights, so expert_slice applies.
inline ExpertWeights as_one_expert(const ExpertWeights& w) {
  ExpertWeights one = w;
  for (TensorView* t : {&one.gate, &one.up, &one.down}) {
    if (t->shape.size() != 2) continue;
    if (!t->strides.empty()) t->strides.insert(t->strides.begin(), t->shape[0] * t->strides[0]);
    t->shape.insert(t->shape.begin(), 1);
  }
  return one;
}

// The weight-gradient GEMMs of one backward: a gradient left empty (frozen weights) gets none. Routed gate
// and up gradients given as the two halves of one [El, 2I, H] tensor (the only strided gradients validation
// lets through) come from one GEMM over the [d_g | d_u] rows, m = 2I, stored from the gate half's base: the
// whole tensor's.
struct WeightGradPlan {
  bool down = false, gate = false, up = false;
  int64_t gate_m = 0;  // output rows of the gate GEMM: I, or 2I for the halves
};

inline WeightGradPlan weight_grad_plan(const ExpertWeights& grads, int64_t intermediate) {
  const bool halves = !grads.gate.is_none() && !grads.gate.is_dense();
  WeightGradPlan plan;
  plan.down = !grads.down.is_none();
  plan.gate = !grads.gate.is_none();
  plan.up = !grads.up.is_none() && !halves;
  plan.gate_m = halves ? 2 * intermediate : intermediate;
  return plan;
}

// The shared expert on this rank's own rows: sym_x and sym_d_out, T padded to 128 with zero rows.
inline MlpBackward shared_mlp_backward(const kernels::layout::WorkspacePointers& p, const BackwardArgs& args,
                                       int max_ctas) {
  return {{p.token_capacity, p.shared_row_offset, 1, max_ctas, nullptr, nullptr, p.gemm_error(),
           p.gemm_failure_injected()},
          p.shared_intermediate,
          p.local_sym<const void>(p.sym_x),
          p.local_sym<const void>(p.sym_d_out),
          p.shared_g,
          p.shared_u,
          p.shared_act,
          p.shared_d_gu,
          p.shared_dx,
          as_one_expert(args.inputs.shared),
          &args.d_shared,
          kernels::weight_grad_schedule_for(num_tokens_of(args))};
}

// The routed experts on the received rows of the forward context (dy pulled by the reverse-combine).
inline MlpBackward routed_mlp_backward(const kernels::layout::WorkspacePointers& p, const BackwardArgs& args,
                                       int max_ctas) {
  return {{p.rows_capacity, p.group_row_offset, p.num_local_experts, max_ctas, nullptr, p.group_rows,
           p.gemm_error(), p.gemm_failure_injected()},
          p.intermediate,
          p.x_rows,
          p.dy_rows,
          p.g_rows,
          p.u_rows,
          p.act_rows,
          p.d_gu_rows,
          p.dx_rows,
          args.inputs.routed,
          &args.d_routed,
          // balanced routing: every rank's tokens times k spread over all experts
          kernels::weight_grad_schedule_for(num_tokens_of(args) * p.num_ranks * p.num_topk /
                                            std::max<int64_t>(1, p.num_experts))};
}

}  // namespace pounce::gpu
