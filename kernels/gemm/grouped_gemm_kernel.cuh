// Persistent warp-specialised grouped GEMM (sm_90a): C[rows, n] = A[rows, k] . B[group(row)][n, k]^T, and
// the gate/up variant that computes gate and up tiles of the same columns together and applies the gated
// activation in the epilogue.
//
// Warps: warpgroup 0 is the producer (one thread issues TMA loads of A and B tiles into a kNumStages ring,
// 128-byte swizzled); warpgroups 1 and 2 are consumers, each owning 64 of the BLOCK_M = 128 tile rows and
// issuing wgmma m64n256k16 with fp32 accumulators in registers, then storing bf16 straight from registers
// (16-byte stores after a quad transpose).
// Handoffs: full[s] completes when a stage's bytes landed (TMA transaction count); empty[s] completes when
// all 8 consumer warps finished the wgmmas that read it. Every wait is bounded: on timeout the waiter writes
// an error code to args.error_flag and leaves, so a broken input fails the call instead of hanging.
// Gate/up: B stage rows 0..127 are w_gate[n0 .. n0+128), rows 128..255 are w_up[same], so one N = 256
// wgmma yields gate (accumulators 0..63) and up (64..127) of the same output columns.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/activation.cuh"
#include "kernels/gemm/grouped_gemm.h"
#include "kernels/gemm/tile_scheduler.cuh"

namespace pounce::kernels::gemm {

// ---------------------------------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------------------------------
enum class Epilogue { kStore, kGateUpActivation };

enum class WaitError : int32_t { kNone = 0, kFullStage = 1, kEmptyStage = 2, kRowsExceedCapacity = 3 };

struct GemmConfig {
  static constexpr int BLOCK_M = 128;
  static constexpr int BLOCK_N = 256;  // B rows per stage (gate/up: 128 gate + 128 up)
  static constexpr int BLOCK_K = 64;
  static constexpr int kNumStages = 4;
  static constexpr int kNumConsumerWarpgroups = 2;
  static constexpr int kNumThreads = 128 * (1 + kNumConsumerWarpgroups);
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kMChunk = 8;  // scheduler: m-blocks that share weights in L2
  static constexpr uint32_t kStageBytesA = BLOCK_M * BLOCK_K * 2;
  static constexpr uint32_t kStageBytesB = BLOCK_N * BLOCK_K * 2;
  static constexpr uint32_t kStageBytes = kStageBytesA + kStageBytesB;
  static constexpr uint64_t kWaitTimeoutNs = 4'000'000'000ull;  // far above any legitimate stall

  static_assert(BLOCK_K * 2 == 128, "a K block must be one 128-byte swizzle row; fix: BLOCK_K = 64 for bf16");
  static_assert(BLOCK_M == 64 * kNumConsumerWarpgroups,
                "each consumer warpgroup owns 64 rows (wgmma m64); fix: BLOCK_M = 64 * consumer warpgroups");
  static_assert(BLOCK_N == 256, "the mainloop issues wgmma m64n256k16; fix: add a wgmma wrapper for other N");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kNumConsumerWarpgroups <= 65536,
                "register file overcommitted; fix: lower kConsumerRegs or kProducerRegs");
};

// Output column block width: the full B tile, or half of it for gate/up (gate and up share columns).
template <Epilogue kEpilogue>
inline constexpr int kOutBlockN =
    kEpilogue == Epilogue::kStore ? GemmConfig::BLOCK_N : GemmConfig::BLOCK_N / 2;

struct GroupedGemmArgs {
  const int32_t* group_row_offset;  // [num_groups + 1] rows, multiples of BLOCK_M
  int num_groups;
  int32_t max_m_blocks;  // capacity / BLOCK_M
  int32_t n;
  int32_t k;
  __nv_bfloat16* out0;  // C, or g
  __nv_bfloat16* out1;  // u (gate/up only)
  __nv_bfloat16* out2;  // act (gate/up only)
  ActivationParams activation;
  int32_t* error_flag;  // first WaitError recorded by any CTA
};

