// The fused forward kernel (docs/design.md §2): the whole forward in ONE persistent launch, one CTA
// per SM: stage x, routing exchange and barrier, schedule (grid_steps.cuh, every CTA), then dispatch, shared
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
// With a macrobatch ring (kRing) the same kernel walks the macrobatches: tasks and communication units in
// macrobatch order, rows in the ring, plus the ring-reuse waits of ForwardScheduler and
// run_communication<kRing> (fused_common.cuh; docs/design.md, "Macrobatch ring").
// Every handoff is a named release/acquire pair at GPU scope (flags.cuh); TMA reads rows another CTA wrote,
// so the reader also orders its acquire before its async-proxy loads (fence.proxy.async.global). Every wait
// is bounded and aborts when another CTA failed. Tiles are computed exactly as by the standalone GEMMs
// (same tiles, same K order), so the output is bitwise that of the staged path.
#pragma once

#include <cuda.h>

#include <type_traits>

#include "kernels/dispatch/dispatch.cuh"
#include "kernels/fused/fused_common.cuh"
#include "kernels/fused/grid_steps.cuh"
#include "kernels/gemm/gemm_operands.cuh"
#include "kernels/sched/forward_tasks.cuh"
#include "kernels/sched/macrobatch_tasks.cuh"

namespace pounce::kernels::fused {

using sched::Task;
using sched::TaskKind;

inline constexpr kernels::gemm::GemmKind kGateUpGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kForwardGateUp);
inline constexpr kernels::gemm::GemmKind kDownGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kForwardStore);

struct FusedForwardParams {
  layout::WorkspacePointers ws;
  ForwardInputs in;  // x, routing, router weights, out
  // Operands (maps + arguments) of the four GEMMs, built on the host by the standalone launchers' builders
  // (src/gpu/gemm_operands.h): routed over x_rows / act_rows [ring_rows, .] and the [El, ., .] weights,
  // shared over sym_x / shared_act [token_capacity, .] (copies of the routed ones without a shared expert:
  // the list then has no shared tiles).
  kernels::GemmOperands gate_up, down, shared_gate_up, shared_down;
  int32_t comm_ctas;
  int32_t unit_blocks;  // m-blocks per minibatch
  bool push_combine;    // true: communication CTAs push y_rows; false: down epilogues scatter into slots
};

// Kernel parameters above 4 KB need CUDA 12.1+ and a matching driver (this project builds with 13.0).
static_assert(sizeof(FusedForwardParams) <= 32764, "fused forward parameters exceed the 32764-byte limit");

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
  shape.shared_gate_up_n = (p.shared_gate_up.args.n + kGateUpN - 1) / kGateUpN;
  shape.shared_down_n = (p.shared_down.args.n + kDownN - 1) / kDownN;
  shape.gate_up_n = (p.gate_up.args.n + kGateUpN - 1) / kGateUpN;
  shape.down_n = (p.down.args.n + kDownN - 1) / kDownN;
  return shape;
}

// The schedule block and macrobatch of a task: a routed task of the ring names its ring block in m_block and
// its schedule block beside it (sched/macrobatch_tasks.cuh); without a ring they are the same.
__device__ __forceinline__ int32_t schedule_block_of(const Task& task) {
  return task.m_block;
}
__device__ __forceinline__ int32_t schedule_block_of(const sched::MacrobatchTask& task) {
  return task.schedule_block;
}
__device__ __forceinline__ int32_t macrobatch_of(const Task&) {
  return 0;
}
__device__ __forceinline__ int32_t macrobatch_of(const sched::MacrobatchTask& task) {
  return task.macrobatch;
}

