// The activation backward with each consumer warpgroup on tiles of its own (sm_90a): the ping-pong tiles of
// grouped_activation_backward (src/gpu/grouped_gemm.h, TileSchedule::kPingPong). d_a = bf16(A .
// W[group(row)]) with A K-major and W read transposed (MN-major), then d_g, d_u = bf16(act'(g, u) d_a) in the
// epilogue. Same sums as the cooperative kernel (grouped_gemm_kernel.cuh, kDataGradActivation), bit for bit:
// the same K steps in the same order per output, and an m64n128 wgmma sums a column as the m64n256 one does
// (the tests compare both schedules bitwise).
//
// Why: this epilogue loads the forward's g and u and evaluates the activation's derivative, about 30
// instructions per element, with the tensor cores idle in the cooperative kernel: 447 useful TFLOP/s on
// gpt-oss-120b against 725 with the epilogue skipped, 583 against 770 on deepseek-v3
// (docs/experiments/010-epilogues-through-shared-memory.md). Here one warpgroup's epilogue runs while the
// other multiplies. The price, as for the weight gradients (weight_grad_pingpong.cuh): a 128 x 128 tile loads
// 32 KB per K block for 2.1 MFLOP instead of 48 KB for 4.2.
//
// Roles as in weight_grad_pingpong.cuh: warpgroup 0's first thread fills a ring of PingPongConfig::kStages
// stages in the CTA's tile order (TileScheduler over row blocks and 128-column blocks, the order of the
// cooperative kernel); warpgroups 1 and 2 take the tiles at even and odd positions, each with its own full
// barriers. Every wait is bounded and recorded in args.error_flag.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/gemm_config.cuh"
#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/gemm/weight_grad_pingpong.cuh"

