// The fused forward (docs/design.md §2): the argument checks, a memset of the counters, then ONE
// persistent cooperative kernel for the pass (kernels/fused/fused_forward.cuh): stage x, routing exchange and
// barrier, schedule, dispatch, shared expert, gate/up + activation, down, combine and combine barrier; then
// the weighted sum kernel (memory-bound: kernels/fused/grid_steps.cuh says why it is not inside). With a
// macrobatch ring the same one kernel walks the macrobatches (fused_forward_kernel<true>), and a small kernel
// after it writes the macrobatch views the backward reads (kernels/sched/macrobatch_plan.cuh).
// Stream-ordered, nothing allocated, no routing count read on the host: capturable like the staged chain.
//
// Heuristic (docs/design.md, "Fused forward", from the EP2 sweeps there):
//   - several ranks and I < 1024 (qwen3: down tiles with a short mainloop, transfers heavy): the
//     communication CTAs push the combine, 20 of them (16: +16 %, 28: +5 % forward time), in
//     minibatches of 16 m-blocks (8: +9 %; with 24 CTAs 32: +3 %, 64: +8 %);
//   - otherwise the down epilogues scatter into the owners' slots and the communication CTAs only pull:
//     4 of them over several ranks (8 and 12 cost 2-9 %), 8 on one rank (a local copy; not swept); the
//     fused backward takes 8 over several ranks (its d_a tiles waited for the dy pulls behind 4: gpt-oss
//     backward 6.88 ms with 4, 6.40 with 8, 6.30 with 12; deepseek 26.3 with 8, 27.0 with 12);
//   - minibatches of 8 m-blocks (1024 rows) otherwise, about one wave of tiles each (16 within noise, 32
//     +3-7 %).
// The sweeps: docs/experiments/004-fused-forward-combines-and-heuristic.md.
// config.forward_comm_sms, minibatch_size and combine override (tests cover both combines on every shape).
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/fused/fused_forward.cuh"
#include "src/gpu/gemm_operands.h"
#include "src/gpu/gpu_state.h"
#include "src/gpu/overlap.h"
#include "src/gpu/profile.h"