// ---------------------------------------------------------------------------------------------------
// Shared storage
// ---------------------------------------------------------------------------------------------------
struct SharedStorage {
  struct alignas(1024) Stage {
    __nv_bfloat16 a[GemmConfig::BLOCK_M * GemmConfig::BLOCK_K];  // 16 KB, 128B-swizzled rows of 64
    __nv_bfloat16 b[GemmConfig::BLOCK_N * GemmConfig::BLOCK_K];  // 32 KB
  };
  Stage stages[GemmConfig::kNumStages];
  uint64_t full[GemmConfig::kNumStages];   // producer -> consumers: stage bytes landed
  uint64_t empty[GemmConfig::kNumStages];  // consumers -> producer: stage may be overwritten
};
static_assert(
    sizeof(SharedStorage::Stage) % 1024 == 0,
    "stages must keep 1024-byte alignment for the 128B swizzle; fix: BLOCK_M/BLOCK_N multiples of 8");
inline constexpr size_t kSharedBytes = sizeof(SharedStorage) + 1024;  // + slack to align the base
static_assert(kSharedBytes <= 227 * 1024, "shared storage exceeds 227 KB per block; fix: fewer stages");

// ---------------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void record_error(int32_t* flag, WaitError code) {
  atomicCAS(flag, 0, static_cast<int32_t>(code));
}

template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) ptx::fence_operand(acc[i]);
}

