// Dispatch (docs/design.md §2): expert owners PULL token rows from the source rank's symmetric x.
//
//   stage_x : sym_x[t] = x[t] for t < T, 0 for T <= t < round_up(T, 128); shared_row_offset = {0, that}
//             (the shared expert's GEMMs run on sym_x as one group of round_up(T, 128) rows)
//   pull    : x_rows[row] = peer(src_rank).sym_x[src_token]   for every schedule row of local experts
//             [expert_begin, expert_end) (a pipeline chunk); padding rows get zeros, so g = u = act = y = 0.
// One warp per row, 16-byte loads and stores; hidden * 2 bytes must be a multiple of 16 (H % 8 == 0).
// Waits on nothing inside: the routing barrier precedes it in stream order, and a pull needs no flag
// because the puller's own load completes when the data has arrived. Mirrors step 1 of reference::forward.
#pragma once

#include <cstdint>

#include "kernels/common/warp.cuh"
#include "kernels/layout/workspace_layout.cuh"

namespace pounce::kernels::dispatch {

__device__ __forceinline__ void stage_x(const layout::WorkspacePointers& ws, const void* x,
                                        int64_t num_tokens) {
  const int64_t padded_tokens = layout::round_up(num_tokens, layout::kBlockM);
  const int64_t row_vectors = ws.hidden * layout::kBf16Bytes / 16;
  int4* sym_x = ws.local_sym<int4>(ws.sym_x);
  for (int64_t t = warp::global_index(); t < padded_tokens; t += warp::num_global()) {
    if (t < num_tokens) {
      warp::copy_16b(sym_x + t * row_vectors, static_cast<const int4*>(x) + t * row_vectors, row_vectors);
    } else {
      warp::zero_16b(sym_x + t * row_vectors, row_vectors);
    }
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    ws.shared_row_offset[0] = 0;
    ws.shared_row_offset[1] = static_cast<int32_t>(padded_tokens);
  }
}

// One receive-schedule row, by one warp: x_rows[row] = peer(src_rank).sym_x[src_token], zeros for padding.
// `ring_first`: the schedule row that x_rows[0] holds (a macrobatch ring's first row; 0 without a ring).
template <int kDepth = 4>
__device__ __forceinline__ void pull_row(const layout::WorkspacePointers& ws, int64_t row,
                                         int64_t ring_first = 0) {
  const int64_t row_vectors = ws.hidden * layout::kBf16Bytes / 16;
  int4* dst = static_cast<int4*>(ws.x_rows) + (row - ring_first) * row_vectors;
  const layout::ScheduleEntry entry = ws.schedule[row];
  if (entry.src_rank < 0) {
    warp::zero_16b(dst, row_vectors);
  } else {
    warp::copy_16b<kDepth>(dst, ws.peer<const int4>(entry.src_rank, ws.sym_x) + entry.src_token * row_vectors,
                           row_vectors);
  }
}

// Schedule rows `row` and `second` (none when negative) by one warp. Where both fit in one round of the depth
// (qwen3's 4 KB rows in 16 loads per lane), each lane loads half its depth from each row before storing
// either, so the warp waits one NVLink round trip for two rows instead of one per row; otherwise pull_row
// twice.
template <int kDepth>
__device__ __forceinline__ void pull_row_pair(const layout::WorkspacePointers& ws, int64_t row,
                                              int64_t second) {
  constexpr int kHalf = kDepth / 2;
  const int64_t row_vectors = ws.hidden * layout::kBf16Bytes / 16;
  if (second < 0 || row_vectors > 32 * kHalf) {
    pull_row<kDepth>(ws, row);
    if (second >= 0) pull_row<kDepth>(ws, second);
    return;
  }
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t rows[2] = {row, second};
  const int4* src[2];
  int4* dst[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const layout::ScheduleEntry entry = ws.schedule[rows[r]];
    dst[r] = static_cast<int4*>(ws.x_rows) + rows[r] * row_vectors;
    src[r] = entry.src_rank < 0
                 ? nullptr  // padding: zeros, as pull_row writes
                 : ws.peer<const int4>(entry.src_rank, ws.sym_x) + entry.src_token * row_vectors;
  }
  int4 in[2][kHalf];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int d = 0; d < kHalf; ++d) {
      const int64_t v = lane + 32 * d;
      in[r][d] = make_int4(0, 0, 0, 0);
      if (src[r] != nullptr && v < row_vectors) in[r][d] = src[r][v];
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
#pragma unroll
    for (int d = 0; d < kHalf; ++d) {
      const int64_t v = lane + 32 * d;
      if (v < row_vectors) dst[r][v] = in[r][d];
    }
  }
}

__device__ __forceinline__ void pull_rows(const layout::WorkspacePointers& ws, int expert_begin,
                                          int expert_end) {
  const int64_t first_row = ws.group_row_offset[expert_begin], end_row = ws.group_row_offset[expert_end];
  for (int64_t row = first_row + warp::global_index(); row < end_row; row += warp::num_global())
    pull_row(ws, row);
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    stage_x_kernel(layout::WorkspacePointers ws, const void* x, int64_t num_tokens) {
  stage_x(ws, x, num_tokens);
}
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    dispatch_pull_kernel(layout::WorkspacePointers ws, int expert_begin, int expert_end) {
  pull_rows(ws, expert_begin, expert_end);
}

}  // namespace pounce::kernels::dispatch
