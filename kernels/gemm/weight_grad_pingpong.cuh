// Weight gradients with each consumer warpgroup on tiles of its own (sm_90a): the ping-pong tiles of
// grouped_weight_grad (src/gpu/grouped_gemm.h, TileSchedule). Same sums as the cooperative kernel
// (grouped_gemm_kernel.cuh, kWeightGrad), bit for bit: the same K steps in the same order per output. Each
// warpgroup owns whole tiles of 128 x 128 outputs (two m64n128 wgmmas per K step, one per 64-row half), every
// other tile of its CTA, so one warpgroup's epilogue runs while the other multiplies.
//
// Why: at EP2 an expert has about 512 rows, so a weight-gradient tile reduces over only 8 K blocks, and in
// the cooperative kernel both warpgroups store at once with the tensor cores idle: 72 % tensor pipe
// utilisation on deepseek-v3 at 1.77 GHz, against 85-92 % for the long-K GEMMs (Nsight Compute,
// docs/experiments/015-weight-grad-pingpong.md). The price: a 128 x 128 tile loads 32 KB per K block for
// 2.1 MFLOP instead of 48 KB for 4.2, so with long reductions (1024 rows) the cooperative tiles stay faster
// (src/gpu/grouped_gemm.h weight_grad_schedule_for).
//
// Roles: warpgroup 0's first thread is the producer (TMA into a ring of kStages stages of 32 KB, filled in
// the CTA's tile order); warpgroups 1 and 2 consume the tiles at even and odd positions of the CTA's sequence
// (ReductionTileScheduler), each skipping the other's stages. Each consumer has its own full barriers
// (`full[c][s]` counts only consumer c's fills of stage s), so its parities stay exact however far the two
// drift apart; a stage is refilled only after its last owner released it (`empty[s]`, 4 warp arrivals). Every
// wait is bounded (GemmConfig::kWaitTimeoutNs) and recorded in args.error_flag.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/gemm_config.cuh"
#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "kernels/gemm/tile_scheduler.cuh"

