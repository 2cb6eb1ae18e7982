// Persistent warp-specialised grouped GEMM (sm_90a), one mainloop for every GEMM of the layer:
//   forward      C[rows, n] = A[rows, k] . B[group(row)][n, k]^T          (A, B K-major)
//   gate/up      g, u and act = act(g, u) of the same columns in one CTA  (A, B K-major)
//   data grads   C[rows, n] = A[rows, k] . B[group(row)][k, n]            (B N-major: weights used
//   transposed),
//                optionally with the activation backward in the epilogue, optionally with B's K range
//                split over two tensors (gate then up)
//   weight grads C[group][m, n] = sum over the group's rows r of A[r, m] B[r, n]   (A, B MN-major: the
//                reduction runs over expert-grouped rows; an expert without rows gets zeros)
//
// Warps: warpgroup 0 is the producer (one thread issues TMA loads of A and B tiles into a kNumStages ring,
// 128-byte swizzled); warpgroups 1 and 2 are consumers, each owning 64 of the BLOCK_M = 128 tile rows and
// issuing wgmma m64n256k16 with fp32 accumulators in registers, then storing bf16 through shared memory and
// TMA stores (tma_store.cuh; the standalone launches), or straight from registers (16-byte stores after a
// quad transpose; the fused kernels' epilogues, whose readers are other CTAs of the same launch).
// Handoffs: full[s] completes when a stage's bytes landed (TMA transaction count); empty[s] completes when
// all 8 consumer warps finished the wgmmas that read it. Every wait is bounded: on timeout the waiter writes
// an error code to args.error_flag and leaves, so a broken input fails the call instead of hanging.
// Gate/up: B stage rows 0..127 are w_gate[n0 .. n0+128), rows 128..255 are w_up[same], so one N = 256
// wgmma yields gate (accumulators 0..63) and up (64..127) of the same output columns.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstdint>
#include <type_traits>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/activation.cuh"
#include "kernels/gemm/gemm_config.cuh"
#include "kernels/gemm/gemm_types.h"
#include "kernels/gemm/tile_scheduler.cuh"
#include "kernels/gemm/tma_store.cuh"

namespace pounce::kernels::gemm {

// ---------------------------------------------------------------------------------------------------
// Tile extents
// ---------------------------------------------------------------------------------------------------
// The wgmma width one consumer warpgroup needs for a tile: 64 columns for an edge tile with at most 64
// columns below n (n % 256 == 64: gpt-oss's 2880), a quarter of the tensor work, else 256; 0 (no wgmma at
// all) when all 64 of the warpgroup's rows are padding: weight-gradient rows at or beyond m, and for C
// (forward down, d_x) a group's rows past its data (`upper_half_padding`, from GroupedGemmArgs::group_rows or
// the fused schedulers). Columns and rows a narrower wgmma leaves out are never stored; skipped rows get
// exactly what zero rows of A give. Measured with the launches interleaved
// (docs/experiments/013-padding-and-edge-tiles.md, deepseek / gpt-oss EP2 rows): the row skip speeds C up 3 %
// / 2 % but slows the activation backward 20 % / 3 % (its warpgroups drift apart: one multiplies alone while
// the other runs the long epilogue), so gate/up and the activation backward compute their padding rows.
// Gate/up always runs 256 wide, and no width but 64 is offered: with more code paths the fused kernels'
// register allocation no longer pipelines their wgmmas (cmake/ptxas_guard.sh).
template <GemmKind kKind>
__device__ __forceinline__ int32_t mma_columns(const GroupedGemmArgs& args, const Tile& tile,
                                               int consumer_idx, bool upper_half_padding) {
  if constexpr (kKind.grouping == Grouping::kReduction) {
    if (tile.m_block * GemmConfig::BLOCK_M + 64 * consumer_idx >= args.m) return 0;
  } else if constexpr (kKind.epilogue == Epilogue::kGateUpActivation) {
    return 256;
  } else if constexpr (kKind.epilogue == Epilogue::kStore) {
    if (consumer_idx == 1 && upper_half_padding) return 0;
  }
  return args.n - tile.n_block * kOutBlockN<kKind.epilogue> <= 64 ? 64 : 256;
}

// Rows 64..127 of a row-grouped tile hold no data (its group's rows end at or before row 64 of the tile),
// read from args.group_rows (false without it). The first half always holds data: padding is < BLOCK_M rows.
template <GemmKind kKind>
__device__ __forceinline__ bool upper_half_padding(const GroupedGemmArgs& args, const Tile& tile) {
  if constexpr (kKind.grouping == Grouping::kRows) {
    if (args.group_rows != nullptr) {
      return tile.m_block * GemmConfig::BLOCK_M + 64 >=
             args.group_row_offset[tile.group] + args.group_rows[tile.group];
    }
  }
  return false;
}

// The K blocks of a weight gradient's group (kReduction): its row segment up to `limit` rows, without the
// K blocks wholly past its data (GroupedGemmArgs::group_rows; zero rows add nothing to the sums).
__device__ __forceinline__ void reduction_k_blocks(const GroupedGemmArgs& args, int32_t group, int32_t limit,
                                                   int32_t& kb_begin, int32_t& kb_end) {
  const int32_t begin = min(args.group_row_offset[group], limit);
  int32_t end = min(args.group_row_offset[group + 1], limit);
  if (args.group_rows != nullptr) end = min(end, begin + args.group_rows[group]);
  kb_begin = begin / GemmConfig::BLOCK_K;
  kb_end = (end + GemmConfig::BLOCK_K - 1) / GemmConfig::BLOCK_K;
}

// ---------------------------------------------------------------------------------------------------
// Tile walk: producer and consumers run the same scheduler, so they agree on every tile and its K range.
// ---------------------------------------------------------------------------------------------------
template <GemmKind kKind>
struct TileWalk {
  using C = GemmConfig;
  static constexpr bool kReduction = kKind.grouping == Grouping::kReduction;
  using Scheduler = std::conditional_t<kReduction, ReductionTileScheduler<C::BLOCK_M, C::BLOCK_N>,
                                       TileScheduler<C::BLOCK_M, C::kMChunk>>;
  Scheduler scheduler;
  int32_t num_k_blocks;  // kRows: every tile runs the whole K

