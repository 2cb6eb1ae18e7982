// FP8 E4M3 (fn) conversions and power-of-two block quantization.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "pounce/error.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce::reference {
namespace {

TEST(ReferenceFp8, KnownValues) {
  EXPECT_EQ(float_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-448.0f), 0xfe);
  EXPECT_EQ(float_to_e4m3(0.5f), 0x30);  // exponent -1 + bias 7 = 6
  EXPECT_EQ(float_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(float_to_e4m3(1.125f), 0x39);
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -6)), 0x08);  // smallest normal
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -9)), 0x01);  // smallest subnormal
  EXPECT_EQ(float_to_e4m3(std::ldexp(7.0f, -9)), 0x07);  // largest subnormal
  EXPECT_EQ(float_to_e4m3(0.0f), 0x00);
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x30), 0.5f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(e4m3_to_float(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_float(0xff)));
  EXPECT_EQ(float_to_e4m3(std::nanf("")) & 0x7f, 0x7f);
}

TEST(ReferenceFp8, RoundsToNearestEven) {
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(17.0f)), 16.0f);  // tie between 16 (even) and 18
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(19.0f)), 20.0f);  // tie between 18 and 20 (even)
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(17.5f)), 18.0f);
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(1.0625f)), 1.0f);                // tie, 1.0 even
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(std::ldexp(1.0f, -10))), 0.0f);  // tie between 0 and 2^-9
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(std::ldexp(3.0f, -11))), std::ldexp(1.0f, -9));
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(std::ldexp(15.0f, -10))), std::ldexp(1.0f, -6));  // carries to normal
  EXPECT_EQ(e4m3_to_float(float_to_e4m3(15.5f)), 16.0f);  // carries into the next binade
}

TEST(ReferenceFp8, Saturates) {
  EXPECT_EQ(float_to_e4m3(449.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7e);
  EXPECT_EQ(float_to_e4m3(1.0e6f), 0x7e);
  EXPECT_EQ(float_to_e4m3(-1.0e6f), 0xfe);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(float_to_e4m3(447.0f), 0x7e);  // rounds up to 448
  EXPECT_EQ(float_to_e4m3(415.0f), 0x7d);  // 416 = 1.625 * 2^8
}

// Every finite code decodes and re-encodes to itself, and the decoded values are increasing.
TEST(ReferenceFp8, AllCodesRoundTrip) {
  float previous = -1.0f;
  for (int bits = 0; bits < 0x7f; ++bits) {
    const float value = e4m3_to_float(static_cast<uint8_t>(bits));
    EXPECT_GT(value, previous) << bits;
    previous = value;
    EXPECT_EQ(float_to_e4m3(value), bits);
    EXPECT_EQ(float_to_e4m3(-value), bits | 0x80);
  }
}

TEST(ReferenceFp8, BlockQuantizationRoundTrip) {
  std::mt19937 rng(7);
  const int64_t rows = 200, cols = 300, block_rows = 128, block_cols = 128;  // partial edge blocks
  std::vector<float> in(rows * cols);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t r = 0; r < rows; ++r) {
    // Magnitudes from 1e-6 to 1e4 across rows, so scales span many powers of two.
    const float row_scale = std::pow(10.0f, -6.0f + 10.0f * static_cast<float>(r) / rows);
    for (int64_t c = 0; c < cols; ++c) in[r * cols + c] = round_bf16(normal(rng) * row_scale);
  }
  for (int64_t c = 0; c < 128; ++c) in[c] = 0.0f;  // first block row starts with zeros
  for (int64_t r = 128; r < rows; ++r) {
    for (int64_t c = 256; c < cols; ++c) in[r * cols + c] = 0.0f;  // an all-zero edge block
  }
  const int64_t block_grid_rows = 2, block_grid_cols = 3;
  std::vector<uint8_t> q(rows * cols);
  std::vector<float> scale(block_grid_rows * block_grid_cols), out(rows * cols);
  quantize_fp8_blocks(in.data(), rows, cols, block_rows, block_cols, q.data(), scale.data());
  dequantize_fp8_blocks(q.data(), scale.data(), rows, cols, block_rows, block_cols, out.data());

  EXPECT_EQ(scale[1 * block_grid_cols + 2], 1.0f);  // the all-zero block
  for (int64_t br = 0; br < block_grid_rows; ++br) {
    for (int64_t bc = 0; bc < block_grid_cols; ++bc) {
      const float s = scale[br * block_grid_cols + bc];
      int exponent;
      EXPECT_EQ(std::frexp(s, &exponent), 0.5f) << "scale is not a power of two: " << s;
      float amax = 0.0f;
      for (int64_t r = br * block_rows; r < std::min(rows, (br + 1) * block_rows); ++r) {
        for (int64_t c = bc * block_cols; c < std::min(cols, (bc + 1) * block_cols); ++c) {
          amax = std::max(amax, std::fabs(in[r * cols + c]));
        }
      }
      if (amax == 0.0f) continue;
      EXPECT_LE(amax / s, 448.0f);  // fits
      EXPECT_GT(amax / s, 224.0f);  // and the smallest such power of two
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = scale[(r / block_rows) * block_grid_cols + c / block_cols];
      const float x = in[r * cols + c];
      // Half a step: 2^-4 relative for normals, 2^-10 * scale absolute in the subnormal range.
      const float bound = std::max(std::fabs(x) * 0.0625f, std::ldexp(s, -10));
      ASSERT_LE(std::fabs(out[r * cols + c] - x), bound)
          << "[" << r << ", " << c << "] x = " << x << " s = " << s;
    }
  }
}

TEST(ReferenceFp8, ExactPowersOfTwoScale) {
  // amax exactly 448 * 2^3 must give scale 2^3 (not 2^4); one ulp above must give 2^4.
  std::vector<float> in = {448.0f * 8.0f, 1.0f};
  std::vector<uint8_t> q(2);
  float scale = 0;
  quantize_fp8_blocks(in.data(), 1, 2, 1, 128, q.data(), &scale);
  EXPECT_EQ(scale, 8.0f);
  EXPECT_EQ(q[0], 0x7e);
  in[0] = std::nextafter(448.0f * 8.0f, 1.0e9f);
  quantize_fp8_blocks(in.data(), 1, 2, 1, 128, q.data(), &scale);
  EXPECT_EQ(scale, 16.0f);
}

TEST(ReferenceFp8, RejectsBadBlocks) {
  float in = 1.0f, scale = 0.0f;
  uint8_t q = 0;
  EXPECT_THROW(quantize_fp8_blocks(&in, 1, 1, 0, 128, &q, &scale), Error);
  in = std::numeric_limits<float>::infinity();
  EXPECT_THROW(quantize_fp8_blocks(&in, 1, 1, 1, 128, &q, &scale), Error);
}

}  // namespace
}  // namespace pounce::reference
