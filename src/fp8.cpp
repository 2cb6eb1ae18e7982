// Weight quantization for the FP8 path: 128x128 blocks, power-of-two scales, both orientations. Checks every
// view, then quantizes where the tensors live: on the CPU through the reference's quantizer, on a CUDA device
// through src/gpu/fp8_quantize.cu (bitwise the same bytes and scales).
#include "pounce/fp8.h"

#include <string>
#include <vector>

#include "pounce/error.h"
#include "reference/bf16.h"
#include "reference/reference.h"
#if POUNCE_HAS_CUDA
#include "src/gpu/fp8_quantize.h"
#endif

namespace pounce {
namespace {

// One routed weight tensor and its two quantized orientations, with the names the messages use.
struct Job {
  std::string name;  // "gate", "up", "down"
  const TensorView& weights;
  const Fp8Tensor& out;
  const Fp8Tensor& out_t;
};

std::string where(const TensorView& view) {
  return view.device == DeviceKind::kCpu ? std::string("cpu") : "cuda:" + std::to_string(view.device_id);
}

void check_fp8_tensor(const std::string& name, const Fp8Tensor& tensor, const std::vector<int64_t>& shape) {
  const int64_t blocks_n = (shape[1] + kFp8Block - 1) / kFp8Block,
                blocks_k = (shape[2] + kFp8Block - 1) / kFp8Block;
  POUNCE_CHECK(tensor.data.dtype == DType::kFP8E4M3 || tensor.data.dtype == DType::kUInt8, "argument '", name,
               ".data' is ", tensor.data.describe(), "; it must be fp8e4m3 (or uint8 holding e4m3 bits)");
  POUNCE_CHECK(tensor.data.shape == shape, "argument '", name, ".data' is ", tensor.data.describe(),
               "; expected [", shape[0], ", ", shape[1], ", ", shape[2], "]");
  POUNCE_CHECK(tensor.data.is_dense() && tensor.scale.is_dense(), "argument '", name, "' is a strided view (",
               tensor.data.describe(), ", scale ", tensor.scale.describe(),
               "); the quantizer writes dense tensors: pass contiguous ones");
  const std::vector<int64_t> scale_shape = {shape[0], blocks_n, blocks_k};
  POUNCE_CHECK(tensor.scale.dtype == DType::kFP32 && tensor.scale.shape == scale_shape, "argument '", name,
               ".scale' is ", tensor.scale.describe(), "; expected fp32[", shape[0], ", ", blocks_n, ", ",
               blocks_k, "]");
}

void check_job(const Job& job) {
  const TensorView& w = job.weights;
  POUNCE_CHECK(w.dtype == DType::kBF16 && w.rank() == 3, "argument 'routed.", job.name, "' is ", w.describe(),
               "; it must be a bf16 [El, N, K] tensor");
  POUNCE_CHECK(w.is_dense(), "argument 'routed.", job.name, "' is a strided view (", w.describe(),
               "); quantize_weights_fp8 reads dense weights: pass a contiguous copy (e.g. the fused gate_up "
               "tensor's halves made contiguous)");
  POUNCE_CHECK(w.shape[1] < (int64_t{1} << 31) && w.shape[2] < (int64_t{1} << 31), "argument 'routed.",
               job.name, "' is ", w.describe(), "; N and K must stay below 2^31");
  check_fp8_tensor("out." + job.name, job.out, w.shape);
  check_fp8_tensor("out." + job.name + "_t", job.out_t, {w.shape[0], w.shape[2], w.shape[1]});
}

// Every view on the device of routed.gate: the quantizer runs where the weights are.
void check_one_device(const std::vector<Job>& jobs) {
  const TensorView& first = jobs[0].weights;
  auto check = [&](const std::string& name, const TensorView& view) {
    POUNCE_CHECK(
        view.device == first.device && (view.device == DeviceKind::kCpu || view.device_id == first.device_id),
        "argument '", name, "' is on ", where(view), " but 'routed.gate' is on ", where(first),
        "; quantize_weights_fp8 runs where the weights are: put every weight and output on ", where(first));
  };
  for (const Job& job : jobs) {
    check("routed." + job.name, job.weights);
    check("out." + job.name + ".data", job.out.data);
    check("out." + job.name + ".scale", job.out.scale);
    check("out." + job.name + "_t.data", job.out_t.data);
    check("out." + job.name + "_t.scale", job.out_t.scale);
  }
}

// Quantizes [El, N, K] into `out` and its transpose into `out_t` ([El, K, N]); square blocks mean the
// transposed scales are the transposed scale grid and the e4m3 bytes are the same bytes, transposed.
void quantize_on_cpu(const Job& job) {
  const TensorView& weights = job.weights;
  const int64_t experts = weights.shape[0], n = weights.shape[1], k = weights.shape[2];
  const int64_t blocks_n = job.out.scale.shape[1], blocks_k = job.out.scale.shape[2];
  std::vector<float> expert_weights(n * k);
  for (int64_t e = 0; e < experts; ++e) {
    const uint16_t* bits = weights.as<uint16_t>() + e * n * k;
    for (int64_t i = 0; i < n * k; ++i) {
      POUNCE_CHECK((bits[i] & 0x7f80) != 0x7f80, "argument 'routed.", job.name, "'[", e, ", ", i / k, ", ",
                   i % k,
                   "] is not finite; no block scale represents it: fix the weights before quantizing them");
      expert_weights[i] = reference::bf16_bits_to_float(bits[i]);
    }
    uint8_t* q = job.out.data.as<uint8_t>() + e * n * k;
    float* scale = job.out.scale.as<float>() + e * blocks_n * blocks_k;
    reference::quantize_fp8_blocks(expert_weights.data(), n, k, kFp8Block, kFp8Block, q, scale);
    uint8_t* q_t = job.out_t.data.as<uint8_t>() + e * n * k;
    float* scale_t = job.out_t.scale.as<float>() + e * blocks_n * blocks_k;
    for (int64_t row = 0; row < n; ++row)
      for (int64_t col = 0; col < k; ++col) q_t[col * n + row] = q[row * k + col];
    for (int64_t bn = 0; bn < blocks_n; ++bn)
      for (int64_t bk = 0; bk < blocks_k; ++bk) scale_t[bk * blocks_n + bn] = scale[bn * blocks_k + bk];
  }
}

}  // namespace

void quantize_weights_fp8(const ExpertWeights& routed, const Fp8Weights& out, void* stream) {
  const std::vector<Job> jobs = {{"gate", routed.gate, out.gate, out.gate_t},
                                 {"up", routed.up, out.up, out.up_t},
                                 {"down", routed.down, out.down, out.down_t}};
  for (const Job& job : jobs) check_job(job);
  POUNCE_CHECK(routed.gate.shape[0] == routed.up.shape[0] && routed.gate.shape[0] == routed.down.shape[0],
               "arguments 'routed.gate', 'routed.up', 'routed.down' hold ", routed.gate.shape[0], ", ",
               routed.up.shape[0], ", ", routed.down.shape[0],
               " experts; pass the same local experts in all three");
  check_one_device(jobs);
  if (routed.gate.device == DeviceKind::kCuda) {
#if POUNCE_HAS_CUDA
    gpu::quantize_weights_fp8(routed, out, stream);
    return;
#else
    detail::fail(
        "quantize_weights_fp8 got CUDA tensors, but this build of Pounce has no CUDA device code (nvcc ",
        "was not found at configure time); install the CUDA toolkit and rebuild, or pass CPU tensors");
#endif
  }
  (void)stream;
  for (const Job& job : jobs) quantize_on_cpu(job);
}

}  // namespace pounce
