// The routed experts of the staged passes in FP8: see src/gpu/fp8_routed.h.
#include "src/gpu/fp8_routed.h"

#include <cuda_runtime.h>

#include "kernels/quant/fp8_stages.cuh"
#include "src/gpu/mlp_backward.h"
#include "src/gpu/overlap.h"

namespace pounce::gpu {
namespace {

int64_t blocks_of(int64_t extent) {
  return kernels::layout::ceil_div(extent, kernels::quant::kBlock);
}

// Row operands in 1x128 blocks, K-block-major scales [cols / 128][ring_rows].
kernels::Fp8Rows fp8_rows(const uint8_t* data, const float* scale,
                          const kernels::layout::WorkspacePointers& p) {
  return {data, scale, p.ring_rows};
}

// Local experts [e0, e1) of `mb` as the GEMMs take them.
kernels::GroupedRows chunk_rows(const kernels::layout::WorkspacePointers& mb, int e0, int e1, int max_ctas) {
  return {mb.rows_capacity, mb.group_row_offset + e0, e1 - e0,         max_ctas,
          nullptr,          mb.group_rows + e0,       mb.gemm_error(), mb.gemm_failure_injected()};
}

// A token-axis copy of `cols` columns (e4m3 [cols][ring_rows], scales [ring_rows / 128][round_up(cols, 4)]).
kernels::quant::TokenAxisCopy token_axis(uint8_t* data, float* scale, int64_t cols,
                                         const kernels::layout::WorkspacePointers& p) {
  return {data, p.ring_rows, scale, kernels::layout::round_up(cols, 4)};
}

kernels::Fp8Columns as_columns(const kernels::quant::TokenAxisCopy& copy, int64_t first_col = 0) {
  return {copy.data + first_col * copy.ld, copy.ld, copy.scale + first_col, copy.scale_ld};
}

void launch_token_axis_copy(const kernels::layout::WorkspacePointers& mb,
                            const kernels::quant::TokenAxisSource& src,
                            const kernels::quant::TokenAxisCopy& dst, int64_t cols, int ctas,
                            cudaStream_t stream) {
  kernels::quant::token_axis_copy_kernel<><<<ctas, kernels::quant::kTileThreads, 0, stream>>>(mb, src, dst,
                                                                                              cols);
}

// A stage's CTAs: several per SM the GEMMs would use (a tile stage is bound by HBM, not by SMs).
int tile_ctas(int max_ctas) {
  return std::max(1, max_ctas) * 4;
}

}  // namespace

kernels::Fp8Matrices fp8_experts(const Fp8Tensor& weights, int64_t first_expert) {
  const int64_t n = weights.data.shape[1], k = weights.data.shape[2];
  return {static_cast<const uint8_t*>(weights.data.data) + first_expert * n * k,
          static_cast<const float*>(weights.scale.data) + first_expert * blocks_of(n) * blocks_of(k)};
}

void check_fp8_forward_args(const ForwardArgs& args) {
  POUNCE_CHECK(args.routed_fp8 != nullptr,
               "argument 'routed_fp8' is missing but config.precision is fp8; quantize the weights with "
               "pounce::quantize_weights_fp8 and pass them");
  const Fp8Weights& w = *args.routed_fp8;
  const std::pair<const char*, const Fp8Tensor*> tensors[] = {{"gate", &w.gate}, {"up", &w.up},
                                                              {"down", &w.down}, {"gate_t", &w.gate_t},
                                                              {"up_t", &w.up_t}, {"down_t", &w.down_t}};
  for (const auto& [name, t] : tensors) {
    POUNCE_CHECK(aligned_16(t->data.data), "argument 'routed_fp8.", name,
                 ".data' must be 16-byte aligned on the GPU backend (TMA); pass tensors from the caching "
                 "allocator or cudaMalloc");
    POUNCE_CHECK(t->data.is_dense() && t->scale.is_dense(), "argument 'routed_fp8.", name,
                 "' must be dense (the layout pounce::quantize_weights_fp8 writes)");
  }
}

void launch_fp8_stage_x(GpuWorkspace& workspace, const void* x, int64_t num_tokens, cudaStream_t stream) {
  kernels::quant::stage_x_fp8_kernel<kCopyThreads>
      <<<workspace.num_sms * 4, kCopyThreads, 0, stream>>>(workspace.pointers(), x, num_tokens);
}

void launch_fp8_pull_x(const kernels::layout::WorkspacePointers& mb, int e0, int e1, int ctas,
                       cudaStream_t stream) {
  kernels::quant::pull_x_fp8_kernel<kCommThreads><<<ctas, kCommThreads, 0, stream>>>(mb, e0, e1);
}

void launch_fp8_expert_forward(const kernels::layout::WorkspacePointers& mb, const Fp8Weights& w, int e0,
                               int e1, int max_ctas, const kernels::ActivationParams& activation,
                               bool with_down, cudaStream_t stream) {
  const int64_t H = mb.hidden, I = mb.intermediate;
  const kernels::GroupedRows rows = chunk_rows(mb, e0, e1, max_ctas);
  const kernels::Fp8Activation a_q{mb.fp8_act_rows, mb.fp8_act_scale, mb.ring_rows};
  kernels::fp8_grouped_gate_up(rows, fp8_rows(mb.fp8_x_rows, mb.fp8_x_scale, mb), fp8_experts(w.gate, e0),
                               fp8_experts(w.up, e0), mb.g_rows, mb.u_rows, mb.act_rows, a_q, I, H,
                               activation, stream);
  if (with_down)
    kernels::fp8_grouped_gemm(rows, fp8_rows(mb.fp8_act_rows, mb.fp8_act_scale, mb), fp8_experts(w.down, e0),
                              mb.y_rows, H, I, stream);
}

void launch_fp8_data_grads(const kernels::layout::WorkspacePointers& mb, const Fp8Weights& w, int e0, int e1,
                           int max_ctas, const kernels::ActivationParams& activation,
                           const WeightGradPlan& plan, cudaStream_t stream) {
  const int64_t H = mb.hidden, I = mb.intermediate;
  const int ctas = tile_ctas(max_ctas);
  const kernels::GroupedRows rows = chunk_rows(mb, e0, e1, max_ctas);
  // The token-axis copies of d_y and [d_g | d_u] come from the same reads as their row forms.
  kernels::quant::TokenAxisCopy dy_t = token_axis(mb.fp8_dy_t, mb.fp8_dy_t_scale, H, mb);
  kernels::quant::TokenAxisCopy dgu_t = token_axis(mb.fp8_dgu_t, mb.fp8_dgu_t_scale, 2 * I, mb);
  if (!plan.down) dy_t.data = nullptr;
  if (!plan.gate && !plan.up) dgu_t.data = nullptr;
  kernels::quant::quantize_dy_tiles_kernel<><<<ctas, kernels::quant::kTileThreads, 0, stream>>>(mb, e0, e1,
                                                                                                dy_t);
  kernels::fp8_grouped_gemm(rows, fp8_rows(mb.fp8_dy_rows, mb.fp8_dy_scale, mb), fp8_experts(w.down_t, e0),
                            mb.fp8_d_a, I, H, stream);
  kernels::quant::activation_backward_tiles_kernel<>
      <<<ctas, kernels::quant::kTileThreads, 0, stream>>>(mb, e0, e1, activation, dgu_t);
  kernels::fp8_grouped_gemm_pair(rows, fp8_rows(mb.fp8_dg_rows, mb.fp8_dg_scale, mb),
                                 fp8_experts(w.gate_t, e0), I, fp8_rows(mb.fp8_du_rows, mb.fp8_du_scale, mb),
                                 fp8_experts(w.up_t, e0), I, mb.dx_rows, H, stream);
  POUNCE_CUDA(cudaGetLastError());
}

void launch_fp8_weight_grads(const kernels::layout::WorkspacePointers& mb, const ExpertWeights& grads,
                             bool accumulate, const int32_t* owned, int max_ctas, int later_ctas,
                             cudaStream_t stream) {
  const int64_t H = mb.hidden, I = mb.intermediate;
  const WeightGradPlan plan = weight_grad_plan(grads, I);
  kernels::GroupedRows rows{mb.rows_capacity, mb.group_row_offset, mb.num_local_experts,      max_ctas, owned,
                            mb.group_rows,    mb.gemm_error(),     mb.gemm_failure_injected()};
  const kernels::quant::TokenAxisCopy x_t = token_axis(mb.fp8_x_t, mb.fp8_x_t_scale, H, mb);
  const kernels::quant::TokenAxisCopy act_t = token_axis(mb.fp8_act_t, mb.fp8_act_t_scale, I, mb);
  const kernels::quant::TokenAxisCopy dy_t = token_axis(mb.fp8_dy_t, mb.fp8_dy_t_scale, H, mb);
  const kernels::quant::TokenAxisCopy dgu_t = token_axis(mb.fp8_dgu_t, mb.fp8_dgu_t_scale, 2 * I, mb);
  const int ctas = tile_ctas(max_ctas);
  // d_y_t and [d_g | d_u]_t were written with the data gradients (launch_fp8_data_grads).
  if (plan.down) {
    launch_token_axis_copy(mb, {mb.act_rows, nullptr, nullptr, I, 0}, act_t, I, ctas, stream);
    kernels::fp8_grouped_weight_grad(rows, as_columns(dy_t), H, as_columns(act_t), I, grads.down.data,
                                     weight_grad_mode(grads.down, accumulate), stream);
  }
  if (plan.gate || plan.up) {
    // x_t from the x_q rows the GEMMs read (dequantized exactly).
    launch_token_axis_copy(mb, {nullptr, mb.fp8_x_rows, mb.fp8_x_scale, H, mb.ring_rows}, x_t, H, ctas,
                           stream);
  }
  rows.max_ctas = later_ctas;
  if (plan.gate)
    kernels::fp8_grouped_weight_grad(rows, as_columns(dgu_t), plan.gate_m, as_columns(x_t), H,
                                     grads.gate.data, weight_grad_mode(grads.gate, accumulate), stream);
  if (plan.up)
    kernels::fp8_grouped_weight_grad(rows, as_columns(dgu_t, I), I, as_columns(x_t), H, grads.up.data,
                                     weight_grad_mode(grads.up, accumulate), stream);
  POUNCE_CUDA(cudaGetLastError());
}

}  // namespace pounce::gpu
