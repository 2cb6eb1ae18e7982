// The fused backward (docs/design.md §2): the shared prologue (stage d_out and the router weights,
// router gradient, inputs barrier), then ONE persistent kernel for the reverse-combine pull, the shared
// expert's backward, d_a + activation backward, d_x, the reverse-dispatch push and every weight gradient
// (kernels/fused/fused_backward.cuh), then the combine barrier and the d_x sum. With a macrobatch ring, one
// launch per possible macrobatch, last first; each replays its macrobatch's forward rows inside (pull x,
// gate/up + activation ahead of the backward tiles) unless it is the resident last one, and the staged
// replay kernels restore that one at the end. Stream-ordered, nothing allocated, no routing count read on the
// host: capturable like the staged chain.
//
// The communication CTAs and the combine (push or scatter) follow the fused forward's heuristic
// (src/gpu/fused_forward.cu): the d_x GEMM (N = H, K = 2I) stands where the down GEMM (N = H, K = I) stands
// in the forward, with the same row counts and transfer sizes. The minibatch is sized so that its d_a tiles
// fill the compute CTAs once (backward_unit_blocks).
// config.backward_comm_sms, minibatch_size and combine override here too.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/fused/fused_backward.cuh"
#include "src/gpu/gemm_operands.h"
#include "src/gpu/gpu_state.h"
#include "src/gpu/mlp_backward.h"
#include "src/gpu/overlap.h"
#include "src/gpu/profile.h"

