// The FP8 layer's quantization stages on expert-grouped rows (docs/design.md §1 "FP8 mode"), standalone
// kernels of the staged path built from the pieces of fp8_quant.cuh:
//
//   stage_x_fp8     x_q = q1x128_H(x) into the symmetric buffer (FP8 on the wire): sym_x_q[t] and its block
//                   scales sym_x_scale[t][H / 128] for t < T, zeros (scale 1) up to round_up(T, 128)
//   pull_x_fp8      x_q rows of the receive schedule from their sources: fp8_x_rows[row], and the row's
//   scales
//                   into the K-block-major fp8_x_scale[kb][ring_rows]; padding rows zero (scale 1)
//   quantize_rows   d_y_q = q1x128_H(d_y) of the pulled bf16 rows
//   activation_backward_fp8   d_g, d_u = bf16(act'(g, u) d_a) into d_gu_rows (bf16, for the token-axis copy)
//                   and q1x128_I of each into fp8_dg_rows / fp8_du_rows
//   token_axis_copy 128x1 blocks along the rows ("q128x1_T") of a bf16 row tensor, or of the dequantized x_q
//                   rows: each column's 128 rows contiguous, the weight gradients' K-major operands
//
// Row stages run one warp per row, each lane holding 4 of a 128-column block (columns a multiple of 64, so
// a lane's 4 values are all inside the row or all past it). Rows of local experts [expert_begin, expert_end)
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

// ---- backward rows
// -----------------------------------------------------------------------------------------

// d_y_q = q1x128_H(d_y) over the rows of local experts [expert_begin, expert_end).
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    quantize_dy_rows_kernel(layout::WorkspacePointers ws, int expert_begin, int expert_end) {
  const int64_t H = ws.hidden, ld = ws.ring_rows;
  const int64_t first_row = ws.group_row_offset[expert_begin], end_row = ws.group_row_offset[expert_end];
  for (int64_t row = first_row + warp::global_index(); row < end_row; row += warp::num_global()) {
    const char* src = static_cast<const char*>(ws.dy_rows) + row * H * layout::kBf16Bytes;
    quantize_row_1x128([&](int64_t col, float(&v)[4]) { load_bf16x4(src + col * layout::kBf16Bytes, v); }, H,
                       ws.fp8_dy_rows + row * H, ws.fp8_dy_scale + row, ld);
  }
}

