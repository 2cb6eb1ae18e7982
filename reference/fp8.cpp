// FP8 E4M3 (fn) conversions and block quantization with power-of-two (UE8M0) scales (docs/design.md §1).
//
// E4M3 fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7f / 0xff are NaN, so the
// largest finite value is 0x7e = 1.75 * 2^8 = 448. Normals reach down to 2^-6, subnormals step by 2^-9.
// float -> e4m3 rounds to nearest even and saturates to ±448 (as cvt.rn.satfinite does).
#include <algorithm>
#include <cmath>

#include "pounce/error.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce::reference {
namespace {

constexpr float kE4m3Max = 448.0f;
constexpr int kMinNormalExponent = -6;  // 2^-6, the smallest normal
constexpr int kMantissaBits = 3;
// UE8M0 scales cover 2^-127 .. 2^127.
constexpr int kMinScaleExponent = -127;
constexpr int kMaxScaleExponent = 127;

}  // namespace

uint8_t float_to_e4m3(float value) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return sign | 0x7f;
  const float magnitude = std::fabs(value);
  if (magnitude >= kE4m3Max) return sign | 0x7e;  // saturate (nothing above 448 rounds below it)
  if (magnitude == 0.0f) return sign;

  // Quantize to the step of magnitude's binade (the subnormal step below 2^-6); the division by a power
  // of two is exact, so nearbyint sees the true value and rounds ties to even.
  int exponent;  // magnitude = fraction * 2^exponent, fraction in [0.5, 1)
  std::frexp(magnitude, &exponent);
  const int binade = std::max(exponent - 1, kMinNormalExponent);
  const int step_exponent = binade - kMantissaBits;
  const float steps = std::nearbyint(std::ldexp(magnitude, -step_exponent));
  const float rounded = std::ldexp(steps, step_exponent);  // may carry into the next binade
  if (rounded == 0.0f) return sign;

  std::frexp(rounded, &exponent);
  if (exponent - 1 < kMinNormalExponent) {  // subnormal: mantissa counts steps of 2^-9
    return sign | static_cast<uint8_t>(std::ldexp(rounded, -(kMinNormalExponent - kMantissaBits)));
  }
  const int biased = exponent - 1 + 7;
  const int mantissa = static_cast<int>(std::ldexp(rounded, -(exponent - 1 - kMantissaBits))) - 8;
  return sign | static_cast<uint8_t>(biased << kMantissaBits) | static_cast<uint8_t>(mantissa);
}

float e4m3_to_float(uint8_t bits) {
  const bool negative = bits & 0x80;
  if ((bits & 0x7f) == 0x7f) return negative ? -std::nanf("") : std::nanf("");
  const int biased = (bits >> kMantissaBits) & 0xf;
  const int mantissa = bits & 0x7;
  const float magnitude = biased == 0
                              ? std::ldexp(static_cast<float>(mantissa), kMinNormalExponent - kMantissaBits)
                              : std::ldexp(static_cast<float>(8 + mantissa), biased - 7 - kMantissaBits);
  return negative ? -magnitude : magnitude;
}

namespace {

// Smallest power of two s with amax / s <= 448, i.e. 2^ceil(log2(amax / 448)), clamped to UE8M0's range;
// 1 for an all-zero block. Computed by comparing against 448 * 2^e, which is exact, not through log2.
float block_scale(float amax) {
  if (amax == 0.0f) return 1.0f;
  int exponent;
  std::frexp(amax / kE4m3Max, &exponent);  // first guess, off by at most one
  while (exponent > kMinScaleExponent && amax <= std::ldexp(kE4m3Max, exponent - 1)) --exponent;
  while (exponent < kMaxScaleExponent && amax > std::ldexp(kE4m3Max, exponent)) ++exponent;
  exponent = std::clamp(exponent, kMinScaleExponent, kMaxScaleExponent);
  return std::ldexp(1.0f, exponent);
}

void check_blocks(int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols) {
  POUNCE_CHECK(rows >= 0 && cols >= 0, "fp8 blocks: rows = ", rows, ", cols = ", cols,
               " must not be negative");
  POUNCE_CHECK(block_rows > 0 && block_cols > 0, "fp8 blocks: block_rows = ", block_rows,
               ", block_cols = ", block_cols, " must be positive (1x128 activations, 128x128 weights)");
}

}  // namespace

void quantize_fp8_blocks(const float* in, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                         uint8_t* q, float* scale) {
  check_blocks(rows, cols, block_rows, block_cols);
  const int64_t num_block_cols = (cols + block_cols - 1) / block_cols;
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min(r0 + block_rows, rows);
    for (int64_t c0 = 0; c0 < cols; c0 += block_cols) {
      const int64_t c1 = std::min(c0 + block_cols, cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float v = in[r * cols + c];
          POUNCE_CHECK(std::isfinite(v), "fp8 quantize: in[", r, ", ", c, "] = ", v,
                       " is not finite: a block scale cannot represent it");
          amax = std::max(amax, std::fabs(v));
        }
      }
      const float s = block_scale(amax);
      scale[(r0 / block_rows) * num_block_cols + c0 / block_cols] = s;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = float_to_e4m3(in[r * cols + c] / s);
      }
    }
  }
}

double Fp8Blocks::value(int64_t r, int64_t c) const {
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  return static_cast<double>(e4m3_to_float(q[r * cols + c])) *
         static_cast<double>(scale[(r / block_rows) * scale_cols + c / block_cols]);
}

void dequantize_fp8_blocks(const uint8_t* q, const float* scale, int64_t rows, int64_t cols,
                           int64_t block_rows, int64_t block_cols, float* out) {
  check_blocks(rows, cols, block_rows, block_cols);
  const int64_t num_block_cols = (cols + block_cols - 1) / block_cols;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] =
          e4m3_to_float(q[r * cols + c]) * scale[(r / block_rows) * num_block_cols + c / block_cols];
    }
  }
}

}  // namespace pounce::reference