  __device__ explicit TileWalk(const GroupedGemmArgs& a)
      : scheduler(make_scheduler(a)), num_k_blocks(a.k / C::BLOCK_K) {}

  static __device__ Scheduler make_scheduler(const GroupedGemmArgs& a) {
    if constexpr (kReduction) {
      return Scheduler(a.num_groups, a.m, a.n, a.group_active);
    } else {
      return Scheduler(a.group_row_offset, a.num_groups, a.max_m_blocks,
                       (a.n + kOutBlockN<kKind.epilogue> - 1) / kOutBlockN<kKind.epilogue>);
    }
  }

  // The next tile and its K blocks [kb_begin, kb_end).
  __device__ bool next(const GroupedGemmArgs& args, Tile& tile, int32_t& kb_begin, int32_t& kb_end) {
    if (!scheduler.next(tile)) return false;
    if constexpr (kReduction) {
      reduction_k_blocks(args, tile.group, INT32_MAX, kb_begin, kb_end);
    } else {
      kb_begin = 0;
      kb_end = num_k_blocks;
    }
    return true;
  }

  // The width this consumer warpgroup multiplies a tile at (mma_columns).
  static __device__ int32_t mma_columns(const GroupedGemmArgs& args, const Tile& tile, int consumer_idx) {
    return gemm::mma_columns<kKind>(args, tile, consumer_idx, upper_half_padding<kKind>(args, tile));
  }
};

// ---------------------------------------------------------------------------------------------------
// Producer side of one tile.
// ---------------------------------------------------------------------------------------------------
// The stage ring's position over its first kStages stages, carried from tile to tile (and across GEMM kinds
// in the fused kernels, which use all of them).
template <int kStages>
struct StageRing {
  static_assert(kStages >= 2, "a ring of at least 2 stages");  // its users check it fits their storage
  uint32_t stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) stage = 0, phase ^= 1;
  }
};
using RingPosition = StageRing<GemmConfig::kNumStages>;

