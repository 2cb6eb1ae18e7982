// Gated activations of the expert MLP, in fp32 from the bf16-rounded gate g and up u (reference:
// reference/activation.cpp activation_t<float>). One definition for the staged GEMM epilogue and the fused
// kernel, so both round identically.
#pragma once

#include "kernels/gemm/grouped_gemm.h"

namespace pounce::kernels::gemm {

// SwiGLU: silu(g') * u'. GPT-OSS: (u' + 1) * g' * sigmoid(alpha * g'). g' = min(g, L), u' = clamp(u, -L, L).
__host__ __device__ inline float apply_activation(float g, float u, const ActivationParams& p) {
  g = fminf(g, p.clamp_limit);
  u = fmaxf(fminf(u, p.clamp_limit), -p.clamp_limit);
  const float alpha = p.kind == kActivationGptOss ? p.alpha : 1.0f;
  const float gated =
      g * (1.0f / (1.0f + expf(-(alpha * g))));  // same association as reference/activation.cpp
  return p.kind == kActivationGptOss ? (u + 1.0f) * gated : gated * u;
}

}  // namespace pounce::kernels::gemm
