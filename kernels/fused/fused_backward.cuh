// The fused backward kernel (docs/design.md §2): reverse-combine pull, the shared expert's
// backward, d_a with the activation backward, d_x, the reverse-dispatch push and every weight gradient in ONE
// persistent launch, one CTA per SM, after the backward's token side (stage d_out, router gradient,
// barrier) and before its combine barrier and d_x sum (src/gpu/fused_backward.cu runs those around it).
//
// The same machinery as the fused forward (fused_common.cuh): the first `comm_ctas` CTAs to start pull
// every routed unit's scaled rows dy = bf16(w * d_out) from the token owners and, with the push combine,
// push finished d_x rows back, then join the compute CTAs for the rest of the list; the compute CTAs take
// tickets over the list of sched/backward_tasks.cuh, wait for each task's inputs, and run the GEMM mainloop
// of kernels/gemm on it:
//   d_a tile    (kDataGradActivation) d_g, d_u = act'(g, u) * (dy . w_down)   -> counts first_done[m]
//   d_x tile    (kDataGrad)           d_x = [d_g, d_u] . [w_gate; w_up]       -> dx_rows + rows_done[j]
//                                                                               (push) or the owners'
//                                                                               d_x slots (scatter)
//   weight tile (kWeightGrad)         one output tile of d_w_down = dy^T act, d_w_gate = d_g^T x or
//                                     d_w_up = d_u^T x over its expert's whole row segment
//   replay tile (kForwardGateUp)      macrobatch ring only, ahead of everything: the forward's g, u, act of
//                                     this macrobatch's rows (x pulled again by the communication CTAs
//                                     first), bitwise the forward's -> counts replay_done[m]
// Every tile is computed exactly as by the standalone GEMMs (same operands from kernels/gemm/
// gemm_operands.h, same tiles, same K order), so every gradient is bitwise the staged path's.
#pragma once

#include <cuda.h>

#include "kernels/backward/reverse_combine.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "kernels/fused/fused_common.cuh"
#include "kernels/gemm/gemm_operands.cuh"
#include "kernels/sched/backward_tasks.cuh"

namespace pounce::kernels::fused {

using sched::BackwardTask;
using sched::BackwardTaskKind;
using sched::WeightGradKind;

inline constexpr kernels::gemm::GemmKind kActGradGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kDataGradActivation);
inline constexpr kernels::gemm::GemmKind kDataGradGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kDataGrad);
inline constexpr kernels::gemm::GemmKind kWeightGradGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kWeightGrad);
inline constexpr kernels::gemm::GemmKind kReplayGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kForwardGateUp);

// Operands (maps + arguments) of the ten GEMMs, built on the host by the standalone launchers' builders.
struct FusedBackwardParams {
  layout::WorkspacePointers ws;
  kernels::GemmOperands shared_act_grad, shared_data_grad;  // unused without a shared expert
  kernels::GemmOperands act_grad, data_grad;
  kernels::GemmOperands weight_grad[sched::kNumWeightGrads];  // sched::WeightGradKind order
  // Macrobatch ring: the forward's gate/up over this macrobatch's rows, and the offsets of the rows to replay
  // (WorkspacePointers::macrobatch(b, kReplay): none for the resident last macrobatch); null without a ring.
  kernels::GemmOperands replay_gate_up;
  const int32_t* replay_row_offset;
  int32_t comm_ctas;
  int32_t unit_blocks;  // m-blocks per minibatch
  bool push_combine;    // true: communication CTAs push dx_rows; false: d_x epilogues scatter into slots
};

// Kernel parameters above 4 KB need CUDA 12.1+ and a matching driver (this project builds with 13.0).
static_assert(sizeof(FusedBackwardParams) <= 32764, "fused backward parameters exceed the 32764-byte limit");

__device__ __forceinline__ int32_t n_blocks(const GroupedGemmArgs& args) {
  return (args.n + GemmConfig::BLOCK_N - 1) / GemmConfig::BLOCK_N;
}

