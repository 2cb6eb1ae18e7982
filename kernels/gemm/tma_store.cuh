// Epilogues through shared memory: a consumer warpgroup converts its 64 rows of a tile to bf16, writes them
// as 64 x 64 chunks into its ring of store chunks (SharedStorage::store_chunks), and one thread hands each
// chunk to the copy engine (a TMA store). The warpgroup goes on to the next tile while the stores drain, so
// the tensor cores wait for the shared-memory writes only, not for the global ones (per-lane global stores
// cost 5-40 % of a GEMM's time, the most with short reductions:
// docs/experiments/010-epilogues-through-shared-memory.md). The per-kind epilogues that use this live in
// grouped_gemm_kernel.cuh next to their per-lane forms.
#pragma once

#include <cstdint>

#include "kernels/common/named_barriers.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/gemm/gemm_config.cuh"

namespace pounce::kernels::gemm {

// One consumer warpgroup's ring of kChunks store chunks. Thread 0 of the warpgroup issues every TMA store, so
// the bulk async-groups it waits on are exactly this ring's. The position runs on across tiles.
template <int kChunks>
class StoreChunkRing {
  static_assert(kChunks >= 2, "a chunk is written while the one before drains; fix: at least 2 chunks");

 public:
  // The chunks of `layout` (gemm_config.cuh) in this CTA's SharedStorage.
  __device__ StoreChunkRing(SharedStorage& ss, EpilogueLayout layout, int consumer_idx)
      : base_(ptx::smem_addr(&ss) + static_cast<uint32_t>(store_chunks_offset(layout)) +
              static_cast<uint32_t>(consumer_idx * kChunks) * kChunkBytes),
        barrier_(named_barrier_id(NamedBarrier::kStoreChunk, consumer_idx)),
        leader_(threadIdx.x % 128 == 0) {}

  // Where this warpgroup writes its next chunk. Free: the publish() before waited until the store that last
  // used this buffer had read it.
  __device__ uint32_t buffer() const { return base_ + (count_ % kChunks) * kChunkBytes; }

  // Every thread of the warpgroup wrote its part of the chunk at buffer(): the leader stores it with
  // `issue(buffer)`, after making sure that the buffer of the next chunk has been read by its last store.
  template <typename Issue>
  __device__ __forceinline__ void publish(Issue issue) {
    ptx::fence_proxy_async_shared();  // this thread's writes before the copy engine's reads
    if (leader_) ptx::bulk_wait_group_read<kChunks - 2>();
    ptx::named_barrier_sync(barrier_, 128);
    if (leader_) {
      issue(buffer());
      ptx::bulk_commit_group();
    }
    ++count_;
  }

  // Every store has read its chunk and written its rows (before the CTA exits, or before a reader elsewhere
  // is told). Leader only; the others return at once.
  __device__ __forceinline__ void drain() const {
    if (leader_) ptx::bulk_wait_group<0>();
  }

 private:
  static constexpr uint32_t kChunkBytes = GemmConfig::kStoreChunkBytes;
  uint32_t base_;
  uint32_t barrier_;
  bool leader_;
  uint32_t count_ = 0;
};

// This lane's first row among the warpgroup's 64 (the second is 8 below).
__device__ __forceinline__ int lane_row_in_group() {
  return static_cast<int>((threadIdx.x / 32) % 4) * 16 + static_cast<int>(threadIdx.x % 32) / 4;
}

// Byte address of bytes [4 q, 4 q + 4) of 16-byte unit `unit` (0..7) of row `row` (0..63) of a chunk. The
// 128-byte swizzle the TMA box expects: the unit index XOR row % 8.
__device__ __forceinline__ uint32_t chunk_address(uint32_t buffer, int row, int unit, int q) {
  return buffer + static_cast<uint32_t>(row * 128 + ((unit ^ (row % 8)) * 16) + q * 4);
}

// One chunk in the accumulator layout: value(u, h) is this lane's packed bf16 pair of 8-column unit u of the
// chunk, row half h. A row's 4 lanes fill one 16-byte unit and a warp's 8 rows land on 8 different units, so
// the writes have no bank conflicts.
template <typename Value>
__device__ __forceinline__ void write_chunk(uint32_t buffer, Value value) {
  const int row = lane_row_in_group(), q = static_cast<int>(threadIdx.x % 4);
#pragma unroll
  for (int u = 0; u < 8; ++u) {
#pragma unroll
    for (int h = 0; h < 2; ++h) ptx::st_shared_b32(chunk_address(buffer, row + 8 * h, u, q), value(u, h));
  }
}

// Where a warpgroup's chunks go: a 2-D map [rows, n] from row `row`.
struct ChunkTarget {
  const CUtensorMap* map;
  int32_t row;
  __device__ __forceinline__ void store(int32_t col, uint32_t buffer) const {
    ptx::tma_store_2d(map, buffer, col, row);
  }
};

}  // namespace pounce::kernels::gemm
