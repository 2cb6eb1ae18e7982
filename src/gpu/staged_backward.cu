// The staged backward (DESIGN.md §1, §4): the chain of standalone stage kernels that the backward
// megakernel will fuse. Stream-ordered, nothing allocated, no routing count read on the host: the schedule,
// row offsets and routed activations of the forward context drive every kernel on the device, so the whole
// chain is capturable in a CUDA graph together with the forward.
//
//   token side   stage d_out, topk_weights -> router gradient <d_out, y> from the forward's slots -> barrier
//   shared       the MLP backward on the rank's own rows with dy = d_out, and its weight gradients
//   expert side  per chunk of local experts: reverse-combine pull dy = bf16(w d_out) [comm stream] ->
//                d_a GEMM (w_down read transposed) with the activation backward in its epilogue -> d_x GEMM
//                over [d_g, d_u] . [w_gate; w_up] -> reverse-dispatch push into the owners' (token, slot)
//                [comm stream]; then the weight gradients of every expert
//   token side   barrier -> d_x[t] = bf16(d_xs[t] + sum_j d_x[t, j]) in ascending j
//
// Weight gradients reduce over each expert's whole row segment in one CTA per output tile, ascending rows
// (bitwise deterministic); an expert without rows gets zeros. The forward context is read, never written,
// so backward may run again on the same context.
#include <cuda_runtime.h>

#include "kernels/backward/reverse_combine.cuh"
#include "kernels/combine/combine.cuh"
#include "kernels/gemm/grouped_gemm.h"
#include "src/gpu/gpu_state.h"
#include "src/gpu/overlap.h"
#include "src/gpu/stage_timer.h"