__device__ __forceinline__ sched::BackwardTaskShape task_shape_of(const FusedBackwardParams& p) {
  sched::BackwardTaskShape shape;
  sched::ForwardTaskShape& data = shape.data;
  const bool has_shared = p.ws.shared_intermediate > 0;
  const int32_t max_m_blocks = static_cast<int32_t>(p.ws.rows_capacity / GemmConfig::BLOCK_M);
  const int32_t token_blocks = static_cast<int32_t>(p.ws.token_capacity / GemmConfig::BLOCK_M);
  data.shared_m_blocks = has_shared ? min(p.ws.shared_row_offset[1] / GemmConfig::BLOCK_M, token_blocks) : 0;
  // Beyond the capacity only with an overflowing schedule (already reported); never touch those rows.
  data.routed_m_blocks =
      min(p.ws.group_row_offset[p.ws.num_local_experts] / GemmConfig::BLOCK_M, max_m_blocks);
  data.unit_blocks = p.unit_blocks;
  data.shared_gate_up_n = has_shared ? n_blocks(p.shared_act_grad.args) : 0;
  data.shared_down_n = has_shared ? n_blocks(p.shared_data_grad.args) : 0;
  data.gate_up_n = n_blocks(p.act_grad.args);
  data.down_n = n_blocks(p.data_grad.args);
  if (p.replay_row_offset != nullptr) {
    shape.replay_m_blocks =
        min(p.replay_row_offset[p.ws.num_local_experts] / GemmConfig::BLOCK_M, data.routed_m_blocks);
    constexpr int kReplayN = kernels::gemm::kOutBlockN<kReplayGemm.epilogue>;
    shape.replay_n = (p.replay_gate_up.args.n + kReplayN - 1) / kReplayN;
  }
  for (int w = 0; w < sched::kNumWeightGrads; ++w) {
    const GroupedGemmArgs& args = p.weight_grad[w].args;
    const bool shared = sched::is_shared(static_cast<WeightGradKind>(w));
    shape.weight[w].groups = shared ? (has_shared ? 1 : 0) : p.ws.num_local_experts;
    shape.weight[w].m_blocks = (args.m + GemmConfig::BLOCK_M - 1) / GemmConfig::BLOCK_M;
    shape.weight[w].n_blocks = n_blocks(args);
  }
  return shape;
}

// Weight gradient of `group`: the K blocks of its row segment that hold data (rows beyond the capacity never
// read), as the standalone weight-gradient GEMM takes them.
__device__ __forceinline__ void weight_grad_k_range(const GroupedGemmArgs& args, int32_t group,
                                                    int32_t& kb_begin, int32_t& kb_end) {
  kernels::gemm::reduction_k_blocks(args, group, args.max_m_blocks * GemmConfig::BLOCK_M, kb_begin, kb_end);
}

// Producer thread, first: ticket -> task -> everything it reads ready (kEnd past the list, on a failure or an
// abort). Weight-gradient tiles come in runs of one expert's tiles, so the last dependency check is
// remembered: tiles after the first of a run start at once.
struct BackwardScheduler {
  const FusedBackwardParams& p;
  sched::BackwardTaskShape shape;
  sched::BackwardTaskCursor cursor;
  // The (weight kind, group) of the last weight-gradient tile: its K range, and whether its inputs were found
  // ready (tiles come in runs of one expert's, so only a run's first tile reads either).
  int32_t run_weight = -1;
  int32_t run_group = -1;
  int32_t kb_begin = 0, kb_end = 0;
  bool run_inputs_ready = false;
  bool all_rows_ready = false;      // the last routed unit pulled: every unit is (each CTA pulls in order)
  bool all_act_grads_done = false;  // every routed d_a tile stored

  __device__ explicit BackwardScheduler(const FusedBackwardParams& params)
      : p(params), shape(task_shape_of(params)), cursor(shape) {}

