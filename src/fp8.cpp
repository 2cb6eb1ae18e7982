// Weight quantization for the FP8 path: 128x128 blocks, power-of-two scales, both orientations.
#include "pounce/fp8.h"

#include <vector>

#include "pounce/error.h"
#include "reference/bf16.h"
#include "reference/reference.h"

namespace pounce {
namespace {

void check_fp8_tensor(const char* name, const Fp8Tensor& tensor, const std::vector<int64_t>& shape) {
  const int64_t blocks_n = (shape[1] + kFp8Block - 1) / kFp8Block,
                blocks_k = (shape[2] + kFp8Block - 1) / kFp8Block;
  POUNCE_CHECK(tensor.data.dtype == DType::kFP8E4M3 || tensor.data.dtype == DType::kUInt8, "argument '", name,
               ".data' is ", tensor.data.describe(), "; it must be fp8e4m3 (or uint8 holding e4m3 bits)");
  POUNCE_CHECK(tensor.data.shape == shape, "argument '", name, ".data' is ", tensor.data.describe(),
               "; expected [", shape[0], ", ", shape[1], ", ", shape[2], "]");
  const std::vector<int64_t> scale_shape = {shape[0], blocks_n, blocks_k};
  POUNCE_CHECK(tensor.scale.dtype == DType::kFP32 && tensor.scale.shape == scale_shape, "argument '", name,
               ".scale' is ", tensor.scale.describe(), "; expected fp32[", shape[0], ", ", blocks_n, ", ",
               blocks_k, "]");
}

// Quantizes [El, N, K] into `out` and its transpose into `out_t` ([El, K, N]); square blocks mean the
// transposed scales are the transposed scale grid and the e4m3 bytes are the same bytes, transposed.
void quantize(const char* name, const TensorView& weights, const Fp8Tensor& out, const Fp8Tensor& out_t) {
  POUNCE_CHECK(weights.dtype == DType::kBF16 && weights.rank() == 3, "argument 'routed.", name, "' is ",
               weights.describe(), "; it must be a bf16 [El, N, K] tensor");
  const int64_t experts = weights.shape[0], n = weights.shape[1], k = weights.shape[2];
  check_fp8_tensor(name, out, {experts, n, k});
  check_fp8_tensor((std::string(name) + "_t").c_str(), out_t, {experts, k, n});
  POUNCE_CHECK(weights.device == DeviceKind::kCpu,
               "quantize_weights_fp8 on GPU tensors arrives with the FP8 ",
               "kernels; pass CPU tensors for now");
  const int64_t blocks_n = out.scale.shape[1], blocks_k = out.scale.shape[2];
  std::vector<float> expert_weights(n * k);
  for (int64_t e = 0; e < experts; ++e) {
    const uint16_t* bits = weights.as<uint16_t>() + e * n * k;
    for (int64_t i = 0; i < n * k; ++i) expert_weights[i] = reference::bf16_bits_to_float(bits[i]);
    uint8_t* q = out.data.as<uint8_t>() + e * n * k;
    float* scale = out.scale.as<float>() + e * blocks_n * blocks_k;
    reference::quantize_fp8_blocks(expert_weights.data(), n, k, kFp8Block, kFp8Block, q, scale);
    uint8_t* q_t = out_t.data.as<uint8_t>() + e * n * k;
    float* scale_t = out_t.scale.as<float>() + e * blocks_n * blocks_k;
    for (int64_t row = 0; row < n; ++row)
      for (int64_t col = 0; col < k; ++col) q_t[col * n + row] = q[row * k + col];
    for (int64_t bn = 0; bn < blocks_n; ++bn)
      for (int64_t bk = 0; bk < blocks_k; ++bk) scale_t[bk * blocks_n + bn] = scale[bn * blocks_k + bk];
  }
}

}  // namespace

void quantize_weights_fp8(const ExpertWeights& routed, const Fp8Weights& out, void* /*stream*/) {
  quantize("gate", routed.gate, out.gate, out.gate_t);
  quantize("up", routed.up, out.up, out.up_t);
  quantize("down", routed.down, out.down, out.down_t);
}

}  // namespace pounce
