// The FP8 layer's quantization stages on expert-grouped rows (docs/design.md §1 "FP8 mode"), standalone
// kernels of the staged path built from the pieces of fp8_quant.cuh:
//
//   stage_x_fp8     x_q = q1x128_H(x) into the symmetric buffer (FP8 on the wire): sym_x_q[t] and its block
//                   scales sym_x_scale[t][H / 128] for t < T, zeros (scale 1) up to round_up(T, 128)
//   pull_x_fp8      x_q rows of the receive schedule from their sources: fp8_x_rows[row], and the row's
//   scales
//                   into the K-block-major fp8_x_scale[kb][ring_rows]; padding rows zero (scale 1)
//   quantize_dy_tiles  d_y_q = q1x128_H(d_y) of the pulled bf16 rows and, from the same read, its
//                   token-axis copy d_y_t = q128x1_T(d_y)
//   activation_backward_tiles  d_g, d_u = bf16(act'(g, u) d_a), each as q1x128_I rows (fp8_dg_rows,
//                   fp8_du_rows) and as token-axis copies (fp8_dgu_t); the bf16 values stay on chip
//   token_axis_copy 128x1 blocks along the rows ("q128x1_T") of the bf16 act rows, or of the dequantized x_q
//                   rows: each column's 128 rows contiguous, the weight gradients' K-major operands
//
// The x stages run one warp per row, each lane holding 4 of a 128-column block (columns a multiple of 64, so
// a lane's 4 values are all inside the row or all past it); the backward's stages run on 128 x 128 tiles. Rows of local experts [expert_begin, expert_end)
// (a pipeline chunk) are read from group_row_offset on the device, so every launch is capturable and a
// macrobatch view's rows are its own. The epilogue-fused forms of these stages belong to the fused FP8
// kernels; here each is a pass over its rows.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/warp.cuh"
#include "kernels/gemm/activation.cuh"
#include "kernels/layout/workspace_layout.cuh"
#include "kernels/quant/fp8_quant.cuh"

namespace pounce::kernels::quant {

__device__ __forceinline__ float bf16_bits_to_float(uint32_t bits) {
  return __uint_as_float(bits << 16);
}

// Four consecutive bf16 values (8-byte aligned) as floats.
__device__ __forceinline__ void load_bf16x4(const void* src, float (&v)[4]) {
  const uint2 raw = *static_cast<const uint2*>(src);
  v[0] = bf16_bits_to_float(raw.x & 0xffffu);
  v[1] = bf16_bits_to_float(raw.x >> 16);
  v[2] = bf16_bits_to_float(raw.y & 0xffffu);
  v[3] = bf16_bits_to_float(raw.y >> 16);
}

__device__ __forceinline__ uint32_t bf16_bits(float v) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(v)));
}

// Quantizes one row of `cols` values in 1x128 blocks with the calling warp: values(col, v) fills v[0..3] with
// columns col..col+3 (called only for col < cols); bytes go to out[0, cols), block kb's scale to
// scale[kb * scale_stride].
template <typename Values>
__device__ __forceinline__ void quantize_row_1x128(const Values& values, int64_t cols, uint8_t* out,
                                                   float* scale, int64_t scale_stride) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t col0 = 0; col0 < cols; col0 += kBlock) {
    const int64_t col = col0 + 4 * lane;
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (col < cols) values(col, v);
    uint32_t packed[1];
    const float s = quantize_lane_group<32, 4>(v, packed);
    if (col < cols) *reinterpret_cast<uint32_t*>(out + col) = packed[0];
    if (lane == 0) scale[(col0 / kBlock) * scale_stride] = s;
  }
}

// Zero bytes and unit scales for a padding row (one warp).
__device__ __forceinline__ void zero_row_1x128(int64_t cols, uint8_t* out, float* scale,
                                               int64_t scale_stride) {
  warp::zero_16b(reinterpret_cast<int4*>(out), cols / 16);
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t kb = lane; kb < layout::ceil_div(cols, kBlock); kb += 32) scale[kb * scale_stride] = 1.0f;
}

