// Launcher of the weight quantizer (kernels/quant/quantize_weights.cuh): pounce::quantize_weights_fp8 on CUDA
// tensors, after src/fp8.cpp has checked dtypes, shapes and that every view is on one device.
// Stream-ordered, allocates nothing, reads nothing back: capturable in a CUDA graph.
#include "src/gpu/fp8_quantize.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/quant/quantize_weights.cuh"
#include "src/gpu/gpu_state.h"

namespace pounce::gpu {
namespace {

using kernels::quant::QuantizeWeightsConfig;
using kernels::quant::QuantizeWeightsParams;
using kernels::quant::WeightQuantTensor;

// Grid-stride: this many CTAs per SM keep the loads in flight; more add nothing.
constexpr int kCtasPerSm = 8;

WeightQuantTensor weight_tensor(const TensorView& weights, const Fp8Tensor& out, const Fp8Tensor& out_t) {
  WeightQuantTensor t;
  t.in = weights.as<const uint16_t>();
  t.q = out.data.as<uint8_t>();
  t.scale = out.scale.as<float>();
  t.q_t = out_t.data.as<uint8_t>();
  t.scale_t = out_t.scale.as<float>();
  t.n = static_cast<int32_t>(weights.shape[1]);
  t.k = static_cast<int32_t>(weights.shape[2]);
  return t;
}

}  // namespace

void quantize_weights_fp8(const ExpertWeights& routed, const Fp8Weights& out, void* stream) {
  QuantizeWeightsParams params;
  const TensorView* weights[] = {&routed.gate, &routed.up, &routed.down};
  const Fp8Tensor* outs[] = {&out.gate, &out.up, &out.down};
  const Fp8Tensor* outs_t[] = {&out.gate_t, &out.up_t, &out.down_t};
  for (int i = 0; i < QuantizeWeightsConfig::kMaxTensors; ++i) {
    WeightQuantTensor t = weight_tensor(*weights[i], *outs[i], *outs_t[i]);
    t.first_block = params.num_blocks;
    params.num_blocks += weights[i]->shape[0] * kernels::quant::blocks_per_expert(t);
    params.tensors[params.num_tensors++] = t;
  }
  if (params.num_blocks == 0) return;

  DeviceGuard guard(routed.gate.device_id);
  int num_sms = 0;
  POUNCE_CUDA(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, routed.gate.device_id));
  const int64_t grid = std::min<int64_t>(params.num_blocks, static_cast<int64_t>(num_sms) * kCtasPerSm);
  kernels::quant::quantize_weights_kernel<<<static_cast<unsigned>(grid), QuantizeWeightsConfig::kThreads, 0,
                                            static_cast<cudaStream_t>(stream)>>>(params);
  POUNCE_CUDA(cudaGetLastError());
}

}  // namespace pounce::gpu