// ---------------------------------------------------------------------------------------------------
// Compute CTA
// ---------------------------------------------------------------------------------------------------
// Producer thread, first: ticket -> task -> its inputs ready (kEnd past the list, on a failure or an abort).
// kRing: the list walks the macrobatches (sched/macrobatch_tasks.cuh) and a routed tile of macrobatch b >= 1
// also waits until macrobatch b - 1's ring rows are free (ring_free: its down tiles stored and, with the push
// combine, its rows pushed). That is on tiles with smaller tickets or on the communication CTAs, which push
// b - 1 at the latest before they wait for anything of b + 1, and wait for nothing of b before that but pulls
// (run_communication<kRing>), so no cycle.
template <bool kRing>
struct ForwardScheduler {
  using TaskT = std::conditional_t<kRing, sched::MacrobatchTask, Task>;
  using Cursor = std::conditional_t<kRing, sched::MacrobatchTaskCursor, sched::ForwardTaskCursor>;
  const FusedForwardParams& p;
  sched::ForwardTaskShape shape;
  Cursor cursor;
  int32_t ring_checked = 0;  // kRing: the ring was found free for the macrobatches up to this one

  __device__ explicit ForwardScheduler(const FusedForwardParams& params)
      : p(params), shape(task_shape_of(params)), cursor(make_cursor(params, shape)) {}

  static __device__ Cursor make_cursor(const FusedForwardParams& params,
                                       const sched::ForwardTaskShape& shape) {
    if constexpr (kRing) {
      return Cursor(sched::MacrobatchTaskShape{shape, ring_bounds(params.ws), ring_macrobatches(params.ws)});
    } else {
      return Cursor(shape);
    }
  }

  // What ring_free[b] reaches once macrobatch b's ring rows may be overwritten.
  __device__ uint32_t ring_free_expected(int32_t b) const {
    if (p.push_combine) return static_cast<uint32_t>(p.comm_ctas);
    const int32_t* bounds = ring_bounds(p.ws);
    return 2u * shape.down_n * static_cast<uint32_t>((bounds[b + 1] - bounds[b]) / GemmConfig::BLOCK_M);
  }

  __device__ void operator()(TaskT& task) {
    const FusedCounters counters = counters_of(p.ws);
    task = TaskT{};  // kEnd
    const int32_t ticket = static_cast<int32_t>(atomicAdd(counters.ticket(), 1u));
    // After a failure anywhere, no new tile (tiles without inputs to wait on would never notice). Read while
    // the ticket is in flight: one round trip for both.
    if (aborted(p.ws) || !cursor.at(ticket, task)) return;
    const bool routed = task.kind == TaskKind::kGateUp || task.kind == TaskKind::kDown;
    if (routed) find_routed_block(p.ws, schedule_block_of(task), task);
    [[maybe_unused]] uint64_t deadline = 0;
    if constexpr (kRing) deadline = flags::global_timer_ns() + 2 * p.ws.timeout_ns - p.ws.timeout_ns / 8;
    bool ready = true;
    if (task.kind == TaskKind::kGateUp) {
      ready = wait_count(p.ws, counters.rows_ready(task.unit), static_cast<uint32_t>(p.comm_ctas),
                         layout::WaitId::kFusedRowsReady, task.unit);
    } else if (task.kind == TaskKind::kDown || task.kind == TaskKind::kSharedDown) {
      const bool shared = task.kind == TaskKind::kSharedDown;
      const uint32_t expected = 2u * (shared ? shape.shared_gate_up_n : shape.gate_up_n);
      ready = wait_count(p.ws, counters.first_done(shared, schedule_block_of(task)), expected,
                         layout::WaitId::kFusedGateUpDone, schedule_block_of(task));
    }
    if constexpr (kRing) {
      if (ready && routed && task.macrobatch > ring_checked) {
        // Both waits end within the consumers' handoff bound (twice the call's), so a stall is named by the
        // wait that saw it, not by the handoff.
        const uint64_t now = flags::global_timer_ns();
        const uint64_t left = now < deadline ? deadline - now : 1;
        const int32_t previous = task.macrobatch - 1;
        ready = wait_count(p.ws, counters.ring_free(previous), ring_free_expected(previous),
                           layout::WaitId::kFusedRingFree, previous, left);
        if (ready) ring_checked = task.macrobatch;
      }
    }
    if (!ready) task.kind = TaskKind::kEnd;
  }
};