// ---- x at its source, and the pull
// -------------------------------------------------------------------------

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    stage_x_fp8_kernel(layout::WorkspacePointers ws, const void* x, int64_t num_tokens) {
  const int64_t H = ws.hidden, h_blocks = layout::ceil_div(H, kBlock);
  const int64_t padded_tokens = layout::round_up(num_tokens, layout::kBlockM);
  uint8_t* x_q = ws.local_sym<uint8_t>(ws.sym_x_q);
  float* x_scale = ws.local_sym<float>(ws.sym_x_scale);
  for (int64_t t = warp::global_index(); t < padded_tokens; t += warp::num_global()) {
    if (t < num_tokens) {
      const char* row = static_cast<const char*>(x) + t * H * layout::kBf16Bytes;
      quantize_row_1x128([&](int64_t col, float(&v)[4]) { load_bf16x4(row + col * layout::kBf16Bytes, v); },
                         H, x_q + t * H, x_scale + t * h_blocks, 1);
    } else {
      zero_row_1x128(H, x_q + t * H, x_scale + t * h_blocks, 1);
    }
  }
}

// Schedule rows of local experts [expert_begin, expert_end): the x_q row and its scales from the source rank.
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    pull_x_fp8_kernel(layout::WorkspacePointers ws, int expert_begin, int expert_end) {
  const int64_t H = ws.hidden, h_blocks = layout::ceil_div(H, kBlock), ld = ws.ring_rows;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t first_row = ws.group_row_offset[expert_begin], end_row = ws.group_row_offset[expert_end];
  for (int64_t row = first_row + warp::global_index(); row < end_row; row += warp::num_global()) {
    const layout::ScheduleEntry entry = ws.schedule[row];
    uint8_t* dst = ws.fp8_x_rows + row * H;
    if (entry.src_rank < 0) {
      zero_row_1x128(H, dst, ws.fp8_x_scale + row, ld);
      continue;
    }
    warp::copy_16b(reinterpret_cast<int4*>(dst),
                   ws.peer<const int4>(entry.src_rank, ws.sym_x_q) + entry.src_token * (H / 16), H / 16);
    const float* src_scale =
        ws.peer<const float>(entry.src_rank, ws.sym_x_scale) + entry.src_token * h_blocks;
    for (int64_t kb = lane; kb < h_blocks; kb += 32) ws.fp8_x_scale[kb * ld + row] = src_scale[kb];
  }
}

// ---- 128 x 128 tiles of expert-grouped rows
// --------------------------------------------------------------------
//
// The backward's quantization stages read each bf16 value once and write every FP8 form of it the GEMMs
// read: the 1x128 row form (the data gradients' A operands) and the 128x1 token-axis form (the weight
// gradients' K-major operands). A CTA of 256 threads takes 128 rows (every expert's segment is padded to 128
// rows, so a tile never straddles two experts) by 128 columns (the last tile 64 wide where cols is an odd
// multiple of 64). Loads: 16 bytes per thread, the 16 lanes of a half warp holding one row's 128 columns, so
// the row form is quantized in registers; the tile goes to shared memory for the token-axis form, where each
// thread takes one column over 64 rows (two threads per column) and stores its 64 bytes contiguously.

inline constexpr int kTileThreads = 256;
inline constexpr int kTileChunks = kBlock / 8;                       // 16-byte chunks of a bf16 tile row
inline constexpr int kTileRowsPerPass = kTileThreads / kTileChunks;  // 16 rows per pass of the CTA

// Tiles of local experts [expert_begin, expert_end) over `cols` columns, row blocks outer.
struct RowBlockTiles {
  int64_t first_row = 0;
  int64_t col_blocks = 0;
  int64_t count = 0;
};

