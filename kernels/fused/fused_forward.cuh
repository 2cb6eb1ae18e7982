// The fused forward kernel (DESIGN.md §2, issue #4): the whole forward in ONE persistent launch, one CTA per
// SM: stage x, routing exchange and barrier, schedule (grid_steps.cuh, every CTA), then dispatch, shared
// expert, gate/up + activation, down and the combine (roles below), then the combine barrier (grid_steps.cuh
// again). The weighted sum is the next kernel on the stream.
//
// Roles, by arrival after the prologue (the first `comm_ctas` CTAs to finish it communicate; the cooperative
// launch keeps every CTA resident, so a compute CTA never waits on a communication CTA that cannot run):
//   communication CTA: pulls the rows of routed minibatch 0, 1, ... (warps strided over the rows, every
//     communication CTA a share of every minibatch), bumping rows_ready[j] after each.
//   compute CTA: the GEMM mainloop of kernels/gemm with a task source instead of a static tile walk. The
//     producer thread takes a ticket (sched/forward_tasks.cuh), waits for the task's inputs, hands the
//     task to the consumer warpgroups through a two-slot mbarrier ring in shared memory (fused_common.cuh)
//     and loads its stages; the consumers multiply, store through the kind's epilogue, and count the tile
//     done.
//   combine, one of two ways (params.push_combine, chosen per shape by src/gpu/fused_forward.cu):
//     - push: the down tile stores y_rows and counts rows_done[j]; between pulls, and after the last one,
//       the communication CTAs push every minibatch whose down tiles are all stored to the token owners'
//       slots. Suits short down mainloops (small I), whose epilogue must not wait on NVLink stores.
//     - scatter: the down tile's epilogue stores each row straight into its token owner's slot (src_rank,
//       src_token, slot) over NVLink: no copy pass, y_rows not written (backward never reads it), and few
//       communication CTAs suffice.
//     Both deliver the same values to the same slots.
// Every handoff is a named release/acquire pair at GPU scope (flags.cuh); TMA reads rows another CTA wrote,
// so the reader also orders its acquire before its async-proxy loads (fence.proxy.async.global). Every wait
// is bounded and aborts when another CTA failed. Tiles are computed exactly as by the standalone GEMMs
// (same tiles, same K order), so the output is bitwise that of the staged path.
#pragma once

#include <cuda.h>

#include "kernels/dispatch/dispatch.cuh"
#include "kernels/fused/fused_common.cuh"
#include "kernels/fused/grid_steps.cuh"
#include "kernels/sched/forward_tasks.cuh"

namespace pounce::fused {

using sched::Task;
using sched::TaskKind;

inline constexpr kernels::gemm::GemmKind kGateUpGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kForwardGateUp);
inline constexpr kernels::gemm::GemmKind kDownGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kForwardStore);

// Operand maps of the four GEMMs (built on the host, src/gpu/fused_forward.cu).
struct FusedForwardMaps {
  CUtensorMap x_rows;                               // A of routed gate/up  [rows_capacity, H]
  CUtensorMap act_rows;                             // A of routed down     [rows_capacity, I]
  CUtensorMap sym_x;                                // A of shared gate/up  [token_capacity, H]
  CUtensorMap shared_act;                           // A of shared down     [token_capacity, Is]
  CUtensorMap gate, up, down;                       // routed weights [El, ., .]
  CUtensorMap shared_gate, shared_up, shared_down;  // shared weights [1, ., .]
};

struct FusedForwardParams {
  layout::WorkspacePointers ws;
  ForwardInputs in;                                            // x, routing, router weights, out
  GroupedGemmArgs gate_up, down, shared_gate_up, shared_down;  // outputs, extents, activation per GEMM
  int32_t comm_ctas;
  int32_t unit_blocks;  // m-blocks per minibatch
  bool push_combine;    // true: communication CTAs push y_rows; false: down epilogues scatter into slots
};

__device__ __forceinline__ sched::ForwardTaskShape task_shape_of(const FusedForwardParams& p) {
  sched::ForwardTaskShape shape;
  const int32_t max_m_blocks = static_cast<int32_t>(p.ws.rows_capacity / GemmConfig::BLOCK_M);
  const int32_t token_blocks = static_cast<int32_t>(p.ws.token_capacity / GemmConfig::BLOCK_M);
  shape.shared_m_blocks =
      p.ws.shared_intermediate > 0 ? min(p.ws.shared_row_offset[1] / GemmConfig::BLOCK_M, token_blocks) : 0;
  // Beyond the capacity only with an overflowing schedule (already reported); never touch those rows.
  shape.routed_m_blocks =
      min(p.ws.group_row_offset[p.ws.num_local_experts] / GemmConfig::BLOCK_M, max_m_blocks);
  shape.unit_blocks = p.unit_blocks;
  constexpr int kGateUpN = kernels::gemm::kOutBlockN<kGateUpGemm.epilogue>;
  constexpr int kDownN = kernels::gemm::kOutBlockN<kDownGemm.epilogue>;
  shape.shared_gate_up_n = (p.shared_gate_up.n + kGateUpN - 1) / kGateUpN;
  shape.shared_down_n = (p.shared_down.n + kDownN - 1) / kDownN;
  shape.gate_up_n = (p.gate_up.n + kGateUpN - 1) / kGateUpN;
  shape.down_n = (p.down.n + kDownN - 1) / kDownN;
  return shape;
}