// ---------------------------------------------------------------------------------------------------
// Producer: one thread walks the tiles and keeps the stage ring full.
// ---------------------------------------------------------------------------------------------------
template <Epilogue kEpilogue>
__device__ __forceinline__ void run_producer(SharedStorage& ss, const CUtensorMap& tmap_a,
                                             const CUtensorMap& tmap_b0, const CUtensorMap& tmap_b1,
                                             const GroupedGemmArgs& args) {
  using C = GemmConfig;
  TileScheduler<C::BLOCK_M, C::kMChunk> scheduler(
      args.group_row_offset, args.num_groups, args.max_m_blocks,
      (args.n + kOutBlockN<kEpilogue> - 1) / kOutBlockN<kEpilogue>);
  const int32_t num_k_blocks = args.k / C::BLOCK_K;
  uint32_t stage = 0, phase = 0;
  Tile tile;
  while (scheduler.next(tile)) {
    const int32_t row0 = tile.m_block * C::BLOCK_M;
    const int32_t col0 = tile.n_block * kOutBlockN<kEpilogue>;
    for (int32_t kb = 0; kb < num_k_blocks; ++kb) {
      if (!ptx::mbarrier_wait_parity_bounded(&ss.empty[stage], phase ^ 1, C::kWaitTimeoutNs)) {
        record_error(args.error_flag, WaitError::kEmptyStage);
        return;
      }
      SharedStorage::Stage& st = ss.stages[stage];
      uint64_t* full = &ss.full[stage];
      ptx::mbarrier_arrive_expect_tx(full, C::kStageBytes);
      const int32_t k0 = kb * C::BLOCK_K;
      ptx::tma_load_2d(st.a, &tmap_a, full, k0, row0);
      if constexpr (kEpilogue == Epilogue::kStore) {
        ptx::tma_load_3d(st.b, &tmap_b0, full, k0, col0, tile.group);
      } else {
        ptx::tma_load_3d(st.b, &tmap_b0, full, k0, col0, tile.group);
        ptx::tma_load_3d(st.b + (C::BLOCK_N / 2) * C::BLOCK_K, &tmap_b1, full, k0, col0, tile.group);
      }
      if (++stage == C::kNumStages) stage = 0, phase ^= 1;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Epilogues: fp32 accumulators -> bf16, 16-byte global stores. A quad transpose of 4 accumulator chunks
// gives each lane 8 consecutive columns, so a quad writes 64 contiguous bytes per row. Columns at or
// beyond n are masked per 32-column group (n % 64 == 0 keeps the test whole and warp-uniform).
// ---------------------------------------------------------------------------------------------------
// On entry lane q (q = lane % 4) holds in w[c] columns 8c + 2q, 8c + 2q + 1 of chunks c = 0..3; on exit it
// holds in w[p] columns 8q + 2p, 8q + 2p + 1: all of chunk q. Two butterfly steps over lane bits 0 and 1.
__device__ __forceinline__ void quad_transpose(uint32_t (&w)[4], int lane) {
  const bool bit0 = lane & 1, bit1 = lane & 2;
#pragma unroll
  for (int s = 0; s < 2; ++s) {  // swap the slot of pair (2s, 2s+1) whose bit 0 differs from the lane's
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, bit0 ? w[2 * s] : w[2 * s + 1], 1);
    if (bit0)
      w[2 * s] = recv;
    else
      w[2 * s + 1] = recv;
  }
#pragma unroll
  for (int t = 0; t < 2; ++t) {  // same for pair (t, t+2) and bit 1
    const uint32_t recv = __shfl_xor_sync(0xffffffffu, bit1 ? w[t] : w[t + 2], 2);
    if (bit1)
      w[t] = recv;
    else
      w[t + 2] = recv;
  }
}

__device__ __forceinline__ void store_16_bytes(__nv_bfloat16* dst, const uint32_t (&w)[4]) {
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float bf16_lo(uint32_t packed) {
  return __uint_as_float(packed << 16);
}
__device__ __forceinline__ float bf16_hi(uint32_t packed) {
  return __uint_as_float(packed & 0xFFFF0000u);
}

// `row`: this lane's first row (the second is row + 8); `col_block`: first column of the tile.
template <int kChunks>
__device__ __forceinline__ void store_chunks(const float* acc, __nv_bfloat16* out, int32_t n, int64_t row,
                                             int32_t col_block, int lane) {
#pragma unroll
  for (int m = 0; m < kChunks / 4; ++m) {
    if (col_block + 32 * m >= n) break;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t w[4];
#pragma unroll
      for (int c = 0; c < 4; ++c)
        w[c] = ptx::pack_bf16x2(acc[4 * (4 * m + c) + 2 * h], acc[4 * (4 * m + c) + 2 * h + 1]);
      quad_transpose(w, lane);
      store_16_bytes(out + (row + 8 * h) * n + col_block + 32 * m + 8 * (lane % 4), w);
    }
  }
}

__device__ __forceinline__ void store_tile(const float (&acc)[128], const GroupedGemmArgs& args, int64_t row,
                                           int32_t col_block, int lane) {
  store_chunks<32>(acc, args.out0, args.n, row, col_block, lane);
}

// Gate in accumulator chunks 0..15, up in 16..31, same columns.
__device__ __forceinline__ void store_gate_up_tile(const float (&acc)[128], const GroupedGemmArgs& args,
                                                   int64_t row, int32_t col_block, int lane) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    if (col_block + 32 * m >= args.n) break;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t g[4], u[4], a[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int i = 4 * (4 * m + c) + 2 * h;
        g[c] = ptx::pack_bf16x2(acc[i], acc[i + 1]);
        u[c] = ptx::pack_bf16x2(acc[64 + i], acc[64 + i + 1]);
        a[c] = ptx::pack_bf16x2(apply_activation(bf16_lo(g[c]), bf16_lo(u[c]), args.activation),
                                apply_activation(bf16_hi(g[c]), bf16_hi(u[c]), args.activation));
      }
      quad_transpose(g, lane);
      quad_transpose(u, lane);
      quad_transpose(a, lane);
      const int64_t offset = (row + 8 * h) * args.n + col_block + 32 * m + 8 * (lane % 4);
      store_16_bytes(args.out0 + offset, g);
      store_16_bytes(args.out1 + offset, u);
      store_16_bytes(args.out2 + offset, a);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Consumer: a warpgroup multiplies its 64 rows of every tile, releasing each stage one K block late so
// that one wgmma group stays in flight while the next is issued.
// ---------------------------------------------------------------------------------------------------
template <Epilogue kEpilogue>
__device__ __forceinline__ void run_consumer(SharedStorage& ss, const GroupedGemmArgs& args,
                                             int consumer_idx) {
  using C = GemmConfig;
  TileScheduler<C::BLOCK_M, C::kMChunk> scheduler(
      args.group_row_offset, args.num_groups, args.max_m_blocks,
      (args.n + kOutBlockN<kEpilogue> - 1) / kOutBlockN<kEpilogue>);
  const int32_t num_k_blocks = args.k / C::BLOCK_K;
  const int warp_in_group = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const uint32_t a_row_offset_bytes = consumer_idx * 64 * C::BLOCK_K * 2;
  auto release = [&](uint32_t s) {
    if (lane == 0) ptx::mbarrier_arrive(&ss.empty[s]);
  };

  uint32_t stage = 0, phase = 0;
  float acc[128];
  Tile tile;
  while (scheduler.next(tile)) {
    uint32_t prev_stage = 0;
    for (int32_t kb = 0; kb < num_k_blocks; ++kb) {
      if (!ptx::mbarrier_wait_parity_bounded(&ss.full[stage], phase, C::kWaitTimeoutNs)) {
        ptx::wgmma_wait_group<0>();  // leave no wgmma in flight behind
        record_error(args.error_flag, WaitError::kFullStage);
        return;
      }
      const uint32_t a_base = ptx::smem_addr(ss.stages[stage].a) + a_row_offset_bytes;
      const uint32_t b_base = ptx::smem_addr(ss.stages[stage].b);
      fence_accumulators(acc);
      ptx::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < C::BLOCK_K / 16; ++kk) {
        ptx::wgmma_m64n256k16_bf16(acc, ptx::make_smem_desc_k_major_sw128(a_base + kk * 32),
                                   ptx::make_smem_desc_k_major_sw128(b_base + kk * 32), kb > 0 || kk > 0);
      }
      ptx::wgmma_commit_group();
      fence_accumulators(acc);
      if (kb > 0) {
        ptx::wgmma_wait_group<1>();
        release(prev_stage);
      }
      prev_stage = stage;
      if (++stage == C::kNumStages) stage = 0, phase ^= 1;
    }
    ptx::wgmma_wait_group<0>();
    fence_accumulators(acc);
    release(prev_stage);

    const int64_t row =
        static_cast<int64_t>(tile.m_block) * C::BLOCK_M + consumer_idx * 64 + warp_in_group * 16 + lane / 4;
    const int32_t col_block = tile.n_block * kOutBlockN<kEpilogue>;
    if constexpr (kEpilogue == Epilogue::kStore) {
      store_tile(acc, args, row, col_block, lane);
    } else {
      store_gate_up_tile(acc, args, row, col_block, lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------------
template <Epilogue kEpilogue>
__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                        const __grid_constant__ CUtensorMap tmap_b0,
                        const __grid_constant__ CUtensorMap tmap_b1, const GroupedGemmArgs args) {
  using C = GemmConfig;
  // Shared memory: the dynamic base aligned up to 1024 bytes for the 128B swizzle atoms.
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t smem_base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_base);
  const int warpgroup_idx = threadIdx.x / 128;

  // Barriers: full[s] expects the producer's one arrival + the stage bytes; empty[s] one arrival per
  // consumer warp.
  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b0);
    if constexpr (kEpilogue == Epilogue::kGateUpActivation) ptx::prefetch_tensor_map(&tmap_b1);
#pragma unroll
    for (int s = 0; s < C::kNumStages; ++s) {
      ptx::mbarrier_init(&ss.full[s], 1);
      ptx::mbarrier_init(&ss.empty[s], 4 * C::kNumConsumerWarpgroups);
    }
    ptx::fence_mbarrier_init();
    if (blockIdx.x == 0 && args.group_row_offset[args.num_groups] > args.max_m_blocks * C::BLOCK_M) {
      record_error(args.error_flag, WaitError::kRowsExceedCapacity);
    }
  }
  __syncthreads();

  // Register reconfiguration + roles: the producer warpgroup gives registers to the two consumers.
  if (warpgroup_idx == 0) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) run_producer<kEpilogue>(ss, tmap_a, tmap_b0, tmap_b1, args);
  } else {
    ptx::setmaxnreg_inc<C::kConsumerRegs>();
    run_consumer<kEpilogue>(ss, args, warpgroup_idx - 1);
  }
}

}  // namespace pounce::kernels::gemm
