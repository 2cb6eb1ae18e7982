// Block-scaled FP8 grouped GEMMs (sm_90a), the FP8 counterparts of grouped_gemm_kernel.cuh's kinds
// (docs/design.md "FP8 GEMMs"):
//   rows         C[rows, n] = A[rows, k] . B[group(row)][n, k]^T, bf16 out; optionally a second
//                (A, B) pair over a second K range, summed into the same C (d_x = d_g . Wg_t + d_u . Wu_t)
//   gate/up      g = bf16(x . Wg^T), u = bf16(x . Wu^T), a = bf16(act(g, u)) and a_q = q1x128(a): the next
//                GEMM's FP8 operand, quantized where it is produced. A tile is 128 rows x 128 columns of a
//                (one 1x128 scale block per row), computed in two passes of 64 columns: B stage rows 0..63
//                are Wg's, 64..127 Wu's, so one m64n128 wgmma gives g and u of the same 64 columns. The
//                first pass's a stays in registers until the second's completes the block.
//   weight grads D[group][m, n] = sum over the group's rows r of A_t[m, r] B_t[n, r] (token-axis copies:
//                the reduction runs along K = rows, both operands K-major), fp32 / fp32 += / bf16 out
// FP8 wgmma reads K-major operands only, so every operand here is K-major: e4m3 bytes in 128-byte swizzled
// rows of BLOCK_K = 128 elements, one scale block per K block. Scales are powers of two:
//   A: one per (row, K block), stored K-block-major [k_blocks][scale_ld] so that a tile's 128 come in one
//      TMA box; B of the row kind: one per 128 x 128 block of each weight matrix,
//      [group][n_blocks][k_blocks]; B of the weight gradients: one per (row of B_t, K block), like A.
// Hopper's wgmma has no block-scaled form, so each K block's wgmmas accumulate into `partial`, which is then
// promoted into the fp32 tile: acc = fma(partial, scale_a * scale_b, acc), K blocks ascending — the
// reference's order (reference/fp8_detail.h). The products are exact; wgmma's own sum inside a K block
// is not the reference's ascending fp32 sum, so results agree within rounding-order noise, not bitwise.
//
// Warps as in the bf16 kernel: warpgroup 0 produces (one thread issues the TMA loads of A, B and the scale
// vectors into a kNumStages ring), warpgroups 1 and 2 each own 64 rows of the 128 x 128 tile. Each consumer
// waits for its K block's wgmmas before promoting, so the two consumers' wgmmas and promotions interleave.
// Tiles are 128 x 128, not the bf16 kernel's 128 x 256: a second 64 x 256 fp32 tile (the partial) would
// need 256 registers per thread.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstddef>
#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/gemm_config.cuh"
#include "kernels/gemm/gemm_types.h"
#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/quant/fp8_quant.cuh"

