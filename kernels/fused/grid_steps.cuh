// The fused forward's own beginning and end (the routing exchange, the schedule and the combine barrier
// inside the one launch). The kernel is launched cooperatively, so every CTA is resident and a CTA
// may wait for all the others. A grid step is an arrival count and a release word in the fused counter header
// (layout::FusedGridStep): the last CTA (or party) to arrive does the step's serial work and releases it;
// whoever needs the step done waits for the release.
//
//   every CTA       stage x; its routing ids into every peer          arrive kStepRouting
//     last arrival  the cross-GPU routing barrier (one warp)           release; every CTA waits
//   every CTA       count its (source, chunk) items                    arrive kStepCounted
//     last arrival  the scan: group_row_offset, padding rows           release; every CTA waits
//   every CTA       place its items                                    arrive kStepPlaced
//     last arrival  nothing                                            release; only communication CTAs wait
//   (compute CTAs need just group_row_offset; a tile reads schedule rows only after its rows were pulled by
//   communication CTAs, which waited for kStepPlaced, so the release chain through rows_ready covers them)
//   ... tiles and transfers ...
//   every party     (warpgroups 1 and 2 of every CTA) done             arrive kStepFinished
//     last arrival  the cross-GPU combine barrier (one warp)           release (a timestamp; nobody waits)
//
// The weighted sum is the next kernel on the stream, not a step: a memory-bound pass wants several lean CTAs
// per SM, and inside this kernel (one CTA of 256 usable threads per SM) it ran at half the speed (qwen3 0.136
// vs 0.072 ms, deepseek 0.54 vs 0.24 ms; docs/design.md).
//
// Ordering: an arrival is bar.sync (or the warpgroup's named barrier) then one atom.acq_rel.gpu, so the last
// arrival has acquired every store of the grid before it; its system-scope release to the peers carries them
// (causality is transitive). Waiters acquire the release word, then bar.sync. After any failure (the abort
// word) the combine barrier is skipped: the peers time out instead of summing slots this rank never wrote.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/flags.cuh"
#include "kernels/common/warp.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "kernels/fused/fused_common.cuh"
#include "kernels/routing/routing_exchange.cuh"
#include "kernels/routing/schedule.cuh"
#include "kernels/sched/macrobatch_plan.cuh"