// Producer thread, then: the task's stages into the ring.
template <typename TaskT>
__device__ __forceinline__ bool produce_task(kernels::gemm::SharedStorage& ss,
                                             kernels::gemm::RingPosition& ring, const FusedForwardParams& p,
                                             const TaskT& task) {
  const kernels::gemm::Tile tile{task.m_block, task.n_block, task.group};  // group: 0 for the shared expert
  auto produce = [&](auto kind_tag, const kernels::GemmOperands& o) {
    return kernels::gemm::produce_tile<decltype(kind_tag)::value>(ss, ring, o.a, o.b0, o.b1, o.args, tile, 0,
                                                                  k_blocks(o.args));
  };
  switch (task.kind) {
    case TaskKind::kSharedGateUp:
      return produce(GemmTag<kGateUpGemm>{}, p.shared_gate_up);
    case TaskKind::kSharedDown:
      return produce(GemmTag<kDownGemm>{}, p.shared_down);
    case TaskKind::kGateUp:
      return produce(GemmTag<kGateUpGemm>{}, p.gate_up);
    case TaskKind::kDown:
      return produce(GemmTag<kDownGemm>{}, p.down);
    case TaskKind::kEnd:
      break;
  }
  return true;
}

// Consumer warpgroup, one task: mainloop + epilogue; `done` is the tile's counter, if any. A routed tile
// stores into its ring rows (m_block) and counts by its schedule block.
template <typename TaskT>
__device__ __forceinline__ bool consume_task(kernels::gemm::SharedStorage& ss,
                                             kernels::gemm::RingPosition& ring, const FusedForwardParams& p,
                                             const TaskT& task, int consumer_idx, float (&acc)[128],
                                             uint32_t*& done, const TileProfile& profile) {
  const FusedCounters counters = counters_of(p.ws);
  const kernels::gemm::Tile tile{task.m_block, task.n_block, task.group};
  auto mma_columns = [&](auto kind_tag, const GroupedGemmArgs& args) {
    return kernels::gemm::mma_columns<decltype(kind_tag)::value>(args, tile, consumer_idx,
                                                                 task.upper_half_padding);
  };
  auto multiply = [&](auto kind_tag, const GroupedGemmArgs& args) {
    return multiply_task<decltype(kind_tag)::value>(ss, ring, args, 0, k_blocks(args), consumer_idx,
                                                    mma_columns(kind_tag, args), acc, profile);
  };
  // A whole-K tile stored by its GEMM's own epilogue (the standalone kernel's).
  auto consume = [&](auto kind_tag, const GroupedGemmArgs& args) {
    if (!multiply(kind_tag, args)) return false;
    kernels::gemm::store_tile<decltype(kind_tag)::value>(acc, args, tile, true, consumer_idx);
    return true;
  };
  const GroupedGemmArgs& down = p.down.args;
  switch (task.kind) {
    case TaskKind::kSharedGateUp:
      done = counters.first_done(true, task.m_block);
      return consume(GemmTag<kGateUpGemm>{}, p.shared_gate_up.args);
    case TaskKind::kSharedDown:
      return consume(GemmTag<kDownGemm>{}, p.shared_down.args);
    case TaskKind::kGateUp:
      done = counters.first_done(false, schedule_block_of(task));
      return consume(GemmTag<kGateUpGemm>{}, p.gate_up.args);
    case TaskKind::kDown:
      if (!multiply(GemmTag<kDownGemm>{}, down)) return false;
      if (p.push_combine) {
        kernels::gemm::store_tile<kDownGemm>(acc, down, tile, true, consumer_idx);
        done = counters.rows_done(task.unit);
      } else {
        store_tile_to_slots(acc, p.ws, p.ws.sym_y_slots, down.n, schedule_block_of(task), task.n_block,
                            consumer_idx);
        if constexpr (!std::is_same_v<TaskT, Task>) done = counters.ring_free(macrobatch_of(task));
      }
      return true;
    case TaskKind::kEnd:
      break;
  }
  return true;
}

