// The last launch of every forward and backward (docs/reliability.md): failures into the record, NaN into
// the outputs.
//
// 1. The staged GEMMs record a bounded wait that ran out (or rows beyond their capacity) in the workspace's
//    GEMM error word, not in the record: it becomes a record here (WaitId::kStagedGemm), unless another
//    failure holds the record already.
// 2. When the record holds a failure (a bounded wait ran out, a topk_idx value out of range, a schedule or
//    macrobatch overflow, a staged GEMM), every element of the call's outputs becomes NaN, so an optimizer
//    step or the next layer that uses them without checking trains on NaN, never silently on a partial
//    result.
// Without a failure each thread reads two words of device memory and returns.
#pragma once

#include <cstdint>

#include "kernels/common/flags.cuh"
#include "kernels/layout/workspace_layout.cuh"

namespace pounce::kernels::common {

// One output: `blocks` runs of `block_bytes` bytes, `block_stride_bytes` apart (a dense tensor is one run;
// each half of a fused [El, 2I, H] gate_up gradient is El runs of I * H elements, 2 * I * H apart).
struct PoisonSpan {
  void* data = nullptr;
  int64_t blocks = 0;
  int64_t block_bytes = 0;
  int64_t block_stride_bytes = 0;
  int32_t element_bytes = 0;  // 2: bf16, 4: fp32
};
inline constexpr int kMaxPoisonSpans = 8;  // d_x, d_topk_weights and six weight gradients
struct PoisonSpans {
  PoisonSpan span[kMaxPoisonSpans];
  int count = 0;
};

// NaN of the element type repeated over 32 bits: bf16 0x7FC0 twice, fp32 0x7FC00000.
__device__ __forceinline__ uint32_t nan_word(int32_t element_bytes) {
  return element_bytes == 2 ? 0x7FC07FC0u : 0x7FC00000u;
}

__global__ void finish_call_kernel(const layout::WorkspacePointers ws, PoisonSpans spans) {
  const int32_t gemm_error = *static_cast<volatile int32_t*>(ws.gemm_error());
  if (gemm_error != 0 && blockIdx.x == 0 && threadIdx.x == 0) {
    flags::record_error(ws, layout::DeviceErrorCode::kWaitTimeout,
                        static_cast<int32_t>(layout::WaitId::kStagedGemm),
                        /*peer=*/-1, /*expected=*/0, /*observed=*/gemm_error);
  }
  // The claim flag (device memory) says whether the record holds a failure: every thread reading the
  // host-mapped record itself would cost each call milliseconds of PCIe reads of one address.
  if (gemm_error == 0 && *static_cast<volatile int32_t*>(ws.error_claim) == 0) return;
  // Grid-stride over every span's 4-byte words (outputs are 16-byte aligned and every run a whole number of
  // words: H and I are multiples of 64, so is every stride).
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int s = 0; s < spans.count; ++s) {
    const PoisonSpan span = spans.span[s];
    const uint32_t word = nan_word(span.element_bytes);
    const int64_t words_per_block = span.block_bytes / 4;
    const int64_t total = span.blocks * words_per_block;
    for (int64_t i = first; i < total; i += stride) {
      const int64_t block = i / words_per_block, w = i - block * words_per_block;
      auto* base = static_cast<char*>(span.data) + block * span.block_stride_bytes;
      reinterpret_cast<uint32_t*>(base)[w] = word;
    }
  }
}

}  // namespace pounce::kernels::common
