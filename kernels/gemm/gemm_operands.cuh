// The operands of one grouped GEMM as a kernel receives them: its tensor maps and arguments. The standalone
// launchers and the fused kernels' task lists take the same struct from the same builders
// (src/gpu/gemm_operands.h), so a fused tile is computed from exactly what a standalone launch would use.
#pragma once

#include <cuda.h>

#include "kernels/gemm/grouped_gemm_kernel.cuh"

namespace pounce::kernels {

struct GemmOperands {
  CUtensorMap a;
  CUtensorMap b0;
  CUtensorMap b1;  // gate/up: w_up; data grad: B's second K range; otherwise a copy of b0
  gemm::GroupedGemmArgs args;
};

}  // namespace pounce::kernels
