// Block-scaled FP8 grouped GEMMs on expert-grouped rows: the host entry points of
// kernels/gemm/fp8_gemm_kernel.cuh (docs/design.md "FP8 GEMMs").
//
//   fp8_grouped_gemm         C[rows, n] = A[rows, k] . B[group(row)][n, k]^T            (y, d_a)
//   fp8_grouped_gemm_pair    C[rows, n] = A0 . B0[group]^T + A1 . B1[group]^T             (d_x: gate + up)
//   fp8_grouped_weight_grad  D[group][m, n] = sum over the group's rows r of A_t[m, r] B_t[n, r]
// E4M3 data with power-of-two fp32 scales: activations in 1x128 blocks along K (per row and K block),
// weights in 128x128 blocks, the weight gradients' token-axis copies in 128-row blocks along the rows. Each
// 128-deep K block's partial sum is promoted into fp32 as partial * scale_a * scale_b, K blocks ascending.
// Calls are stream-ordered, allocate nothing, never synchronise and are CUDA-graph capturable. A bounded wait
// that times out is recorded where the bf16 GEMMs record theirs: grouped_gemm_error_code reads it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/gemm/gemm_types.h"

namespace pounce::kernels {

// Expert-grouped rows in FP8, K-major: data e4m3 [max_rows, k] (row stride k bytes, a multiple of 16), scale
// fp32 [ceil(k / 128)][scale_ld] (scale_ld >= max_rows, a multiple of 4): the scale of row r's K block kb at
// scale[kb * scale_ld + r].
struct Fp8Rows {
  const void* data = nullptr;
  const float* scale = nullptr;
  int64_t scale_ld = 0;
};

// Per-group matrices in FP8, K-major: data e4m3 [num_groups][n, k], scale fp32 [num_groups][ceil(n / 128)]
// [ceil(k / 128)] (the layout pounce::quantize_weights_fp8 writes).
struct Fp8Matrices {
  const void* data = nullptr;
  const float* scale = nullptr;
};

// Token-axis copies for the weight gradients: data e4m3 [cols, ld] (column c's rows contiguous, ld >=
// max_rows, a multiple of 16), scale fp32 [max_rows / 128][scale_ld] (scale_ld >= cols, a multiple of 4): the
// scale of column c's 128-row block rb at scale[rb * scale_ld + c].
struct Fp8Columns {
  const void* data = nullptr;
  int64_t ld = 0;
  const float* scale = nullptr;
  int64_t scale_ld = 0;
};

// An FP8 activation written by an epilogue: data e4m3 [max_rows, n] (row stride n), scale fp32
// [ceil(n / 128)][scale_ld] (scale_ld >= max_rows, a multiple of 4), the Fp8Rows layout the next GEMM reads.
struct Fp8Activation {
  void* data = nullptr;
  float* scale = nullptr;
  int64_t scale_ld = 0;
};

// n a multiple of 64, k a multiple of 16; rows beyond group_row_offset[num_groups] are not touched.
void fp8_grouped_gemm(const GroupedRows& rows, const Fp8Rows& a, const Fp8Matrices& b, void* c, int64_t n,
                      int64_t k, cudaStream_t stream);

// K ranges [0, k0) from (a0, b0) and [0, k1) from (a1, b1), summed into one fp32 tile, K blocks of the first
// pair first: d_x = d_g . Wg_t^T + d_u . Wu_t^T with both pairs quantized separately.
void fp8_grouped_gemm_pair(const GroupedRows& rows, const Fp8Rows& a0, const Fp8Matrices& b0, int64_t k0,
                           const Fp8Rows& a1, const Fp8Matrices& b1, int64_t k1, void* c, int64_t n,
                           cudaStream_t stream);

// Gate/up with the activation and a's quantization fused: g = bf16(x . Wg^T), u = bf16(x . Wu^T) and, when
// `a` is not null, a = bf16(act(g, u)), each [rows, n] bf16 (row stride n); a_q = q1x128(a) (the down
// projection's A). n a multiple of 64, k a multiple of 16.
void fp8_grouped_gate_up(const GroupedRows& rows, const Fp8Rows& x, const Fp8Matrices& w_gate,
                         const Fp8Matrices& w_up, void* g, void* u, void* a, const Fp8Activation& a_q,
                         int64_t n, int64_t k, const ActivationParams& activation, cudaStream_t stream);

// Per group g: D[g][m, n] over its rows [offset[g], offset[g + 1]) (multiples of 128), fp32 accumulation,
// K blocks ascending; written as fp32, added into fp32 or rounded to bf16 (as grouped_weight_grad). A group
// without rows gets zeros (nothing added). m, n multiples of 64.
void fp8_grouped_weight_grad(const GroupedRows& rows, const Fp8Columns& a_t, int64_t m, const Fp8Columns& b_t,
                             int64_t n, void* d, WeightGradMode mode, cudaStream_t stream);

}  // namespace pounce::kernels