  // Waits of one task share one deadline (`deadline_ns`, global timer; 0 = the call's timeout per wait).
  __device__ static uint64_t left_until(uint64_t deadline_ns) {
    if (deadline_ns == 0) return 0;
    const uint64_t now = flags::global_timer_ns();
    return now < deadline_ns ? deadline_ns - now : 1;
  }
  __device__ bool act_grads_done(bool shared, int32_t m_block, uint64_t deadline_ns = 0) const {
    const uint32_t expected = 2u * (shared ? shape.data.shared_gate_up_n : shape.data.gate_up_n);
    return wait_count(p.ws, counters_of(p.ws).first_done(shared, m_block), expected,
                      layout::WaitId::kFusedActGradDone, m_block, left_until(deadline_ns));
  }
  // act_grads_done for routed m-blocks [m_begin, m_end), once routed_inputs_all_ready found not every
  // routed d_a tile stored yet: per m-block (a round trip each, between two tiles' loads).
  __device__ bool routed_act_grads_done(int32_t m_begin, int32_t m_end, uint64_t deadline_ns) {
    for (int32_t m = m_begin; m < m_end; ++m) {
      if (!act_grads_done(false, m, deadline_ns)) return false;
    }
    return true;
  }
  __device__ bool replayed(int32_t m_block, uint64_t deadline_ns = 0) const {
    return wait_count(p.ws, counters_of(p.ws).replay_done(m_block), 2u * shape.replay_n,
                      layout::WaitId::kFusedReplayDone, m_block, left_until(deadline_ns));
  }
  __device__ bool rows_ready(int32_t j, uint64_t deadline_ns = 0) const {
    return wait_count(p.ws, counters_of(p.ws).rows_ready(j), static_cast<uint32_t>(p.comm_ctas),
                      layout::WaitId::kFusedBackwardRowsReady, j, left_until(deadline_ns));
  }

  // Every routed weight-gradient tile of this kind's inputs known ready: one count read until it is, none
  // after (so a tile of a new expert starts without reading its row offsets).
  __device__ bool routed_inputs_all_ready(WeightGradKind kind) {
    if (kind == WeightGradKind::kDown && shape.replay_m_blocks == 0) {  // dy rows, pulled in unit order
      const int32_t units = shape.data.routed_units();
      if (!all_rows_ready && units > 0 &&
          flags::ld_acquire_gpu(counters_of(p.ws).rows_ready(units - 1)) >=
              static_cast<uint32_t>(p.comm_ctas))
        all_rows_ready = true;
      return all_rows_ready;
    }
    if (!all_act_grads_done) {  // d_g, d_u (down with a replay: act, which the d_a tiles waited for)
      const uint32_t expected = 2u * static_cast<uint32_t>(shape.data.gate_up_n * shape.data.routed_m_blocks);
      all_act_grads_done = flags::ld_acquire_gpu(counters_of(p.ws).routed_first_done_total()) >= expected;
    }
    return all_act_grads_done;
  }

  // Inputs of one weight-gradient tile of the current run: dy of the expert's units (down) or d_g, d_u of its
  // m-blocks.
  __device__ bool weight_grad_inputs(const BackwardTask& task) {
    if (run_inputs_ready) return true;
    if (task.weight == WeightGradKind::kSharedDown) return true;  // sym_d_out and the forward's act
    const bool shared = sched::is_shared(task.weight);
    if (!shared && routed_inputs_all_ready(task.weight)) return run_inputs_ready = true;
    // Here not every input of the kind is known ready (all_rows_ready, all_act_grads_done are false).
    const uint64_t deadline = flags::global_timer_ns() + p.ws.timeout_ns;  // one bound for the whole check
    int32_t m_begin = 0, m_end = shape.data.shared_m_blocks;
    if (!shared) {
      m_begin = min(p.ws.group_row_offset[task.group] / GemmConfig::BLOCK_M, shape.data.routed_m_blocks);
      m_end = min(p.ws.group_row_offset[task.group + 1] / GemmConfig::BLOCK_M, shape.data.routed_m_blocks);
    }
    if (task.weight == WeightGradKind::kDown && shape.replay_m_blocks > 0) {
      // act is replayed: the expert's d_a tiles waited for it (and for dy)
      if (!routed_act_grads_done(m_begin, m_end, deadline)) return false;
    } else if (task.weight == WeightGradKind::kDown) {
      const int32_t unit_blocks = shape.data.unit_blocks;
      for (int32_t j = m_begin / unit_blocks; m_end > m_begin && j <= (m_end - 1) / unit_blocks; ++j) {
        if (!rows_ready(j, deadline)) return false;
      }
    } else if (shared) {
      for (int32_t m = m_begin; m < m_end; ++m) {
        if (!act_grads_done(true, m, deadline)) return false;
      }
    } else if (!routed_act_grads_done(m_begin, m_end, deadline)) {
      return false;
    }
    return run_inputs_ready = true;
  }

