// Host: tensor maps of the K-major GEMM operands, for kernels that run the GEMM mainloop outside the
// standalone launchers (the fused forward kernel). Same maps, field for field, as grouped_gemm.cu builds.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace pounce::kernels {

// Activation rows [rows, k] row-major bf16: tiles of BLOCK_M rows x BLOCK_K.
CUtensorMap activation_rows_map(const void* a, int64_t rows, int64_t k);

// Weights [num_groups, n, k] bf16 (nn.Linear layout per group): tiles of box_rows x BLOCK_K; a box past a
// group's last row reads zeros, never the next group.
CUtensorMap weight_rows_map(const void* w, int num_groups, int64_t n, int64_t k, uint32_t box_rows);

}  // namespace pounce::kernels
