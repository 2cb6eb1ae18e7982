// Combine (docs/design.md §1-§2): expert owners PUSH each output row into the token owner's private slot,
// then every rank reduces its own tokens.
//
//   push         : peer(src_rank).y_slots[src_token][slot] = y_rows[row]   for every non-padding row
//   (phase barrier, flags.cuh: all pushes into this rank's slots are visible after it)
//   weighted_sum : out[t] = bf16(float(ys[t]) + sum_{j ascending, 0 <= idx[t,j] < E} w[t,j] * float(y[t,j]))
//                  one fp32 accumulator starting at ys[t] (0 without a shared expert), multiply and add
//                  rounded separately (no FMA contraction), exactly as reference::forward step 4.
// The routing ids come from this rank's own row of the exchanged routing (int32 already). Slots with an
// id outside [-1, E) were recorded by the schedule stage and are skipped here.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/warp.cuh"
#include "kernels/layout/workspace_layout.cuh"

namespace pounce::kernels::combine {

// The start of (token, slot)'s row in the slot region `sym_slots` ([max_tokens][k][H] bf16) of the rank that
// owns the token: where the output of schedule row `entry` goes.
template <typename T>
__device__ __forceinline__ T* slot_row(const layout::WorkspacePointers& ws, int64_t sym_slots,
                                       const layout::ScheduleEntry& entry) {
  const int64_t slot = static_cast<int64_t>(entry.src_token) * ws.num_topk + entry.slot;
  return reinterpret_cast<T*>(ws.peer<char>(entry.src_rank, sym_slots) +
                              slot * ws.hidden * layout::kBf16Bytes);
}

// One schedule row of `rows` ([rows_capacity][H] expert-grouped), by one warp, into its owner's slot
// (forward: y_rows into sym_y_slots; backward's reverse-dispatch: dx_rows into sym_dx_slots). Padding rows go
// nowhere. `ring_first`: the schedule row that rows[0] holds (a macrobatch ring's first row; 0 without).
template <int kDepth = 4>
__device__ __forceinline__ void push_row(const layout::WorkspacePointers& ws, const void* rows,
                                         int64_t sym_slots, int64_t row, int64_t ring_first = 0) {
  const layout::ScheduleEntry entry = ws.schedule[row];
  if (entry.src_rank < 0) return;
  const int64_t row_vectors = ws.hidden * layout::kBf16Bytes / 16;
  warp::copy_16b<kDepth>(slot_row<int4>(ws, sym_slots, entry),
                         static_cast<const int4*>(rows) + (row - ring_first) * row_vectors, row_vectors);
}

// A schedule row whose expert output cannot be computed (a macrobatch overflow): its owner's slot gets bf16
// NaNs, so that the owner's sum shows the failure instead of a stale slot. By one warp.
__device__ __forceinline__ void poison_row(const layout::WorkspacePointers& ws, int64_t sym_slots,
                                           int64_t row) {
  const layout::ScheduleEntry entry = ws.schedule[row];
  if (entry.src_rank < 0) return;
  const int64_t row_vectors = ws.hidden * layout::kBf16Bytes / 16;
  int4* dst = slot_row<int4>(ws, sym_slots, entry);
  const int nan2 = 0x7FC07FC0;  // two bf16 quiet NaNs
  for (int64_t v = threadIdx.x % 32; v < row_vectors; v += 32) dst[v] = make_int4(nan2, nan2, nan2, nan2);
}

// Rows of local experts [expert_begin, expert_end) only (a pipeline chunk).
__device__ __forceinline__ void push_rows(const layout::WorkspacePointers& ws, const void* rows,
                                          int64_t sym_slots, int expert_begin, int expert_end) {
  const int64_t first_row = ws.group_row_offset[expert_begin], end_row = ws.group_row_offset[expert_end];
  for (int64_t row = first_row + warp::global_index(); row < end_row; row += warp::num_global())
    push_row(ws, rows, sym_slots, row);
}

// One thread per (token, 8 consecutive hidden columns), threads first_thread, + num_threads, ... `base`
// [T][H] starts the accumulator (the shared expert's output or d_x; null = 0); `topk_weights` null means
// weight 1 (backward's d_x sum: 1 * v == v). Slots go in groups of kSumGroup: the group's ids first, then
// every valid slot's load, so the loads of a group are in flight together; the accumulation still runs in
// ascending j.
template <int kSumGroup = 8>
__device__ __forceinline__ void weighted_sum(const layout::WorkspacePointers& ws, int64_t sym_slots,
                                             const float* topk_weights, const void* base, void* out,
                                             int64_t num_tokens, int64_t first_thread, int64_t num_threads) {
  const int64_t H = ws.hidden, k = ws.num_topk;
  const int64_t vectors_per_row = H / 8;
  const int64_t total = num_tokens * vectors_per_row;
  const int32_t* topk_idx = ws.local_sym<const int32_t>(ws.sym_routing_idx) + ws.rank * ws.routing_stride;
  const int4* y_slots = ws.local_sym<const int4>(sym_slots);
  const int4* shared_y = static_cast<const int4*>(base);
  for (int64_t item = first_thread; item < total; item += num_threads) {
    const int64_t t = item / vectors_per_row, v = item % vectors_per_row;
    float acc[8];
    if (shared_y != nullptr) {
      const int4 packed = shared_y[t * vectors_per_row + v];
      const __nv_bfloat16* ys = reinterpret_cast<const __nv_bfloat16*>(&packed);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = __bfloat162float(ys[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] = 0.0f;
    }
    for (int64_t group = 0; group < k; group += kSumGroup) {
      uint32_t valid = 0;  // bit j: slot group + j exists and names an expert in [0, E)
#pragma unroll
      for (int j = 0; j < kSumGroup; ++j) {
        if (group + j < k) {
          const int32_t expert = topk_idx[t * k + group + j];
          if (expert >= 0 && expert < ws.num_experts) valid |= 1u << j;
        }
      }
      float w[kSumGroup];
      int4 packed[kSumGroup];
#pragma unroll
      for (int j = 0; j < kSumGroup; ++j) {
        w[j] = 0.0f;
        packed[j] = make_int4(0, 0, 0, 0);
        if (valid & (1u << j)) {
          const int64_t slot = t * k + group + j;
          w[j] = topk_weights != nullptr ? topk_weights[slot] : 1.0f;
          packed[j] = y_slots[slot * vectors_per_row + v];
        }
      }
#pragma unroll
      for (int j = 0; j < kSumGroup; ++j) {
        if (!(valid & (1u << j))) continue;
        const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(&packed[j]);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w[j], __bfloat162float(y[i])));
      }
    }
    int4 result;
    __nv_bfloat16* o = reinterpret_cast<__nv_bfloat16*>(&result);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(acc[i]);
    static_cast<int4*>(out)[t * vectors_per_row + v] = result;
  }
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    combine_push_kernel(layout::WorkspacePointers ws, const void* rows, int64_t sym_slots, int expert_begin,
                        int expert_end) {
  push_rows(ws, rows, sym_slots, expert_begin, expert_end);
}
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    weighted_sum_kernel(layout::WorkspacePointers ws, int64_t sym_slots, const float* topk_weights,
                        const void* base, void* out, int64_t num_tokens) {
  weighted_sum(ws, sym_slots, topk_weights, base, out, num_tokens,
               static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x,
               static_cast<int64_t>(gridDim.x) * blockDim.x);
}

}  // namespace pounce::kernels::combine