  __device__ void operator()(BackwardTask& task) {
    task = BackwardTask{BackwardTaskKind::kEnd, 0, 0, 0, 0, WeightGradKind::kSharedDown};
    // A macrobatch's launch skips the weight-gradient tiles of experts it does not hold (group_active).
    for (;;) {
      const int32_t ticket = static_cast<int32_t>(atomicAdd(counters_of(p.ws).ticket(), 1u));
      // After a failure anywhere, no new tile (tiles without inputs to wait on would never notice). Read
      // while the ticket is in flight: one round trip for both.
      if (aborted(p.ws)) {
        task.kind = BackwardTaskKind::kEnd;
        return;
      }
      if (!cursor.at(ticket, task)) {
        task.kind = BackwardTaskKind::kEnd;
        return;
      }
      if (task.kind != BackwardTaskKind::kWeightGrad) break;
      const int32_t* active = p.weight_grad[static_cast<int>(task.weight)].args.group_active;
      if (active == nullptr || active[task.group] != 0) break;
    }
    if (task.kind == BackwardTaskKind::kWeightGrad) {
      // Runs of one expert's tiles share the range: read once per run, here, for producer and consumers.
      if (static_cast<int32_t>(task.weight) != run_weight || task.group != run_group) {
        weight_grad_k_range(p.weight_grad[static_cast<int>(task.weight)].args, task.group, kb_begin, kb_end);
        run_weight = static_cast<int32_t>(task.weight);
        run_group = task.group;
        run_inputs_ready = false;
      }
      task.kb_begin = kb_begin;
      task.kb_end = kb_end;
    }
    if (task.kind == BackwardTaskKind::kActGrad || task.kind == BackwardTaskKind::kDataGrad ||
        task.kind == BackwardTaskKind::kReplayGateUp)
      find_routed_block(p.ws, task.m_block, task);
    bool ready = true;
    switch (task.kind) {
      case BackwardTaskKind::kReplayGateUp:
        ready =
            wait_count(p.ws, counters_of(p.ws).replay_rows_ready(task.unit),
                       static_cast<uint32_t>(p.comm_ctas), layout::WaitId::kFusedReplayRowsReady, task.unit);
        break;
      case BackwardTaskKind::kActGrad: {
        const uint64_t deadline = flags::global_timer_ns() + p.ws.timeout_ns;
        ready = rows_ready(task.unit, deadline) &&
                (shape.replay_m_blocks == 0 || replayed(task.m_block, deadline));
        break;
      }
      case BackwardTaskKind::kSharedDataGrad:
      case BackwardTaskKind::kDataGrad:
        ready = act_grads_done(task.kind == BackwardTaskKind::kSharedDataGrad, task.m_block);
        break;
      case BackwardTaskKind::kWeightGrad:
        ready = weight_grad_inputs(task);
        break;
      case BackwardTaskKind::kSharedActGrad:  // sym_d_out, staged before the launch
      case BackwardTaskKind::kEnd:
        break;
    }
    if (!ready) task.kind = BackwardTaskKind::kEnd;
  }
};

