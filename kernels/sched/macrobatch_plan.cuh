// The macrobatch plan of one call (docs/design.md, "Macrobatch ring"), built on the device right after the
// receive schedule, so the host never reads a row count. Only workspaces with a ring run it
// (WorkspacePointers::has_ring). From group_row_offset it writes, for every possible macrobatch b < maxB:
//
//   plan[0] = B, plan[1 + b] = bounds[b]         macrobatches of whole experts (sched/macrobatches.cuh)
//   offsets[b][kForward][e] = clamp(group_row_offset[e], bounds[b], bounds[b + 1]) - bounds[b]
//                                                b's expert offsets, ring-relative (all 0 for b >= B)
//   offsets[b][kReplay]  = offsets[b][kForward] for b < B - 1, else 0
//                                                what the backward replays (the last macrobatch is resident)
//   offsets[b][kRestore] = offsets[b][kForward] for b = B - 1 when B > 1, else 0
//                                                what the backward replays at its end to leave the context as
//                                                the forward did (layout::MacrobatchRows)
//   owned[b][e]      = 1 where b writes expert e's weight gradient: the macrobatch holding its rows, or
//                      macrobatch 0 for an expert without rows (it gets zeros there)
//   schedule[b][r]   = schedule[bounds[b] + r]   b's schedule rows, ring-relative
//
// Every kernel of macrobatch b then runs unchanged on WorkspacePointers::macrobatch(b). An expert never spans
// two macrobatches: the ring is at least the largest segment distinct expert ids per token can produce
// (num_ranks * max_tokens, padded). A larger one (a token naming an expert twice) is recorded
// (kMacrobatchOverflow) and the plan is left empty: the routed experts compute nothing, their rows' owners
// get NaN slots (not stale ones), every weight gradient is written as zeros, nothing is written out of
// bounds.
#pragma once

#include <cstdint>

#include "kernels/combine/combine.cuh"
#include "kernels/common/flags.cuh"
#include "kernels/layout/workspace_layout.cuh"
#include "kernels/sched/macrobatches.cuh"

namespace pounce::kernels::sched {

inline constexpr int kMaxMacrobatches = 1024;  // bounds kept in shared memory while the plan is built
inline constexpr int kPlanThreads = 256;

// One thread: bounds[0 .. B] of the ring's macrobatches (whole experts, packed greedily), B returned. An
// expert with more rows than the ring is recorded (when `report`) and leaves B = 0: nothing routed runs.
__device__ __forceinline__ int32_t plan_ring_bounds(const layout::WorkspacePointers& ws, int32_t* bounds,
                                                    bool report) {
  const int El = ws.num_local_experts;
  const int32_t M = static_cast<int32_t>(ws.ring_rows);
  const int32_t* row_offset = ws.group_row_offset;  // clamped to rows_capacity by the scan
  int32_t largest = 0, largest_expert = 0;
  for (int e = 0; e < El; ++e) {
    const int32_t rows = row_offset[e + 1] - row_offset[e];
    if (rows > largest) largest = rows, largest_expert = e;
  }
  bounds[0] = row_offset[0];
  if (largest > M) {
    if (report)
      flags::record_error(ws, layout::DeviceErrorCode::kMacrobatchOverflow, 0, -1, M, largest,
                          largest_expert);
    return 0;
  }
  // No segment beyond the ring: whole experts only, at most max_macrobatches (WorkspaceLayout's bound).
  return plan_macrobatches(row_offset, El, M, bounds);
}

// Any grid of kNumThreads-thread CTAs: every CTA plans the bounds (one thread, El steps) and copies its share
// of the schedule rows; CTA 0 writes the plan, the offsets and the owners.
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    plan_macrobatches_kernel(const layout::WorkspacePointers ws, bool poison_on_overflow) {
  __shared__ int32_t bounds[kMaxMacrobatches + 1];
  __shared__ int32_t count;
  const int El = ws.num_local_experts;
  const int32_t* row_offset = ws.group_row_offset;  // clamped to rows_capacity by the scan
  if (threadIdx.x == 0) count = plan_ring_bounds(ws, bounds, blockIdx.x == 0);
  __syncthreads();
  const int32_t B = count;
  const int32_t maxB = ws.max_macrobatches;
  if (blockIdx.x == 0) {
    if (threadIdx.x == 0) ws.macrobatch_plan[0] = B;
    for (int32_t b = threadIdx.x; b <= maxB; b += blockDim.x) ws.macrobatch_plan[1 + b] = bounds[min(b, B)];
    const int32_t row_entries = El + 1;
    for (int32_t i = threadIdx.x; i < maxB * row_entries; i += blockDim.x) {
      const int32_t b = i / row_entries, e = i - b * row_entries;
      const int32_t value = b < B ? min(max(row_offset[e], bounds[b]), bounds[b + 1]) - bounds[b] : 0;
      int32_t* sets = ws.macrobatch_offsets + 3 * b * row_entries + e;
      sets[static_cast<int>(layout::MacrobatchRows::kForward) * row_entries] = value;
      sets[static_cast<int>(layout::MacrobatchRows::kReplay) * row_entries] = b + 1 < B ? value : 0;
      sets[static_cast<int>(layout::MacrobatchRows::kRestore) * row_entries] =
          b + 1 == B && B > 1 ? value : 0;
    }
    for (int32_t i = threadIdx.x; i < maxB * El; i += blockDim.x) {
      const int32_t b = i / El, e = i - b * El;
      const int32_t first = row_offset[e];
      const bool has_rows = row_offset[e + 1] > first;
      const bool holds = b < B && bounds[b] <= first && first < bounds[b + 1];
      // After an overflow (B = 0 with rows) macrobatch 0 writes every expert: zeros, nothing stale.
      ws.macrobatch_owned[i] = (has_rows && B > 0 ? holds : b == 0) ? 1 : 0;
    }
  }
  // After an overflow the routed experts compute nothing: their rows' owners get NaN slots. Only where this
  // runs before the combine barrier (`poison_on_overflow`: the staged path; the fused forward poisons inside
  // its kernel, and a write after the barrier could land in the owner's next call).
  if (B == 0 && row_offset[El] > row_offset[0]) {
    if (!poison_on_overflow) return;
    const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
    for (int64_t row = row_offset[0] + warp; row < row_offset[El]; row += num_warps)
      combine::poison_row(ws, ws.sym_y_slots, row);
    return;
  }
  // Schedule rows, ring-relative, every CTA a strided share (16-byte entries).
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int32_t b = 0;
  for (int64_t row = bounds[0] + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; row < bounds[B];
       row += stride) {
    while (row >= bounds[b + 1]) ++b;
    ws.macrobatch_schedule[static_cast<int64_t>(b) * ws.ring_rows + (row - bounds[b])] = ws.schedule[row];
  }
}

}  // namespace pounce::kernels::sched