namespace pounce::kernels::gemm {

enum class Fp8Kind { kRows, kGateUp, kWeightGrad };

struct Fp8GemmConfig {
  static constexpr int BLOCK_M = 128;
  static constexpr int BLOCK_N = 128;
  static constexpr int BLOCK_K = 128;  // one scale block, one 128-byte swizzled e4m3 row
  static constexpr int kNumStages = 6;
  static constexpr int kNumConsumerWarpgroups = 2;
  static constexpr int kNumThreads = 128 * (1 + kNumConsumerWarpgroups);
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kMChunk = 8;
  static constexpr uint32_t kStageBytesA = BLOCK_M * BLOCK_K;
  static constexpr uint32_t kStageBytesB = BLOCK_N * BLOCK_K;
  static constexpr uint32_t kScaleBytes = BLOCK_M * 4;
  static constexpr uint64_t kWaitTimeoutNs = GemmConfig::kWaitTimeoutNs;
  static_assert(BLOCK_M == BLOCK_N, "one scale box shape serves A and the weight gradients' B");
  static_assert(BLOCK_M == 64 * kNumConsumerWarpgroups, "each consumer warpgroup owns 64 rows (wgmma m64)");
};

struct Fp8GemmArgs {
  GroupedGemmArgs common;  // offsets, n, k (kRows: of the first pair), m (weight grads), outputs, error flag
  int32_t k_blocks0;       // kRows: K blocks of the first (A, B) pair; the second pair's follow
  int32_t k_blocks1;       // kRows: K blocks of the second pair (0 = none)
  const float* b_scale0;   // kRows: [group][ceil(n / 128)][k_blocks0]
  const float* b_scale1;   // kRows: [group][ceil(n / 128)][k_blocks1]; gate/up: b_scale0 Wg's, b_scale1 Wu's
  // gate/up: common.out0 = g, out1 = u [rows, n] bf16 (row stride out_ld), out2 = bf16 a or null; a_q e4m3
  // [rows, n] (row stride n) and its scales [ceil(n / 128)][act_scale_ld].
  uint8_t* act_q;
  float* act_scale;
  int64_t act_scale_ld;
};

struct Fp8TensorMaps {
  CUtensorMap a[2];        // e4m3 [rows, k] (kRows; per pair) or [m, rows] (A_t)
  CUtensorMap b[2];        // e4m3 [group][n, k] (kRows; per pair) or [n, rows] (B_t)
  CUtensorMap a_scale[2];  // fp32 [k_blocks][scale_ld]
  CUtensorMap b_scale;     // weight grads: fp32 [row blocks][scale_ld] of B_t
};

struct Fp8SharedStorage {
  struct alignas(1024) Stage {
    uint8_t a[Fp8GemmConfig::BLOCK_M * Fp8GemmConfig::BLOCK_K];  // 16 KB
    uint8_t b[Fp8GemmConfig::BLOCK_N * Fp8GemmConfig::BLOCK_K];  // 16 KB
    float a_scale[Fp8GemmConfig::BLOCK_M];
    float b_scale[Fp8GemmConfig::BLOCK_N];  // weight grads only
  };
  alignas(1024) uint64_t full[Fp8GemmConfig::kNumStages];
  uint64_t empty[Fp8GemmConfig::kNumStages];
  Stage stages[Fp8GemmConfig::kNumStages];
};
inline constexpr size_t kFp8SharedBytes = sizeof(Fp8SharedStorage) + 1024;
static_assert(kFp8SharedBytes <= 227 * 1024, "FP8 GEMM shared storage exceeds 227 KB; fix: fewer stages");

// ---------------------------------------------------------------------------------------------------
// Tile walk, shared by producer and consumers.
// ---------------------------------------------------------------------------------------------------
template <Fp8Kind kKind>
struct Fp8TileWalk {
  using C = Fp8GemmConfig;
  static constexpr bool kReduction = kKind == Fp8Kind::kWeightGrad;
  using Scheduler = std::conditional_t<kReduction, ReductionTileScheduler<C::BLOCK_M, C::BLOCK_N>,
                                       TileScheduler<C::BLOCK_M, C::kMChunk>>;
  Scheduler scheduler;

  __device__ explicit Fp8TileWalk(const Fp8GemmArgs& a) : scheduler(make_scheduler(a.common)) {}

  static __device__ Scheduler make_scheduler(const GroupedGemmArgs& a) {
    if constexpr (kReduction) {
      return Scheduler(a.num_groups, a.m, a.n, a.group_active);
    } else {
      return Scheduler(a.group_row_offset, a.num_groups, a.max_m_blocks, (a.n + C::BLOCK_N - 1) / C::BLOCK_N);
    }
  }

  // The passes over K of a tile: gate/up computes its two 64-column halves one after the other (the second
  // only when inside n, a multiple of 64); every other kind one pass.
  static __device__ int passes(const Fp8GemmArgs& args, const Tile& tile) {
    if constexpr (kKind == Fp8Kind::kGateUp) return tile.n_block * C::BLOCK_N + 64 < args.common.n ? 2 : 1;
    return 1;
  }

