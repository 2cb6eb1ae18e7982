// The gated activations of docs/design.md §1 and their derivatives, in fp32 (kBf16) or fp64 (kFp64).
//
//   SwiGLU:  a = silu(g') * u'                       silu(v) = v * sigmoid(v)
//   GPT-OSS: a = (u' + 1) * g' * sigmoid(alpha * g')
// with g' = min(g, L), u' = clamp(u, -L, L) when clamp_limit L is set, g' = g, u' = u otherwise.
// The clamps pass no gradient where they are active (g > L, |u| > L); at the limit itself they pass it, as
// torch.clamp's backward does (where(min <= x <= max, grad, 0)), so transformers' GPT-OSS experts
// (gate.clamp(max=L), up.clamp(-L, L)) get the same gradients.
#include <algorithm>
#include <cmath>

#include "reference/detail.h"

namespace pounce::reference {
namespace detail {
namespace {

template <typename T>
T sigmoid(T v) {
  return T(1) / (T(1) + std::exp(-v));
}

// The slope of the sigmoid gate: alpha = 1 for SwiGLU.
template <typename T>
T gate_alpha(const Activation& act) {
  return act.kind == ActivationKind::kGptOss ? static_cast<T>(act.alpha) : T(1);
}

}  // namespace

template <typename T>
T activation_t(const Activation& act, T g, T u) {
  if (act.clamp_limit) {
    const T limit = static_cast<T>(*act.clamp_limit);
    g = std::min(g, limit);
    u = std::clamp(u, -limit, limit);
  }
  const T alpha = gate_alpha<T>(act);
  const T gated = g * sigmoid(alpha * g);  // g' * sigmoid(alpha g')
  return act.kind == ActivationKind::kGptOss ? (u + T(1)) * gated : gated * u;
}

template <typename T>
void activation_backward_t(const Activation& act, T g, T u, T d_a, T* d_g, T* d_u) {
  bool g_passes = true, u_passes = true;
  if (act.clamp_limit) {
    const T limit = static_cast<T>(*act.clamp_limit);
    g_passes = !(g > limit);
    u_passes = !(std::abs(u) > limit);
    g = std::min(g, limit);
    u = std::clamp(u, -limit, limit);
  }
  const T alpha = gate_alpha<T>(act);
  const T s = sigmoid(alpha * g);
  const T gated = g * s;                             // d a / d u' in both forms
  const T d_gated = s + alpha * g * s * (T(1) - s);  // d (g sigmoid(alpha g)) / d g
  const T u_factor = act.kind == ActivationKind::kGptOss ? u + T(1) : u;
  *d_g = g_passes ? d_a * u_factor * d_gated : T(0);
  *d_u = u_passes ? d_a * gated : T(0);
}

template float activation_t<float>(const Activation&, float, float);
template double activation_t<double>(const Activation&, double, double);
template void activation_backward_t<float>(const Activation&, float, float, float, float*, float*);
template void activation_backward_t<double>(const Activation&, double, double, double, double*, double*);

}  // namespace detail

double activation(const Activation& act, double g, double u) {
  return detail::activation_t<double>(act, g, u);
}

void activation_backward(const Activation& act, double g, double u, double d_a, double* d_g, double* d_u) {
  detail::activation_backward_t<double>(act, g, u, d_a, d_g, d_u);
}

}  // namespace pounce::reference
