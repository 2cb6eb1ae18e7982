// The staged backward (docs/design.md §1, §4): the chain of standalone stage kernels that the fused backward
// kernel (src/gpu/fused_backward.cu) runs as one launch between the same prologue and epilogue.
// Stream-ordered, nothing allocated, no routing count read on the host: the schedule, row offsets and routed
// activations of the forward context drive every kernel on the device, so the whole chain is capturable in a
// CUDA graph together with the forward.
//
//   token side   stage d_out, topk_weights -> router gradient <d_out, y> from the forward's slots -> barrier
//   shared       the MLP backward on the rank's own rows with dy = d_out, and its weight gradients
//   expert side  per chunk of local experts: reverse-combine pull dy = bf16(w d_out) [comm stream] ->
//                d_a GEMM (w_down read transposed) with the activation backward in its epilogue -> d_x GEMM
//                over [d_g, d_u] . [w_gate; w_up] -> reverse-dispatch push into the owners' (token, slot)
//                [comm stream]; then the weight gradients of every expert
//   token side   barrier -> d_x[t] = bf16(d_xs[t] + sum_j d_x[t, j]) in ascending j
// With a macrobatch ring the expert side runs once per possible macrobatch, last first; every macrobatch but
// the resident last one first replays its forward rows (pull x, gate/up + activation: bitwise the forward's).
//
// Weight gradients reduce over each expert's whole row segment in one CTA per output tile, ascending rows
// (bitwise deterministic); an expert without rows gets zeros. The forward context is read, never changed (a
// ring's replays overwrite its rows and the restore puts back the forward's, bitwise), so backward may run
// again on the same context.
#include <cuda_runtime.h>

#include "kernels/backward/reverse_combine.cuh"
#include "kernels/combine/combine.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "src/gpu/fp8_routed.h"
#include "src/gpu/grouped_gemm.h"
#include "src/gpu/gpu_state.h"
#include "src/gpu/mlp_backward.h"
#include "src/gpu/overlap.h"
#include "src/gpu/profile.h"

