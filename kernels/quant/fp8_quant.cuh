// Block quantization to FP8 E4M3 (fn) with power-of-two scales on the device (docs/design.md §1 "FP8 mode"):
//   scale = 2^ceil(log2(amax / 448)) (1 for an all-zero block), q = e4m3(v / scale), round to nearest even,
// bitwise as the CPU quantizer (reference/fp8.cpp quantize_fp8_blocks: scale exponents clamped to UE8M0's
// 2^-127..2^127, found by exact comparison with 448 * 2^e, never through log2).
//
// Pieces for the epilogues and copy warps that quantize activations where they are written:
//   quantize_lane_group  a group of kLanes consecutive lanes holding one 128-value block in registers, any
//                        order: a 1x128 row chunk (a copy warp's row; the 4 lanes of a wgmma accumulator
//                        quad, 32 values each, hold 128 columns of one row) or a column chunk of 128 token
//                        rows;
//   quantize_columns_128x1  threads of a CTA walking the columns of a 128-row tile (an epilogue's staging
//                        tile in shared memory, or any loader): the token-axis copies ("q128x1_T"), each
//                        column's 128 bytes stored contiguously (the K-major operand of the weight
//                        gradients).
// A block with a non-finite value gets a NaN scale (the outputs are poisoned, docs/design.md §5); the CPU
// quantizer rejects such input instead.
#pragma once

#include <cstdint>

#include "kernels/common/ptx.cuh"

namespace pounce::kernels::quant {

inline constexpr int kBlock = 128;  // 1x128 activations, 128x1 token-axis copies, 128x128 weights
inline constexpr float kE4m3Max = 448.0f;

// ---- scales --------------------------------------------------------------------------------------------

// The smallest power of two s = 2^e with amax <= 448 * s, e in [-127, 127]; 1 for amax = 0, NaN for a
// non-finite amax. With amax = m * 2^E (m in [1, 2)) and 448 = 1.75 * 2^8: e = E - 8 when m <= 1.75, else
// E - 7. A subnormal amax (below 2^-126) needs e <= -134: clamped to -127.
__device__ __forceinline__ float block_scale(float amax) {
  const uint32_t bits = __float_as_uint(amax);
  const int biased = static_cast<int>(bits >> 23);  // amax >= 0: no sign bit
  if (amax == 0.0f) return 1.0f;
  if (biased == 0xff) return __uint_as_float(0x7fc00000u);  // inf or NaN
  int e = biased == 0 ? -127 : biased - 127 - 8 + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0);
  e = max(e, -127);
  return e >= -126 ? __uint_as_float(static_cast<uint32_t>(e + 127) << 23) : __uint_as_float(1u << 22);
}

// 1 / scale, exactly (a power of two in 2^-127..2^127, a subnormal at 2^-127): v * inverse_scale(s) is the
// correctly rounded v / s, as the CPU's division.
__device__ __forceinline__ float inverse_scale(float scale) {
  const int e = static_cast<int>(__float_as_uint(scale) >> 23) - 127;  // scale normal or 2^-127 (e = -127)
  if (e == -127) return 0x1p127f;
  if (e == 128) return scale;  // NaN stays NaN
  const int inverse = -e;
  return inverse >= -126 ? __uint_as_float(static_cast<uint32_t>(inverse + 127) << 23)
                         : __uint_as_float(1u << 22);
}

// |v| folded into a running amax; a NaN makes the amax NaN (fmaxf would drop it).
__device__ __forceinline__ float fold_amax(float amax, float v) {
  const float magnitude = fabsf(v);
  return magnitude > amax || magnitude != magnitude ? magnitude : amax;
}

// ---- a lane group holding one block --------------------------------------------------------------------

// The amax over kLanes consecutive lanes (aligned groups of the warp); every lane of the warp calls it.
template <int kLanes>
__device__ __forceinline__ float lane_group_amax(float amax) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0,
                "a lane group is 1, 2, 4, 8, 16 or 32 consecutive lanes");
#pragma unroll
  for (int offset = kLanes / 2; offset >= 1; offset /= 2)
    amax = fold_amax(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  return amax;
}

// One block of kLanes * kValues = 128 values (values past a tensor's edge passed as 0) quantized by the
// kLanes consecutive lanes that hold it, kValues each: every lane gets the block's scale back and its own
// values' e4m3 bytes in `packed` (value i in byte i % 4 of word i / 4). Every lane of the warp calls it.
template <int kLanes, int kValues>
__device__ __forceinline__ float quantize_lane_group(const float (&values)[kValues],
                                                     uint32_t (&packed)[kValues / 4]) {
  static_assert(kLanes * kValues == kBlock, "the lane group holds exactly one 128-value block");
  static_assert(kValues % 4 == 0,
                "values pack four to a word; fix: at least 4 values per lane, a multiple of 4");
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kValues; ++i) amax = fold_amax(amax, values[i]);
  const float scale = block_scale(lane_group_amax<kLanes>(amax));
  const float inverse = inverse_scale(scale);
#pragma unroll
  for (int i = 0; i < kValues; i += 4) {
    const uint32_t lo = ptx::cvt_e4m3x2(__fmul_rn(values[i], inverse), __fmul_rn(values[i + 1], inverse));
    const uint32_t hi = ptx::cvt_e4m3x2(__fmul_rn(values[i + 2], inverse), __fmul_rn(values[i + 3], inverse));
    packed[i / 4] = lo | (hi << 16);
  }
  return scale;
}

// ---- the token axis: columns of a 128-row tile ---------------------------------------------------------

// Quantizes columns [0, num_cols) of a tile of 128 rows in 128x1 blocks: load(row, col) gives the value of
// rows [0, num_rows) (num_rows <= 128; rows past it are padding, quantized as exact zeros). Thread
// `thread_idx` of kThreads takes columns thread_idx, thread_idx + kThreads, ...: it stores column c's 128
// bytes at out + c * out_col_stride (16-byte aligned: eight 16-byte stores, row r at byte r) and its scale
// at scale[c * scale_col_stride]. Two passes over the column (amax, then convert), so `load` must give the
// same value twice (shared memory, or a global tensor nobody writes meanwhile).
template <int kThreads, typename Load>
__device__ __forceinline__ void quantize_columns_128x1(const Load& load, int num_rows, int num_cols,
                                                       int thread_idx, uint8_t* out, int64_t out_col_stride,
                                                       float* scale, int64_t scale_col_stride) {
  for (int col = thread_idx; col < num_cols; col += kThreads) {
    float amax = 0.0f;
    for (int row = 0; row < num_rows; ++row) amax = fold_amax(amax, load(row, col));
    const float s = block_scale(amax);
    const float inverse = inverse_scale(s);
    scale[col * scale_col_stride] = s;
    uint4* dst = reinterpret_cast<uint4*>(out + col * out_col_stride);
#pragma unroll 1
    for (int row0 = 0; row0 < kBlock; row0 += 16) {
      uint32_t words[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = row0 + 4 * w + i;
          v[i] = row < num_rows ? __fmul_rn(load(row, col), inverse) : 0.0f;
        }
        words[w] = static_cast<uint32_t>(ptx::cvt_e4m3x2(v[0], v[1])) |
                   (static_cast<uint32_t>(ptx::cvt_e4m3x2(v[2], v[3])) << 16);
      }
      dst[row0 / 16] = make_uint4(words[0], words[1], words[2], words[3]);
    }
  }
}

}  // namespace pounce::kernels::quant