// Launched cooperatively (grid_steps.cuh needs every CTA resident), one CTA per SM. kRing: the workspace's
// routed rows are a macrobatch ring; the kernel walks its macrobatches (the scan's step plans them).
template <bool kRing>
__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardParams params) {
  using Scheduler = ForwardScheduler<kRing>;
  using TaskT = typename Scheduler::TaskT;
  kernels::gemm::SharedStorage& ss = stage_storage();
  __shared__ TaskSlots<TaskT> slots;
  __shared__ SchedulerStorage<Scheduler> scheduler;
  const layout::WorkspacePointers& ws = params.ws;

  // Prologue scratch in the stage ring: the per-warp counters from its start, the scan's at its end.
  static_assert(
      GemmConfig::kNumThreads <= routing::ScanScratch::kMaxThreads && GemmConfig::kNumThreads % 32 == 0,
      "the scan keeps one int32 per thread of whole warps");
  auto* scan_scratch = reinterpret_cast<routing::ScanScratch*>(
      reinterpret_cast<char*>(ss.stages) + sizeof(ss.stages) - sizeof(routing::ScanScratch));
  if (!run_forward_prologue<kRing>(ws, params.in, reinterpret_cast<int32_t*>(ss.stages), *scan_scratch,
                                   slots.go))
    return;
  const int32_t role = start_cta(ws, params.comm_ctas, ss, slots);
  const int warpgroup = threadIdx.x / 128;
  if (role < params.comm_ctas) {
    if (!wait_schedule_placed(ws, slots.go)) return;
    CommunicationPlan plan;
    plan.shape = task_shape_of(params);
    plan.comm_ctas = params.comm_ctas;
    plan.push_combine = params.push_combine;
    plan.second_tiles_per_block = 2u * plan.shape.down_n;
    plan.rows_done_wait = layout::WaitId::kFusedRowsDone;
    // Over a ring, one row per pull (pull_row_pair has no ring offset); otherwise the short rows in pairs.
    run_communication<kRing, !kRing>(
        ws, slots.go, plan, role,
        [&](int64_t row, int64_t second, int64_t ring_first) {
          if constexpr (kRing) {
            dispatch::pull_row<kPullDepth>(ws, row, ring_first);
          } else {
            dispatch::pull_row_pair<kPullDepth>(ws, row, second);
          }
        },
        [&](int64_t row, int64_t ring_first) {
          combine::push_row<8>(ws, ws.y_rows, ws.sym_y_slots, row, ring_first);
        });
    __syncthreads();  // every warp's pushes are issued before warpgroups 1 and 2 arrive for the CTA
    if (warpgroup > 0) finish_forward(ws, warpgroup);
    return;
  }
  if (threadIdx.x == 0) {
    for (const CUtensorMap* map :
         {&params.gate_up.a, &params.gate_up.b0, &params.gate_up.b1, &params.down.a, &params.down.b0})
      kernels::ptx::prefetch_tensor_map(map);
  }
  run_compute_cta(
      ws, slots, scheduler, params,
      [&](const TaskT& task, kernels::gemm::RingPosition& ring) {
        return produce_task(ss, ring, params, task);
      },
      [&](const TaskT& task, kernels::gemm::RingPosition& ring, float(&acc)[128], uint32_t*& done, uint32_t*&,
          const TileProfile& profile) {
        return consume_task(ss, ring, params, task, warpgroup - 1, acc, done, profile);
      },
      [&] { finish_forward(ws, warpgroup); });
}

}  // namespace pounce::kernels::fused