  // The next tile and its K blocks [kb_begin, kb_end) per pass: every block of both pairs (kRows, gate/up),
  // or the blocks of the group's rows up to its data (weight grads; offsets are multiples of BLOCK_K).
  __device__ bool next(const Fp8GemmArgs& args, Tile& tile, int32_t& kb_begin, int32_t& kb_end) {
    if (!scheduler.next(tile)) return false;
    if constexpr (kReduction) {
      const GroupedGemmArgs& c = args.common;
      const int32_t begin = c.group_row_offset[tile.group];
      int32_t end = c.group_row_offset[tile.group + 1];
      if (c.group_rows != nullptr) end = min(end, begin + c.group_rows[tile.group]);
      kb_begin = begin / C::BLOCK_K;
      kb_end = (end + C::BLOCK_K - 1) / C::BLOCK_K;
    } else {
      kb_begin = 0;
      kb_end = args.k_blocks0 + args.k_blocks1;
    }
    return true;
  }

  // Whether this consumer warpgroup's 64 rows hold any output (weight grads: rows below m).
  static __device__ bool has_rows(const Fp8GemmArgs& args, const Tile& tile, int consumer_idx) {
    if constexpr (kReduction) return tile.m_block * C::BLOCK_M + 64 * consumer_idx < args.common.m;
    return true;
  }
};

// ---------------------------------------------------------------------------------------------------
// Producer
// ---------------------------------------------------------------------------------------------------
template <Fp8Kind kKind>
__device__ __forceinline__ void run_fp8_producer(Fp8SharedStorage& ss, const Fp8TensorMaps& maps,
                                                 const Fp8GemmArgs& args) {
  using C = Fp8GemmConfig;
  constexpr bool kReduction = kKind == Fp8Kind::kWeightGrad;
  constexpr uint32_t kBytes =
      C::kStageBytesA + C::kStageBytesB + C::kScaleBytes + (kReduction ? C::kScaleBytes : 0u);
  Fp8TileWalk<kKind> walk(args);
  StageRing<C::kNumStages> ring;
  Tile tile;
  int32_t kb_begin = 0, kb_end = 0;
  while (walk.next(args, tile, kb_begin, kb_end)) {
    const int32_t row0 = tile.m_block * C::BLOCK_M;
    const int passes = walk.passes(args, tile);
    for (int pass = 0; pass < passes; ++pass)
      for (int32_t kb = kb_begin; kb < kb_end; ++kb) {
        const int32_t col0 = tile.n_block * C::BLOCK_N + 64 * pass;
        if (args.common.inject_failure != 0 ||
            !ptx::mbarrier_wait_parity_bounded(&ss.empty[ring.stage], ring.phase ^ 1, C::kWaitTimeoutNs)) {
          record_error(args.common.error_flag, WaitError::kEmptyStage);
          return;
        }
        Fp8SharedStorage::Stage& st = ss.stages[ring.stage];
        uint64_t* full = &ss.full[ring.stage];
        ptx::mbarrier_arrive_expect_tx(full, kBytes);
        if constexpr (kReduction) {
          const int32_t r0 = kb * C::BLOCK_K;
          ptx::tma_load_2d(st.a, &maps.a[0], full, r0, row0);
          ptx::tma_load_2d(st.b, &maps.b[0], full, r0, col0);
          ptx::tma_load_2d(st.a_scale, &maps.a_scale[0], full, row0, kb);
          ptx::tma_load_2d(st.b_scale, &maps.b_scale, full, col0, kb);
        } else if constexpr (kKind == Fp8Kind::kGateUp) {
          ptx::tma_load_2d(st.a, &maps.a[0], full, kb * C::BLOCK_K, row0);
          ptx::tma_load_3d(st.b, &maps.b[0], full, kb * C::BLOCK_K, col0, tile.group);
          ptx::tma_load_3d(st.b + 64 * C::BLOCK_K, &maps.b[1], full, kb * C::BLOCK_K, col0, tile.group);
          ptx::tma_load_2d(st.a_scale, &maps.a_scale[0], full, row0, kb);
        } else {
          const int pair = kb < args.k_blocks0 ? 0 : 1;
          const int32_t kb_in = pair == 0 ? kb : kb - args.k_blocks0;
          ptx::tma_load_2d(st.a, &maps.a[pair], full, kb_in * C::BLOCK_K, row0);
          ptx::tma_load_3d(st.b, &maps.b[pair], full, kb_in * C::BLOCK_K, col0, tile.group);
          ptx::tma_load_2d(st.a_scale, &maps.a_scale[pair], full, row0, kb_in);
        }
        ring.advance();
      }
  }
}

// ---------------------------------------------------------------------------------------------------
// Consumers
// ---------------------------------------------------------------------------------------------------
// Shared-space byte addresses of the ring, computed once per consumer: a K block is only ~130 cycles of
// tensor work here (half a bf16 one), so per-block address conversions and descriptor builds showed up in
// Nsight Compute as most of the issue slots between wgmmas (docs/experiments/035-fp8-grouped-gemm.md).
struct Fp8RingAddresses {
  uint32_t full0;   // full[0]; full[s] = full0 + 8 s, empty[s] = full0 + 8 (kNumStages + s)
  uint32_t stage0;  // stages[0]; stages[s] = stage0 + s * sizeof(Stage)
  static constexpr uint32_t kStageBytes = sizeof(Fp8SharedStorage::Stage);
  static constexpr uint32_t kB = offsetof(Fp8SharedStorage::Stage, b);
  static constexpr uint32_t kAScale = offsetof(Fp8SharedStorage::Stage, a_scale);
  static constexpr uint32_t kBScale = offsetof(Fp8SharedStorage::Stage, b_scale);
  __device__ explicit Fp8RingAddresses(Fp8SharedStorage& ss)
      : full0(ptx::smem_addr(&ss.full[0])), stage0(ptx::smem_addr(&ss.stages[0])) {}
  __device__ uint32_t full(uint32_t s) const { return full0 + 8 * s; }
  __device__ uint32_t empty(uint32_t s) const { return full0 + 8 * (Fp8GemmConfig::kNumStages + s); }
  __device__ uint32_t stage(uint32_t s) const { return stage0 + s * kStageBytes; }
};
static_assert(offsetof(Fp8SharedStorage, empty) ==
                  offsetof(Fp8SharedStorage, full) + 8 * Fp8GemmConfig::kNumStages,
              "Fp8RingAddresses::empty assumes empty[] right after full[]");

// One K block's four k32 wgmmas into `partial` (overwritten), waited for. The descriptors' start address
// field steps by 32 bytes (2 in its 16-byte units) per k32.
__device__ __forceinline__ void multiply_fp8_k_block(float (&partial)[64], uint32_t a_base, uint32_t b_base) {
  const uint64_t desc_a = ptx::make_smem_desc_k_major_sw128(a_base);
  const uint64_t desc_b = ptx::make_smem_desc_k_major_sw128(b_base);
  fence_accumulators(partial);
  ptx::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Fp8GemmConfig::BLOCK_K / 32; ++kk)
    ptx::wgmma_m64n128k32_e4m3(partial, desc_a + 2 * kk, desc_b + 2 * kk, kk > 0);
  ptx::wgmma_commit_group();
  ptx::wgmma_wait_group<0>();
  fence_accumulators(partial);
}