__device__ __forceinline__ RowBlockTiles row_block_tiles(const layout::WorkspacePointers& ws,
                                                         int expert_begin, int expert_end, int64_t cols) {
  RowBlockTiles tiles;
  tiles.first_row = ws.group_row_offset[expert_begin];
  tiles.col_blocks = layout::ceil_div(cols, kBlock);
  tiles.count = (ws.group_row_offset[expert_end] - tiles.first_row) / kBlock * tiles.col_blocks;
  return tiles;
}

// Where a token-axis copy reads its rows: bf16 [rows][ld] (ld in elements), or e4m3 [rows][ld] with 1x128
// scales [ld / 128 blocks][scale_ld] (the pulled x_q rows, dequantized: value = e4m3 * scale, exact).
struct TokenAxisSource {
  const void* bf16 = nullptr;
  const uint8_t* e4m3 = nullptr;
  const float* scale = nullptr;
  int64_t ld = 0;
  int64_t scale_ld = 0;
};

// Where it writes: e4m3 [cols][ld] (column c's rows contiguous) and scales [rows / 128][scale_ld]. A null
// `data` is a copy nobody wants (a frozen weight's gradient): the stages skip it.
struct TokenAxisCopy {
  uint8_t* data = nullptr;
  int64_t ld = 0;
  float* scale = nullptr;
  int64_t scale_ld = 0;
};

__device__ __forceinline__ int tile_width(int64_t cols, int64_t col0) {
  return cols - col0 < kBlock ? static_cast<int>(cols - col0) : kBlock;
}

__device__ __forceinline__ void unpack_bf16x8(const uint4& raw, float (&v)[8]) {
  const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = bf16_bits_to_float(words[i] & 0xffffu);
    v[2 * i + 1] = bf16_bits_to_float(words[i] >> 16);
  }
}

