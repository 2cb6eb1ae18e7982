// The staged forward (docs/design.md §4): the chain of standalone stage kernels, each a thin wrapper over the
// device function the fused kernel will call. Stream-ordered, nothing allocated, no routing count read on
// the host (every kernel reads group_row_offset on the device), so the whole chain is capturable in a CUDA
// graph and replays with new routing written into the same input buffers.
//
//   stage x -> routing exchange -> barrier -> schedule (count, scan, place) [-> macrobatch plan] ->
//   per macrobatch (one without a ring):
//     [comm stream]  dispatch pull per expert chunk ........ combine push per chunk
//     [caller]       shared expert (first only) -> per chunk: grouped gate/up -> grouped down
//   -> barrier -> weighted sum
//
// Cross-GPU ordering exists only at the two phase barriers (system-scope release/acquire, flags.cuh);
// the two streams hand over through events (src/gpu/overlap.h).
#include <cuda_runtime.h>

#include <cmath>
#include <limits>

#include "kernels/combine/combine.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "src/gpu/grouped_gemm.h"
#include "kernels/routing/routing_exchange.cuh"
#include "kernels/routing/schedule.cuh"
#include "kernels/sched/macrobatch_plan.cuh"
#include "src/gpu/fp8_routed.h"
#include "src/gpu/gpu_state.h"
#include "src/gpu/overlap.h"
#include "src/gpu/profile.h"