// acc += partial * (scale_a[row] * scale_b) per row half h; units [j0, j1) only.
template <int kJ0, int kJ1>
__device__ __forceinline__ void promote(float (&acc)[64], const float (&partial)[64], const float (&s)[2]) {
#pragma unroll
  for (int j = kJ0; j < kJ1; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      acc[4 * j + 2 * h] = __fmaf_rn(partial[4 * j + 2 * h], s[h], acc[4 * j + 2 * h]);
      acc[4 * j + 2 * h + 1] = __fmaf_rn(partial[4 * j + 2 * h + 1], s[h], acc[4 * j + 2 * h + 1]);
    }
  }
}

// Multiplies this warpgroup's 64 rows of one tile into `acc` (fp32, K blocks promoted in ascending order).
// False when a stage never filled (recorded in the error flag).
template <Fp8Kind kKind>
__device__ __forceinline__ bool multiply_fp8_tile(const Fp8RingAddresses& ring_at,
                                                  StageRing<Fp8GemmConfig::kNumStages>& ring,
                                                  const Fp8GemmArgs& args, const Tile& tile, int32_t kb_begin,
                                                  int32_t kb_end, int consumer_idx, bool has_rows,
                                                  float (&acc)[64]) {
  using C = Fp8GemmConfig;
  const int warp_in_group = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const uint32_t a_row_offset = consumer_idx * 64 * C::BLOCK_K;
  // This lane's rows' A scales (row_in_tile, and 8 below: 32 bytes on).
  const uint32_t a_scale_offset =
      Fp8RingAddresses::kAScale + 4 * (consumer_idx * 64 + warp_in_group * 16 + lane / 4);
  // The tile's B scales per K block (kRows: one per 128 x 128 block of each pair; gate/up: Wg's and Wu's).
  const int32_t n_blocks = (args.common.n + C::BLOCK_N - 1) / C::BLOCK_N;
  const int64_t b_block = static_cast<int64_t>(tile.group) * n_blocks + tile.n_block;
  // Running pointers at K block kb's B scales (kRows: the first pair's, then the second's; gate/up: Wg's,
  // Wu's), stepped per block: recomputing them from the tile each block cost a dozen instructions.
  const float* scale_b0_at = args.b_scale0 + b_block * args.k_blocks0 + kb_begin;
  const float* scale_b1_at =
      args.b_scale1 + b_block * (kKind == Fp8Kind::kGateUp ? args.k_blocks0 : args.k_blocks1);
  if (kKind == Fp8Kind::kGateUp) scale_b1_at += kb_begin;
#pragma unroll
  for (int i = 0; i < 64; ++i) acc[i] = 0.0f;
  float partial[64];
  for (int32_t kb = kb_begin; kb < kb_end; ++kb) {
    // The B scales first: their load overlaps the wait and the wgmmas.
    float scale_b0 = 0.0f, scale_b1 = 0.0f;
    if constexpr (kKind == Fp8Kind::kRows) {
      if (kb == args.k_blocks0) scale_b0_at = scale_b1_at;  // the second pair starts
      scale_b0 = __ldg(scale_b0_at++);
    } else if constexpr (kKind == Fp8Kind::kGateUp) {
      scale_b0 = __ldg(scale_b0_at++);
      scale_b1 = __ldg(scale_b1_at++);
    }
    if (args.common.inject_failure != 0 ||
        !ptx::mbarrier_wait_parity_bounded_at(ring_at.full(ring.stage), ring.phase, C::kWaitTimeoutNs)) {
      record_error(args.common.error_flag, WaitError::kFullStage);
      return false;
    }
    const uint32_t st = ring_at.stage(ring.stage);
    if (has_rows) {
      // The A scales before the wgmmas, so that their latency is spent waiting for those.
      const float scale_a[2] = {ptx::ld_shared_f32(st + a_scale_offset),
                                ptx::ld_shared_f32(st + a_scale_offset + 32)};
      multiply_fp8_k_block(partial, st + a_row_offset, st + Fp8RingAddresses::kB);
      if constexpr (kKind == Fp8Kind::kWeightGrad) {
        float2 scale_b[16];
#pragma unroll
        for (int j = 0; j < 16; ++j)
          scale_b[j] = ptx::ld_shared_f32x2(st + Fp8RingAddresses::kBScale + 4 * (8 * j + 2 * (lane % 4)));
        if (lane == 0) ptx::mbarrier_arrive_at(ring_at.empty(ring.stage));
#pragma unroll
        for (int j = 0; j < 16; ++j) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            acc[4 * j + 2 * h] =
                __fmaf_rn(partial[4 * j + 2 * h], __fmul_rn(scale_a[h], scale_b[j].x), acc[4 * j + 2 * h]);
            acc[4 * j + 2 * h + 1] = __fmaf_rn(partial[4 * j + 2 * h + 1],
                                               __fmul_rn(scale_a[h], scale_b[j].y), acc[4 * j + 2 * h + 1]);
          }
        }
      } else if constexpr (kKind == Fp8Kind::kGateUp) {
        // Units 0..7 are g's columns (Wg's block scale), 8..15 u's (Wu's).
        if (lane == 0) ptx::mbarrier_arrive_at(ring_at.empty(ring.stage));
        const float s_g[2] = {__fmul_rn(scale_a[0], scale_b0), __fmul_rn(scale_a[1], scale_b0)};
        const float s_u[2] = {__fmul_rn(scale_a[0], scale_b1), __fmul_rn(scale_a[1], scale_b1)};
        promote<0, 8>(acc, partial, s_g);
        promote<8, 16>(acc, partial, s_u);
      } else {
        if (lane == 0) ptx::mbarrier_arrive_at(ring_at.empty(ring.stage));
        const float s[2] = {__fmul_rn(scale_a[0], scale_b0), __fmul_rn(scale_a[1], scale_b0)};
        promote<0, 16>(acc, partial, s);
      }
    } else if (lane == 0) {
      ptx::mbarrier_arrive_at(ring_at.empty(ring.stage));
    }
    ring.advance();
  }
  return true;
}

