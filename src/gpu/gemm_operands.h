// Host: the operands of one GEMM of kernels/gemm (tensor maps + arguments), for the standalone launchers
// (grouped_gemm.cu) and for the fused kernels that run the same mainloop from a task list. One builder per
// GEMM of the layer, so a fused tile is computed from exactly the maps and arguments a standalone launch
// would use (the fused == staged bitwise tests rely on it). Builders check their arguments and throw
// pounce::Error; they leave args.error_flag null for the caller to set.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/gemm/gemm_operands.cuh"
#include "src/gpu/grouped_gemm.h"

namespace pounce::kernels {

// Activation rows [rows, k] row-major bf16: tiles of BLOCK_M rows x BLOCK_K.
CUtensorMap activation_rows_map(const void* a, int64_t rows, int64_t k);

// Weights [num_groups, n, k] bf16 (nn.Linear layout per group, strides as WeightRows gives them): tiles of
// box_rows x BLOCK_K; a box past a group's last row reads zeros, never the next group.
CUtensorMap weight_rows_map(WeightRows w, int num_groups, int64_t n, int64_t k, uint32_t box_rows);

// The operands of grouped_gemm, grouped_gate_up, grouped_activation_backward, grouped_gemm_transposed and
// grouped_weight_grad (grouped_gemm.h), argument for argument.
GemmOperands store_operands(const GroupedRows& rows, const void* a, WeightRows b, void* c, int64_t n,
                            int64_t k);
GemmOperands gate_up_operands(const GroupedRows& rows, const void* a, WeightRows w_gate, WeightRows w_up,
                              void* g, void* u, void* act, int64_t n, int64_t k,
                              const ActivationParams& activation);
GemmOperands activation_backward_operands(const GroupedRows& rows, const void* a, WeightRows w, const void* g,
                                          const void* u, void* d_g, void* d_u, int64_t d_ld, int64_t n,
                                          int64_t k, const ActivationParams& activation);
GemmOperands transposed_operands(const GroupedRows& rows, const void* a, WeightRows b0, WeightRows b1,
                                 int64_t k_split, void* c, int64_t n, int64_t k);
GemmOperands weight_grad_operands(const GroupedRows& rows, const void* a, int64_t a_ld, int64_t m,
                                  const void* b, int64_t b_ld, int64_t n, void* d, WeightGradMode mode);

}  // namespace pounce::kernels