namespace pounce::gpu {
namespace {

constexpr int kScanThreads = 512;

}  // namespace

bool aligned_16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

kernels::WeightRows expert_slice(const TensorView& weights, int64_t first_expert) {
  const int64_t rank = weights.rank();
  const int64_t row_stride = weights.stride(rank - 2);
  const int64_t group_stride = rank == 3 ? weights.stride(0) : weights.shape[0] * row_stride;
  return {static_cast<const char*>(weights.data) + first_expert * group_stride * size_of(weights.dtype),
          group_stride, row_stride};
}

void check_weights_aligned(const ExpertWeights& weights, const char* name) {
  for (const TensorView* t : {&weights.gate, &weights.up, &weights.down}) {
    POUNCE_CHECK(t->data == nullptr || reinterpret_cast<uintptr_t>(t->data) % 16 == 0, "'", name,
                 "' tensors must be 16-byte aligned on the GPU backend (TMA); pass tensors from the caching "
                 "allocator or cudaMalloc");
  }
}

kernels::ActivationParams activation_params(const Activation& activation) {
  kernels::ActivationParams params;
  params.kind =
      activation.kind == ActivationKind::kSwiGLU ? kernels::kActivationSwiGLU : kernels::kActivationGptOss;
  params.clamp_limit =
      activation.clamp_limit ? *activation.clamp_limit : std::numeric_limits<float>::infinity();
  params.alpha = activation.alpha;
  return params;
}

void launch_barrier(const kernels::layout::WorkspacePointers& p, kernels::layout::WaitId which,
                    cudaStream_t stream) {
  if (p.num_ranks == 1 && !p.injects(which)) return;  // no peer to wait for (unless a test makes it fail)
  POUNCE_CHECK(p.num_ranks <= kBarrierThreads, "num_ranks = ", p.num_ranks, " exceeds ", kBarrierThreads);
  kernels::routing::phase_barrier_kernel<kBarrierThreads><<<1, kBarrierThreads, 0, stream>>>(p, which);
}

ForwardLaunch check_forward_args(GpuWorkspace& workspace, const ForwardArgs& args, bool write_out) {
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  ForwardLaunch launch;
  launch.num_tokens = args.x.shape.empty() ? 0 : args.x.shape[0];
  const int64_t num_tokens = launch.num_tokens;
  POUNCE_CHECK(num_tokens >= 0 && num_tokens <= p.max_tokens, "x has ", num_tokens,
               " tokens but the workspace was created for max_tokens = ", p.max_tokens);
  POUNCE_CHECK(num_tokens == 0 || aligned_16(args.x.data), "x must be 16-byte aligned on the GPU backend");
  POUNCE_CHECK(!write_out || num_tokens == 0 || aligned_16(args.out.data),
               "out must be 16-byte aligned on the GPU backend");
  // Checked before the first kernel is queued: a launcher refusing later would leave peers at a barrier.
  check_weights_aligned(args.routed, "routed");
  check_weights_aligned(args.shared, "shared");
  if (workspace.config.precision == Precision::kFP8) check_fp8_forward_args(args);
  launch.activation = activation_params(workspace.config.activation);
  launch.idx_int64 = args.topk_idx.dtype == DType::kInt64;
  return launch;
}

ForwardLaunch launch_forward_prologue(GpuWorkspace& workspace, const ForwardArgs& args, bool write_out,
                                      StageTimer& timer, cudaStream_t stream) {
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  const ForwardLaunch launch = check_forward_args(workspace, args, write_out);
  const int64_t num_tokens = launch.num_tokens;
  const int copy_grid = workspace.num_sms * 4;

  // 1. This rank's x into its symmetric buffer (peers pull from it), shared-expert row offsets.
  kernels::dispatch::stage_x_kernel<kCopyThreads>
      <<<copy_grid, kCopyThreads, 0, stream>>>(p, args.x.data, num_tokens);
  // FP8: x_q = q1x128_H(x) beside it, the rows peers pull (the shared expert reads the bf16 x).
  if (workspace.config.precision == Precision::kFP8)
    launch_fp8_stage_x(workspace, args.x.data, num_tokens, stream);
  // 2. Routing exchange: topk_idx (int32) and T into every peer; barrier.
  kernels::routing::routing_exchange_kernel<kCopyThreads>
      <<<copy_grid, kCopyThreads, 0, stream>>>(p, args.topk_idx.data, launch.idx_int64, num_tokens);
  timer.mark("stage+exchange");
  launch_barrier(p, kernels::layout::WaitId::kRoutingBarrier, stream);
  timer.mark("barrier");
  // 3. Receive schedule on the device.
  const dim3 schedule_grid(static_cast<unsigned>(kernels::layout::ceil_div(
                               p.max_chunks, kernels::routing::kScheduleWarpsPerBlock)),
                           static_cast<unsigned>(p.num_ranks));
  const size_t schedule_smem =
      kernels::routing::kScheduleWarpsPerBlock * p.num_local_experts * sizeof(int32_t);
  kernels::routing::schedule_count_kernel<kernels::routing::kScheduleThreads>
      <<<schedule_grid, kernels::routing::kScheduleThreads, schedule_smem, stream>>>(p);
  kernels::routing::schedule_scan_kernel<kScanThreads><<<1, kScanThreads, 0, stream>>>(p);
  kernels::routing::schedule_place_kernel<kernels::routing::kScheduleThreads>
      <<<schedule_grid, kernels::routing::kScheduleThreads, schedule_smem, stream>>>(p);
  if (p.has_ring()) {
    constexpr int kPlanThreads = kernels::sched::kPlanThreads;
    kernels::sched::plan_macrobatches_kernel<kPlanThreads>
        <<<workspace.num_sms, kPlanThreads, 0, stream>>>(p, true);
  }
  POUNCE_CUDA(cudaGetLastError());
  timer.mark("schedule");
  return launch;
}

void launch_forward_epilogue(GpuWorkspace& workspace, const ForwardArgs& args, const ForwardLaunch& launch,
                             bool write_out, StageTimer& timer, cudaStream_t stream) {
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  // 8. Every output row has reached its owner after the barrier; weighted sum over slots.
  launch_barrier(p, kernels::layout::WaitId::kCombineBarrier, stream);
  timer.mark("barrier");
  launch_weighted_sum(workspace, args, launch, write_out, stream);
  timer.mark("sum");
}

void launch_weighted_sum(GpuWorkspace& workspace, const ForwardArgs& args, const ForwardLaunch& launch,
                         bool write_out, cudaStream_t stream) {
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  if (write_out && launch.num_tokens > 0) {
    kernels::combine::weighted_sum_kernel<kCopyThreads><<<workspace.num_sms * 4, kCopyThreads, 0, stream>>>(
        p, p.sym_y_slots, args.topk_weights.as<const float>(),
        p.shared_intermediate > 0 ? p.shared_y : nullptr, args.out.data, launch.num_tokens);
  }
  POUNCE_CUDA(cudaGetLastError());
}

// One macrobatch's routed work (the whole routed part without a ring), on `mb` = p.macrobatch(b), and with
// the shared expert in macrobatch 0.
void launch_macrobatch_forward(GpuWorkspace& workspace, const ForwardArgs& args, const ForwardLaunch& launch,
                               const kernels::layout::WorkspacePointers& mb, bool with_shared,
                               StageTimer& timer, cudaStream_t stream) {
  const int64_t H = mb.hidden, I = mb.intermediate, Is = mb.shared_intermediate;
  const kernels::ActivationParams& activation = launch.activation;
  // 4-7 overlapped (src/gpu/overlap.h): the comm stream pulls chunk c's rows while the GEMMs of chunk c - 1
  // run, and pushes chunk c's outputs while chunk c + 1 computes. The shared expert needs no transfer, so
  // it runs first and covers the first pull.
  Overlap overlap(workspace, stream, workspace.config.forward_comm_sms);
  cudaStream_t comm = overlap.comm();
  overlap.comm_after_main();
  const bool fp8 = workspace.config.precision == Precision::kFP8;
  cudaEvent_t pulled[kMaxChunks];
  for (int c = 0; c < overlap.num_chunks(); ++c) {
    if (fp8) {
      launch_fp8_pull_x(mb, overlap.chunk_begin(c), overlap.chunk_begin(c + 1), overlap.comm_sms(), comm);
    } else {
      kernels::dispatch::dispatch_pull_kernel<kCommThreads><<<overlap.comm_sms(), kCommThreads, 0, comm>>>(
          mb, overlap.chunk_begin(c), overlap.chunk_begin(c + 1));
    }
    pulled[c] = overlap.mark(comm);
  }
  POUNCE_CUDA(cudaGetLastError());
  if (with_shared && Is > 0 && launch.num_tokens > 0) {  // own rows: sym_x, T padded to 128 with zero rows
    const kernels::GroupedRows shared{
        mb.token_capacity, mb.shared_row_offset,      1, overlap.gemm_ctas(), nullptr, nullptr,
        mb.gemm_error(),   mb.gemm_failure_injected()};
    const void* sym_x = mb.local_sym<const void>(mb.sym_x);
    kernels::grouped_gate_up(shared, sym_x, expert_slice(args.shared.gate), expert_slice(args.shared.up),
                             mb.shared_g, mb.shared_u, mb.shared_act, Is, H, activation, stream);
    kernels::grouped_gemm(shared, mb.shared_act, expert_slice(args.shared.down), mb.shared_y, H, Is, stream);
  }
  if (with_shared) timer.mark("shared");
  for (int c = 0; c < overlap.num_chunks(); ++c) {
    const int e0 = overlap.chunk_begin(c), e1 = overlap.chunk_begin(c + 1);
    overlap.wait(stream, pulled[c]);
    if (fp8) {
      launch_fp8_expert_forward(mb, *args.routed_fp8, e0, e1, overlap.gemm_ctas(), activation,
                                /*with_down=*/true, stream);
    } else {
      const kernels::GroupedRows routed{
          mb.rows_capacity, mb.group_row_offset + e0, e1 - e0,         overlap.gemm_ctas(),
          nullptr,          mb.group_rows + e0,       mb.gemm_error(), mb.gemm_failure_injected()};
      kernels::grouped_gate_up(routed, mb.x_rows, expert_slice(args.routed.gate, e0),
                               expert_slice(args.routed.up, e0), mb.g_rows, mb.u_rows, mb.act_rows, I, H,
                               activation, stream);
      kernels::grouped_gemm(routed, mb.act_rows, expert_slice(args.routed.down, e0), mb.y_rows, H, I, stream);
    }
    overlap.comm_after_main();
    kernels::combine::combine_push_kernel<kCommThreads>
        <<<overlap.comm_sms(), kCommThreads, 0, comm>>>(mb, mb.y_rows, mb.sym_y_slots, e0, e1);
  }
  timer.mark("chunks");
  overlap.main_after_comm();  // the next macrobatch overwrites the ring rows these transfers read
  timer.mark("join");
  POUNCE_CUDA(cudaGetLastError());
}

void launch_staged_forward(GpuWorkspace& workspace, const ForwardArgs& args, cudaStream_t stream,
                           bool write_out) {
  DeviceGuard guard(workspace.device);
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  StageTimer timer("forward", p, stream);
  const ForwardLaunch launch = launch_forward_prologue(workspace, args, write_out, timer, stream);
  // Every possible macrobatch in order (one without a ring); those past the plan's count find no rows.
  for (int32_t b = 0; b < p.max_macrobatches; ++b)
    launch_macrobatch_forward(workspace, args, launch, p.macrobatch(b), b == 0, timer, stream);
  launch_forward_epilogue(workspace, args, launch, write_out, timer, stream);
}

}  // namespace pounce::gpu