namespace pounce::kernels::fused {

// The caller's tensors the fused forward reads.
struct ForwardInputs {
  const void* x;         // [T, H] bf16
  const void* topk_idx;  // [T, k] int32 or int64
  int64_t num_tokens;
  bool idx_int64;
};

__device__ __forceinline__ uint32_t* step_arrived(const layout::WorkspacePointers& ws,
                                                  layout::FusedGridStep step) {
  return ws.fused_counters + layout::kFusedGridArrived + step;
}
__device__ __forceinline__ uint32_t* step_released(const layout::WorkspacePointers& ws,
                                                   layout::FusedGridStep step) {
  return ws.fused_counters + layout::kFusedGridReleased + step;
}

// Waits for the release of `step` (one thread). Twice the call's bound: the releasing CTA may itself wait out
// one bound at a cross-GPU barrier first.
__device__ __forceinline__ bool wait_step_released(const layout::WorkspacePointers& ws,
                                                   layout::FusedGridStep step) {
  return wait_count(ws, step_released(ws, step), 1u, layout::WaitId::kFusedGridStep, step, 2 * ws.timeout_ns);
}

// The last arrival's release; a failed serial step aborts the kernel (its error is recorded already).
__device__ __forceinline__ void release_step(const layout::WorkspacePointers& ws, layout::FusedGridStep step,
                                             bool ok) {
  if (!ok) atomicExch(counters_of(ws).abort(), 1u);
  static_assert(layout::kTimeCombineBarrier == layout::kStepFinished + 1 &&
                    layout::kTimePlacedReleased == layout::kStepPlaced,
                "the step times of the released steps follow the steps' order");
  step_times(ws)[step == layout::kStepFinished ? layout::kTimeCombineBarrier : step] =
      flags::global_timer_ns();
  flags::st_release_gpu(step_released(ws, step), 1u);
}

// Whole CTA: arrive at `step`; the last CTA to arrive runs `serial()` (whole CTA; thread 0's result counts)
// and releases the step; when `wait`, the others wait for that. False once any CTA failed.
template <typename Serial>
__device__ __forceinline__ bool cta_grid_step(const layout::WorkspacePointers& ws, int32_t& word,
                                              layout::FusedGridStep step, bool wait, Serial&& serial) {
  __syncthreads();  // the CTA's stores of this step are issued before thread 0 arrives
  bool arrived_last = false;
  if (threadIdx.x == 0) {
    kernels::ptx::fence_proxy_async_global();  // staged x rows are read by TMA (the shared expert's tiles)
    flags::fence_acq_rel_sys();  // the routing ids stored into peers: ordered at system scope, not only GPU
    if (step == layout::kStepRouting)
      atomicMax(step_times(ws) + layout::kTimeRoutingFenced, flags::global_timer_ns());
    arrived_last = flags::atom_add_acq_rel_gpu(step_arrived(ws, step), 1u) == gridDim.x - 1;
  }
  const bool last = cta_broadcast(word, arrived_last);
  if (last) {
    const bool ok = serial();
    __syncthreads();
    if (threadIdx.x == 0) release_step(ws, step, ok);
  } else if (wait && threadIdx.x == 0) {
    wait_step_released(ws, step);
  }
  return !cta_broadcast(word, threadIdx.x == 0 && aborted(ws));
}

// The routing barrier, by warp 0 of the calling CTA (thread 0's result). It reserves both epochs of the call
// (routing E + 1, combine E + 2) before it waits: a call that fails anywhere after this point leaves the
// epoch where the peers' will be (they time out at the combine barrier, which advances theirs), so the next
// call's barriers still pair up.
__device__ __forceinline__ bool cta_routing_barrier(const layout::WorkspacePointers& ws) {
  if (threadIdx.x >= 32) return true;
  uint32_t base = 0;
  if (threadIdx.x == 0) {
    base = *ws.barrier_epoch;
    *ws.barrier_epoch = base + 2;  // read by the combine barrier's warp after the step's release
  }
  base = __shfl_sync(0xffffffffu, base, 0);
  const bool alone = ws.num_ranks == 1 && !ws.injects(layout::WaitId::kRoutingBarrier);
  return alone || flags::phase_barrier_warp(ws, layout::WaitId::kRoutingBarrier, base + 1);
}

// Every CTA, all threads, before the roles: stage x, exchange the routing, build the schedule. `scratch` is
// shared memory for one [El] int32 counter array per warp and `scan_scratch` the scan's (both the stage
// ring's, unused until the tiles start; they must not overlap). kRing: the scan's step also plans the
// macrobatches (their bounds, read by every CTA after the step).
// False once any CTA failed.
template <bool kRing>
__device__ __forceinline__ bool run_forward_prologue(const layout::WorkspacePointers& ws,
                                                     const ForwardInputs& in, int32_t* scratch,
                                                     routing::ScanScratch& scan_scratch, int32_t& word) {
  // The prologue's milestones (kFusedStepTimes; the latest CTA's by atomicMax) cost two bar.syncs.
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0) step_times(ws)[layout::kTimeKernelStarted] = flags::global_timer_ns();
    atomicMax(step_times(ws) + layout::kTimeLastCtaStarted, flags::global_timer_ns());
  }
  dispatch::stage_x(ws, in.x, in.num_tokens);
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(step_times(ws) + layout::kTimeXStaged, flags::global_timer_ns());
  routing::store_routing_to_peers(ws, in.topk_idx, in.idx_int64, in.num_tokens);
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(step_times(ws) + layout::kTimeRoutingStored, flags::global_timer_ns());
  auto routing_barrier = [&] {
    if (threadIdx.x == 0) step_times(ws)[layout::kTimeRoutingArrived] = flags::global_timer_ns();
    return cta_routing_barrier(ws);
  };
  if (!cta_grid_step(ws, word, layout::kStepRouting, /*wait=*/true, routing_barrier)) return false;

  int32_t* counters = scratch + (threadIdx.x / 32) * ws.num_local_experts;
  const int64_t warp = warp::global_index(), num_warps = warp::num_global();
  routing::for_each_schedule_chunk(ws, warp, num_warps, counters, routing::schedule_count_chunk);
  if (!cta_grid_step(ws, word, layout::kStepCounted, /*wait=*/true, [&] {
        routing::schedule_scan(ws, scan_scratch);
        if constexpr (kRing) {
          __syncthreads();  // group_row_offset written by the scan
          if (threadIdx.x == 0)
            ws.macrobatch_plan[0] = sched::plan_ring_bounds(ws, ws.macrobatch_plan + 1, true);
        }
        return true;  // an overflow is recorded and clamped, as on the staged path
      }))
    return false;

  routing::for_each_schedule_chunk(ws, warp, num_warps, counters, routing::schedule_place_chunk);
  kernels::ptx::fence_proxy_async_shared();  // the counters' smem is the stage ring's: TMA writes it next
  return cta_grid_step(ws, word, layout::kStepPlaced, /*wait=*/false, [] { return true; });
}

