// Warp-wide helpers every stage shares: row copies by one warp, and the grid's warps as one index space.
// A row is a run of 16-byte vectors (bf16 rows of H or I elements, H % 8 == 0); lane l moves vectors l, l +
// 32,
// ... The copies are plain loads and stores: the caller orders them (flags.cuh, barriers) as its stage says.
#pragma once

#include <cstdint>

namespace pounce::kernels::warp {

// Copies `num_vectors` 16-byte vectors with the calling warp. Each lane issues up to kDepth loads before its
// first store, the last round predicated rather than serialised, so a row costs ceil(vectors / (32 kDepth))
// round trips (over NVLink: the fused kernels' communication warps go 16 deep).
template <int kDepth = 4>
__device__ __forceinline__ void copy_16b(int4* dst, const int4* src, int64_t num_vectors) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t base = lane; base < num_vectors; base += 32 * kDepth) {
    int4 in[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      in[d] = make_int4(0, 0, 0, 0);
      if (base + 32 * d < num_vectors) in[d] = src[base + 32 * d];
    }
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (base + 32 * d < num_vectors) dst[base + 32 * d] = in[d];
    }
  }
}
// Zeros `num_vectors` 16-byte vectors with the calling warp.
__device__ __forceinline__ void zero_16b(int4* dst, int64_t num_vectors) {
  for (int64_t v = threadIdx.x % 32; v < num_vectors; v += 32) dst[v] = make_int4(0, 0, 0, 0);
}

// This warp's index over the grid, and the number of warps in it (grid-stride loops by warp).
__device__ __forceinline__ int64_t global_index() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
}
__device__ __forceinline__ int64_t num_global() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
}

}  // namespace pounce::kernels::warp