// Producer thread, then: the task's stages into the ring.
__device__ __forceinline__ bool produce_task(kernels::gemm::SharedStorage& ss,
                                             kernels::gemm::RingPosition& ring, const FusedBackwardParams& p,
                                             const BackwardTask& task) {
  auto produce = [&](auto kind_tag, const kernels::GemmOperands& o, int32_t group, int32_t kb_begin,
                     int32_t kb_end) {
    constexpr kernels::gemm::GemmKind kKind = decltype(kind_tag)::value;
    const kernels::gemm::Tile tile{task.m_block, task.n_block, group};
    return kernels::gemm::produce_tile<kKind>(ss, ring, o.a, o.b0, o.b1, o.args, tile, kb_begin, kb_end);
  };
  switch (task.kind) {
    case BackwardTaskKind::kSharedActGrad:
      return produce(GemmTag<kActGradGemm>{}, p.shared_act_grad, 0, 0, k_blocks(p.shared_act_grad.args));
    case BackwardTaskKind::kSharedDataGrad:
      return produce(GemmTag<kDataGradGemm>{}, p.shared_data_grad, 0, 0, k_blocks(p.shared_data_grad.args));
    case BackwardTaskKind::kActGrad:
      return produce(GemmTag<kActGradGemm>{}, p.act_grad, task.group, 0, k_blocks(p.act_grad.args));
    case BackwardTaskKind::kDataGrad:
      return produce(GemmTag<kDataGradGemm>{}, p.data_grad, task.group, 0, k_blocks(p.data_grad.args));
    case BackwardTaskKind::kWeightGrad:
      return produce(GemmTag<kWeightGradGemm>{}, p.weight_grad[static_cast<int>(task.weight)], task.group,
                     task.kb_begin, task.kb_end);
    case BackwardTaskKind::kReplayGateUp:
      return produce(GemmTag<kReplayGemm>{}, p.replay_gate_up, task.group, 0,
                     k_blocks(p.replay_gate_up.args));
    case BackwardTaskKind::kEnd:
      break;
  }
  return true;
}

// Consumer warpgroup, one task: mainloop + epilogue; `done` is the tile's counter, if any, `done_total` a
// second one (every routed d_a tile).
__device__ __forceinline__ bool consume_task(kernels::gemm::SharedStorage& ss,
                                             kernels::gemm::RingPosition& ring, const FusedBackwardParams& p,
                                             const BackwardTask& task, int consumer_idx, float (&acc)[128],
                                             uint32_t*& done, uint32_t*& done_total,
                                             const TileProfile& profile) {
  const FusedCounters counters = counters_of(p.ws);
  const kernels::gemm::Tile tile{task.m_block, task.n_block, task.group};
  // K blocks [kb_begin, kb_end) at the width mma_columns gives this warpgroup.
  auto multiply = [&](auto kind_tag, const GroupedGemmArgs& args, int32_t kb_begin, int32_t kb_end,
                      bool upper_half_padding) {
    constexpr kernels::gemm::GemmKind kKind = decltype(kind_tag)::value;
    return multiply_task<kKind>(
        ss, ring, args, kb_begin, kb_end, consumer_idx,
        kernels::gemm::mma_columns<kKind>(args, tile, consumer_idx, upper_half_padding), acc, profile);
  };
  // A whole-K tile stored by its GEMM's own epilogue (the standalone kernel's).
  auto consume = [&](auto kind_tag, const GroupedGemmArgs& args) {
    if (!multiply(kind_tag, args, 0, k_blocks(args), task.upper_half_padding)) return false;
    kernels::gemm::store_tile<decltype(kind_tag)::value>(acc, args, tile, true, consumer_idx);
    return true;
  };
  switch (task.kind) {
    case BackwardTaskKind::kSharedActGrad:
      done = counters.first_done(true, task.m_block);
      return consume(GemmTag<kActGradGemm>{}, p.shared_act_grad.args);
    case BackwardTaskKind::kActGrad: {
      const bool consumed = consume(GemmTag<kActGradGemm>{}, p.act_grad.args);
      done = counters.first_done(false, task.m_block);  // set after the mainloop: no registers held across it
      done_total = counters.routed_first_done_total();
      return consumed;
    }
    case BackwardTaskKind::kSharedDataGrad:
      return consume(GemmTag<kDataGradGemm>{}, p.shared_data_grad.args);
    case BackwardTaskKind::kDataGrad:
      if (!multiply(GemmTag<kDataGradGemm>{}, p.data_grad.args, 0, k_blocks(p.data_grad.args),
                    task.upper_half_padding))
        return false;
      if (p.push_combine) {
        kernels::gemm::store_tile<kDataGradGemm>(acc, p.data_grad.args, tile, true, consumer_idx);
        done = counters.rows_done(task.unit);
      } else {
        store_tile_to_slots(acc, p.ws, p.ws.sym_dx_slots, p.data_grad.args.n, task.m_block, task.n_block,
                            consumer_idx);
      }
      return true;
    case BackwardTaskKind::kReplayGateUp:
      done = counters.replay_done(task.m_block);
      return consume(GemmTag<kReplayGemm>{}, p.replay_gate_up.args);
    case BackwardTaskKind::kWeightGrad: {
      const GroupedGemmArgs& args = p.weight_grad[static_cast<int>(task.weight)].args;
      if (!multiply(GemmTag<kWeightGradGemm>{}, args, task.kb_begin, task.kb_end, false)) return false;
      kernels::gemm::store_tile<kWeightGradGemm>(acc, args, tile, task.kb_end > task.kb_begin, consumer_idx);
      return true;
    }
    case BackwardTaskKind::kEnd:
      break;
  }
  return true;
}

