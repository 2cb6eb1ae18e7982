// The named barriers (bar.sync ids) of the 384-thread GEMM / fused CTA, in one list so that no two stages
// pick the same id. Id 0 is __syncthreads. Each barrier joins the 128 threads of one warpgroup, and every
// kind has one id per warpgroup index (0 or 1: the two consumer warpgroups, or warpgroups 1 and 2 of a
// communication CTA), so the two warpgroups never wait on each other. Kinds differ so that a warpgroup whose
// warps fell apart at one (per-thread timeouts) can never pair with another kind's.
#pragma once

#include <cstdint>

#include "kernels/common/ptx.cuh"

namespace pounce::kernels {

enum class NamedBarrier : uint32_t {
  kTileStored = 1,  // fused: every store of a tile's 64 rows, before the tile's count is released
  kFinish = 3,      // fused forward: the warpgroup's work issued, before it arrives at the combine barrier
  kStoreChunk = 5,  // gemm epilogue: a TMA-store chunk written to shared memory, before its leader issues it
};
inline constexpr uint32_t kNumNamedBarriers = 7;  // ids 0..6 of the 16 a CTA has

// The id of `kind` for warpgroup index `index` (0 or 1).
__device__ __forceinline__ uint32_t named_barrier_id(NamedBarrier kind, int index) {
  return static_cast<uint32_t>(kind) + static_cast<uint32_t>(index);
}

// bar.sync of the 128 threads of warpgroup index `index` at `kind`.
__device__ __forceinline__ void warpgroup_sync(NamedBarrier kind, int index) {
  ptx::named_barrier_sync(named_barrier_id(kind, index), 128);
}

}  // namespace pounce::kernels
