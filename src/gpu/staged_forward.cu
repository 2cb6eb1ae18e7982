// The staged forward (DESIGN.md §4): the chain of standalone stage kernels, each a thin wrapper over the
// device function the fused kernel will call. Stream-ordered, nothing allocated, no routing count read on
// the host (every kernel reads group_row_offset on the device), so the whole chain is capturable in a CUDA
// graph and replays with new routing written into the same input buffers.
//
//   stage x -> routing exchange -> barrier -> schedule (count, scan, place) -> dispatch pull ->
//   grouped gate/up (El groups) -> grouped down -> shared expert (1 group, own rows) ->
//   combine push -> barrier -> weighted sum
//
// Cross-GPU ordering exists only at the two phase barriers (system-scope release/acquire, flags.cuh).
#include <cuda_runtime.h>

#include <cmath>
#include <limits>

#include "kernels/combine/combine.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "kernels/gemm/grouped_gemm.h"
#include "kernels/routing/routing_exchange.cuh"
#include "kernels/routing/schedule.cuh"
#include "src/gpu/gpu_state.h"

namespace pounce::gpu {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kScanThreads = 512;

bool aligned_16(const void* pointer) {
  return reinterpret_cast<uintptr_t>(pointer) % 16 == 0;
}

}  // namespace

kernels::ActivationParams activation_params(const Activation& activation) {
  kernels::ActivationParams params;
  params.kind =
      activation.kind == ActivationKind::kSwiGLU ? kernels::kActivationSwiGLU : kernels::kActivationGptOss;
  params.clamp_limit =
      activation.clamp_limit ? *activation.clamp_limit : std::numeric_limits<float>::infinity();
  params.alpha = activation.alpha;
  return params;
}

void launch_barrier(const layout::WorkspacePointers& p, layout::WaitId which, cudaStream_t stream) {
  if (p.num_ranks == 1) return;
  POUNCE_CHECK(p.num_ranks <= kBarrierThreads, "num_ranks = ", p.num_ranks, " exceeds ", kBarrierThreads);
  routing::phase_barrier_kernel<kBarrierThreads><<<1, kBarrierThreads, 0, stream>>>(p, which);
}

void launch_staged_forward(GpuWorkspace& workspace, const ForwardArgs& args, cudaStream_t stream,
                           bool write_out) {
  DeviceGuard guard(workspace.device);
  const layout::WorkspacePointers p = workspace.pointers();
  const int64_t num_tokens = args.x.shape.empty() ? 0 : args.x.shape[0];
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate;
  POUNCE_CHECK(num_tokens >= 0 && num_tokens <= p.max_tokens, "x has ", num_tokens,
               " tokens but the workspace was created for max_tokens = ", p.max_tokens);
  POUNCE_CHECK(num_tokens == 0 || aligned_16(args.x.data), "x must be 16-byte aligned on the GPU backend");
  POUNCE_CHECK(!write_out || num_tokens == 0 || aligned_16(args.out.data),
               "out must be 16-byte aligned on the GPU backend");
  const bool idx_int64 = args.topk_idx.dtype == DType::kInt64;
  const kernels::ActivationParams activation = activation_params(workspace.config.activation);
  const int copy_grid = workspace.num_sms * 4;

  // 1. This rank's x into its symmetric buffer (peers pull from it), shared-expert row offsets.
  dispatch::stage_x_kernel<kCopyThreads><<<copy_grid, kCopyThreads, 0, stream>>>(p, args.x.data, num_tokens);
  // 2. Routing exchange: topk_idx (int32) and T into every peer; barrier.
  routing::routing_exchange_kernel<kCopyThreads>
      <<<copy_grid, kCopyThreads, 0, stream>>>(p, args.topk_idx.data, idx_int64, num_tokens);
  launch_barrier(p, layout::WaitId::kRoutingBarrier, stream);
  // 3. Receive schedule on the device.
  const dim3 schedule_grid(
      static_cast<unsigned>(layout::ceil_div(p.max_chunks, routing::kScheduleWarpsPerBlock)),
      static_cast<unsigned>(p.num_ranks));
  const size_t schedule_smem = routing::kScheduleWarpsPerBlock * p.num_local_experts * sizeof(int32_t);
  routing::schedule_count_kernel<routing::kScheduleThreads>
      <<<schedule_grid, routing::kScheduleThreads, schedule_smem, stream>>>(p);
  routing::schedule_scan_kernel<kScanThreads><<<1, kScanThreads, 0, stream>>>(p);
  routing::schedule_place_kernel<routing::kScheduleThreads>
      <<<schedule_grid, routing::kScheduleThreads, schedule_smem, stream>>>(p);
  // 4. Dispatch: pull token rows into expert-grouped rows.
  dispatch::dispatch_pull_kernel<kCopyThreads><<<copy_grid, kCopyThreads, 0, stream>>>(p);
  POUNCE_CUDA(cudaGetLastError());

  // 5. Routed experts: rows per group come from group_row_offset on the device.
  const kernels::GroupedRows routed{p.rows_capacity, p.group_row_offset, p.num_local_experts};
  kernels::grouped_gate_up(routed, p.x_rows, args.routed.gate.data, args.routed.up.data, p.g_rows, p.u_rows,
                           p.act_rows, I, H, activation, stream);
  kernels::grouped_gemm(routed, p.act_rows, args.routed.down.data, p.y_rows, H, I, stream);
  // 6. Shared expert on this rank's own rows (sym_x, T padded to 128 with zero rows).
  if (Is > 0 && num_tokens > 0) {
    const kernels::GroupedRows shared{p.token_capacity, p.shared_row_offset, 1};
    const void* sym_x = p.local_sym<const void>(p.sym_x);
    kernels::grouped_gate_up(shared, sym_x, args.shared.gate.data, args.shared.up.data, p.shared_g,
                             p.shared_u, p.shared_act, Is, H, activation, stream);
    kernels::grouped_gemm(shared, p.shared_act, args.shared.down.data, p.shared_y, H, Is, stream);
  }

  // 7. Combine: push rows into the owners' slots; barrier; weighted sum over slots.
  combine::combine_push_kernel<kCopyThreads>
      <<<copy_grid, kCopyThreads, 0, stream>>>(p, p.y_rows, p.sym_y_slots);
  launch_barrier(p, layout::WaitId::kCombineBarrier, stream);
  if (write_out && num_tokens > 0) {
    combine::weighted_sum_kernel<kCopyThreads>
        <<<copy_grid, kCopyThreads, 0, stream>>>(p, p.sym_y_slots, args.topk_weights.as<const float>(),
                                                 Is > 0 ? p.shared_y : nullptr, args.out.data, num_tokens);
  }
  POUNCE_CUDA(cudaGetLastError());
}

}  // namespace pounce::gpu