// Loads the K blocks [kb_begin, kb_end) of one tile into the ring. False when a stage never became free
// (recorded in args.error_flag).
template <GemmKind kKind, typename Ring>
__device__ __forceinline__ bool produce_tile(SharedStorage& ss, Ring& ring, const CUtensorMap& tmap_a,
                                             const CUtensorMap& tmap_b0, const CUtensorMap& tmap_b1,
                                             const GroupedGemmArgs& args, const Tile& tile, int32_t kb_begin,
                                             int32_t kb_end) {
  using C = GemmConfig;
  constexpr Epilogue kEpilogue = kKind.epilogue;
  const int32_t row0 = tile.m_block * C::BLOCK_M;
  const int32_t col0 = tile.n_block * kOutBlockN<kEpilogue>;
  // Boxes inside the matrix (MN-major only; K-major tiles are single boxes with zero fill).
  const int32_t a_boxes = kKind.a == Major::kMN ? min(C::BLOCK_M / C::kBoxMN, (args.m - row0 + 63) / 64) : 0;
  const int32_t b_boxes = kKind.b == Major::kMN ? min(C::BLOCK_N / C::kBoxMN, (args.n - col0 + 63) / 64) : 0;
  const uint32_t bytes = (kKind.a == Major::kMN ? a_boxes * C::kBoxBytes : C::kStageBytesA) +
                         (kKind.b == Major::kMN ? b_boxes * C::kBoxBytes : C::kStageBytesB);
  for (int32_t kb = kb_begin; kb < kb_end; ++kb) {
    if (args.inject_failure != 0 ||
        !ptx::mbarrier_wait_parity_bounded(&ss.empty[ring.stage], ring.phase ^ 1, C::kWaitTimeoutNs)) {
      record_error(args.error_flag, WaitError::kEmptyStage);
      return false;
    }
    SharedStorage::Stage& st = ss.stages[ring.stage];
    uint64_t* full = &ss.full[ring.stage];
    ptx::mbarrier_arrive_expect_tx(full, bytes);
    const int32_t k0 = kb * C::BLOCK_K;
    if constexpr (kKind.a == Major::kK) {
      ptx::tma_load_2d(st.a, &tmap_a, full, k0, row0);
    } else {
      for (int32_t box = 0; box < a_boxes; ++box)
        ptx::tma_load_2d(st.a + box * C::kBoxMN * C::BLOCK_K, &tmap_a, full, row0 + box * C::kBoxMN, k0);
    }
    if constexpr (kEpilogue == Epilogue::kGateUpActivation) {
      ptx::tma_load_3d(st.b, &tmap_b0, full, k0, col0, tile.group);
      ptx::tma_load_3d(st.b + (C::BLOCK_N / 2) * C::BLOCK_K, &tmap_b1, full, k0, col0, tile.group);
    } else if constexpr (kKind.b == Major::kK) {
      ptx::tma_load_3d(st.b, &tmap_b0, full, k0, col0, tile.group);
    } else if constexpr (kKind.grouping == Grouping::kReduction) {
      for (int32_t box = 0; box < b_boxes; ++box)
        ptx::tma_load_2d(st.b + box * C::kBoxMN * C::BLOCK_K, &tmap_b0, full, col0 + box * C::kBoxMN, k0);
    } else {
      const bool second = k0 >= args.k_split;
      const CUtensorMap* map = second ? &tmap_b1 : &tmap_b0;
      const int32_t k_in = second ? k0 - args.k_split : k0;
      for (int32_t box = 0; box < b_boxes; ++box)
        ptx::tma_load_3d(st.b + box * C::kBoxMN * C::BLOCK_K, map, full, col0 + box * C::kBoxMN, k_in,
                         tile.group);
    }
    ring.advance();
  }
  return true;
}

// ---------------------------------------------------------------------------------------------------
// Producer: one thread walks the tiles and keeps the stage ring full. MN-major operands arrive as boxes of
// 64 MN elements x BLOCK_K rows; boxes wholly past the matrix edge are not loaded (their columns or rows
// of the tile are never stored).
// ---------------------------------------------------------------------------------------------------
template <GemmKind kKind>
__device__ __forceinline__ void run_producer(SharedStorage& ss, const CUtensorMap& tmap_a,
                                             const CUtensorMap& tmap_b0, const CUtensorMap& tmap_b1,
                                             const GroupedGemmArgs& args) {
  static_assert(epilogue_layout(kKind.epilogue).stages <= GemmConfig::kNumStages,
                "the ring runs past SharedStorage::stages; fix: epilogue_layout");
  TileWalk<kKind> walk(args);
  StageRing<epilogue_layout(kKind.epilogue).stages> ring;
  Tile tile;
  int32_t kb_begin = 0, kb_end = 0;
  while (walk.next(args, tile, kb_begin, kb_end)) {
    if (!produce_tile<kKind>(ss, ring, tmap_a, tmap_b0, tmap_b1, args, tile, kb_begin, kb_end)) return;
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

// This lane's 8 consecutive columns of 32-column group m, row half h, as 4 packed bf16 pairs: the group's 4
// accumulator chunks, packed, then quad-transposed. kAccs accumulators per thread hold kAccs * 2 columns.
template <int kAccs>
__device__ __forceinline__ void transposed_group(const float (&acc)[kAccs], int m, int h, int lane,
                                                 uint32_t (&w)[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c)
    w[c] = ptx::pack_bf16x2(acc[4 * (4 * m + c) + 2 * h], acc[4 * (4 * m + c) + 2 * h + 1]);
  quad_transpose(w, lane);
}

// Stores this lane's two rows of a tile as bf16: `row_base[h]` points at column 0 of its row h (the second
// is 8 below the first), null = not stored; columns [col_block, col_block + 2 kAccs) below n. Every lane
// takes part in the transposes, whatever it stores.
template <int kAccs>
__device__ __forceinline__ void store_rows_bf16(const float (&acc)[kAccs],
                                                __nv_bfloat16* const (&row_base)[2], int32_t n,
                                                int32_t col_block, int lane) {
#pragma unroll
  for (int m = 0; m < kAccs / 16; ++m) {
    if (col_block + 32 * m >= n) break;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t w[4];
      transposed_group(acc, m, h, lane, w);
      if (row_base[h] != nullptr) store_16_bytes(row_base[h] + col_block + 32 * m + 8 * (lane % 4), w);
    }
  }
}

// `row`: this lane's first row (the second is row + 8); `col_block`: first column of the tile; `row_limit`:
// rows at or beyond it are not stored (weight gradients whose m is not a multiple of BLOCK_M).
template <int kAccs>
__device__ __forceinline__ void store_tile_bf16(const float (&acc)[kAccs], __nv_bfloat16* out, int64_t ld,
                                                int32_t n, int64_t row, int32_t col_block, int64_t row_limit,
                                                int lane) {
  __nv_bfloat16* const row_base[2] = {row < row_limit ? out + row * ld : nullptr,
                                      row + 8 < row_limit ? out + (row + 8) * ld : nullptr};
  store_rows_bf16(acc, row_base, n, col_block, lane);
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
      const int64_t offset = (row + 8 * h) * args.out_ld + col_block + 32 * m + 8 * (lane % 4);
      store_16_bytes(args.out0 + offset, g);
      store_16_bytes(args.out1 + offset, u);
      store_16_bytes(args.out2 + offset, a);
    }
  }
}