// One gate/up pass: g (units 0..7) and u (8..15) of 64 columns from col0 rounded to bf16 and stored, and
// a = bf16(act(g, u)) kept in `act` for the quantization. `row`: this lane's first row (the second is 8
// below).
__device__ __forceinline__ void store_gate_up_pass(const float (&acc)[64], const Fp8GemmArgs& args,
                                                   int64_t row, int32_t col0, int lane,
                                                   uint32_t (&act)[2][8]) {
  const GroupedGemmArgs& c = args.common;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t at = (row + 8 * h) * c.out_ld + col0 + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t g = ptx::pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      const uint32_t u = ptx::pack_bf16x2(acc[4 * (j + 8) + 2 * h], acc[4 * (j + 8) + 2 * h + 1]);
      act[h][j] = ptx::pack_bf16x2(apply_activation(bf16_lo(g), bf16_lo(u), c.activation),
                                   apply_activation(bf16_hi(g), bf16_hi(u), c.activation));
      *reinterpret_cast<uint32_t*>(c.out0 + at + 8 * j) = g;
      *reinterpret_cast<uint32_t*>(c.out1 + at + 8 * j) = u;
      if (c.out2 != nullptr) *reinterpret_cast<uint32_t*>(c.out2 + at + 8 * j) = act[h][j];
    }
  }
}