// ---------------------------------------------------------------------------------------------------
// Compute CTA
// ---------------------------------------------------------------------------------------------------
// Producer thread, first: ticket -> task -> its inputs ready (kEnd past the list, on a failure or an abort).
struct ForwardScheduler {
  const FusedForwardParams& p;
  sched::ForwardTaskShape shape;
  sched::ForwardTaskCursor cursor;

  __device__ explicit ForwardScheduler(const FusedForwardParams& params)
      : p(params), shape(task_shape_of(params)), cursor(shape) {}

  __device__ void operator()(Task& task) {
    const FusedCounters counters = counters_of(p.ws);
    task = Task{TaskKind::kEnd, 0, 0, 0};
    // After a failure anywhere, no new tile (tiles without inputs to wait on would never notice).
    if (aborted(p.ws)) return;
    const int32_t ticket = static_cast<int32_t>(atomicAdd(counters.ticket(), 1u));
    if (!cursor.at(ticket, task)) return;
    bool ready = true;
    if (task.kind == TaskKind::kGateUp) {
      ready = wait_count(p.ws, counters.rows_ready(task.unit), static_cast<uint32_t>(p.comm_ctas),
                         layout::WaitId::kFusedRowsReady, task.unit);
    } else if (task.kind == TaskKind::kDown || task.kind == TaskKind::kSharedDown) {
      const bool shared = task.kind == TaskKind::kSharedDown;
      const uint32_t expected = 2u * (shared ? shape.shared_gate_up_n : shape.gate_up_n);
      ready = wait_count(p.ws, counters.first_done(shared, task.m_block), expected,
                         layout::WaitId::kFusedGateUpDone, task.m_block);
    }
    if (!ready) task.kind = TaskKind::kEnd;
  }
};

// Producer thread, then: the task's stages into the ring.
__device__ __forceinline__ bool produce_task(kernels::gemm::SharedStorage& ss,
                                             kernels::gemm::RingPosition& ring, const FusedForwardMaps& maps,
                                             const FusedForwardParams& p, const Task& task) {
  const bool routed = task.kind == TaskKind::kGateUp || task.kind == TaskKind::kDown;
  const kernels::gemm::Tile tile{task.m_block, task.n_block,
                                 routed ? expert_of_block(p.ws, task.m_block) : 0};
  switch (task.kind) {
    case TaskKind::kSharedGateUp:
      return kernels::gemm::produce_tile<kGateUpGemm>(ss, ring, maps.sym_x, maps.shared_gate, maps.shared_up,
                                                      p.shared_gate_up, tile, 0, k_blocks(p.shared_gate_up));
    case TaskKind::kSharedDown:
      return kernels::gemm::produce_tile<kDownGemm>(ss, ring, maps.shared_act, maps.shared_down,
                                                    maps.shared_down, p.shared_down, tile, 0,
                                                    k_blocks(p.shared_down));
    case TaskKind::kGateUp:
      return kernels::gemm::produce_tile<kGateUpGemm>(ss, ring, maps.x_rows, maps.gate, maps.up, p.gate_up,
                                                      tile, 0, k_blocks(p.gate_up));
    case TaskKind::kDown:
      return kernels::gemm::produce_tile<kDownGemm>(ss, ring, maps.act_rows, maps.down, maps.down, p.down,
                                                    tile, 0, k_blocks(p.down));
    case TaskKind::kEnd:
      break;
  }
  return true;
}

