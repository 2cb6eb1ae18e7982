// The routed experts of the staged passes in FP8 (docs/design.md §1 "FP8 mode"): the stages that differ from
// BF16, launched by src/gpu/staged_forward.cu and staged_backward.cu on a workspace (or a macrobatch view of
// it) created with Precision::kFP8. The shared expert, the routing, the combine and every token-side stage
// are the BF16 ones.
//
//   forward   stage x_q at the source -> pull x_q rows + scales -> gate/up (a = act(g, u) and a_q in its
//             epilogue) -> down (y)
//   backward  [d_y pulled as BF16] -> d_y_q -> d_a = d_y_q . Wd_t -> d_g, d_u (bf16 and quantized) ->
//             d_x = d_g_q . Wg_t + d_u_q . Wu_t; then the token-axis copies (x_t from x_q, a_t, d_y_t,
//             [d_g | d_u]_t) and the weight gradients from them
// Every launch is stream-ordered, allocates nothing and reads row counts on the device only.
#pragma once

#include <cuda_runtime.h>

#include "pounce/fp8.h"
#include "src/gpu/fp8_gemm.h"
#include "src/gpu/gpu_state.h"
#include "src/gpu/mlp_backward.h"

namespace pounce::gpu {

// Local experts [first_expert, ...) of a quantized weight tensor, as the FP8 GEMMs take them.
kernels::Fp8Matrices fp8_experts(const Fp8Tensor& weights, int64_t first_expert = 0);

// Throws, naming the argument, unless the quantized weights are there and laid out as the FP8 GEMMs read
// them.
void check_fp8_forward_args(const ForwardArgs& args);

// x_q = q1x128_H(x) into the symmetric buffer (rows up to round_up(T, 128); zeros past T).
void launch_fp8_stage_x(GpuWorkspace& workspace, const void* x, int64_t num_tokens, cudaStream_t stream);
// The x_q rows of local experts [e0, e1) of `mb` from their sources, on `ctas` blocks.
void launch_fp8_pull_x(const kernels::layout::WorkspacePointers& mb, int e0, int e1, int ctas,
                       cudaStream_t stream);
// g, u, a and a_q, then y, for local experts [e0, e1) of `mb` on rows.max_ctas SMs.
void launch_fp8_expert_forward(const kernels::layout::WorkspacePointers& mb, const Fp8Weights& w, int e0,
                               int e1, int max_ctas, const kernels::ActivationParams& activation,
                               bool with_down, cudaStream_t stream);
// d_y_q, d_a, d_g/d_u and d_x of local experts [e0, e1) of `mb` (d_y rows already pulled), with the
// token-axis copies of d_y and [d_g | d_u] that the weight gradients of `plan` read.
void launch_fp8_data_grads(const kernels::layout::WorkspacePointers& mb, const Fp8Weights& w, int e0, int e1,
                           int max_ctas, const kernels::ActivationParams& activation,
                           const WeightGradPlan& plan, cudaStream_t stream);
// The token-axis copies of act and x and the routed weight gradients of every expert `mb` holds
// (`owned`: null = all): down on `max_ctas` SMs, gate and up on `later_ctas`.
void launch_fp8_weight_grads(const kernels::layout::WorkspacePointers& mb, const ExpertWeights& grads,
                             bool accumulate, const int32_t* owned, int max_ctas, int later_ctas,
                             cudaStream_t stream);

}  // namespace pounce::gpu