// d_g, d_u = bf16(act'(g, u) d_a) for the rows of local experts [expert_begin, expert_end): bf16 into
// d_gu_rows [rows][2I] (d_g in columns [0, I), d_u in [I, 2I)), and each quantized in 1x128 blocks.
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    activation_backward_fp8_kernel(layout::WorkspacePointers ws, int expert_begin, int expert_end,
                                   ActivationParams activation) {
  const int64_t I = ws.intermediate, ld = ws.ring_rows;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t first_row = ws.group_row_offset[expert_begin], end_row = ws.group_row_offset[expert_end];
  for (int64_t row = first_row + warp::global_index(); row < end_row; row += warp::num_global()) {
    const char* d_a = static_cast<const char*>(ws.fp8_d_a) + row * I * layout::kBf16Bytes;
    const char* g = static_cast<const char*>(ws.g_rows) + row * I * layout::kBf16Bytes;
    const char* u = static_cast<const char*>(ws.u_rows) + row * I * layout::kBf16Bytes;
    char* d_gu = static_cast<char*>(ws.d_gu_rows) + row * 2 * I * layout::kBf16Bytes;
    for (int64_t col0 = 0; col0 < I; col0 += kBlock) {
      const int64_t col = col0 + 4 * lane;
      float d_g[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d_u[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (col < I) {
        float a4[4], g4[4], u4[4];
        load_bf16x4(d_a + col * layout::kBf16Bytes, a4);
        load_bf16x4(g + col * layout::kBf16Bytes, g4);
        load_bf16x4(u + col * layout::kBf16Bytes, u4);
        uint32_t g_bits[4], u_bits[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          gemm::apply_activation_backward(g4[i], u4[i], a4[i], activation, d_g[i], d_u[i]);
          g_bits[i] = bf16_bits(d_g[i]);
          u_bits[i] = bf16_bits(d_u[i]);
          d_g[i] = bf16_bits_to_float(g_bits[i]);  // the rounding point: what is quantized and stored
          d_u[i] = bf16_bits_to_float(u_bits[i]);
        }
        *reinterpret_cast<uint2*>(d_gu + col * layout::kBf16Bytes) =
            make_uint2(g_bits[0] | (g_bits[1] << 16), g_bits[2] | (g_bits[3] << 16));
        *reinterpret_cast<uint2*>(d_gu + (I + col) * layout::kBf16Bytes) =
            make_uint2(u_bits[0] | (u_bits[1] << 16), u_bits[2] | (u_bits[3] << 16));
      }
      uint32_t packed_g[1], packed_u[1];
      const float s_g = quantize_lane_group<32, 4>(d_g, packed_g);
      const float s_u = quantize_lane_group<32, 4>(d_u, packed_u);
      if (col < I) {
        *reinterpret_cast<uint32_t*>(ws.fp8_dg_rows + row * I + col) = packed_g[0];
        *reinterpret_cast<uint32_t*>(ws.fp8_du_rows + row * I + col) = packed_u[0];
      }
      if (lane == 0) {
        ws.fp8_dg_scale[(col0 / kBlock) * ld + row] = s_g;
        ws.fp8_du_scale[(col0 / kBlock) * ld + row] = s_u;
      }
    }
  }
}

// ---- the token-axis copies
// ---------------------------------------------------------------------------------

// Where a token-axis copy reads its rows: bf16 [rows][ld] (ld in elements), or e4m3 [rows][ld] with 1x128
// scales [ld / 128 blocks][scale_ld] (the pulled x_q rows, dequantized: value = e4m3 * scale, exact).
struct TokenAxisSource {
  const void* bf16 = nullptr;
  const uint8_t* e4m3 = nullptr;
  const float* scale = nullptr;
  int64_t ld = 0;
  int64_t scale_ld = 0;
};

// Where it writes: e4m3 [cols][ld] (column c's rows contiguous) and scales [rows / 128][scale_ld].
struct TokenAxisCopy {
  uint8_t* data = nullptr;
  int64_t ld = 0;
  float* scale = nullptr;
  int64_t scale_ld = 0;
};

inline constexpr int kTokenAxisThreads = 256;
inline constexpr int kTokenAxisCols = 64;  // columns per CTA: a [128][64] fp32 tile (32 KB)

// CTA (m_block, column chunk) quantizes rows [128 m_block, + 128) x columns [64 chunk, + 64) of `src` in
// 128x1 blocks; m-blocks past the rows of every local expert are left alone. grid = (ring_rows / 128, cols /
// 64).
template <int kNumThreads = kTokenAxisThreads>
__global__ void __launch_bounds__(kNumThreads)
    token_axis_copy_kernel(layout::WorkspacePointers ws, TokenAxisSource src, TokenAxisCopy dst) {
  static_assert(kNumThreads >= kTokenAxisCols, "one thread per column of the tile in the quantize pass");
  __shared__ float tile[kBlock][kTokenAxisCols];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kBlock;
  if (row0 >= ws.group_row_offset[ws.num_local_experts]) return;
  const int64_t col0 = static_cast<int64_t>(blockIdx.y) * kTokenAxisCols;
  for (int i = threadIdx.x; i < kBlock * kTokenAxisCols; i += kNumThreads) {
    const int r = i / kTokenAxisCols, c = i % kTokenAxisCols;
    const int64_t row = row0 + r, col = col0 + c;
    float v;
    if (src.e4m3 != nullptr) {
      float lo, hi;
      ptx::cvt_e4m3x2_to_f32(src.e4m3[row * src.ld + col], lo, hi);
      v = __fmul_rn(lo, src.scale[(col / kBlock) * src.scale_ld + row]);
    } else {
      v = bf16_bits_to_float(static_cast<const uint16_t*>(src.bf16)[row * src.ld + col]);
    }
    tile[r][c] = v;
  }
  __syncthreads();
  if (threadIdx.x < kTokenAxisCols) {
    quantize_columns_128x1<kTokenAxisCols>([&](int r, int c) { return tile[r][c]; }, kBlock, kTokenAxisCols,
                                           static_cast<int>(threadIdx.x), dst.data + col0 * dst.ld + row0,
                                           dst.ld, dst.scale + blockIdx.x * dst.scale_ld + col0, 1);
  }
}

}  // namespace pounce::kernels::quant