__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    fused_backward_kernel(const __grid_constant__ FusedBackwardParams params) {
  kernels::gemm::SharedStorage& ss = stage_storage();
  __shared__ TaskSlots<BackwardTask> slots;
  __shared__ SchedulerStorage<BackwardScheduler> scheduler;

  const int32_t role = start_cta(params.ws, params.comm_ctas, ss, slots);
  if (role < params.comm_ctas) {
    const layout::WorkspacePointers& ws = params.ws;
    const sched::BackwardTaskShape shape = task_shape_of(params);
    CommunicationPlan plan;
    plan.shape = shape.data;
    plan.comm_ctas = params.comm_ctas;
    plan.push_combine = params.push_combine;
    plan.second_tiles_per_block = 2u * plan.shape.down_n;
    plan.rows_done_wait = layout::WaitId::kFusedBackwardRowsDone;
    if (shape.replay_m_blocks > 0) {  // this macrobatch's x rows again, ahead of dy: the list replays first
      CommunicationPlan replay = plan;
      replay.replay = true;
      replay.push_combine = false;
      run_communication</*kRing=*/false, /*kPullPairs=*/false>(
          ws, slots.go, replay, role,
          [&](int64_t row, int64_t, int64_t) { dispatch::pull_row<kPullDepth>(ws, row); },
          [](int64_t, int64_t) {});
    }
    run_communication</*kRing=*/false, /*kPullPairs=*/false>(
        ws, slots.go, plan, role,
        [&](int64_t row, int64_t, int64_t) { reverse_combine::pull_scaled_row<kPullDepth>(ws, row); },
        [&](int64_t row, int64_t) { combine::push_row<8>(ws, ws.dx_rows, ws.sym_dx_slots, row); });
    // The weight-gradient tail needs no transfer: every SM computes it, as the staged path's GEMMs do.
    turn_to_compute(ss, slots);
  }
  run_compute_cta(
      params.ws, slots, scheduler, params,
      [&](const BackwardTask& task, kernels::gemm::RingPosition& ring) {
        return produce_task(ss, ring, params, task);
      },
      [&](const BackwardTask& task, kernels::gemm::RingPosition& ring, float(&acc)[128], uint32_t*& done,
          uint32_t*& done_total, const TileProfile& profile) {
        return consume_task(ss, ring, params, task, threadIdx.x / 128 - 1, acc, done, done_total, profile);
      },
      [] {});
}

}  // namespace pounce::kernels::fused