namespace pounce::gpu {
namespace {

// Data gradients of groups [first_group, first_group + num_groups) of m (a pipeline chunk).
void launch_mlp_data_grads(const MlpBackward& m, int first_group, int num_groups, int64_t H,
                           const kernels::ActivationParams& activation, cudaStream_t stream) {
  const int64_t I = m.intermediate;
  kernels::GroupedRows rows = m.rows;
  rows.group_row_offset += first_group;
  if (rows.group_rows != nullptr) rows.group_rows += first_group;
  rows.num_groups = num_groups;
  void* d_u = static_cast<char*>(m.d_gu) + I * 2;
  kernels::grouped_activation_backward(rows, m.dy, expert_slice(m.weights.down, first_group), m.g, m.u,
                                       m.d_gu, d_u, 2 * I, I, H, activation, stream,
                                       kernels::activation_backward_schedule_for(activation));
  kernels::grouped_gemm_transposed(rows, m.d_gu, expert_slice(m.weights.gate, first_group),
                                   expert_slice(m.weights.up, first_group), I, m.dx, H, 2 * I, stream);
}

// The down gradient on m.rows.max_ctas SMs, the gate and up gradients on `later_ctas`: the routed ones run
// after the last chunk's d_x push has had the down gradient's time (0.4 ms of deepseek's 3 ms) to finish, so
// they take the communication SMs too (a CTA whose SM is still pushing starts a little late).
void launch_mlp_weight_grads(const MlpBackward& m, int64_t H, bool accumulate, int later_ctas,
                             cudaStream_t stream) {
  const int64_t I = m.intermediate;
  const void* d_u = static_cast<const char*>(m.d_gu) + I * 2;
  const WeightGradPlan plan = weight_grad_plan(*m.grads, I);
  if (plan.down)
    kernels::grouped_weight_grad(m.rows, m.dy, H, H, m.act, I, I, m.grads->down.data,
                                 weight_grad_mode(m.grads->down, accumulate), stream, m.weight_grad_schedule);
  kernels::GroupedRows later = m.rows;
  later.max_ctas = later_ctas;
  if (plan.gate)
    kernels::grouped_weight_grad(later, m.d_gu, 2 * I, plan.gate_m, m.x, H, H, m.grads->gate.data,
                                 weight_grad_mode(m.grads->gate, accumulate), stream, m.weight_grad_schedule);
  if (plan.up)
    kernels::grouped_weight_grad(later, d_u, 2 * I, I, m.x, H, H, m.grads->up.data,
                                 weight_grad_mode(m.grads->up, accumulate), stream, m.weight_grad_schedule);
}

}  // namespace

BackwardLaunch launch_backward_prologue(GpuWorkspace& workspace, const BackwardArgs& args, StageTimer& timer,
                                        cudaStream_t stream) {
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  const ForwardArgs& in = args.inputs;
  BackwardLaunch launch;
  launch.num_tokens = num_tokens_of(args);
  const int64_t num_tokens = launch.num_tokens;
  POUNCE_CHECK(num_tokens >= 0 && num_tokens <= p.max_tokens, "x has ", num_tokens,
               " tokens but the workspace was created for max_tokens = ", p.max_tokens);
  POUNCE_CHECK(num_tokens == 0 || (aligned_16(args.d_out.data) && aligned_16(args.d_x.data)),
               "d_out and d_x must be 16-byte aligned on the GPU backend");
  // Checked before the first kernel is queued: a launcher refusing later would leave peers at a barrier.
  check_weights_aligned(in.routed, "routed");
  check_weights_aligned(in.shared, "shared");
  check_weights_aligned(args.d_routed, "d_routed");
  check_weights_aligned(args.d_shared, "d_shared");
  launch.activation = activation_params(workspace.config.activation);
  const int copy_grid = workspace.num_sms * 4;

  // 1. Token side: stage d_out and the router weights for the owners' pulls; router gradient from the
  //    forward's slots; barrier.
  kernels::reverse_combine::stage_inputs_kernel<kCopyThreads><<<copy_grid, kCopyThreads, 0, stream>>>(
      p, args.d_out.data, in.topk_weights.as<const float>(), num_tokens);
  if (num_tokens > 0) {
    kernels::reverse_combine::router_grad_kernel<kCopyThreads><<<copy_grid, kCopyThreads, 0, stream>>>(
        p, args.d_out.data, args.d_topk_weights.as<float>(), num_tokens);
  }
  timer.mark("stage+router_grad");
  launch_barrier(p, kernels::layout::WaitId::kBackwardInputsBarrier, stream);
  timer.mark("barrier");
  POUNCE_CUDA(cudaGetLastError());
  return launch;
}

void launch_backward_epilogue(GpuWorkspace& workspace, const BackwardArgs& args, const BackwardLaunch& launch,
                              StageTimer& timer, cudaStream_t stream) {
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  // 5. Token side: every d_x pair has arrived after the barrier; fixed-order sum.
  launch_barrier(p, kernels::layout::WaitId::kBackwardCombineBarrier, stream);
  timer.mark("barrier");
  if (launch.num_tokens > 0) {
    kernels::combine::weighted_sum_kernel<kCopyThreads><<<workspace.num_sms * 4, kCopyThreads, 0, stream>>>(
        p, p.sym_dx_slots, nullptr, p.shared_intermediate > 0 ? p.shared_dx : nullptr, args.d_x.data,
        launch.num_tokens);
  }
  timer.mark("sum");
  POUNCE_CUDA(cudaGetLastError());
}

void launch_forward_replay(GpuWorkspace& workspace, const BackwardArgs& args,
                           const kernels::ActivationParams& activation,
                           const kernels::layout::WorkspacePointers& replay, cudaStream_t stream) {
  const int El = replay.num_local_experts;
  if (workspace.config.precision == Precision::kFP8) {
    launch_fp8_pull_x(replay, 0, El, workspace.num_sms, stream);
    launch_fp8_expert_forward(replay, *args.inputs.routed_fp8, 0, El, 0, activation, /*with_down=*/false,
                              stream);
    POUNCE_CUDA(cudaGetLastError());
    return;
  }
  kernels::dispatch::dispatch_pull_kernel<kCommThreads>
      <<<workspace.num_sms, kCommThreads, 0, stream>>>(replay, 0, El);
  const kernels::GroupedRows rows{
      replay.rows_capacity, replay.group_row_offset,       El, 0, nullptr, replay.group_rows,
      replay.gemm_error(),  replay.gemm_failure_injected()};
  kernels::grouped_gate_up(rows, replay.x_rows, expert_slice(args.inputs.routed.gate),
                           expert_slice(args.inputs.routed.up), replay.g_rows, replay.u_rows, replay.act_rows,
                           replay.intermediate, replay.hidden, activation, stream);
  POUNCE_CUDA(cudaGetLastError());
}

void launch_context_restore(GpuWorkspace& workspace, const BackwardArgs& args,
                            const kernels::ActivationParams& activation, cudaStream_t stream) {
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  if (!p.has_ring()) return;
  for (int32_t b = 0; b < p.max_macrobatches; ++b)
    launch_forward_replay(workspace, args, activation,
                          p.macrobatch(b, kernels::layout::MacrobatchRows::kRestore), stream);
}

namespace {

// One macrobatch's routed backward (the whole routed part without a ring) on mb = p.macrobatch(b), with the
// shared expert's backward in the first one to run.
void launch_macrobatch_backward(GpuWorkspace& workspace, const BackwardArgs& args,
                                const BackwardLaunch& launch, const kernels::layout::WorkspacePointers& p,
                                int32_t b, bool with_shared, StageTimer& timer, cudaStream_t stream) {
  const kernels::layout::WorkspacePointers mb = p.macrobatch(b);
  const int64_t H = p.hidden, Is = p.shared_intermediate;
  const kernels::ActivationParams& activation = launch.activation;
  // Only the last macrobatch's x, g, u, act rows are resident after the forward: replay the others'.
  if (p.has_ring())
    launch_forward_replay(workspace, args, activation,
                          p.macrobatch(b, kernels::layout::MacrobatchRows::kReplay), stream);

  // 2-4 overlapped (src/gpu/overlap.h): the comm stream pulls chunk c's scaled d_out rows while earlier
  // chunks compute, and pushes chunk c's d_x rows while later chunks compute; the shared expert covers the
  // first pull and the routed weight gradients cover the last push.
  Overlap overlap(workspace, stream, workspace.config.backward_comm_sms);
  cudaStream_t comm = overlap.comm();
  overlap.comm_after_main();
  cudaEvent_t pulled[kMaxChunks];
  for (int c = 0; c < overlap.num_chunks(); ++c) {
    kernels::reverse_combine::pull_scaled_rows_kernel<kCommThreads>
        <<<overlap.comm_sms(), kCommThreads, 0, comm>>>(mb, overlap.chunk_begin(c),
                                                        overlap.chunk_begin(c + 1));
    pulled[c] = overlap.mark(comm);
  }
  POUNCE_CUDA(cudaGetLastError());

  if (with_shared) {
    const MlpBackward shared = shared_mlp_backward(p, args, overlap.gemm_ctas());
    if (Is > 0 && launch.num_tokens > 0) launch_mlp_data_grads(shared, 0, 1, H, activation, stream);
    if (Is > 0)
      launch_mlp_weight_grads(shared, H, args.accumulate_weight_grads, shared.rows.max_ctas, stream);
    timer.mark("shared");
  }
  // Routed experts, chunk by chunk: data gradients, then the reverse-dispatch push on the comm stream.
  if (workspace.config.precision == Precision::kFP8) {
    for (int c = 0; c < overlap.num_chunks(); ++c) {
      const int e0 = overlap.chunk_begin(c), e1 = overlap.chunk_begin(c + 1);
      overlap.wait(stream, pulled[c]);
      launch_fp8_data_grads(mb, *args.inputs.routed_fp8, e0, e1, overlap.gemm_ctas(), activation,
                            weight_grad_plan(args.d_routed, p.intermediate), stream);
      overlap.comm_after_main();
      kernels::combine::combine_push_kernel<kCommThreads>
          <<<overlap.comm_sms(), kCommThreads, 0, comm>>>(mb, mb.dx_rows, mb.sym_dx_slots, e0, e1);
    }
    POUNCE_CUDA(cudaGetLastError());
    timer.mark("data_grad_chunks");
    launch_fp8_weight_grads(mb, args.d_routed, args.accumulate_weight_grads, p.owned_experts(b),
                            overlap.gemm_ctas(), workspace.num_sms, stream);
    timer.mark("weight_grads");
    overlap.main_after_comm();
    timer.mark("join");
    return;
  }
  MlpBackward routed = routed_mlp_backward(mb, args, overlap.gemm_ctas());
  routed.rows.group_active = p.owned_experts(b);  // weight gradients of the experts b holds (all: no ring)
  for (int c = 0; c < overlap.num_chunks(); ++c) {
    const int e0 = overlap.chunk_begin(c), e1 = overlap.chunk_begin(c + 1);
    overlap.wait(stream, pulled[c]);
    launch_mlp_data_grads(routed, e0, e1 - e0, H, activation, stream);
    overlap.comm_after_main();
    kernels::combine::combine_push_kernel<kCommThreads>
        <<<overlap.comm_sms(), kCommThreads, 0, comm>>>(mb, mb.dx_rows, mb.sym_dx_slots, e0, e1);
  }
  POUNCE_CUDA(cudaGetLastError());
  timer.mark("data_grad_chunks");
  // Weight gradients over every expert's whole segment (experts without rows get zeros).
  launch_mlp_weight_grads(routed, H, args.accumulate_weight_grads, workspace.num_sms, stream);
  timer.mark("weight_grads");
  overlap.main_after_comm();  // the next macrobatch overwrites the ring rows these transfers read
  timer.mark("join");
}

}  // namespace

void launch_staged_backward(GpuWorkspace& workspace, const BackwardArgs& args, cudaStream_t stream) {
  DeviceGuard guard(workspace.device);
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  StageTimer timer("backward", p, stream);
  const BackwardLaunch launch = launch_backward_prologue(workspace, args, timer, stream);
  // Every possible macrobatch, last first (one without a ring): the forward left the last one resident.
  for (int32_t b = p.max_macrobatches - 1; b >= 0; --b)
    launch_macrobatch_backward(workspace, args, launch, p, b, b == p.max_macrobatches - 1, timer, stream);
  launch_context_restore(workspace, args, launch.activation, stream);
  launch_backward_epilogue(workspace, args, launch, timer, stream);
}

}  // namespace pounce::gpu