// d_a = bf16(acc) (the reference's rounding point), then d_g, d_u = bf16(act'(g, u) d_a) with g and u the
// bf16 values the forward saved at the same (row, column). g and u of kActivationLoadBatch 32-column groups
// are loaded before any is used: one memory latency per batch instead of one per group (the loads, not the
// arithmetic, were most of this epilogue's time).
// kAccs accumulators per thread hold the tile's 2 kAccs columns from col_block (128: the cooperative tiles,
// 64: the ping-pong ones, activation_backward_pingpong.cuh).
inline constexpr int kActivationLoadBatch = 2;
template <int kAccs>
__device__ __forceinline__ void store_activation_backward_tile(const float (&acc)[kAccs],
                                                               const GroupedGemmArgs& args, int64_t row,
                                                               int32_t col_block, int lane) {
  static_assert(kAccs % (16 * kActivationLoadBatch) == 0, "whole load batches of 32-column groups");
  const int64_t lane_col = col_block + 8 * (lane % 4);
#pragma unroll
  for (int m0 = 0; m0 < kAccs / 16; m0 += kActivationLoadBatch) {
    if (col_block + 32 * m0 >= args.n) break;
    uint4 g[kActivationLoadBatch][2], u[kActivationLoadBatch][2];
#pragma unroll
    for (int b = 0; b < kActivationLoadBatch; ++b) {
      const bool inside = col_block + 32 * (m0 + b) < args.n;  // n % 64 == 0: whole groups
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t at = (row + 8 * h) * args.n + lane_col + 32 * (m0 + b);
        g[b][h] = inside ? *reinterpret_cast<const uint4*>(args.in0 + at) : make_uint4(0, 0, 0, 0);
        u[b][h] = inside ? *reinterpret_cast<const uint4*>(args.in1 + at) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int b = 0; b < kActivationLoadBatch; ++b) {
      const int m = m0 + b;
      if (col_block + 32 * m >= args.n) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        uint32_t d_a[4];
        transposed_group(acc, m, h, lane, d_a);
        const uint32_t gw[4] = {g[b][h].x, g[b][h].y, g[b][h].z, g[b][h].w};
        const uint32_t uw[4] = {u[b][h].x, u[b][h].y, u[b][h].z, u[b][h].w};
        uint32_t d_g[4], d_u[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float dg_lo, du_lo, dg_hi, du_hi;
          apply_activation_backward(bf16_lo(gw[c]), bf16_lo(uw[c]), bf16_lo(d_a[c]), args.activation, dg_lo,
                                    du_lo);
          apply_activation_backward(bf16_hi(gw[c]), bf16_hi(uw[c]), bf16_hi(d_a[c]), args.activation, dg_hi,
                                    du_hi);
          d_g[c] = ptx::pack_bf16x2(dg_lo, dg_hi);
          d_u[c] = ptx::pack_bf16x2(du_lo, du_hi);
        }
        const int64_t offset = (row + 8 * h) * args.out_ld + lane_col + 32 * m;
        store_16_bytes(args.out0 + offset, d_g);
        store_16_bytes(args.out1 + offset, d_u);
      }
    }
  }
}

