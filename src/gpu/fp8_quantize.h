// The GPU side of pounce::quantize_weights_fp8 (src/fp8.cpp validates, then calls this for CUDA tensors).
#pragma once

#include "pounce/fp8.h"

namespace pounce::gpu {

// Every block of routed.gate/up/down and every local expert in one launch of
// kernels/quant/quantize_weights.cuh on `stream`; the views passed src/fp8.cpp's checks (one CUDA device).
void quantize_weights_fp8(const ExpertWeights& routed, const Fp8Weights& out, void* stream);

}  // namespace pounce::gpu
