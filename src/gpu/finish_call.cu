// The last launch of every forward, recompute and backward (kernels/common/finish_call.cuh): a staged GEMM's
// failure into the record, NaN into the call's outputs once the record holds a failure (docs/reliability.md).
#include <algorithm>

#include "kernels/common/finish_call.cuh"
#include "src/gpu/gpu_state.h"

namespace pounce::gpu {
namespace {

constexpr int kPoisonThreads = 256;

// Dense tensors are one run; a weight gradient that is half of a fused [El, 2I, H] tensor (strides
// {2 I H, H, 1}, the only strided form validation lets through) is one run per expert.
void add_span(kernels::common::PoisonSpans& spans, const TensorView& view) {
  if (view.is_none() || view.numel() == 0) return;
  POUNCE_CHECK(spans.count < kernels::common::kMaxPoisonSpans, "internal: more outputs than poison spans");
  kernels::common::PoisonSpan& span = spans.span[spans.count++];
  span.data = view.data;
  span.element_bytes = static_cast<int32_t>(size_of(view.dtype));
  if (view.is_dense()) {
    span.blocks = 1;
    span.block_bytes = span.block_stride_bytes = view.bytes();
  } else {
    POUNCE_CHECK(view.rank() == 3 && view.stride(2) == 1 && view.stride(1) == view.shape[2],
                 "internal: a strided output that is not half of a fused gate_up tensor");
    span.blocks = view.shape[0];
    span.block_bytes = view.shape[1] * view.shape[2] * span.element_bytes;
    span.block_stride_bytes = view.stride(0) * span.element_bytes;
  }
  POUNCE_CHECK(span.block_bytes % 4 == 0 && span.block_stride_bytes % 4 == 0, "internal: a poison run of ",
               span.block_bytes, " bytes is not whole 4-byte words");
}

void add_weights(kernels::common::PoisonSpans& spans, const ExpertWeights& weights) {
  add_span(spans, weights.gate);
  add_span(spans, weights.up);
  add_span(spans, weights.down);
}

void launch(GpuWorkspace& workspace, const kernels::common::PoisonSpans& spans, cudaStream_t stream) {
  int64_t words = 0;
  for (int s = 0; s < spans.count; ++s)
    words = std::max(words, spans.span[s].blocks * spans.span[s].block_bytes / 4);
  const int64_t needed = (words + kPoisonThreads - 1) / kPoisonThreads;
  const int grid =
      static_cast<int>(std::clamp<int64_t>(needed, 1, 2 * static_cast<int64_t>(workspace.num_sms)));
  kernels::common::finish_call_kernel<<<grid, kPoisonThreads, 0, stream>>>(workspace.pointers(), spans);
  POUNCE_CUDA(cudaGetLastError());
}

}  // namespace

void launch_finish_forward(GpuWorkspace& workspace, const ForwardArgs& args, bool write_out,
                           cudaStream_t stream) {
  kernels::common::PoisonSpans spans;
  if (write_out) add_span(spans, args.out);
  launch(workspace, spans, stream);
}

void launch_finish_backward(GpuWorkspace& workspace, const BackwardArgs& args, cudaStream_t stream) {
  kernels::common::PoisonSpans spans;
  add_span(spans, args.d_x);
  add_span(spans, args.d_topk_weights);
  add_weights(spans, args.d_routed);
  add_weights(spans, args.d_shared);
  launch(workspace, spans, stream);
}

}  // namespace pounce::gpu