// Weight gradient of one expert: fp32 pairs straight from the accumulator layout, or bf16 through the
// 16-byte path. Rows at or beyond m belong to no expert and are not stored. kAccs accumulators per thread:
// the tile's 2 kAccs columns from col_block.
template <int kAccs>
__device__ __forceinline__ void store_weight_grad_tile(const float (&acc)[kAccs], const GroupedGemmArgs& args,
                                                       int32_t group, int64_t row, int32_t col_block,
                                                       int lane) {
  const int64_t matrix = static_cast<int64_t>(group) * args.m * args.n;
  if (args.weight_grad_mode == WeightGradMode::kStoreBf16) {
    store_tile_bf16(acc, static_cast<__nv_bfloat16*>(args.weight_grad) + matrix, args.n, args.n, row,
                    col_block, args.m, lane);
    return;
  }
  float* out = static_cast<float*>(args.weight_grad) + matrix;
  const bool accumulate = args.weight_grad_mode == WeightGradMode::kAccumulateF32;
  // Adding into fp32: the old values of kWeightGradLoadBatch 8-column units are loaded before any is added,
  // one memory latency per batch (n % 64 == 0: a batch is inside or past n as a whole).
  constexpr int kWeightGradLoadBatch = 8;
#pragma unroll
  for (int j0 = 0; j0 < kAccs / 4; j0 += kWeightGradLoadBatch) {
    if (col_block + 8 * j0 >= args.n) break;
    float2 old[kWeightGradLoadBatch][2];
#pragma unroll
    for (int b = 0; b < kWeightGradLoadBatch; ++b) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t at = (row + 8 * h) * args.n + col_block + 8 * (j0 + b) + 2 * (lane % 4);
        old[b][h] = accumulate && row + 8 * h < args.m ? *reinterpret_cast<const float2*>(out + at)
                                                       : make_float2(0.0f, 0.0f);
      }
    }
#pragma unroll
    for (int b = 0; b < kWeightGradLoadBatch; ++b) {
      const int j = j0 + b;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (row + 8 * h >= args.m) continue;
        float2 value = make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        if (accumulate) {
          value.x = __fadd_rn(old[b][h].x, value.x);
          value.y = __fadd_rn(old[b][h].y, value.y);
        }
        *reinterpret_cast<float2*>(out + (row + 8 * h) * args.n + col_block + 8 * j + 2 * (lane % 4)) = value;
      }
    }
  }
}

