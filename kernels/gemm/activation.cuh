// Gated activations of the expert MLP and their derivatives, in fp32 from the bf16-rounded gate g and up u
// (reference: reference/activation.cpp activation_t<float>, activation_backward_t<float>). One definition for
// the staged GEMM epilogue and the fused kernel, so both round identically.
#pragma once

#include <cmath>

#include "kernels/gemm/gemm_types.h"

// Host and device: the CPU tests evaluate these very functions against the reference.
#if defined(__CUDACC__)
#define POUNCE_HOST_DEVICE __host__ __device__
#else
#define POUNCE_HOST_DEVICE
#endif

namespace pounce::kernels::gemm {

// 1 / (1 + exp(-x)). On the GPU with the hardware's approximate exp2 and division (__expf: 2 + 1.2 |x| ulp in
// fp32; __fdividef: 2 ulp, and 0 once 1 + exp(-x) passes 2^126, i.e. x < -87.3, where the exact value is a
// denormal below 1e-38): far below bf16 resolution, and shared by the staged and fused kernels, which stay
// bitwise equal. The epilogues evaluate it with the tensor cores idle, and the exact forms cost about twice
// the instructions. The host keeps the exact forms.
POUNCE_HOST_DEVICE inline float sigmoid(float x) {
#ifdef __CUDA_ARCH__
  // __expf(-x) is ex2.approx((-x) log2(e)) with two extra steps that keep a denormal result (input below
  // -126); 1 + such a result is 1 either way, so the flushing form gives the same sigmoid in three fewer
  // instructions.
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"((-x) * 1.4426950408889634f));
  return __fdividef(1.0f, 1.0f + e);
#else
  return 1.0f / (1.0f + expf(-x));
#endif
}

// SwiGLU: silu(g') * u'. GPT-OSS: (u' + 1) * g' * sigmoid(alpha * g'). g' = min(g, L), u' = clamp(u, -L, L).
POUNCE_HOST_DEVICE inline float apply_activation(float g, float u, const ActivationParams& p) {
  g = fminf(g, p.clamp_limit);
  u = fmaxf(fminf(u, p.clamp_limit), -p.clamp_limit);
  const float alpha = p.kind == kActivationGptOss ? p.alpha : 1.0f;
  const float gated = g * sigmoid(alpha * g);  // same association as reference/activation.cpp
  return p.kind == kActivationGptOss ? (u + 1.0f) * gated : gated * u;
}

// d_g = d_a * u'' * d(g' sigmoid(alpha g'))/dg, d_u = d_a * g' sigmoid(alpha g'), where u'' = u' (SwiGLU) or
// u' + 1 (GPT-OSS). An active clamp passes no gradient (g > L, |u| > L); at the limit itself it passes it, as
// torch.clamp's backward does (where(min <= x <= max, grad, 0): the subgradient 1 at the boundaries).
POUNCE_HOST_DEVICE inline void apply_activation_backward(float g, float u, float d_a,
                                                         const ActivationParams& p, float& d_g, float& d_u) {
  const bool g_passes = !(g > p.clamp_limit), u_passes = !(fabsf(u) > p.clamp_limit);
  g = fminf(g, p.clamp_limit);
  u = fmaxf(fminf(u, p.clamp_limit), -p.clamp_limit);
  const float alpha = p.kind == kActivationGptOss ? p.alpha : 1.0f;
  const float s = sigmoid(alpha * g);
  const float gated = g * s;
  const float d_gated = s + alpha * g * s * (1.0f - s);
  const float u_factor = p.kind == kActivationGptOss ? u + 1.0f : u;
  d_g = g_passes ? d_a * u_factor * d_gated : 0.0f;
  d_u = u_passes ? d_a * gated : 0.0f;
}

}  // namespace pounce::kernels::gemm
