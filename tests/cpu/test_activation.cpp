// The clamped activations' gradients at and around the clamp limit, on every implementation: the reference
// (fp64 and fp32) and the GPU epilogues' function (kernels/gemm/activation.cuh, its host path). The clamp
// follows torch.clamp's backward, where(min <= x <= max, grad, 0): at exactly the limit the gradient passes,
// one step beyond it is zero. transformers' GPT-OSS experts clamp g from above only (gate.clamp(max=L)) and u
// on both sides (up.clamp(-L, L)).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kernels/gemm/activation.cuh"
#include "reference/bf16.h"
#include "reference/detail.h"
#include "reference/reference.h"

namespace pounce {
namespace {

// d(v sigmoid(alpha v)) / dv and v sigmoid(alpha v) in double.
double gated(double v, double alpha) {
  return v / (1.0 + std::exp(-alpha * v));
}
double d_gated(double v, double alpha) {
  const double s = 1.0 / (1.0 + std::exp(-alpha * v));
  return s + alpha * v * s * (1.0 - s);
}

// torch's chain rule for the layer's activation with `limit`: clamp masks where(g <= L) and where(-L <= u <=
// L).
void torch_style_backward(const Activation& act, double g, double u, double d_a, double& d_g, double& d_u) {
  const double limit = *act.clamp_limit;
  const double alpha = act.kind == ActivationKind::kGptOss ? act.alpha : 1.0;
  const double g_clamped = std::min(g, limit), u_clamped = std::clamp(u, -limit, limit);
  const double u_factor = act.kind == ActivationKind::kGptOss ? u_clamped + 1.0 : u_clamped;
  d_g = g <= limit ? d_a * u_factor * d_gated(g_clamped, alpha) : 0.0;
  d_u = (u >= -limit && u <= limit) ? d_a * gated(g_clamped, alpha) : 0.0;
}

kernels::ActivationParams params_of(const Activation& act) {
  kernels::ActivationParams p;
  p.kind = act.kind == ActivationKind::kGptOss ? kernels::kActivationGptOss : kernels::kActivationSwiGLU;
  p.clamp_limit = act.clamp_limit ? *act.clamp_limit : std::numeric_limits<float>::infinity();
  p.alpha = act.alpha;
  return p;
}

struct Point {
  float g, u;
  const char* what;
};

// The bf16 value `steps` bf16 steps away from the positive `value` (the layer's g and u are bf16).
float bf16_steps(float value, int steps) {
  return reference::bf16_bits_to_float(static_cast<uint16_t>(reference::float_to_bf16_bits(value) + steps));
}

// g and u at, one bf16 step beyond, and well beyond the limit on each side, each paired with an unclamped
// partner so the other gradient is non-zero.
std::vector<Point> points_around(float limit) {
  const float above = bf16_steps(limit, 1), below = bf16_steps(limit, -1);
  return {{limit, 0.25f, "g at the limit"},
          {above, 0.25f, "g one bf16 step above the limit"},
          {below, 0.25f, "g one bf16 step below the limit"},
          {limit + 1.0f, 0.25f, "g beyond the limit"},
          {-limit - 1.0f, 0.25f, "g below -limit (no lower clamp on g)"},
          {0.3f, limit, "u at the limit"},
          {0.3f, -limit, "u at -limit"},
          {0.3f, above, "u one bf16 step above the limit"},
          {0.3f, -above, "u one bf16 step below -limit"},
          {0.3f, below, "u one bf16 step inside the limit"},
          {0.3f, limit + 2.0f, "u beyond the limit"},
          {0.3f, -limit - 2.0f, "u beyond -limit"},
          {limit, -limit, "both at the limit"},
          {limit + 1.0f, limit + 1.0f, "both beyond the limit"}};
}

class ClampGradient : public ::testing::TestWithParam<std::tuple<ActivationKind, float>> {};

TEST_P(ClampGradient, FollowsTorchClampAtAndBeyondTheLimit) {
  const auto [kind, limit] = GetParam();
  Activation act = kind == ActivationKind::kGptOss ? Activation::gpt_oss() : Activation::swiglu();
  act.clamp_limit = limit;
  const kernels::ActivationParams params = params_of(act);
  const float d_a = 0.75f;
  for (const Point& point : points_around(limit)) {
    SCOPED_TRACE(std::string(point.what) + ": g = " + std::to_string(point.g) +
                 ", u = " + std::to_string(point.u) + ", limit " + std::to_string(limit));
    double want_g = 0, want_u = 0;
    torch_style_backward(act, point.g, point.u, d_a, want_g, want_u);

    double ref_g = 0, ref_u = 0;  // the reference's fp64 numerics
    reference::activation_backward(act, point.g, point.u, d_a, &ref_g, &ref_u);
    EXPECT_NEAR(ref_g, want_g, 1e-12 * (1 + std::abs(want_g)));
    EXPECT_NEAR(ref_u, want_u, 1e-12 * (1 + std::abs(want_u)));
    EXPECT_EQ(ref_g == 0.0, want_g == 0.0) << "the reference's d_g mask differs from torch.clamp's";
    EXPECT_EQ(ref_u == 0.0, want_u == 0.0) << "the reference's d_u mask differs from torch.clamp's";

    float bf16_g = 0, bf16_u = 0;  // the reference's kBf16 numerics (fp32 arithmetic)
    reference::detail::activation_backward_t<float>(act, point.g, point.u, d_a, &bf16_g, &bf16_u);
    float gpu_g = 0, gpu_u = 0;  // the GPU epilogues' function
    kernels::gemm::apply_activation_backward(point.g, point.u, d_a, params, gpu_g, gpu_u);
    EXPECT_EQ(bf16_g, gpu_g) << "reference fp32 and the GPU epilogue's d_g differ";
    EXPECT_EQ(bf16_u, gpu_u) << "reference fp32 and the GPU epilogue's d_u differ";
    EXPECT_NEAR(bf16_g, want_g, 1e-5 * (1 + std::abs(want_g)));
    EXPECT_NEAR(bf16_u, want_u, 1e-5 * (1 + std::abs(want_u)));
    EXPECT_EQ(bf16_g == 0.0f, want_g == 0.0);
    EXPECT_EQ(bf16_u == 0.0f, want_u == 0.0);

    EXPECT_EQ(reference::detail::activation_t<float>(act, point.g, point.u),
              kernels::gemm::apply_activation(point.g, point.u, params))
        << "reference fp32 and the GPU epilogue's forward differ";
  }
}

// The limits `pounce run --clamp` is checked with, and gpt-oss-120b's 7; all bf16-representable, so a bf16 g
// lands on them exactly.
INSTANTIATE_TEST_SUITE_P(Limits, ClampGradient,
                         ::testing::Combine(::testing::Values(ActivationKind::kSwiGLU,
                                                              ActivationKind::kGptOss),
                                            ::testing::Values(0.5f, 1.0f, 2.0f, 7.0f)));

// Where the masks are not the question: without a clamp every implementation passes the gradient everywhere.
TEST(ClampGradient, NoClampPassesEverywhere) {
  Activation act = Activation::gpt_oss();
  act.clamp_limit.reset();
  const kernels::ActivationParams params = params_of(act);
  for (float v : {-100.0f, -7.0f, 0.0f, 7.0f, 100.0f}) {
    float gpu_g = 0, gpu_u = 0, ref_g = 0, ref_u = 0;
    kernels::gemm::apply_activation_backward(1.0f, v, 1.0f, params, gpu_g, gpu_u);
    reference::detail::activation_backward_t<float>(act, 1.0f, v, 1.0f, &ref_g, &ref_u);
    EXPECT_EQ(gpu_g, ref_g);
    EXPECT_EQ(gpu_u, ref_u);
    EXPECT_NE(ref_u, 0.0f);
  }
}

}  // namespace
}  // namespace pounce