// The same rows and columns as store_weight_grad_tile, all zero (nothing to add when accumulating): kColumns
// columns from col_block.
template <int kColumns = GemmConfig::BLOCK_N>
__device__ __forceinline__ void store_weight_grad_zeros(const GroupedGemmArgs& args, int32_t group,
                                                        int64_t row, int32_t col_block, int lane) {
  if (args.weight_grad_mode == WeightGradMode::kAccumulateF32) return;
  const bool bf16 = args.weight_grad_mode == WeightGradMode::kStoreBf16;
  const int64_t matrix = static_cast<int64_t>(group) * args.m * args.n;
  for (int j = 0; j < kColumns / 8 && col_block + 8 * j < args.n; ++j) {
    const int64_t col = col_block + 8 * j + 2 * (lane % 4);
    for (int h = 0; h < 2; ++h) {
      if (row + 8 * h >= args.m) continue;
      const int64_t at = matrix + (row + 8 * h) * args.n + col;
      if (bf16) {
        *reinterpret_cast<uint32_t*>(static_cast<__nv_bfloat16*>(args.weight_grad) + at) = 0u;
      } else {
        *reinterpret_cast<float2*>(static_cast<float*>(args.weight_grad) + at) = make_float2(0.0f, 0.0f);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// The bf16 stores of C and of gate/up through the store chunks (tma_store.cuh): the same values, TMA stores.
// Columns at or beyond n are skipped per 64-column chunk (n % 64 == 0).
// ---------------------------------------------------------------------------------------------------
// The packed bf16 pair of accumulator unit j (columns 8j + 2q, +1), row half h.
__device__ __forceinline__ uint32_t packed_pair(const float (&acc)[128], int j, int h) {
  return ptx::pack_bf16x2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
}

// Columns [col_block, col_block + BLOCK_N) of C, 4 chunks.
template <typename Chunks>
__device__ __forceinline__ void store_chunks_bf16(const float (&acc)[128], Chunks& chunks,
                                                  const ChunkTarget& target, int32_t n, int32_t col_block) {
#pragma unroll
  for (int c = 0; c < GemmConfig::BLOCK_N / GemmConfig::kStoreChunkCols; ++c) {
    const int32_t col = col_block + c * GemmConfig::kStoreChunkCols;
    if (col >= n) break;
    write_chunk(chunks.buffer(), [&](int u, int h) { return packed_pair(acc, 8 * c + u, h); });
    chunks.publish([&](uint32_t buffer) { target.store(col, buffer); });
  }
}

// g (accumulator units 0..15), u (16..31) and act of the same 128 columns: per 64 columns a chunk of each.
template <typename Chunks>
__device__ __forceinline__ void store_gate_up_chunks(const float (&acc)[128], Chunks& chunks,
                                                     const OutputMaps& maps, const GroupedGemmArgs& args,
                                                     int32_t row, int32_t col_block) {
  constexpr int kUpUnits = kOutBlockN<Epilogue::kGateUpActivation> / 8;
#pragma unroll
  for (int c = 0; c < kOutBlockN<Epilogue::kGateUpActivation> / GemmConfig::kStoreChunkCols; ++c) {
    const int32_t col = col_block + c * GemmConfig::kStoreChunkCols;
    if (col >= args.n) break;
    write_chunk(chunks.buffer(), [&](int u, int h) { return packed_pair(acc, 8 * c + u, h); });
    chunks.publish([&](uint32_t buffer) { ptx::tma_store_2d(&maps.out[0], buffer, col, row); });
    write_chunk(chunks.buffer(), [&](int u, int h) { return packed_pair(acc, kUpUnits + 8 * c + u, h); });
    chunks.publish([&](uint32_t buffer) { ptx::tma_store_2d(&maps.out[1], buffer, col, row); });
    write_chunk(chunks.buffer(), [&](int u, int h) {
      const uint32_t g = packed_pair(acc, 8 * c + u, h), up = packed_pair(acc, kUpUnits + 8 * c + u, h);
      return ptx::pack_bf16x2(apply_activation(bf16_lo(g), bf16_lo(up), args.activation),
                              apply_activation(bf16_hi(g), bf16_hi(up), args.activation));
    });
    chunks.publish([&](uint32_t buffer) { ptx::tma_store_2d(&maps.out[2], buffer, col, row); });
  }
}

// ---------------------------------------------------------------------------------------------------
// Consumer side of one tile.
// ---------------------------------------------------------------------------------------------------
template <Major kMajor>
__device__ __forceinline__ uint64_t smem_desc(uint32_t tile_base, int kk) {
  if constexpr (kMajor == Major::kK) {
    return ptx::make_smem_desc_k_major_sw128(tile_base + kk * 32);  // 16 elements along the swizzled row
  } else {
    return ptx::make_smem_desc_mn_major_sw128(tile_base + kk * 16 * 128, GemmConfig::kBoxBytes);  // 16 rows
  }
}

// Hands a stage back to this CTA's producer: one arrival per warp on its empty barrier.
struct ReleaseToProducer {
  SharedStorage& ss;
  __device__ void operator()(uint32_t s) const {
    if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&ss.empty[s]);
  }
};

// A K block's wgmmas at width kCols (mma_columns): accumulators [0, kCols / 2) hold columns [0, kCols).
template <GemmKind kKind, int kCols>
__device__ __forceinline__ void issue_k_block(float (&acc)[128], uint32_t a_base, uint32_t b_base,
                                              bool accumulate) {
  using C = GemmConfig;
  constexpr bool kMnA = kKind.a == Major::kMN, kMnB = kKind.b == Major::kMN;
#pragma unroll
  for (int kk = 0; kk < C::BLOCK_K / 16; ++kk) {
    const uint64_t a = smem_desc<kKind.a>(a_base, kk);
    const uint64_t b = smem_desc<kKind.b>(b_base, kk);
    const bool acc_in = accumulate || kk > 0;
    if constexpr (kCols == 256) {
      ptx::wgmma_m64n256k16_bf16<kMnA, kMnB>(acc, a, b, acc_in);
    } else {
      ptx::wgmma_m64n64k16_bf16<kMnA, kMnB>(acc, a, b, acc_in);
    }
  }
}

// K blocks [kb_begin, kb_end) at width kCols. kCols = 0 (the warpgroup's rows are all padding): every stage
// is waited for and handed back; a row tile's accumulators become what its zero A rows give, by one k16 wgmma
// over the first stage (writing them with plain instructions would make ptxas serialise every wgmma of the
// kernel); a weight-gradient tile's rows at or beyond m are never stored, so they stay as they are.
template <GemmKind kKind, int kCols, typename Ring, typename Release>
__device__ __forceinline__ bool multiply_k_blocks(SharedStorage& ss, Ring& ring, const GroupedGemmArgs& args,
                                                  int32_t kb_begin, int32_t kb_end, int consumer_idx,
                                                  float (&acc)[128], Release release) {
  using C = GemmConfig;
  // This warpgroup's 64 rows of A: rows 64c.. of a K-major tile, or box c of an M-major one; both 8 KB in.
  const uint32_t a_offset_bytes = consumer_idx * 64 * C::BLOCK_K * 2;
  constexpr bool kZeroRows = kCols == 0 && kKind.grouping == Grouping::kRows;
  uint32_t prev_stage = 0;
  for (int32_t kb = kb_begin; kb < kb_end; ++kb) {
    if (args.inject_failure != 0 ||
        !ptx::mbarrier_wait_parity_bounded(&ss.full[ring.stage], ring.phase, C::kWaitTimeoutNs)) {
      ptx::wgmma_wait_group<0>();  // leave no wgmma in flight behind
      record_error(args.error_flag, WaitError::kFullStage);
      return false;
    }
    const uint32_t a_base = ptx::smem_addr(ss.stages[ring.stage].a) + a_offset_bytes;
    const uint32_t b_base = ptx::smem_addr(ss.stages[ring.stage].b);
    if constexpr (kCols == 0) {
      if (kZeroRows && kb == kb_begin) {
        fence_accumulators(acc);
        ptx::wgmma_fence();
        ptx::wgmma_m64n256k16_bf16<kKind.a == Major::kMN, kKind.b == Major::kMN>(
            acc, smem_desc<kKind.a>(a_base, 0), smem_desc<kKind.b>(b_base, 0), false);
        ptx::wgmma_commit_group();
        ptx::wgmma_wait_group<0>();
        fence_accumulators(acc);
      }
      release(ring.stage);  // the other warpgroup's wgmmas hold the stage until they arrive too
    } else {
      fence_accumulators(acc);
      ptx::wgmma_fence();
      issue_k_block<kKind, kCols>(acc, a_base, b_base, kb > kb_begin);
      ptx::wgmma_commit_group();
      fence_accumulators(acc);
      if (kb > kb_begin) {
        ptx::wgmma_wait_group<1>();
        release(prev_stage);
      }
      prev_stage = ring.stage;
    }
    ring.advance();
  }
  if constexpr (kCols != 0) {
    ptx::wgmma_wait_group<0>();
    fence_accumulators(acc);
    if (kb_end > kb_begin) release(prev_stage);
  }
  return true;
}

// Multiplies this warpgroup's 64 rows of one tile over K blocks [kb_begin, kb_end) into `acc` at the width
// `mma_cols` (mma_columns); every thread calls `release(stage)` once a stage's wgmmas are done. False when a
// stage never filled (recorded in args.error_flag).
template <GemmKind kKind, typename Ring, typename Release>
__device__ __forceinline__ bool multiply_tile(SharedStorage& ss, Ring& ring, const GroupedGemmArgs& args,
                                              int32_t kb_begin, int32_t kb_end, int consumer_idx,
                                              int32_t mma_cols, float (&acc)[128], Release release) {
  if constexpr (kKind.epilogue != Epilogue::kGateUpActivation) {  // always 256 (mma_columns)
    if (mma_cols == 0)
      return multiply_k_blocks<kKind, 0>(ss, ring, args, kb_begin, kb_end, consumer_idx, acc, release);
    if (mma_cols == 64)
      return multiply_k_blocks<kKind, 64>(ss, ring, args, kb_begin, kb_end, consumer_idx, acc, release);
  }
  return multiply_k_blocks<kKind, 256>(ss, ring, args, kb_begin, kb_end, consumer_idx, acc, release);
}
template <GemmKind kKind, typename Ring>
__device__ __forceinline__ bool multiply_tile(SharedStorage& ss, Ring& ring, const GroupedGemmArgs& args,
                                              int32_t kb_begin, int32_t kb_end, int consumer_idx,
                                              int32_t mma_cols, float (&acc)[128]) {
  return multiply_tile<kKind>(ss, ring, args, kb_begin, kb_end, consumer_idx, mma_cols, acc,
                              ReleaseToProducer{ss});
}

// This lane's first row of a tile (the second is 8 below): consumer warpgroup, warp and quad.
__device__ __forceinline__ int64_t tile_row(int32_t m_block, int consumer_idx) {
  const int warp_in_group = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  return static_cast<int64_t>(m_block) * GemmConfig::BLOCK_M + consumer_idx * 64 + warp_in_group * 16 +
         lane / 4;
}

// Stores this warpgroup's rows of a multiplied tile through the kind's epilogue.
template <GemmKind kKind>
__device__ __forceinline__ void store_tile(const float (&acc)[128], const GroupedGemmArgs& args,
                                           const Tile& tile, bool has_k_blocks, int consumer_idx) {
  constexpr Epilogue kEpilogue = kKind.epilogue;
  const int lane = threadIdx.x % 32;
  const int64_t row = tile_row(tile.m_block, consumer_idx);
  const int32_t col_block = tile.n_block * kOutBlockN<kEpilogue>;
  if constexpr (kEpilogue == Epilogue::kStore) {
    store_tile_bf16(acc, args.out0, args.out_ld, args.n, row, col_block, INT64_MAX, lane);
  } else if constexpr (kEpilogue == Epilogue::kGateUpActivation) {
    store_gate_up_tile(acc, args, row, col_block, lane);
  } else if constexpr (kEpilogue == Epilogue::kActivationBackward) {
    store_activation_backward_tile(acc, args, row, col_block, lane);
  } else if (has_k_blocks) {
    store_weight_grad_tile(acc, args, tile.group, row, col_block, lane);
  } else {
    store_weight_grad_zeros(args, tile.group, row, col_block, lane);  // an expert without rows
  }
}

// store_tile through the store chunks (the kinds whose epilogue_layout has chunks).
template <GemmKind kKind, typename Chunks>
__device__ __forceinline__ void store_tile_through_smem(const float (&acc)[128], const GroupedGemmArgs& args,
                                                        const OutputMaps& maps, const Tile& tile,
                                                        int consumer_idx, Chunks& chunks) {
  const int32_t row = tile.m_block * GemmConfig::BLOCK_M + consumer_idx * 64;  // the warpgroup's first
  const int32_t col_block = tile.n_block * kOutBlockN<kKind.epilogue>;
  if constexpr (kKind.epilogue == Epilogue::kStore) {
    store_chunks_bf16(acc, chunks, ChunkTarget{&maps.out[0], row}, args.n, col_block);
  } else {
    static_assert(kKind.epilogue == Epilogue::kGateUpActivation,
                  "C and gate/up only: the other epilogues store per lane (epilogue_layout)");
    store_gate_up_chunks(acc, chunks, maps, args, row, col_block);
  }
}

// Consumer: a warpgroup multiplies its 64 rows of every tile, releasing each stage one K block late so that
// one wgmma group stays in flight while the next is issued.
template <GemmKind kKind>
__device__ __forceinline__ void run_consumer(SharedStorage& ss, const GroupedGemmArgs& args,
                                             const OutputMaps& maps, int consumer_idx) {
  constexpr EpilogueLayout kLayout = epilogue_layout(kKind.epilogue);
  static_assert(kLayout.stages <= GemmConfig::kNumStages,
                "the ring runs past SharedStorage::stages; fix: epilogue_layout");
  TileWalk<kKind> walk(args);
  StageRing<kLayout.stages> ring;
  float acc[128];
  Tile tile;
  int32_t kb_begin = 0, kb_end = 0;
  if constexpr (kLayout.chunks > 0) {
    StoreChunkRing<kLayout.chunks> chunks(ss, kLayout, consumer_idx);
    while (walk.next(args, tile, kb_begin, kb_end)) {
      if (!multiply_tile<kKind>(ss, ring, args, kb_begin, kb_end, consumer_idx,
                                walk.mma_columns(args, tile, consumer_idx), acc))
        break;
      store_tile_through_smem<kKind>(acc, args, maps, tile, consumer_idx, chunks);
    }
    chunks.drain();
  } else {
    while (walk.next(args, tile, kb_begin, kb_end)) {
      if (!multiply_tile<kKind>(ss, ring, args, kb_begin, kb_end, consumer_idx,
                                walk.mma_columns(args, tile, consumer_idx), acc))
        break;
      store_tile<kKind>(acc, args, tile, kb_end > kb_begin, consumer_idx);
    }
  }
}

// Thread 0: the stage ring's mbarriers. full[s]: the producer's one arrival + the stage bytes; empty[s]: one
// arrival per consumer warp that reads the stage (`empty_arrivals`).
__device__ __forceinline__ void init_stage_ring(SharedStorage& ss, uint32_t empty_arrivals) {
#pragma unroll
  for (int s = 0; s < GemmConfig::kNumStages; ++s) {
    ptx::mbarrier_init(&ss.full[s], 1);
    ptx::mbarrier_init(&ss.empty[s], empty_arrivals);
  }
}
inline constexpr uint32_t kConsumerWarps = 4 * GemmConfig::kNumConsumerWarpgroups;

// ---------------------------------------------------------------------------------------------------
// Kernel
// ---------------------------------------------------------------------------------------------------
template <KernelKind kKernelKind>
__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                        const __grid_constant__ CUtensorMap tmap_b0,
                        const __grid_constant__ CUtensorMap tmap_b1,
                        const __grid_constant__ OutputMaps out_maps, const GroupedGemmArgs args) {
  using C = GemmConfig;
  constexpr GemmKind kKind = gemm_kind(kKernelKind);
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
    ptx::prefetch_tensor_map(&tmap_b1);
    init_stage_ring(ss, kConsumerWarps);
    ptx::fence_mbarrier_init();
    if (kKind.grouping == Grouping::kRows && blockIdx.x == 0 &&
        args.group_row_offset[args.num_groups] > args.max_m_blocks * C::BLOCK_M) {
      record_error(args.error_flag, WaitError::kRowsExceedCapacity);
    }
  }
  __syncthreads();

  // Register reconfiguration + roles: the producer warpgroup gives registers to the two consumers.
  if (warpgroup_idx == 0) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) run_producer<kKind>(ss, tmap_a, tmap_b0, tmap_b1, args);
  } else {
    ptx::setmaxnreg_inc<C::kConsumerRegs>();
    run_consumer<kKind>(ss, args, out_maps, warpgroup_idx - 1);
  }
}

}  // namespace pounce::kernels::gemm