namespace pounce::kernels::gemm {

using ActivationBackwardScheduler = TileScheduler<PingPongConfig::TILE_M, GemmConfig::kMChunk>;

__device__ __forceinline__ ActivationBackwardScheduler
activation_backward_scheduler(const GroupedGemmArgs& args) {
  return ActivationBackwardScheduler(args.group_row_offset, args.num_groups, args.max_m_blocks,
                                     (args.n + PingPongConfig::TILE_N - 1) / PingPongConfig::TILE_N);
}

// Columns of a tile below n: TILE_N, or 64 at the edge (n % 64 == 0).
__device__ __forceinline__ int32_t activation_backward_columns(const GroupedGemmArgs& args,
                                                               const Tile& tile) {
  return args.n - tile.n_block * PingPongConfig::TILE_N >= PingPongConfig::TILE_N ? PingPongConfig::TILE_N
                                                                                  : GemmConfig::kBoxMN;
}

// ---------------------------------------------------------------------------------------------------
// Producer: every tile of the CTA, in order, whichever warpgroup multiplies it.
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void produce_activation_backward(PingPongStorage& ss, const CUtensorMap& tmap_a,
                                                            const CUtensorMap& tmap_b,
                                                            const GroupedGemmArgs& args) {
  using C = GemmConfig;
  ActivationBackwardScheduler scheduler = activation_backward_scheduler(args);
  StageRing<PingPongConfig::kStages> ring;
  const int32_t num_k_blocks = args.k / C::BLOCK_K;
  Tile tile;
  for (int32_t position = 0; scheduler.next(tile); ++position) {
    const int owner = position % C::kNumConsumerWarpgroups;
    const int32_t row0 = tile.m_block * PingPongConfig::TILE_M;
    const int32_t col0 = tile.n_block * PingPongConfig::TILE_N;
    const int32_t b_boxes = activation_backward_columns(args, tile) / C::kBoxMN;
    const uint32_t bytes = C::kStageBytesA + static_cast<uint32_t>(b_boxes) * C::kBoxBytes;
    for (int32_t kb = 0; kb < num_k_blocks; ++kb) {
      uint64_t* full = nullptr;
      PingPongStorage::Stage* st = claim_pingpong_stage(ss, ring, owner, bytes, args, full);
      if (st == nullptr) return;
      const int32_t k0 = kb * C::BLOCK_K;
      ptx::tma_load_2d(st->a, &tmap_a, full, k0, row0);  // 128 rows x 64 K, K-major
      for (int32_t box = 0; box < b_boxes; ++box)
        ptx::tma_load_3d(st->b + box * C::kBoxMN * C::BLOCK_K, &tmap_b, full, col0 + box * C::kBoxMN, k0,
                         tile.group);
      ring.advance();
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Consumers
// ---------------------------------------------------------------------------------------------------
// One K block of a tile at width kCols: per K step of 16, rows 0..63 (A rows 0..63) then rows 64..127.
template <int kCols>
__device__ __forceinline__ void issue_activation_backward_k_block(float (&acc0)[64], float (&acc1)[64],
                                                                  uint32_t a_base, uint32_t b_base,
                                                                  bool accumulate) {
  using C = GemmConfig;
  constexpr uint32_t kHalfBytes = 64 * C::BLOCK_K * 2;  // 64 K-major rows of A
#pragma unroll
  for (int kk = 0; kk < C::BLOCK_K / 16; ++kk) {
    const bool acc_in = accumulate || kk > 0;
    const uint64_t b = smem_desc<Major::kMN>(b_base, kk);
    const uint64_t a0 = smem_desc<Major::kK>(a_base, kk);
    const uint64_t a1 = smem_desc<Major::kK>(a_base + kHalfBytes, kk);
    if constexpr (kCols == PingPongConfig::TILE_N) {
      ptx::wgmma_m64n128k16_bf16<false, true>(acc0, a0, b, acc_in);
      ptx::wgmma_m64n128k16_bf16<false, true>(acc1, a1, b, acc_in);
    } else {
      ptx::wgmma_m64n64k16_bf16<false, true>(acc0, a0, b, acc_in);
      ptx::wgmma_m64n64k16_bf16<false, true>(acc1, a1, b, acc_in);
    }
  }
}

// Every K block of this warpgroup's tile at width kCols (multiply_pingpong_k_blocks). False when a stage
// never filled.
template <int kCols>
__device__ __forceinline__ bool multiply_activation_backward_tile(PingPongStorage& ss,
                                                                  StageRing<PingPongConfig::kStages>& ring,
                                                                  uint32_t& full_phases,
                                                                  const GroupedGemmArgs& args,
                                                                  int consumer_idx, int32_t num_k_blocks,
                                                                  float (&acc0)[64], float (&acc1)[64]) {
  return multiply_pingpong_k_blocks(
      ss, ring, full_phases, args, consumer_idx, 0, num_k_blocks, acc0, acc1,
      [](float(&a0)[64], float(&a1)[64], uint32_t a_base, uint32_t b_base, bool accumulate) {
        issue_activation_backward_k_block<kCols>(a0, a1, a_base, b_base, accumulate);
      });
}

// Consumer `consumer_idx` (0 or 1): the CTA's tiles at positions consumer_idx, consumer_idx + 2, ...
__device__ __forceinline__ void consume_activation_backward(PingPongStorage& ss, const GroupedGemmArgs& args,
                                                            int consumer_idx) {
  ActivationBackwardScheduler scheduler = activation_backward_scheduler(args);
  StageRing<PingPongConfig::kStages> ring;
  uint32_t full_phases = 0;  // bit s: the parity of this consumer's next fill of stage s
  const int32_t num_k_blocks = args.k / GemmConfig::BLOCK_K;
  const int warp_in_group = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  float acc0[64], acc1[64];
  Tile tile;
  for (int32_t position = 0; scheduler.next(tile); ++position) {
    if (position % GemmConfig::kNumConsumerWarpgroups != consumer_idx) {  // the other's tile and stages
      for (int32_t kb = 0; kb < num_k_blocks; ++kb) ring.advance();
      continue;
    }
    const bool whole = activation_backward_columns(args, tile) == PingPongConfig::TILE_N;
    const bool multiplied = whole ? multiply_activation_backward_tile<PingPongConfig::TILE_N>(
                                        ss, ring, full_phases, args, consumer_idx, num_k_blocks, acc0, acc1)
                                  : multiply_activation_backward_tile<GemmConfig::kBoxMN>(
                                        ss, ring, full_phases, args, consumer_idx, num_k_blocks, acc0, acc1);
    if (!multiplied) return;
    const int64_t row0 =
        static_cast<int64_t>(tile.m_block) * PingPongConfig::TILE_M + warp_in_group * 16 + lane / 4;
    const int32_t col_block = tile.n_block * PingPongConfig::TILE_N;
    store_activation_backward_tile(acc0, args, row0, col_block, lane);
    store_activation_backward_tile(acc1, args, row0 + 64, col_block, lane);
  }
}

// ---------------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    activation_backward_pingpong_kernel(const __grid_constant__ CUtensorMap tmap_a,
                                        const __grid_constant__ CUtensorMap tmap_b,
                                        const GroupedGemmArgs args) {
  run_pingpong(
      tmap_a, tmap_b,
      [&](PingPongStorage& ss) {
        if (blockIdx.x == 0 &&
            args.group_row_offset[args.num_groups] > args.max_m_blocks * GemmConfig::BLOCK_M)
          record_error(args.error_flag, WaitError::kRowsExceedCapacity);
        produce_activation_backward(ss, tmap_a, tmap_b, args);
      },
      [&](PingPongStorage& ss, int consumer_idx) { consume_activation_backward(ss, args, consumer_idx); });
}

}  // namespace pounce::kernels::gemm
