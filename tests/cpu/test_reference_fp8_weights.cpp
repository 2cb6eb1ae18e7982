// pounce::quantize_weights_fp8 on CPU tensors: every expert's 128x128 blocks equal quantize_fp8_blocks of the
// expert (bitwise), the backward orientation is the same bytes and scales transposed, partial blocks at the
// N and K edges, an all-zero block gets scale 1; bad arguments fail naming the argument and the fix.
// (The GPU path is checked bitwise against this one in tests/gpu/test_fp8_quantize.cu.)
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce {
namespace {

constexpr int64_t kExperts = 2, kI = 192, kH = 320;  // 1.5 x 2.5 blocks

struct Buffers {
  std::vector<uint16_t> gate, up, down;    // bf16 [El, I, H] x2, [El, H, I]
  std::vector<std::vector<uint8_t>> data;  // [6] gate, up, down, gate_t, up_t, down_t
  std::vector<std::vector<float>> scale;   // [6]
  std::vector<std::vector<int64_t>> data_shapes, scale_shapes;

  explicit Buffers(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 0.05f);
    for (std::vector<uint16_t>* w : {&gate, &up, &down}) {
      w->resize(kExperts * kI * kH);
      for (uint16_t& bits : *w) bits = reference::float_to_bf16_bits(normal(rng));
    }
    for (int64_t r = 128; r < kI; ++r)  // gate[1]: an all-zero edge block (rows 128.., columns 256..)
      for (int64_t c = 256; c < kH; ++c) gate[(kI + r) * kH + c] = 0;
    const int64_t bi = 2, bh = 3;
    data_shapes = {{kExperts, kI, kH}, {kExperts, kI, kH}, {kExperts, kH, kI},
                   {kExperts, kH, kI}, {kExperts, kH, kI}, {kExperts, kI, kH}};
    scale_shapes = {{kExperts, bi, bh}, {kExperts, bi, bh}, {kExperts, bh, bi},
                    {kExperts, bh, bi}, {kExperts, bh, bi}, {kExperts, bi, bh}};
    for (int i = 0; i < 6; ++i) {
      data.emplace_back(kExperts * kI * kH, 0xFF);
      scale.emplace_back(scale_shapes[i][0] * scale_shapes[i][1] * scale_shapes[i][2], -1.0f);
    }
  }

  ExpertWeights routed() {
    return {TensorView(gate.data(), DType::kBF16, {kExperts, kI, kH}),
            TensorView(up.data(), DType::kBF16, {kExperts, kI, kH}),
            TensorView(down.data(), DType::kBF16, {kExperts, kH, kI})};
  }
  Fp8Tensor tensor(int i) {
    return {TensorView(data[i].data(), DType::kUInt8, data_shapes[i]),
            TensorView(scale[i].data(), DType::kFP32, scale_shapes[i])};
  }
  Fp8Weights out() { return {tensor(0), tensor(1), tensor(2), tensor(3), tensor(4), tensor(5)}; }
};

std::string error_of(const ExpertWeights& routed, const Fp8Weights& out) {
  try {
    quantize_weights_fp8(routed, out);
  } catch (const Error& error) {
    return error.what();
  }
  ADD_FAILURE() << "quantize_weights_fp8 accepted bad arguments";
  return {};
}

TEST(ReferenceFp8Weights, CpuQuantizerIsTheBlockQuantizerInBothOrientations) {
  Buffers b(5);
  quantize_weights_fp8(b.routed(), b.out());
  const std::vector<uint16_t>* weights[] = {&b.gate, &b.up, &b.down};
  for (int t = 0; t < 3; ++t) {
    const int64_t n = b.data_shapes[t][1], k = b.data_shapes[t][2], bn = b.scale_shapes[t][1],
                  bk = b.scale_shapes[t][2];
    for (int64_t e = 0; e < kExperts; ++e) {
      std::vector<float> in(n * k), scale(bn * bk);
      std::vector<uint8_t> q(n * k);
      for (int64_t i = 0; i < n * k; ++i) in[i] = reference::bf16_bits_to_float((*weights[t])[e * n * k + i]);
      reference::quantize_fp8_blocks(in.data(), n, k, 128, 128, q.data(), scale.data());
      for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < k; ++c) {
          ASSERT_EQ(b.data[t][e * n * k + r * k + c], q[r * k + c])
              << "tensor " << t << " [" << e << ", " << r << ", " << c << "]";
          ASSERT_EQ(b.data[t + 3][e * n * k + c * n + r], q[r * k + c]) << "transposed tensor " << t;
        }
      }
      for (int64_t i = 0; i < bn; ++i) {
        for (int64_t j = 0; j < bk; ++j) {
          ASSERT_EQ(b.scale[t][e * bn * bk + i * bk + j], scale[i * bk + j]) << "scale of tensor " << t;
          ASSERT_EQ(b.scale[t + 3][e * bn * bk + j * bn + i], scale[i * bk + j]) << "transposed scale " << t;
        }
      }
    }
  }
  EXPECT_EQ(b.scale[0][1 * 2 * 3 + 1 * 3 + 2], 1.0f) << "the all-zero block of gate[1]";
}

TEST(ReferenceFp8Weights, BadArgumentsNameTheArgumentAndTheFix) {
  Buffers b(6);
  Fp8Weights out = b.out();
  out.up_t.scale.shape = {kExperts, 3, 3};
  std::string message = error_of(b.routed(), out);
  EXPECT_NE(message.find("'out.up_t.scale'"), std::string::npos) << message;

  out = b.out();
  out.down.data.dtype = DType::kFP32;
  message = error_of(b.routed(), out);
  EXPECT_NE(message.find("'out.down.data'"), std::string::npos) << message;

  ExpertWeights routed = b.routed();
  routed.up.dtype = DType::kFP32;
  message = error_of(routed, b.out());
  EXPECT_NE(message.find("'routed.up'"), std::string::npos) << message;

  out = b.out();  // one output on another device than the weights
  out.gate_t.data.device = DeviceKind::kCuda;
  message = error_of(b.routed(), out);
  EXPECT_NE(message.find("'out.gate_t.data' is on cuda:0 but 'routed.gate' is on cpu"), std::string::npos)
      << message;
  EXPECT_NE(message.find("put every weight and output on cpu"), std::string::npos) << message;

  routed = b.routed();  // a strided view (rows kH + 64 apart) would be misread as dense
  routed.gate.strides = {kI * (kH + 64), kH + 64, 1};
  message = error_of(routed, b.out());
  EXPECT_NE(message.find("'routed.gate' is a strided view"), std::string::npos) << message;

  out = b.out();
  out.down_t.data.strides = {kI * kH, kH, 1};
  message = error_of(b.routed(), out);
  EXPECT_NE(message.find("'out.down_t' is a strided view"), std::string::npos) << message;

  b.up[1 * kI * kH + 7 * kH + 9] = 0x7f80;  // +inf
  message = error_of(b.routed(), b.out());
  EXPECT_NE(message.find("'routed.up'[1, 7, 9] is not finite"), std::string::npos) << message;
}

}  // namespace
}  // namespace pounce
