// Grouped (per-expert) bf16 GEMMs on expert-grouped rows: the host entry points of kernels/gemm.
//
//   grouped_gemm:    C[rows, n] = A[rows, k] . B[group(row)][n, k]^T
//   grouped_gate_up: g = bf16(A . Wg^T), u = bf16(A . Wu^T), act = bf16(act_fp32(g, u))
// bf16 in, fp32 accumulate, bf16 out; weights in nn.Linear layout [num_groups, n, k] row-major.
// Both run one persistent warp-specialised kernel (TMA producer warpgroup + two wgmma consumer
// warpgroups). Calls are stream-ordered, allocate nothing, never synchronise and are CUDA-graph capturable:
// the valid row count is read on the device from group_row_offset.
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <limits>

namespace pounce::kernels {

// Expert-grouped activation rows, device memory.
struct GroupedRows {
  int64_t max_rows = 0;  // capacity in rows (multiple of 128); tensor maps are built over it
  // Device [num_groups + 1]: [0] = 0, non-decreasing multiples of 128. Read only on the device.
  const int32_t* group_row_offset = nullptr;
  int num_groups = 0;
};

struct ActivationParams {
  int kind = 0;  // 0 SwiGLU silu(g) * u, 1 GPT-OSS (u + 1) * g * sigmoid(alpha * g)
  // g = min(g, L), u = clamp(u, -L, L); +inf means no clamp.
  float clamp_limit = std::numeric_limits<float>::infinity();
  float alpha = 1.702f;  // GPT-OSS only
};
inline constexpr int kActivationSwiGLU = 0;
inline constexpr int kActivationGptOss = 1;

// C[rows, n] = A[rows, k] . B[group(row)][n, k]^T. Rows at or beyond group_row_offset[num_groups] are not
// touched. n and k multiples of 64; a, b, c 16-byte aligned. Throws pounce::Error on invalid arguments.
void grouped_gemm(const GroupedRows& rows, const void* a, const void* b, void* c, int64_t n, int64_t k,
                  cudaStream_t stream);

// Gate/up with fused activation; gate and up tiles of the same output columns are computed in one CTA.
// Writes g and u (saved for backward) and act, each [rows, n] bf16.
void grouped_gate_up(const GroupedRows& rows, const void* a, const void* w_gate, const void* w_up, void* g,
                     void* u, void* act, int64_t n, int64_t k, const ActivationParams& activation,
                     cudaStream_t stream);

// Diagnostics: the first bounded-wait timeout any grouped GEMM kernel recorded on the current device
// (0 = none; 1 = consumer waited too long for a filled stage, 2 = producer waited too long for a free
// stage, 3 = group_row_offset[num_groups] exceeded max_rows: the excess rows were skipped). Synchronises the
// device; for tests and error reporting, not for the hot path.
int32_t grouped_gemm_error_code(bool reset);

}  // namespace pounce::kernels