// Eight floats rounded to bf16, packed; `v` becomes the rounded values (what is quantized and stored).
__device__ __forceinline__ uint4 round_bf16x8(float (&v)[8]) {
  uint32_t words[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = bf16_bits(v[2 * i]), hi = bf16_bits(v[2 * i + 1]);
    v[2 * i] = bf16_bits_to_float(lo);
    v[2 * i + 1] = bf16_bits_to_float(hi);
    words[i] = lo | (hi << 16);
  }
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// One row's 128-column block held by a half warp, 8 values per lane (chunk = lane % 16, columns past the
// tensor's edge as 0): its e4m3 bytes to row_out[8 chunk, + 8) where `in_range`, its scale by chunk 0.
__device__ __forceinline__ void store_row_block(const float (&v)[8], int chunk, bool in_range,
                                                uint8_t* row_out, float* scale_out) {
  uint32_t packed[2];
  const float s = quantize_lane_group<kTileChunks, 8>(v, packed);
  if (in_range) *reinterpret_cast<uint2*>(row_out + 8 * chunk) = make_uint2(packed[0], packed[1]);
  if (chunk == 0) *scale_out = s;
}

// The token-axis form of a tile the CTA holds: value(r, c) for rows [0, 128) and columns [0, width); column
// c's 128 bytes to out + c * out_ld, its scale to scale[c]. Bitwise quantize_columns_128x1 of the same tile
// (the amax is a max, in any order). Every thread calls it; the caller syncs before the tile is overwritten.
template <typename Value>
__device__ __forceinline__ void store_token_axis_tile(const Value& value, int width, uint8_t* out,
                                                      int64_t out_ld, float* scale,
                                                      float (&half_amax)[2][kBlock]) {
  constexpr int kHalf = kBlock / 2;
  const int col = static_cast<int>(threadIdx.x) % kBlock, half = static_cast<int>(threadIdx.x) / kBlock;
  const int row0 = half * kHalf;
  float amax = 0.0f;
  if (col < width) {
#pragma unroll 8
    for (int r = 0; r < kHalf; ++r) amax = fold_amax(amax, value(row0 + r, col));
  }
  half_amax[half][col] = amax;
  __syncthreads();
  if (col >= width) return;
  const float s = block_scale(fold_amax(half_amax[0][col], half_amax[1][col]));
  const float inverse = inverse_scale(s);
  if (half == 0) scale[col] = s;
  uint4* dst = reinterpret_cast<uint4*>(out + col * out_ld + row0);
#pragma unroll
  for (int q = 0; q < kHalf / 16; ++q) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int r = row0 + 16 * q + 4 * w;
      words[w] = static_cast<uint32_t>(ptx::cvt_e4m3x2(__fmul_rn(value(r, col), inverse),
                                                       __fmul_rn(value(r + 1, col), inverse))) |
                 (static_cast<uint32_t>(ptx::cvt_e4m3x2(__fmul_rn(value(r + 2, col), inverse),
                                                        __fmul_rn(value(r + 3, col), inverse)))
                  << 16);
    }
    dst[q] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// The shared memory of a tile stage: a bf16 tile [128][128] (or an e4m3 one in its first half, with the
// rows' scales), and the two half-columns' amax.
struct TileShared {
  alignas(16) uint16_t bf16[kBlock][kBlock];
  float row_scale[kBlock];
  float half_amax[2][kBlock];
  __device__ uint8_t* e4m3() { return reinterpret_cast<uint8_t*>(bf16); }
};

__device__ __forceinline__ uint8_t* token_axis_out(const TokenAxisCopy& copy, int64_t row0, int64_t col0) {
  return copy.data + col0 * copy.ld + row0;
}
__device__ __forceinline__ float* token_axis_scale(const TokenAxisCopy& copy, int64_t row0, int64_t col0) {
  return copy.scale + (row0 / kBlock) * copy.scale_ld + col0;
}

// ---- the backward's stages
// ------------------------------------------------------------------------------------

// d_y_q = q1x128_H(d_y) of the rows of local experts [expert_begin, expert_end), and d_y_t = q128x1_T(d_y)
// into `dy_t` (when wanted) from the same read.
template <int kNumThreads = kTileThreads>
__global__ void __launch_bounds__(kNumThreads)
    quantize_dy_tiles_kernel(layout::WorkspacePointers ws, int expert_begin, int expert_end,
                             TokenAxisCopy dy_t) {
  static_assert(kNumThreads == kTileThreads, "the tile mapping is for 256 threads");
  __shared__ TileShared smem;
  const int64_t H = ws.hidden, ld = ws.ring_rows;
  const RowBlockTiles tiles = row_block_tiles(ws, expert_begin, expert_end, H);
  const int chunk = static_cast<int>(threadIdx.x) % kTileChunks;
  const int first_tile_row = static_cast<int>(threadIdx.x) / kTileChunks;
  const uint16_t* dy = static_cast<const uint16_t*>(ws.dy_rows);
  for (int64_t tile = blockIdx.x; tile < tiles.count; tile += gridDim.x) {
    const int64_t row0 = tiles.first_row + tile / tiles.col_blocks * kBlock;
    const int64_t col0 = tile % tiles.col_blocks * kBlock;
    const int width = tile_width(H, col0);
    const bool in_range = chunk * 8 < width;
#pragma unroll
    for (int pass = 0; pass < kBlock / kTileRowsPerPass; ++pass) {
      const int r = first_tile_row + pass * kTileRowsPerPass;
      const int64_t row = row0 + r;
      float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      if (in_range) {
        const uint4 raw = *reinterpret_cast<const uint4*>(dy + row * H + col0 + 8 * chunk);
        *reinterpret_cast<uint4*>(&smem.bf16[r][8 * chunk]) = raw;
        unpack_bf16x8(raw, v);
      }
      store_row_block(v, chunk, in_range, ws.fp8_dy_rows + row * H + col0,
                      ws.fp8_dy_scale + (col0 / kBlock) * ld + row);
    }
    if (dy_t.data != nullptr) {
      __syncthreads();
      store_token_axis_tile([&](int r, int c) { return bf16_bits_to_float(smem.bf16[r][c]); }, width,
                            token_axis_out(dy_t, row0, col0), dy_t.ld, token_axis_scale(dy_t, row0, col0),
                            smem.half_amax);
    }
    __syncthreads();
  }
}

// d_g, d_u = bf16(act'(g, u) d_a) for the rows of local experts [expert_begin, expert_end): each quantized
// in 1x128 blocks (fp8_dg_rows, fp8_du_rows) and, when wanted, in 128x1 blocks into `dgu_t` (d_g_t in its
// columns [0, I), d_u_t in [I, 2I)). The bf16 d_g, d_u never reach HBM.
template <int kNumThreads = kTileThreads>
__global__ void __launch_bounds__(kNumThreads)
    activation_backward_tiles_kernel(layout::WorkspacePointers ws, int expert_begin, int expert_end,
                                     ActivationParams activation, TokenAxisCopy dgu_t) {
  static_assert(kNumThreads == kTileThreads, "the tile mapping is for 256 threads");
  constexpr int kPasses = kBlock / kTileRowsPerPass;
  __shared__ TileShared smem;
  const int64_t I = ws.intermediate, ld = ws.ring_rows;
  const RowBlockTiles tiles = row_block_tiles(ws, expert_begin, expert_end, I);
  const int chunk = static_cast<int>(threadIdx.x) % kTileChunks;
  const int first_tile_row = static_cast<int>(threadIdx.x) / kTileChunks;
  const uint16_t* d_a = static_cast<const uint16_t*>(ws.fp8_d_a);
  const uint16_t* g = static_cast<const uint16_t*>(ws.g_rows);
  const uint16_t* u = static_cast<const uint16_t*>(ws.u_rows);
  const auto tile_value = [&](int r, int c) { return bf16_bits_to_float(smem.bf16[r][c]); };
  for (int64_t tile = blockIdx.x; tile < tiles.count; tile += gridDim.x) {
    const int64_t row0 = tiles.first_row + tile / tiles.col_blocks * kBlock;
    const int64_t col0 = tile % tiles.col_blocks * kBlock;
    const int width = tile_width(I, col0);
    const bool in_range = chunk * 8 < width;
    uint4 du_bits[kPasses];  // d_u waits in registers while d_g's token-axis form uses the tile
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
      const int r = first_tile_row + pass * kTileRowsPerPass;
      const int64_t row = row0 + r, offset = row * I + col0 + 8 * chunk;
      float d_g[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      float d_u[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      du_bits[pass] = make_uint4(0, 0, 0, 0);
      if (in_range) {
        float a8[8], g8[8], u8[8];
        unpack_bf16x8(*reinterpret_cast<const uint4*>(d_a + offset), a8);
        unpack_bf16x8(*reinterpret_cast<const uint4*>(g + offset), g8);
        unpack_bf16x8(*reinterpret_cast<const uint4*>(u + offset), u8);
#pragma unroll
        for (int i = 0; i < 8; ++i) gemm::apply_activation_backward(g8[i], u8[i], a8[i], activation, d_g[i], d_u[i]);
        *reinterpret_cast<uint4*>(&smem.bf16[r][8 * chunk]) = round_bf16x8(d_g);
        du_bits[pass] = round_bf16x8(d_u);
      }
      const int64_t scale_at = (col0 / kBlock) * ld + row;
      store_row_block(d_g, chunk, in_range, ws.fp8_dg_rows + row * I + col0, ws.fp8_dg_scale + scale_at);
      store_row_block(d_u, chunk, in_range, ws.fp8_du_rows + row * I + col0, ws.fp8_du_scale + scale_at);
    }
    if (dgu_t.data != nullptr) {
      __syncthreads();
      store_token_axis_tile(tile_value, width, token_axis_out(dgu_t, row0, col0), dgu_t.ld,
                            token_axis_scale(dgu_t, row0, col0), smem.half_amax);
      __syncthreads();
      if (in_range) {
#pragma unroll
        for (int pass = 0; pass < kPasses; ++pass)
          *reinterpret_cast<uint4*>(&smem.bf16[first_tile_row + pass * kTileRowsPerPass][8 * chunk]) =
              du_bits[pass];
      }
      __syncthreads();
      store_token_axis_tile(tile_value, width, token_axis_out(dgu_t, row0, I + col0), dgu_t.ld,
                            token_axis_scale(dgu_t, row0, I + col0), smem.half_amax);
    }
    __syncthreads();
  }
}

// ---- the token-axis copies of forward rows
// --------------------------------------------------------------------

// q128x1_T of `cols` columns of `src` over the rows of every local expert, into `dst`: the bf16 act rows, or
// the pulled x_q rows dequantized (each 128-column block one scale per row).
template <int kNumThreads = kTileThreads>
__global__ void __launch_bounds__(kNumThreads)
    token_axis_copy_kernel(layout::WorkspacePointers ws, TokenAxisSource src, TokenAxisCopy dst,
                           int64_t cols) {
  static_assert(kNumThreads == kTileThreads, "the tile mapping is for 256 threads");
  __shared__ TileShared smem;
  const RowBlockTiles tiles = row_block_tiles(ws, 0, ws.num_local_experts, cols);
  const int thread = static_cast<int>(threadIdx.x);
  const bool e4m3 = src.e4m3 != nullptr;
  for (int64_t tile = blockIdx.x; tile < tiles.count; tile += gridDim.x) {
    const int64_t row0 = tiles.first_row + tile / tiles.col_blocks * kBlock;
    const int64_t col0 = tile % tiles.col_blocks * kBlock;
    const int width = tile_width(cols, col0);
    if (e4m3) {
      // 128 rows of 128 bytes: 8 chunks a row, 32 rows per pass; and each row's scale for this block.
      constexpr int kChunks = kBlock / 16;
      const int chunk = thread % kChunks;
      if (chunk * 16 < width) {
#pragma unroll
        for (int r = thread / kChunks; r < kBlock; r += kTileThreads / kChunks)
          *reinterpret_cast<uint4*>(smem.e4m3() + r * kBlock + 16 * chunk) =
              *reinterpret_cast<const uint4*>(src.e4m3 + (row0 + r) * src.ld + col0 + 16 * chunk);
      }
      if (thread < kBlock) smem.row_scale[thread] = src.scale[(col0 / kBlock) * src.scale_ld + row0 + thread];
    } else {
      const int chunk = thread % kTileChunks;
      const uint16_t* rows = static_cast<const uint16_t*>(src.bf16);
      if (chunk * 8 < width) {
#pragma unroll
        for (int r = thread / kTileChunks; r < kBlock; r += kTileRowsPerPass)
          *reinterpret_cast<uint4*>(&smem.bf16[r][8 * chunk]) =
              *reinterpret_cast<const uint4*>(rows + (row0 + r) * src.ld + col0 + 8 * chunk);
      }
    }
    __syncthreads();
    uint8_t* out = token_axis_out(dst, row0, col0);
    float* scale = token_axis_scale(dst, row0, col0);
    if (e4m3) {
      store_token_axis_tile(
          [&](int r, int c) {
            float lo, hi;
            ptx::cvt_e4m3x2_to_f32(smem.e4m3()[r * kBlock + c], lo, hi);
            return __fmul_rn(lo, smem.row_scale[r]);
          },
          width, out, dst.ld, scale, smem.half_amax);
    } else {
      store_token_axis_tile([&](int r, int c) { return bf16_bits_to_float(smem.bf16[r][c]); }, width, out,
                            dst.ld, scale, smem.half_amax);
    }
    __syncthreads();
  }
}

}  // namespace pounce::kernels::quant