namespace pounce::gpu {
namespace {

kernels::WeightGradMode weight_grad_mode(const TensorView& grad, bool accumulate) {
  if (accumulate) return kernels::WeightGradMode::kAccumulateF32;
  return grad.dtype == DType::kFP32 ? kernels::WeightGradMode::kStoreF32
                                    : kernels::WeightGradMode::kStoreBf16;
}

// The MLP backward of one set of experts on expert-grouped rows (routed: El groups; shared: one group of
// the rank's own rows):
//   [d_g, d_u] = act'(g, u) * (dy . w_down)      d_x = [d_g, d_u] . [w_gate; w_up]
//   d_w_down = dy^T a    d_w_gate = d_g^T x    d_w_up = d_u^T x
struct MlpBackward {
  kernels::GroupedRows rows;
  int64_t intermediate;
  const void *x, *dy, *g, *u, *act;  // [rows][H], [rows][H], [rows][I] x3
  void *d_gu, *dx;                   // [rows][2I], [rows][H]
  const ExpertWeights* weights;
  const ExpertWeights* grads;
};

// Data gradients of groups [first_group, first_group + num_groups) of m (a pipeline chunk).
void launch_mlp_data_grads(const MlpBackward& m, int first_group, int num_groups, int64_t H,
                           const kernels::ActivationParams& activation, cudaStream_t stream) {
  const int64_t I = m.intermediate;
  kernels::GroupedRows rows = m.rows;
  rows.group_row_offset += first_group;
  rows.num_groups = num_groups;
  void* d_u = static_cast<char*>(m.d_gu) + I * 2;
  kernels::grouped_activation_backward(rows, m.dy, expert_slice(m.weights->down, first_group), m.g, m.u,
                                       m.d_gu, d_u, 2 * I, I, H, activation, stream);
  kernels::grouped_gemm_transposed(rows, m.d_gu, expert_slice(m.weights->gate, first_group),
                                   expert_slice(m.weights->up, first_group), I, m.dx, H, 2 * I, stream);
}

void launch_mlp_weight_grads(const MlpBackward& m, int64_t H, bool accumulate, cudaStream_t stream) {
  const int64_t I = m.intermediate;
  const void* d_u = static_cast<const char*>(m.d_gu) + I * 2;
  kernels::grouped_weight_grad(m.rows, m.dy, H, H, m.act, I, I, m.grads->down.data,
                               weight_grad_mode(m.grads->down, accumulate), stream);
  kernels::grouped_weight_grad(m.rows, m.d_gu, 2 * I, I, m.x, H, H, m.grads->gate.data,
                               weight_grad_mode(m.grads->gate, accumulate), stream);
  kernels::grouped_weight_grad(m.rows, d_u, 2 * I, I, m.x, H, H, m.grads->up.data,
                               weight_grad_mode(m.grads->up, accumulate), stream);
}

// The shared expert's [1, Is, H] / [1, H, Is] view of its 2-D weights, so expert_slice applies.
ExpertWeights as_one_expert(const ExpertWeights& w) {
  ExpertWeights one = w;
  for (TensorView* t : {&one.gate, &one.up, &one.down}) {
    if (t->shape.size() == 2) t->shape.insert(t->shape.begin(), 1);
  }
  return one;
}

}  // namespace

void launch_staged_backward(GpuWorkspace& workspace, const BackwardArgs& args, cudaStream_t stream) {
  DeviceGuard guard(workspace.device);
  const layout::WorkspacePointers p = workspace.pointers();
  const ForwardArgs& in = args.inputs;
  const int64_t num_tokens = in.x.shape.empty() ? 0 : in.x.shape[0];
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate;
  POUNCE_CHECK(num_tokens >= 0 && num_tokens <= p.max_tokens, "x has ", num_tokens,
               " tokens but the workspace was created for max_tokens = ", p.max_tokens);
  POUNCE_CHECK(num_tokens == 0 || (aligned_16(args.d_out.data) && aligned_16(args.d_x.data)),
               "d_out and d_x must be 16-byte aligned on the GPU backend");
  // Checked before the first kernel is queued: a launcher refusing later would leave peers at a barrier.
  check_weights_aligned(in.routed, "routed");
  check_weights_aligned(in.shared, "shared");
  check_weights_aligned(args.d_routed, "d_routed");
  check_weights_aligned(args.d_shared, "d_shared");
  const kernels::ActivationParams activation = activation_params(workspace.config.activation);
  const int copy_grid = workspace.num_sms * 4;

  StageTimer timer("backward", p.rank, stream);
  // 1. Token side: stage d_out and the router weights for the owners' pulls; router gradient from the
  //    forward's slots; barrier.
  reverse_combine::stage_inputs_kernel<kCopyThreads><<<copy_grid, kCopyThreads, 0, stream>>>(
      p, args.d_out.data, in.topk_weights.as<const float>(), num_tokens);
  if (num_tokens > 0) {
    reverse_combine::router_grad_kernel<kCopyThreads><<<copy_grid, kCopyThreads, 0, stream>>>(
        p, args.d_out.data, args.d_topk_weights.as<float>(), num_tokens);
  }
  timer.mark("stage+router_grad");
  launch_barrier(p, layout::WaitId::kBackwardInputsBarrier, stream);
  timer.mark("barrier");
  POUNCE_CUDA(cudaGetLastError());

  // 2-4 overlapped (src/gpu/overlap.h): the comm stream pulls chunk c's scaled d_out rows while earlier
  // chunks compute, and pushes chunk c's d_x rows while later chunks compute; the shared expert covers the
  // first pull and the routed weight gradients cover the last push.
  Overlap overlap(workspace, stream, workspace.config.backward_comm_sms);
  cudaStream_t comm = overlap.comm();
  overlap.comm_after_main();
  cudaEvent_t pulled[kMaxChunks];
  for (int c = 0; c < overlap.num_chunks(); ++c) {
    reverse_combine::pull_scaled_rows_kernel<kCommThreads><<<overlap.comm_sms(), kCommThreads, 0, comm>>>(
        p, overlap.chunk_begin(c), overlap.chunk_begin(c + 1));
    pulled[c] = overlap.mark(comm);
  }
  POUNCE_CUDA(cudaGetLastError());

  // Shared expert on this rank's own rows (sym_x and sym_d_out, T padded to 128 with zero rows).
  const ExpertWeights shared_weights = as_one_expert(in.shared);
  const MlpBackward shared{{p.token_capacity, p.shared_row_offset, 1, overlap.gemm_ctas()},
                           Is,
                           p.local_sym<const void>(p.sym_x),
                           p.local_sym<const void>(p.sym_d_out),
                           p.shared_g,
                           p.shared_u,
                           p.shared_act,
                           p.shared_d_gu,
                           p.shared_dx,
                           &shared_weights,
                           &args.d_shared};
  if (Is > 0 && num_tokens > 0) launch_mlp_data_grads(shared, 0, 1, H, activation, stream);
  if (Is > 0) launch_mlp_weight_grads(shared, H, args.accumulate_weight_grads, stream);

  timer.mark("shared");
  // Routed experts, chunk by chunk: data gradients, then the reverse-dispatch push on the comm stream.
  const MlpBackward routed{{p.rows_capacity, p.group_row_offset, p.num_local_experts, overlap.gemm_ctas()},
                           I,
                           p.x_rows,
                           p.dy_rows,
                           p.g_rows,
                           p.u_rows,
                           p.act_rows,
                           p.d_gu_rows,
                           p.dx_rows,
                           &in.routed,
                           &args.d_routed};
  for (int c = 0; c < overlap.num_chunks(); ++c) {
    const int e0 = overlap.chunk_begin(c), e1 = overlap.chunk_begin(c + 1);
    overlap.wait(stream, pulled[c]);
    launch_mlp_data_grads(routed, e0, e1 - e0, H, activation, stream);
    overlap.comm_after_main();
    combine::combine_push_kernel<kCommThreads>
        <<<overlap.comm_sms(), kCommThreads, 0, comm>>>(p, p.dx_rows, p.sym_dx_slots, e0, e1);
  }
  POUNCE_CUDA(cudaGetLastError());
  timer.mark("data_grad_chunks");
  // Weight gradients over every expert's whole segment (experts without rows get zeros).
  launch_mlp_weight_grads(routed, H, args.accumulate_weight_grads, stream);
  timer.mark("weight_grads");
  overlap.main_after_comm();
  timer.mark("join");

  // 5. Token side: every d_x pair has arrived after the barrier; fixed-order sum.
  launch_barrier(p, layout::WaitId::kBackwardCombineBarrier, stream);
  timer.mark("barrier");
  if (num_tokens > 0) {
    combine::weighted_sum_kernel<kCopyThreads><<<copy_grid, kCopyThreads, 0, stream>>>(
        p, p.sym_dx_slots, nullptr, Is > 0 ? p.shared_dx : nullptr, args.d_x.data, num_tokens);
  }
  timer.mark("sum");
  POUNCE_CUDA(cudaGetLastError());
}

}  // namespace pounce::gpu