// A communication CTA, before its first pull: every schedule row is placed.
__device__ __forceinline__ bool wait_schedule_placed(const layout::WorkspacePointers& ws, int32_t& word) {
  return cta_broadcast(word, threadIdx.x == 0 && wait_step_released(ws, layout::kStepPlaced));
}

// Warpgroup 1 or 2 of any CTA (a compute CTA's consumers call it inside their register branch:
// run_compute_cta), all 128 threads, once its work (and, in a communication CTA, the whole CTA's: the caller
// synchronised it) is issued: arrive at kStepFinished; the last party runs the combine barrier at the epoch
// the routing barrier reserved. Nobody waits for it inside the kernel: the weighted sum is the next kernel on
// the stream (src/gpu/fused_forward.cu).
__device__ __forceinline__ void finish_forward(const layout::WorkspacePointers& ws, int warpgroup) {
  warpgroup_sync(NamedBarrier::kFinish, warpgroup - 1);
  if (threadIdx.x % 128 >= 32) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  uint32_t previous = 0;
  if (lane == 0) {
    flags::fence_acq_rel_sys();  // the warpgroup's stores into peers' slots, ordered at system scope
    previous = flags::atom_add_acq_rel_gpu(step_arrived(ws, layout::kStepFinished), 1u);
  }
  __syncwarp();  // lane 0's acquire of the grid's stores precedes the other lanes' releases to the peers
  if (__shfl_sync(0xffffffffu, previous, 0) != 2 * gridDim.x - 1) return;
  uint32_t go = 0, epoch = 0;
  if (lane == 0) {
    step_times(ws)[layout::kTimeLastFinished] = flags::global_timer_ns();
    go = aborted(ws) ? 0u : 1u;  // after a failure no peer may sum this rank's slots: skip the barrier
    epoch = *ws.barrier_epoch;
  }
  go = __shfl_sync(0xffffffffu, go, 0);
  epoch = __shfl_sync(0xffffffffu, epoch, 0);
  bool ok = go != 0;
  const bool alone = ws.num_ranks == 1 && !ws.injects(layout::WaitId::kCombineBarrier);
  if (ok && !alone) ok = flags::phase_barrier_warp(ws, layout::WaitId::kCombineBarrier, epoch);
  if (lane == 0) release_step(ws, layout::kStepFinished, ok);
}

}  // namespace pounce::kernels::fused
