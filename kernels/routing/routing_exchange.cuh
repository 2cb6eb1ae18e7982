// Routing exchange (docs/design.md §2): every rank needs every rank's topk_idx to build its receive schedule.
//
//   rank r, for every peer p (itself included):
//     peer p .routing_tokens[r]      = T_r                              int32
//     peer p .routing_idx[r][0, T*k) = int32(topk_idx_r[T, k])          (int64 input converted here)
//   then a phase barrier (flags.cuh): after it, routing_idx[s] of every source s is complete locally.
//
// Entries travel four at a time as one 16-byte store; the tail of a source's row is padded with -1.
// int64 ids outside the int32 range saturate, so the schedule stage reports them as out of range.
// Mirrors the inputs reference::build_schedule reads (RankInputs::topk_idx of every rank).
#pragma once

#include <cstdint>

#include "kernels/common/flags.cuh"
#include "kernels/layout/workspace_layout.cuh"

namespace pounce::kernels::routing {

__device__ __forceinline__ int32_t load_expert_id(const void* topk_idx, bool idx_int64, int64_t i) {
  if (!idx_int64) return static_cast<const int32_t*>(topk_idx)[i];
  const int64_t value = static_cast<const int64_t*>(topk_idx)[i];
  if (value > INT32_MAX) return INT32_MAX;
  if (value < INT32_MIN) return INT32_MIN;
  return static_cast<int32_t>(value);
}

// Grid-stride over (peer, group of four entries). Any grid shape works.
__device__ __forceinline__ void store_routing_to_peers(const layout::WorkspacePointers& ws,
                                                       const void* topk_idx, bool idx_int64,
                                                       int64_t num_tokens) {
  const int64_t num_entries = num_tokens * ws.num_topk;
  const int64_t num_quads = layout::ceil_div(num_entries, 4);
  const int64_t num_units = num_quads * ws.num_ranks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t unit = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; unit < num_units;
       unit += stride) {
    const int peer = static_cast<int>(unit / num_quads);
    const int64_t quad = unit % num_quads;
    int32_t ids[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t entry = quad * 4 + i;
      ids[i] = entry < num_entries ? load_expert_id(topk_idx, idx_int64, entry) : -1;
    }
    int4* dst = ws.peer<int4>(peer, ws.sym_routing_idx + (ws.rank * ws.routing_stride + quad * 4) * 4);
    *dst = make_int4(ids[0], ids[1], ids[2], ids[3]);
  }
  if (blockIdx.x == 0 && threadIdx.x < ws.num_ranks) {
    *ws.peer<int32_t>(static_cast<int>(threadIdx.x), ws.sym_routing_tokens + ws.rank * 4) =
        static_cast<int32_t>(num_tokens);
  }
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    routing_exchange_kernel(layout::WorkspacePointers ws, const void* topk_idx, bool idx_int64,
                            int64_t num_tokens) {
  store_routing_to_peers(ws, topk_idx, idx_int64, num_tokens);
}

// One block of at least R threads. Launched between phases of the staged path.
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    phase_barrier_kernel(layout::WorkspacePointers ws, layout::WaitId which) {
  flags::phase_barrier_block(ws, which);
}

}  // namespace pounce::kernels::routing
