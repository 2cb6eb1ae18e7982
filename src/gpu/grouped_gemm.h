// Grouped (per-expert) bf16 GEMMs on expert-grouped rows: the host entry points of kernels/gemm.
//
//   forward
//     grouped_gemm:    C[rows, n] = A[rows, k] . B[group(row)][n, k]^T
//     grouped_gate_up: g = bf16(A . Wg^T), u = bf16(A . Wu^T), act = bf16(act_fp32(g, u))
//   backward (weights read transposed, no copy)
//     grouped_activation_backward: d_a = bf16(A . W[group(row)]), d_g, d_u = bf16(act'(g, u) d_a)
//     grouped_gemm_transposed:     C[rows, n] = A[rows, k] . [B0; B1][group(row)]
//     grouped_weight_grad:         D[group][m, n] = sum over the group's rows r of A[r, :m]^T B[r, :n]
// bf16 in, fp32 accumulate; weights in nn.Linear layout [num_groups, out, in] row-major.
// Both run one persistent warp-specialised kernel (TMA producer warpgroup + two wgmma consumer
// warpgroups). Calls are stream-ordered, allocate nothing, never synchronise and are CUDA-graph capturable:
// the valid row count is read on the device from group_row_offset.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/gemm/gemm_types.h"

namespace pounce::kernels {

// A weight operand in device memory: num_groups matrices of rows x cols bf16 (rows, cols as the GEMM names
// them), row r of group g at data + g * group_stride + r * row_stride elements, each row contiguous. A zero
// stride is the dense one (rows * cols, cols); a pointer alone is a dense operand. Strided: views of a larger
// tensor read in place, e.g. the halves of transformers' fused gate_up [E, 2I, H] (group stride 2I * H) or
// its interleaved rows (row stride 2H). Strides must be multiples of 8 elements (16 bytes, for TMA).
struct WeightRows {
  const void* data = nullptr;
  int64_t group_stride = 0;
  int64_t row_stride = 0;
  WeightRows() = default;
  WeightRows(const void* data, int64_t group_stride = 0, int64_t row_stride = 0)  // implicit: a dense pointer
      : data(data), group_stride(group_stride), row_stride(row_stride) {}
};

// C[rows, n] = A[rows, k] . B[group(row)][n, k]^T. Rows at or beyond group_row_offset[num_groups] are not
// touched. n and k multiples of 64; a, b, c 16-byte aligned. Throws pounce::Error on invalid arguments.
void grouped_gemm(const GroupedRows& rows, const void* a, WeightRows b, void* c, int64_t n, int64_t k,
                  cudaStream_t stream);

// Gate/up with fused activation; gate and up tiles of the same output columns are computed in one CTA.
// Writes g and u (saved for backward) and act, each [rows, n] bf16.
void grouped_gate_up(const GroupedRows& rows, const void* a, WeightRows w_gate, WeightRows w_up, void* g,
                     void* u, void* act, int64_t n, int64_t k, const ActivationParams& activation,
                     cudaStream_t stream);

// d_a = bf16(A[rows, k] . W[group(row)]) with W = [num_groups, k, n] (w_down [El, H, I] for the
// down-projection backward), then d_g = bf16(act'_g(g, u) d_a), d_u = bf16(act'_u(g, u) d_a) with g, u the
// forward's [rows, n] bf16 values. d_g and d_u rows are d_ld elements apart (d_ld >= n, multiple of 8).
// `schedule`: TileSchedule's tiles (the same values bit for bit); activation_backward_schedule_for picks one.
// Ping-pong hides the epilogue (the forward's g and u loaded, the derivative evaluated) behind the other
// warpgroup's mainloop, at a third more bytes per FLOP. Measured on H200 (both launches interleaved,
// docs/experiments/019-activation-backward-pingpong.md), ping-pong against cooperative:
// gpt-oss-120b (GPT-OSS activation, k = 2880) +10 % balanced, +5 % routed; SwiGLU presets -4 %
// (qwen3-30b-a3b, k = 2048) and -6..-11 % (deepseek-v3, k = 7168). So the GPT-OSS activation's costlier
// derivative decides.
inline TileSchedule activation_backward_schedule_for(const ActivationParams& activation) {
  return activation.kind == kActivationGptOss ? TileSchedule::kPingPong : TileSchedule::kCooperative;
}
void grouped_activation_backward(const GroupedRows& rows, const void* a, WeightRows w, const void* g,
                                 const void* u, void* d_g, void* d_u, int64_t d_ld, int64_t n, int64_t k,
                                 const ActivationParams& activation, cudaStream_t stream,
                                 TileSchedule schedule);

// C[rows, n] = A[rows, k] . B[group(row)] where B's K rows [0, k_split) come from b0 [num_groups, k_split, n]
// and [k_split, k) from b1 [num_groups, k - k_split, n] (d_x = [d_g, d_u] . [w_gate; w_up]); b1 may be null
// when k_split == k. k_split a multiple of 64.
void grouped_gemm_transposed(const GroupedRows& rows, const void* a, WeightRows b0, WeightRows b1,
                             int64_t k_split, void* c, int64_t n, int64_t k, cudaStream_t stream);

// Per group g: D[g][m, n] = sum over rows r in [offset[g], offset[g+1]) of A[r, 0:m]^T B[r, 0:n], fp32
// accumulation in ascending row order (deterministic), written as fp32, added into fp32, or rounded to
// bf16. A rows are a_ld elements apart, B rows b_ld. A group without rows gets zeros (or nothing added).
// m and n multiples of 64; rows.group_row_offset multiples of 128.
// `schedule`: how the two consumer warpgroups share the work (TileSchedule); the sums are the same bit for
// bit. Measured on H200 (docs/experiments/015-weight-grad-pingpong.md): with 512 rows per group (8 K
// blocks per tile) ping-pong is 1-9 % faster on every shape; with 1024 it ranges from 3 % faster (qwen3) to
// 27 % slower (deepseek's down projection), the stores no longer being the larger cost.
// The schedule for groups of about `rows_per_group` rows each: ping-pong up to 768, between the measured 512
// (faster on every shape) and 1024 (slower on most, by more than it gains on the others). A proxy: the
// crossover depends on the shape too.
inline TileSchedule weight_grad_schedule_for(int64_t rows_per_group) {
  return rows_per_group <= 768 ? TileSchedule::kPingPong : TileSchedule::kCooperative;
}
void grouped_weight_grad(const GroupedRows& rows, const void* a, int64_t a_ld, int64_t m, const void* b,
                         int64_t b_ld, int64_t n, void* d, WeightGradMode mode, cudaStream_t stream,
                         TileSchedule schedule = TileSchedule::kCooperative);

// Diagnostics: the first bounded-wait timeout any grouped GEMM kernel (bf16 or FP8, src/gpu/fp8_gemm.h)
// recorded on the current device
// (0 = none; 1 = consumer waited too long for a filled stage, 2 = producer waited too long for a free
// stage, 3 = group_row_offset[num_groups] exceeded max_rows: the excess rows were skipped). Synchronises the
// device; for tests and error reporting, not for the hot path.
int32_t grouped_gemm_error_code(bool reset);

}  // namespace pounce::kernels