namespace pounce::gpu {
namespace {

constexpr int kDefaultUnitBlocks = 8;
constexpr int kPushUnitBlocks = 16;
constexpr int kPushCommCtas = 20;
constexpr int kScatterCommCtas = 4;
constexpr int kBackwardScatterCommCtas = 8;
constexpr int kOneRankCommCtas = 8;
constexpr size_t kFusedSharedBytes = kernels::gemm::kSharedBytes;

// Zeroed counters (a memset node in a captured graph), then the kernel, cooperatively: the grid steps
// (kernels/fused/grid_steps.cuh) wait for every CTA, so all must be resident; the launch fails instead of
// hanging when they cannot be.
template <bool kRing>
void launch_fused_kernel(GpuWorkspace& workspace, const kernels::fused::FusedForwardParams& params,
                         cudaStream_t stream) {
  POUNCE_CUDA(cudaMemsetAsync(params.ws.fused_counters, 0,
                              workspace.layout.fused_counter_words * sizeof(uint32_t), stream));
  cudaLaunchAttribute cooperative{};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  cudaLaunchConfig_t launch_config{};
  launch_config.gridDim = dim3(static_cast<unsigned>(workspace.num_sms));
  launch_config.blockDim = dim3(kernels::gemm::GemmConfig::kNumThreads);
  launch_config.dynamicSmemBytes = kFusedSharedBytes;
  launch_config.stream = stream;
  launch_config.attrs = &cooperative;
  launch_config.numAttrs = 1;
  const cudaError_t launched =
      cudaLaunchKernelEx(&launch_config, kernels::fused::fused_forward_kernel<kRing>, params);
  if (launched == cudaErrorCooperativeLaunchTooLarge) {
    (void)cudaGetLastError();  // clear it: the call fails here, the workspace stays usable
    POUNCE_CHECK(
        false, "the fused forward needs one resident CTA on each of the device's ", workspace.num_sms,
        " SMs (a cooperative launch) and the device cannot give them now (an MPS or green-context SM "
        "limit?); use Config::kernel_path = KernelPath::kStaged");
  }
  POUNCE_CUDA(launched);
}

}  // namespace

bool fused_push_combine(const GpuWorkspace& workspace) {
  if (workspace.config.combine != CombineMode::kAuto) return workspace.config.combine == CombineMode::kPush;
  return workspace.layout.num_ranks > 1 && workspace.layout.intermediate < kCommHeavyIntermediate;
}

int fused_comm_ctas(const GpuWorkspace& workspace, bool push_combine, int configured, FusedPass pass) {
  const int scatter_ctas = pass == FusedPass::kBackward ? kBackwardScatterCommCtas : kScatterCommCtas;
  const int heuristic = push_combine                     ? kPushCommCtas
                        : workspace.layout.num_ranks > 1 ? scatter_ctas
                                                         : kOneRankCommCtas;
  return std::clamp(configured > 0 ? configured : heuristic, 1, std::max(1, workspace.num_sms / 2));
}

int32_t fused_unit_blocks(const GpuWorkspace& workspace, bool push_combine) {
  const int64_t minibatch = workspace.config.minibatch_size;
  const int64_t heuristic_blocks = push_combine ? kPushUnitBlocks : kDefaultUnitBlocks;
  const int64_t max_m_blocks =
      std::max<int64_t>(1, workspace.layout.rows_capacity / kernels::layout::kBlockM);
  return static_cast<int32_t>(std::clamp<int64_t>(
      minibatch > 0 ? minibatch / kernels::layout::kBlockM : heuristic_blocks, 1, max_m_blocks));
}

void launch_fused_forward(GpuWorkspace& workspace, const ForwardArgs& args, cudaStream_t stream,
                          bool write_out) {
  DeviceGuard guard(workspace.device);
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate;
  const int El = p.num_local_experts;
  POUNCE_CHECK(H % 64 == 0 && I % 64 == 0 && Is % 64 == 0,
               "the fused kernel needs hidden, intermediate and "
               "shared_intermediate multiples of 64 (got ",
               H, ", ", I, ", ", Is, "); fix: pad the weights");
  // Communication CTAs are the first to start; with every SM one of them no tile would ever run.
  POUNCE_CHECK(workspace.num_sms >= 2, "the fused kernel needs at least 2 SMs (device ", workspace.device,
               " has ", workspace.num_sms, "); use Config::kernel_path = KernelPath::kStaged");
  set_shared_limit_once<kernels::fused::fused_forward_kernel<true>>(workspace.device, kFusedSharedBytes);
  set_shared_limit_once<kernels::fused::fused_forward_kernel<false>>(workspace.device, kFusedSharedBytes);
  // The prologue's schedule counters live in the stage ring's shared memory, one [El] array per warp.
  constexpr size_t kScratchBytes =
      sizeof(kernels::gemm::SharedStorage::stages) - sizeof(kernels::routing::ScanScratch);
  POUNCE_CHECK(kernels::fused::kWarps * El * sizeof(int32_t) <= kScratchBytes,
               "the fused kernel builds the schedule with ", kernels::fused::kWarps,
               " x num_local_experts counters in ", kScratchBytes,
               " bytes of shared memory; num_local_experts = ", El,
               " is too many: use Config::kernel_path = KernelPath::kStaged");
  StageTimer timer("forward", p, stream);
  const ForwardLaunch launch = check_forward_args(workspace, args, write_out);

  kernels::fused::FusedForwardParams params{};
  params.ws = p;
  params.in.x = args.x.data;
  params.in.topk_idx = args.topk_idx.data;
  params.in.num_tokens = launch.num_tokens;
  params.in.idx_int64 = launch.idx_int64;
  // The staged path's maps and arguments from the same builders, over the routed rows of the ring (all of
  // them without one) and the rank's own token rows. The tiles take their expert from the scheduler
  // (find_routed_block), not from the offsets in the arguments.
  const kernels::GroupedRows routed{p.ring_rows, p.group_row_offset, El, 0, nullptr, p.group_rows};
  params.gate_up = kernels::gate_up_operands(routed, p.x_rows, expert_slice(args.routed.gate),
                                             expert_slice(args.routed.up), p.g_rows, p.u_rows, p.act_rows, I,
                                             H, launch.activation);
  params.down = kernels::store_operands(routed, p.act_rows, expert_slice(args.routed.down), p.y_rows, H, I);
  if (Is > 0) {
    const kernels::GroupedRows shared{p.token_capacity, p.shared_row_offset, 1, 0};
    params.shared_gate_up = kernels::gate_up_operands(
        shared, p.local_sym<const void>(p.sym_x), expert_slice(args.shared.gate),
        expert_slice(args.shared.up), p.shared_g, p.shared_u, p.shared_act, Is, H, launch.activation);
    params.shared_down =
        kernels::store_operands(shared, p.shared_act, expert_slice(args.shared.down), p.shared_y, H, Is);
  } else {  // never read: the task list has no shared tiles
    params.shared_gate_up = params.gate_up;
    params.shared_down = params.down;
  }
  int32_t* gemm_error = p.gemm_error();
  for (kernels::GemmOperands* o :
       {&params.gate_up, &params.down, &params.shared_gate_up, &params.shared_down})
    o->args.error_flag = gemm_error;
  params.push_combine = fused_push_combine(workspace);
  params.comm_ctas =
      fused_comm_ctas(workspace, params.push_combine, workspace.config.forward_comm_sms, FusedPass::kForward);
  params.unit_blocks = fused_unit_blocks(workspace, params.push_combine);

  if (!p.has_ring()) {
    launch_fused_kernel<false>(workspace, params, stream);
  } else {
    launch_fused_kernel<true>(workspace, params, stream);
    // The backward's view of every macrobatch (kernels/sched/macrobatch_plan.cuh; the kernel planned the same
    // bounds in its scan step)
    constexpr int kPlanThreads = kernels::sched::kPlanThreads;
    kernels::sched::plan_macrobatches_kernel<kPlanThreads>
        <<<workspace.num_sms, kPlanThreads, 0, stream>>>(p, false);
    POUNCE_CUDA(cudaGetLastError());
  }
  timer.mark("fused");
  report_step_times(p, stream);
  launch_weighted_sum(workspace, args, launch, write_out, stream);
  timer.mark("sum");
}

}  // namespace pounce::gpu