// Consumer warpgroup, one task: mainloop + epilogue; `done` is the tile's counter, if any.
__device__ __forceinline__ bool consume_task(kernels::gemm::SharedStorage& ss,
                                             kernels::gemm::RingPosition& ring, const FusedForwardParams& p,
                                             const Task& task, int consumer_idx, float (&acc)[128],
                                             uint32_t*& done) {
  const FusedCounters counters = counters_of(p.ws);
  const kernels::gemm::Tile tile{task.m_block, task.n_block, 0};
  switch (task.kind) {
    case TaskKind::kSharedGateUp:
      done = counters.first_done(true, task.m_block);
      return kernels::gemm::consume_tile<kGateUpGemm>(ss, ring, p.shared_gate_up, tile, 0,
                                                      k_blocks(p.shared_gate_up), consumer_idx, acc);
    case TaskKind::kSharedDown:
      return kernels::gemm::consume_tile<kDownGemm>(ss, ring, p.shared_down, tile, 0, k_blocks(p.shared_down),
                                                    consumer_idx, acc);
    case TaskKind::kGateUp:
      done = counters.first_done(false, task.m_block);
      return kernels::gemm::consume_tile<kGateUpGemm>(ss, ring, p.gate_up, tile, 0, k_blocks(p.gate_up),
                                                      consumer_idx, acc);
    case TaskKind::kDown:
      if (!kernels::gemm::multiply_tile<kDownGemm>(ss, ring, p.down, 0, k_blocks(p.down), consumer_idx, acc))
        return false;
      if (p.push_combine) {
        kernels::gemm::store_tile<kDownGemm>(acc, p.down, tile, true, consumer_idx);
        done = counters.rows_done(task.unit);
      } else {
        store_tile_to_slots(acc, p.ws, p.ws.sym_y_slots, p.down.n, task.m_block, task.n_block, consumer_idx);
      }
      return true;
    case TaskKind::kEnd:
      break;
  }
  return true;
}

// Launched cooperatively (grid_steps.cuh needs every CTA resident), one CTA per SM.
// kWholePass: the whole pass as described above. Otherwise one macrobatch of a workspace with a ring
// (params.ws = WorkspacePointers::macrobatch(b)): its tiles and transfers only; the prologue, the macrobatch
// plan, the combine barrier and the weighted sum are kernels around the launches (src/gpu/fused_forward.cu).
template <bool kWholePass>
__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardMaps maps,
                         const __grid_constant__ FusedForwardParams params) {
  kernels::gemm::SharedStorage& ss = stage_storage();
  __shared__ TaskSlots<Task> slots;
  __shared__ SchedulerStorage<ForwardScheduler> scheduler;
  const layout::WorkspacePointers& ws = params.ws;

  // Prologue scratch in the stage ring: the per-warp counters from its start, the scan's at its end.
  static_assert(
      GemmConfig::kNumThreads <= routing::ScanScratch::kMaxThreads && GemmConfig::kNumThreads % 32 == 0,
      "the scan keeps one int32 per thread of whole warps");
  auto* scan_scratch = reinterpret_cast<routing::ScanScratch*>(
      reinterpret_cast<char*>(ss.stages) + sizeof(ss.stages) - sizeof(routing::ScanScratch));
  if constexpr (kWholePass) {
    if (!run_forward_prologue(ws, params.in, reinterpret_cast<int32_t*>(ss.stages), *scan_scratch, slots.go))
      return;
  }
  const int32_t role = start_cta(ws, params.comm_ctas, ss, slots);
  const int warpgroup = threadIdx.x / 128;
  if (role < params.comm_ctas) {
    if constexpr (kWholePass) {
      if (!wait_schedule_placed(ws, slots.go)) return;
    }
    CommunicationPlan plan;
    plan.shape = task_shape_of(params);
    plan.comm_ctas = params.comm_ctas;
    plan.push_combine = params.push_combine;
    plan.second_tiles_per_block = 2u * plan.shape.down_n;
    plan.rows_done_wait = layout::WaitId::kFusedRowsDone;
    run_communication(
        ws, slots.go, plan, role, [&](int64_t row) { dispatch::pull_row<8>(ws, row); },
        [&](int64_t row) { combine::push_row<8>(ws, ws.y_rows, ws.sym_y_slots, row); });
    if constexpr (kWholePass) {
      __syncthreads();  // every warp's pushes are issued before warpgroups 1 and 2 arrive for the CTA
      if (warpgroup > 0) finish_forward(ws, warpgroup);
    }
    return;
  }
  if (threadIdx.x == 0) {
    for (const CUtensorMap* map : {&maps.x_rows, &maps.act_rows, &maps.gate, &maps.up, &maps.down})
      kernels::ptx::prefetch_tensor_map(map);
  }
  run_compute_cta(
      ws, slots, scheduler, params,
      [&](const Task& task, kernels::gemm::RingPosition& ring) {
        return produce_task(ss, ring, maps, params, task);
      },
      [&](const Task& task, kernels::gemm::RingPosition& ring, float(&acc)[128], uint32_t*& done) {
        return consume_task(ss, ring, params, task, warpgroup - 1, acc, done);
      },
      [&] {
        if constexpr (kWholePass) finish_forward(ws, warpgroup);
      });
}

}  // namespace pounce::fused