// a's 1x128 blocks of this tile: each row's 128 columns are held by one quad (lane % 4), 32 values each; the
// quad finds the block's scale and writes its e4m3 bytes (two per unit, as the accumulator layout holds
// them) and the scale. Columns past n (the second pass skipped) are neither real nor stored.
__device__ __forceinline__ void store_quantized_activation(const uint32_t (&act)[2][2][8],
                                                           const Fp8GemmArgs& args, int64_t row,
                                                           int32_t col_block, int lane) {
  const int32_t n = args.common.n;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float values[32];
#pragma unroll
    for (int pass = 0; pass < 2; ++pass)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        values[16 * pass + 2 * j] = bf16_lo(act[pass][h][j]);
        values[16 * pass + 2 * j + 1] = bf16_hi(act[pass][h][j]);
      }
    uint32_t packed[8];
    const float scale = quant::quantize_lane_group<4, 32>(values, packed);
    const int64_t r = row + 8 * h;
    uint8_t* out = args.act_q + r * n + col_block + 2 * (lane % 4);
#pragma unroll
    for (int w = 0; w < 8; ++w) {  // word w: units 2w and 2w + 1 (values 4w .. 4w + 3)
      const int pass = w / 4, j = 2 * (w % 4);
      if (col_block + 64 * pass >= n) break;
      *reinterpret_cast<uint16_t*>(out + 64 * pass + 8 * j) = static_cast<uint16_t>(packed[w] & 0xFFFFu);
      *reinterpret_cast<uint16_t*>(out + 64 * pass + 8 * (j + 1)) = static_cast<uint16_t>(packed[w] >> 16);
    }
    if (lane % 4 == 0) args.act_scale[(col_block / Fp8GemmConfig::BLOCK_N) * args.act_scale_ld + r] = scale;
  }
}