namespace pounce::gpu {
namespace {

constexpr size_t kFusedSharedBytes = kernels::gemm::kSharedBytes;

// The operands of m's five GEMMs, exactly as the staged path's launchers build them for all groups at once.
struct MlpOperands {
  kernels::GemmOperands act_grad, data_grad;
  kernels::GemmOperands down, gate, up;  // weight gradients
};

MlpOperands mlp_operands(const MlpBackward& m, int64_t H, const kernels::ActivationParams& activation,
                         bool accumulate, int32_t* error_flag) {
  const int64_t I = m.intermediate;
  void* d_u = static_cast<char*>(m.d_gu) + I * 2;
  MlpOperands o{};
  o.act_grad = kernels::activation_backward_operands(m.rows, m.dy, expert_slice(m.weights.down), m.g, m.u,
                                                     m.d_gu, d_u, 2 * I, I, H, activation);
  o.data_grad = kernels::transposed_operands(m.rows, m.d_gu, expert_slice(m.weights.gate),
                                             expert_slice(m.weights.up), I, m.dx, H, 2 * I);
  // A weight gradient not computed keeps m = 0: the task list then holds none of its tiles.
  const WeightGradPlan plan = weight_grad_plan(*m.grads, I);
  if (plan.down)
    o.down = kernels::weight_grad_operands(m.rows, m.dy, H, H, m.act, I, I, m.grads->down.data,
                                           weight_grad_mode(m.grads->down, accumulate));
  if (plan.gate)
    o.gate = kernels::weight_grad_operands(m.rows, m.d_gu, 2 * I, plan.gate_m, m.x, H, H, m.grads->gate.data,
                                           weight_grad_mode(m.grads->gate, accumulate));
  if (plan.up)
    o.up = kernels::weight_grad_operands(m.rows, d_u, 2 * I, I, m.x, H, H, m.grads->up.data,
                                         weight_grad_mode(m.grads->up, accumulate));
  for (kernels::GemmOperands* g : {&o.act_grad, &o.data_grad, &o.down, &o.gate, &o.up})
    g->args.error_flag = error_flag;
  return o;
}

// m-blocks per minibatch: enough that one minibatch's d_a tiles fill every compute CTA once. A d_x tile
// waits for the d_a tiles of its m-block, which were handed out one minibatch earlier; with less than a wave
// between them (the forward's 8 m-blocks on deepseek: 64 d_a tiles for 128 CTAs) d_x tiles wait on d_a
// mainloops still running. config.minibatch_size overrides.
int32_t backward_unit_blocks(const GpuWorkspace& workspace, int comm_ctas) {
  const int64_t act_grad_n = std::max<int64_t>(
      1, kernels::layout::ceil_div(workspace.layout.intermediate, kernels::gemm::GemmConfig::BLOCK_N));
  const int64_t compute_ctas = std::max(1, workspace.num_sms - comm_ctas);
  const int64_t minibatch = workspace.config.minibatch_size;
  const int64_t max_m_blocks =
      std::max<int64_t>(1, workspace.layout.rows_capacity / kernels::layout::kBlockM);
  const int64_t blocks = minibatch > 0 ? minibatch / kernels::layout::kBlockM
                                       : kernels::layout::ceil_div(compute_ctas, act_grad_n);
  return static_cast<int32_t>(std::clamp<int64_t>(blocks, 1, max_m_blocks));
}

}  // namespace

// kAuto: the fused kernel where it measured faster than the stage kernels (2 x H200, 8192 tokens/rank, bf16
// weight gradients, same call; docs/design.md "Fused backward"): I >= 1024. EP2: gpt-oss-120b 6.30-6.40 vs
// 6.57 ms, deepseek-v3 26.3 vs 27.0 ms for the backward's kernels; one GPU, fwd+bwd: gpt-oss 12.72 vs 13.02,
// deepseek 47.12 vs 47.66 ms. qwen3-30b-a3b (I = 768: short GEMMs, the push combine over several ranks)
// keeps the stage kernels: EP2 2.60 vs 2.43 ms, one GPU fwd+bwd 4.66 vs 4.46 ms.
bool fused_backward_chosen(const GpuWorkspace& workspace) {
  if (workspace.config.precision == Precision::kFP8) return false;  // the fused kernels are BF16 only so far
  switch (workspace.config.backward_kernel_path) {
    case KernelPath::kFused:
      return true;
    case KernelPath::kStaged:
      return false;
    case KernelPath::kAuto:
      break;
  }
  return workspace.layout.intermediate >= kCommHeavyIntermediate;
}

void launch_fused_backward(GpuWorkspace& workspace, const BackwardArgs& args, cudaStream_t stream) {
  DeviceGuard guard(workspace.device);
  const kernels::layout::WorkspacePointers p = workspace.pointers();
  const int64_t H = p.hidden, I = p.intermediate, Is = p.shared_intermediate;
  POUNCE_CHECK(H % 64 == 0 && I % 64 == 0 && Is % 64 == 0,
               "the fused kernel needs hidden, intermediate and shared_intermediate multiples of 64 (got ", H,
               ", ", I, ", ", Is, "); fix: pad the weights");
  // Communication CTAs are the first to start; with every SM one of them no tile would ever run.
  POUNCE_CHECK(workspace.num_sms >= 2, "the fused kernel needs at least 2 SMs (device ", workspace.device,
               " has ", workspace.num_sms, "); use Config::backward_kernel_path = KernelPath::kStaged");
  set_shared_limit_once<kernels::fused::fused_backward_kernel>(workspace.device, kFusedSharedBytes);
  StageTimer timer("backward", p, stream);
  // The operands are built (and checked) before the prologue queues anything: a refusal after it would
  // leave the peers at the combine barrier.
  int32_t* gemm_error = p.gemm_error();
  const kernels::ActivationParams activation = activation_params(workspace.config.activation);
  // Without a shared expert the task list has no shared tiles; null operands would fault, not write the
  // routed gradients, should that ever change.
  const MlpOperands shared = Is > 0 ? mlp_operands(shared_mlp_backward(p, args, 0), H, activation,
                                                   args.accumulate_weight_grads, gemm_error)
                                    : MlpOperands{};
  // One launch per possible macrobatch, last first (one without a ring); macrobatch b's routed operands.
  std::vector<kernels::fused::FusedBackwardParams> launches;
  for (int32_t b = p.max_macrobatches - 1; b >= 0; --b) {
    const kernels::layout::WorkspacePointers mb = p.macrobatch(b);
    MlpBackward rows = routed_mlp_backward(mb, args, 0);
    rows.rows.group_active = p.owned_experts(b);  // weight gradients of the experts b holds (all: no ring)
    const MlpOperands routed = mlp_operands(rows, H, activation, args.accumulate_weight_grads, gemm_error);

    kernels::fused::FusedBackwardParams params{};
    params.ws = mb;
    if (b != p.max_macrobatches - 1) params.ws.shared_intermediate = 0;  // the shared expert runs once
    params.shared_act_grad = shared.act_grad;
    params.shared_data_grad = shared.data_grad;
    if (p.has_ring()) {  // this macrobatch's forward rows, replayed inside the kernel where due
      params.replay_gate_up = kernels::gate_up_operands(
          kernels::GroupedRows{mb.rows_capacity, mb.group_row_offset, mb.num_local_experts, 0, nullptr,
                               mb.group_rows},
          mb.x_rows, expert_slice(args.inputs.routed.gate), expert_slice(args.inputs.routed.up), mb.g_rows,
          mb.u_rows, mb.act_rows, I, H, activation);
      params.replay_gate_up.args.error_flag = gemm_error;
      params.replay_row_offset = p.macrobatch(b, kernels::layout::MacrobatchRows::kReplay).group_row_offset;
    }
    params.act_grad = routed.act_grad;
    params.data_grad = routed.data_grad;
    using kernels::sched::WeightGradKind;
    auto weight = [&](WeightGradKind kind) -> kernels::GemmOperands& {
      return params.weight_grad[static_cast<int>(kind)];
    };
    weight(WeightGradKind::kSharedDown) = shared.down;
    weight(WeightGradKind::kSharedGate) = shared.gate;
    weight(WeightGradKind::kSharedUp) = shared.up;
    weight(WeightGradKind::kDown) = routed.down;
    weight(WeightGradKind::kGate) = routed.gate;
    weight(WeightGradKind::kUp) = routed.up;
    params.push_combine = fused_push_combine(workspace);
    params.comm_ctas = fused_comm_ctas(workspace, params.push_combine, workspace.config.backward_comm_sms,
                                       FusedPass::kBackward);
    params.unit_blocks = backward_unit_blocks(workspace, params.comm_ctas);
    launches.push_back(params);
  }

  const BackwardLaunch launch = launch_backward_prologue(workspace, args, timer, stream);
  // Counters start at zero every call (memset nodes in a captured graph). Between macrobatch launches only
  // the ticket, the roles and the per-tile counters restart: an abort (and the stage ring's error) stays, so
  // the later launches end at once and the error keeps its detail.
  POUNCE_CUDA(
      cudaMemsetAsync(p.fused_counters, 0, workspace.layout.fused_counter_words * sizeof(uint32_t), stream));
  static_assert(kernels::layout::kFusedTicket == 0 && kernels::layout::kFusedRole == 1,
                "ticket and role lead the header");
  for (size_t i = 0; i < launches.size(); ++i) {
    if (i > 0) {
      POUNCE_CUDA(cudaMemsetAsync(p.fused_counters, 0, 2 * sizeof(uint32_t), stream));
      POUNCE_CUDA(cudaMemsetAsync(
          p.fused_counters + kernels::layout::kFusedHeaderWords, 0,
          (workspace.layout.fused_counter_words - kernels::layout::kFusedHeaderWords) * sizeof(uint32_t),
          stream));
    }
    kernels::fused::fused_backward_kernel<<<workspace.num_sms, kernels::gemm::GemmConfig::kNumThreads,
                                            kFusedSharedBytes, stream>>>(launches[i]);
    POUNCE_CUDA(cudaGetLastError());
  }
  launch_context_restore(workspace, args, activation, stream);
  timer.mark("fused");
  report_tile_profile(p, "backward",
                      {"", "shared d_a", "shared d_x", "d_a", "d_x", "weight grad", "replayed gate/up"},
                      stream);
  launch_backward_epilogue(workspace, args, launch, timer, stream);
}

}  // namespace pounce::gpu