namespace pounce::kernels::gemm {

struct PingPongConfig {
  static constexpr int TILE_M = 128;  // output rows per warpgroup tile: two m64 halves
  static constexpr int TILE_N = 128;  // output columns: one m64n128 wgmma per half and K step
  static constexpr int kStages = 6;
  static constexpr int kBoxes = 2;  // 64-wide MN-major boxes per operand and stage
  static_assert(TILE_M == kBoxes * GemmConfig::kBoxMN && TILE_N == kBoxes * GemmConfig::kBoxMN,
                "a tile is whole 64-wide boxes of both operands");
  static_assert(kStages <= 32, "a consumer keeps one parity bit per stage in 32 bits");
  static_assert(GemmConfig::kNumConsumerWarpgroups == 2, "two consumers take every other tile");
};
using PingPongScheduler = ReductionTileScheduler<PingPongConfig::TILE_M, PingPongConfig::TILE_N>;

struct PingPongStorage {
  struct alignas(1024) Stage {
    __nv_bfloat16 a[PingPongConfig::TILE_M * GemmConfig::BLOCK_K];  // 16 KB: two boxes of 64 m x 64 rows
    __nv_bfloat16 b[PingPongConfig::TILE_N * GemmConfig::BLOCK_K];  // 16 KB: two boxes of 64 n x 64 rows
  };
  // full[c][s]: stage s's bytes landed for consumer c (each consumer's barriers count only its own fills, so
  // its parities stay unambiguous however far the other runs ahead or behind).
  alignas(1024) uint64_t full[2][PingPongConfig::kStages];
  uint64_t empty[PingPongConfig::kStages];  // owner's 4 warps -> producer: stage may be overwritten
  Stage stages[PingPongConfig::kStages];
};
inline constexpr size_t kPingPongSharedBytes = sizeof(PingPongStorage) + 1024;  // + slack to align the base
static_assert(kPingPongSharedBytes <= 227 * 1024,
              "ping-pong stages exceed 227 KB per block; fix: fewer stages");

// Thread 0: the ring's mbarriers. full[c][s]: the producer's one arrival + the stage bytes; empty[s]: the
// owning warpgroup's 4 warps.
__device__ __forceinline__ void init_pingpong_ring(PingPongStorage& ss) {
#pragma unroll
  for (int s = 0; s < PingPongConfig::kStages; ++s) {
    ptx::mbarrier_init(&ss.full[0][s], 1);
    ptx::mbarrier_init(&ss.full[1][s], 1);
    ptx::mbarrier_init(&ss.empty[s], 4);
  }
  ptx::fence_mbarrier_init();
}

// Producer: waits until the ring's next stage is free and arms consumer `owner`'s full barrier for `bytes`.
// Null when the stage never became free (recorded in args.error_flag). Shared by both ping-pong producers.
__device__ __forceinline__ PingPongStorage::Stage* claim_pingpong_stage(
    PingPongStorage& ss, const StageRing<PingPongConfig::kStages>& ring, int owner, uint32_t bytes,
    const GroupedGemmArgs& args, uint64_t*& full) {
  if (args.inject_failure != 0 ||
      !ptx::mbarrier_wait_parity_bounded(&ss.empty[ring.stage], ring.phase ^ 1, GemmConfig::kWaitTimeoutNs)) {
    record_error(args.error_flag, WaitError::kEmptyStage);
    return nullptr;
  }
  full = &ss.full[owner][ring.stage];
  ptx::mbarrier_arrive_expect_tx(full, bytes);
  return &ss.stages[ring.stage];
}

// The halves (64-row boxes of A) and the width of a tile below m and n: 2 or 1, TILE_N or 64 (m, n % 64 ==
// 0).
struct PingPongExtent {
  int32_t halves;
  int32_t columns;
};
__device__ __forceinline__ PingPongExtent pingpong_extent(const GroupedGemmArgs& args, const Tile& tile) {
  using P = PingPongConfig;
  const int32_t rows_left = args.m - tile.m_block * P::TILE_M;
  const int32_t cols_left = args.n - tile.n_block * P::TILE_N;
  return {rows_left >= P::TILE_M ? P::kBoxes : 1, cols_left >= P::TILE_N ? P::TILE_N : GemmConfig::kBoxMN};
}

// ---------------------------------------------------------------------------------------------------
// Producer: every tile of the CTA, in order, whichever warpgroup multiplies it.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void produce_weight_grads(PingPongStorage& ss, const CUtensorMap& tmap_a,
                                                     const CUtensorMap& tmap_b, const GroupedGemmArgs& args) {
  using C = GemmConfig;
  PingPongScheduler scheduler(args.num_groups, args.m, args.n, args.group_active);
  StageRing<PingPongConfig::kStages> ring;
  Tile tile;
  for (int32_t position = 0; scheduler.next(tile); ++position) {
    const int owner = position % GemmConfig::kNumConsumerWarpgroups;
    int32_t kb_begin = 0, kb_end = 0;
    reduction_k_blocks(args, tile.group, INT32_MAX, kb_begin, kb_end);
    const PingPongExtent extent = pingpong_extent(args, tile);
    const int32_t row0 = tile.m_block * PingPongConfig::TILE_M;
    const int32_t col0 = tile.n_block * PingPongConfig::TILE_N;
    const int32_t b_boxes = extent.columns / C::kBoxMN;
    const uint32_t bytes = static_cast<uint32_t>(extent.halves + b_boxes) * C::kBoxBytes;
    for (int32_t kb = kb_begin; kb < kb_end; ++kb) {
      uint64_t* full = nullptr;
      PingPongStorage::Stage* st = claim_pingpong_stage(ss, ring, owner, bytes, args, full);
      if (st == nullptr) return;
      const int32_t k0 = kb * C::BLOCK_K;
      for (int32_t box = 0; box < extent.halves; ++box)
        ptx::tma_load_2d(st->a + box * C::kBoxMN * C::BLOCK_K, &tmap_a, full, row0 + box * C::kBoxMN, k0);
      for (int32_t box = 0; box < b_boxes; ++box)
        ptx::tma_load_2d(st->b + box * C::kBoxMN * C::BLOCK_K, &tmap_b, full, col0 + box * C::kBoxMN, k0);
      ring.advance();
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Consumers
// ---------------------------------------------------------------------------------------------------
// One half's wgmma of one K step: rows 64 half.. of the tile (A box `half`), kCols columns.
template <int kCols>
__device__ __forceinline__ void issue_pingpong_half(float (&acc)[64], uint32_t a_box, uint64_t b_desc, int kk,
                                                    bool accumulate) {
  const uint64_t a = smem_desc<Major::kMN>(a_box, kk);
  if constexpr (kCols == PingPongConfig::TILE_N) {
    ptx::wgmma_m64n128k16_bf16<true, true>(acc, a, b_desc, accumulate);
  } else {
    ptx::wgmma_m64n64k16_bf16<true, true>(acc, a, b_desc, accumulate);
  }
}

// One K block of a tile: per K step of 16, half 0 then half 1 (each accumulator sees its K steps in the
// order of the cooperative kernel).
template <int kHalves, int kCols>
__device__ __forceinline__ void issue_pingpong_k_block(float (&acc0)[64], float (&acc1)[64], uint32_t a_base,
                                                       uint32_t b_base, bool accumulate) {
  using C = GemmConfig;
#pragma unroll
  for (int kk = 0; kk < C::BLOCK_K / 16; ++kk) {
    const bool acc_in = accumulate || kk > 0;
    const uint64_t b = smem_desc<Major::kMN>(b_base, kk);
    issue_pingpong_half<kCols>(acc0, a_base, b, kk, acc_in);
    if constexpr (kHalves == 2) issue_pingpong_half<kCols>(acc1, a_base + C::kBoxBytes, b, kk, acc_in);
  }
}

// K blocks [kb_begin, kb_end) of this warpgroup's tile, one wgmma group in flight while the next is issued;
// `issue(acc0, acc1, a_base, b_base, accumulate)` issues one K block's wgmmas from a stage. `full_phases` bit
// s is the parity of this consumer's next fill of stage s. False when a stage never filled. Shared by both
// ping-pong kernels (this file, activation_backward_pingpong.cuh).
template <typename IssueKBlock>
__device__ __forceinline__ bool multiply_pingpong_k_blocks(PingPongStorage& ss,
                                                           StageRing<PingPongConfig::kStages>& ring,
                                                           uint32_t& full_phases, const GroupedGemmArgs& args,
                                                           int consumer_idx, int32_t kb_begin, int32_t kb_end,
                                                           float (&acc0)[64], float (&acc1)[64],
                                                           IssueKBlock issue) {
  using C = GemmConfig;
  uint32_t prev_stage = 0;
  for (int32_t kb = kb_begin; kb < kb_end; ++kb) {
    const uint32_t parity = (full_phases >> ring.stage) & 1u;
    full_phases ^= 1u << ring.stage;
    if (args.inject_failure != 0 ||
        !ptx::mbarrier_wait_parity_bounded(&ss.full[consumer_idx][ring.stage], parity, C::kWaitTimeoutNs)) {
      ptx::wgmma_wait_group<0>();
      record_error(args.error_flag, WaitError::kFullStage);
      return false;
    }
    const uint32_t a_base = ptx::smem_addr(ss.stages[ring.stage].a);
    const uint32_t b_base = ptx::smem_addr(ss.stages[ring.stage].b);
    fence_accumulators(acc0);
    fence_accumulators(acc1);
    ptx::wgmma_fence();
    issue(acc0, acc1, a_base, b_base, kb > kb_begin);
    ptx::wgmma_commit_group();
    fence_accumulators(acc0);
    fence_accumulators(acc1);
    if (kb > kb_begin) {
      ptx::wgmma_wait_group<1>();
      if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&ss.empty[prev_stage]);
    }
    prev_stage = ring.stage;
    ring.advance();
  }
  ptx::wgmma_wait_group<0>();
  fence_accumulators(acc0);
  fence_accumulators(acc1);
  if (kb_end > kb_begin && threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&ss.empty[prev_stage]);
  return true;
}

template <int kHalves, int kCols>
__device__ __forceinline__ bool multiply_pingpong_tile(PingPongStorage& ss,
                                                       StageRing<PingPongConfig::kStages>& ring,
                                                       uint32_t& full_phases, const GroupedGemmArgs& args,
                                                       int consumer_idx, int32_t kb_begin, int32_t kb_end,
                                                       float (&acc0)[64], float (&acc1)[64]) {
  return multiply_pingpong_k_blocks(
      ss, ring, full_phases, args, consumer_idx, kb_begin, kb_end, acc0, acc1,
      [](float(&a0)[64], float(&a1)[64], uint32_t a_base, uint32_t b_base, bool accumulate) {
        issue_pingpong_k_block<kHalves, kCols>(a0, a1, a_base, b_base, accumulate);
      });
}

__device__ __forceinline__ bool multiply_pingpong_tile(PingPongStorage& ss,
                                                       StageRing<PingPongConfig::kStages>& ring,
                                                       uint32_t& full_phases, const GroupedGemmArgs& args,
                                                       int consumer_idx, PingPongExtent extent,
                                                       int32_t kb_begin, int32_t kb_end, float (&acc0)[64],
                                                       float (&acc1)[64]) {
  if (extent.halves == 2 && extent.columns == PingPongConfig::TILE_N)
    return multiply_pingpong_tile<2, PingPongConfig::TILE_N>(ss, ring, full_phases, args, consumer_idx,
                                                             kb_begin, kb_end, acc0, acc1);
  if (extent.halves == 2)
    return multiply_pingpong_tile<2, 64>(ss, ring, full_phases, args, consumer_idx, kb_begin, kb_end, acc0,
                                         acc1);
  if (extent.columns == PingPongConfig::TILE_N)
    return multiply_pingpong_tile<1, PingPongConfig::TILE_N>(ss, ring, full_phases, args, consumer_idx,
                                                             kb_begin, kb_end, acc0, acc1);
  return multiply_pingpong_tile<1, 64>(ss, ring, full_phases, args, consumer_idx, kb_begin, kb_end, acc0,
                                       acc1);
}

// Consumer `consumer_idx` (0 or 1): the CTA's tiles at positions consumer_idx, consumer_idx + 2, ...
__device__ __forceinline__ void consume_weight_grads(PingPongStorage& ss, const GroupedGemmArgs& args,
                                                     int consumer_idx) {
  PingPongScheduler scheduler(args.num_groups, args.m, args.n, args.group_active);
  StageRing<PingPongConfig::kStages> ring;
  uint32_t full_phases = 0;  // bit s: the parity of this consumer's next fill of stage s
  const int warp_in_group = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  float acc0[64], acc1[64];
  Tile tile;
  for (int32_t position = 0; scheduler.next(tile); ++position) {
    int32_t kb_begin = 0, kb_end = 0;
    reduction_k_blocks(args, tile.group, INT32_MAX, kb_begin, kb_end);
    if (position % GemmConfig::kNumConsumerWarpgroups != consumer_idx) {  // the other's tile and stages
      for (int32_t kb = kb_begin; kb < kb_end; ++kb) ring.advance();
      continue;
    }
    const PingPongExtent extent = pingpong_extent(args, tile);
    const int64_t row0 =
        static_cast<int64_t>(tile.m_block) * PingPongConfig::TILE_M + warp_in_group * 16 + lane / 4;
    const int32_t col_block = tile.n_block * PingPongConfig::TILE_N;
    if (kb_end <= kb_begin) {  // an expert without rows: zeros (as the cooperative kernel writes them)
      for (int32_t half = 0; half < extent.halves; ++half)
        store_weight_grad_zeros<PingPongConfig::TILE_N>(args, tile.group, row0 + 64 * half, col_block, lane);
      continue;
    }
    if (!multiply_pingpong_tile(ss, ring, full_phases, args, consumer_idx, extent, kb_begin, kb_end, acc0,
                                acc1))
      return;
    store_weight_grad_tile(acc0, args, tile.group, row0, col_block, lane);
    if (extent.halves == 2) store_weight_grad_tile(acc1, args, tile.group, row0 + 64, col_block, lane);
  }
}

// ---------------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------------
// The body of both ping-pong kernels: the ring in dynamic shared memory, its barriers, then the roles: thread
// 0 runs `produce(ss)`, consumer warpgroup c runs `consume(ss, c)`.
template <typename Produce, typename Consume>
__device__ __forceinline__ void run_pingpong(const CUtensorMap& tmap_a, const CUtensorMap& tmap_b,
                                             Produce produce, Consume consume) {
  using C = GemmConfig;
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t smem_base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
  PingPongStorage& ss = *reinterpret_cast<PingPongStorage*>(smem_base);
  const int warpgroup_idx = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b);
    init_pingpong_ring(ss);
  }
  __syncthreads();
  if (warpgroup_idx == 0) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) produce(ss);
  } else {
    ptx::setmaxnreg_inc<C::kConsumerRegs>();
    consume(ss, warpgroup_idx - 1);
  }
}

__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    weight_grad_pingpong_kernel(const __grid_constant__ CUtensorMap tmap_a,
                                const __grid_constant__ CUtensorMap tmap_b, const GroupedGemmArgs args) {
  run_pingpong(
      tmap_a, tmap_b, [&](PingPongStorage& ss) { produce_weight_grads(ss, tmap_a, tmap_b, args); },
      [&](PingPongStorage& ss, int consumer_idx) { consume_weight_grads(ss, args, consumer_idx); });
}

}  // namespace pounce::kernels::gemm