template <Fp8Kind kKind>
__device__ __forceinline__ void run_fp8_consumer(Fp8SharedStorage& ss, const Fp8GemmArgs& args,
                                                 int consumer_idx) {
  using C = Fp8GemmConfig;
  Fp8TileWalk<kKind> walk(args);
  StageRing<C::kNumStages> ring;
  const Fp8RingAddresses ring_at(ss);
  float acc[64];
  Tile tile;
  int32_t kb_begin = 0, kb_end = 0;
  const int lane = threadIdx.x % 32;
  const int warp_in_group = (threadIdx.x / 32) % 4;
  while (walk.next(args, tile, kb_begin, kb_end)) {
    const bool has_rows = walk.has_rows(args, tile, consumer_idx);
    if (!multiply_fp8_tile<kKind>(ring_at, ring, args, tile, kb_begin, kb_end, consumer_idx, has_rows, acc))
      return;
    if (!has_rows) continue;
    const int64_t row =
        static_cast<int64_t>(tile.m_block) * C::BLOCK_M + consumer_idx * 64 + warp_in_group * 16 + lane / 4;
    const int32_t col_block = tile.n_block * C::BLOCK_N;
    if constexpr (kKind == Fp8Kind::kGateUp) {
      uint32_t act[2][2]
                  [8];  // [pass][row half][unit]: bf16 pairs of a, columns 64 pass + 8 unit + 2 (lane % 4)
      store_gate_up_pass(acc, args, row, col_block, lane, act[0]);
      if (walk.passes(args, tile) == 2) {
        if (!multiply_fp8_tile<kKind>(ring_at, ring, args, tile, kb_begin, kb_end, consumer_idx, true, acc))
          return;
        store_gate_up_pass(acc, args, row, col_block + 64, lane, act[1]);
      } else {
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int j = 0; j < 8; ++j) act[1][h][j] = 0u;  // past n: zeros add nothing to the block's amax
      }
      store_quantized_activation(act, args, row, col_block, lane);
    } else if constexpr (kKind == Fp8Kind::kWeightGrad) {
      if (kb_end > kb_begin) {
        store_weight_grad_tile(acc, args.common, tile.group, row, col_block, lane);
      } else {
        store_weight_grad_zeros<C::BLOCK_N>(args.common, tile.group, row, col_block, lane);
      }
    } else {
      store_tile_bf16(acc, args.common.out0, args.common.out_ld, args.common.n, row, col_block, INT64_MAX,
                      lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------------
template <Fp8Kind kKind>
__global__ void __launch_bounds__(Fp8GemmConfig::kNumThreads, 1)
    fp8_grouped_gemm_kernel(const __grid_constant__ Fp8TensorMaps maps, const Fp8GemmArgs args) {
  using C = Fp8GemmConfig;
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t smem_base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
  Fp8SharedStorage& ss = *reinterpret_cast<Fp8SharedStorage*>(smem_base);
  const int warpgroup_idx = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < C::kNumStages; ++s) {
      ptx::mbarrier_init(&ss.full[s], 1);
      ptx::mbarrier_init(&ss.empty[s], 4 * C::kNumConsumerWarpgroups);
    }
    ptx::fence_mbarrier_init();
    if (kKind != Fp8Kind::kWeightGrad && blockIdx.x == 0 &&
        args.common.group_row_offset[args.common.num_groups] > args.common.max_m_blocks * C::BLOCK_M) {
      record_error(args.common.error_flag, WaitError::kRowsExceedCapacity);
    }
  }
  __syncthreads();
  if (warpgroup_idx == 0) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) run_fp8_producer<kKind>(ss, maps, args);
  } else {
    ptx::setmaxnreg_inc<C::kConsumerRegs>();
    run_fp8_consumer<kKind>(ss, args, warpgroup_idx - 1);
  }
}

}  // namespace pounce::kernels::gemm
