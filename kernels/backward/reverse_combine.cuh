// Backward, token side and reverse-combine (docs/design.md §1-§2; reference/backward.cpp phase 1).
//
//   stage_inputs   : sym_d_out[t] = d_out[t] for t < T, 0 up to round_up(T, 128) (the shared expert's rows);
//                    sym_topk_weights[t, j] = topk_weights[t, j]. Peers pull both after the barrier.
//   router_grad    : d_topk_weights[t, j] = <d_out[t], y[t, j]> with y the expert output the forward pushed
//                    into this rank's slot (t, j); 0 for an unused slot. fp32 products and sums, no division
//                    by the weight, so a zero weight still gets its true gradient. One warp per token: for
//                    each (t, j) each lane sums its columns in ascending order, then a fixed xor tree
//                    (deterministic).
//   pull_scaled    : dy_rows[row] = bf16(w * d_out_src[t]) for every schedule row of local experts
//                    [expert_begin, expert_end), w = topk_weights_src[t, j] pulled with the row; padding rows
//                    get zeros (their GEMM rows and wgrad terms vanish).
// No flags inside: the backward inputs barrier orders the staged rows before the pulls, exactly as the
// routing barrier does for the forward dispatch.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/warp.cuh"
#include "kernels/layout/workspace_layout.cuh"

namespace pounce::kernels::reverse_combine {

__device__ __forceinline__ void stage_inputs(const layout::WorkspacePointers& ws, const void* d_out,
                                             const float* topk_weights, int64_t num_tokens) {
  const int64_t padded_tokens = layout::round_up(num_tokens, layout::kBlockM);
  const int64_t row_vectors = ws.hidden * layout::kBf16Bytes / 16;
  int4* sym_d_out = ws.local_sym<int4>(ws.sym_d_out);
  for (int64_t t = warp::global_index(); t < padded_tokens; t += warp::num_global()) {
    if (t < num_tokens) {
      warp::copy_16b(sym_d_out + t * row_vectors, static_cast<const int4*>(d_out) + t * row_vectors,
                     row_vectors);
    } else {
      warp::zero_16b(sym_d_out + t * row_vectors, row_vectors);
    }
  }
  float* sym_weights = ws.local_sym<float>(ws.sym_topk_weights);
  const int64_t num_entries = num_tokens * ws.num_topk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_entries;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    sym_weights[i] = topk_weights[i];
  }
}

__device__ __forceinline__ float dot_bf16x8(const int4& a, const int4& b, float acc) {
  const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&a);
  const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(&b);
#pragma unroll
  for (int i = 0; i < 8; ++i) acc = __fadd_rn(acc, __fmul_rn(__bfloat162float(x[i]), __bfloat162float(y[i])));
  return acc;
}

// One warp per token: its d_out row is read once for up to kSlotsAtOnce slots, whose y rows load beside it
// (one warp per (t, j) read d_out k times and kept two loads in flight per lane: deepseek-v3's 1 GB took
// ~0.6 ms, twice the DRAM time). Each pair's sum is the same as one warp per pair computed: every lane sums
// its columns in ascending order, then the same xor tree.
__device__ __forceinline__ void router_grad(const layout::WorkspacePointers& ws, const void* d_out,
                                            float* d_topk_weights, int64_t num_tokens) {
  constexpr int kSlotsAtOnce = 8;
  const int64_t k = ws.num_topk, row_vectors = ws.hidden * layout::kBf16Bytes / 16;
  const int32_t* topk_idx = ws.local_sym<const int32_t>(ws.sym_routing_idx) + ws.rank * ws.routing_stride;
  const int4* y_slots = ws.local_sym<const int4>(ws.sym_y_slots);
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t t = warp::global_index(); t < num_tokens; t += warp::num_global()) {
    const int4* dy = static_cast<const int4*>(d_out) + t * row_vectors;
    for (int64_t first = t * k; first < (t + 1) * k; first += kSlotsAtOnce) {
      const int slots = static_cast<int>(layout::min_i64(kSlotsAtOnce, (t + 1) * k - first));
      uint32_t used = 0;  // bit s: slot first + s names an expert (the same for every lane)
      float acc[kSlotsAtOnce];
#pragma unroll
      for (int s = 0; s < kSlotsAtOnce; ++s) {
        const int32_t expert = s < slots ? topk_idx[first + s] : -1;
        if (expert >= 0 && expert < ws.num_experts) used |= 1u << s;
        acc[s] = 0.0f;
      }
      const int4* y = y_slots + first * row_vectors;
      for (int64_t v = lane; v < row_vectors; v += 32) {
        const int4 d = dy[v];
        int4 ys[kSlotsAtOnce];
#pragma unroll
        for (int s = 0; s < kSlotsAtOnce; ++s) {
          if (used & (1u << s)) ys[s] = y[s * row_vectors + v];
        }
#pragma unroll
        for (int s = 0; s < kSlotsAtOnce; ++s) {
          if (used & (1u << s)) acc[s] = dot_bf16x8(d, ys[s], acc[s]);
        }
      }
#pragma unroll
      for (int s = 0; s < kSlotsAtOnce; ++s) {
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
          acc[s] = __fadd_rn(acc[s], __shfl_xor_sync(0xffffffffu, acc[s], offset));
      }
      if (lane < slots) {
        float mine = 0.0f;
#pragma unroll
        for (int s = 0; s < kSlotsAtOnce; ++s) mine = s == lane ? acc[s] : mine;
        d_topk_weights[first + lane] = mine;  // 0 for an unused slot (its acc stayed 0)
      }
    }
  }
}

// One schedule row, by one warp: dy_rows[row] = bf16(w * d_out_src[t]), zeros for a padding row. Each lane
// keeps kDepth 16-byte loads in flight (NVLink latency), the last round predicated.
template <int kDepth = 4>
__device__ __forceinline__ void pull_scaled_row(const layout::WorkspacePointers& ws, int64_t row) {
  const int64_t row_vectors = ws.hidden * layout::kBf16Bytes / 16;
  int4* dst = static_cast<int4*>(ws.dy_rows) + row * row_vectors;
  const layout::ScheduleEntry entry = ws.schedule[row];
  if (entry.src_rank < 0) {
    warp::zero_16b(dst, row_vectors);
    return;
  }
  const float w = ws.peer<const float>(
      entry.src_rank, ws.sym_topk_weights)[static_cast<int64_t>(entry.src_token) * ws.num_topk + entry.slot];
  const int4* src = ws.peer<const int4>(entry.src_rank, ws.sym_d_out) + entry.src_token * row_vectors;
  for (int64_t base = threadIdx.x % 32; base < row_vectors; base += 32 * kDepth) {
    int4 packed[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (base + 32 * d < row_vectors) packed[d] = src[base + 32 * d];
    }
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (base + 32 * d >= row_vectors) break;
      const __nv_bfloat16* in = reinterpret_cast<const __nv_bfloat16*>(&packed[d]);
      int4 scaled;
      __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(&scaled);
#pragma unroll
      for (int i = 0; i < 8; ++i) out[i] = __float2bfloat16_rn(__fmul_rn(w, __bfloat162float(in[i])));
      dst[base + 32 * d] = scaled;
    }
  }
}

// Rows of local experts [expert_begin, expert_end) (a pipeline chunk).
__device__ __forceinline__ void pull_scaled_rows(const layout::WorkspacePointers& ws, int expert_begin,
                                                 int expert_end) {
  const int64_t first_row = ws.group_row_offset[expert_begin], end_row = ws.group_row_offset[expert_end];
  for (int64_t row = first_row + warp::global_index(); row < end_row; row += warp::num_global())
    pull_scaled_row(ws, row);
}

template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    stage_inputs_kernel(layout::WorkspacePointers ws, const void* d_out, const float* topk_weights,
                        int64_t num_tokens) {
  stage_inputs(ws, d_out, topk_weights, num_tokens);
}
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    router_grad_kernel(layout::WorkspacePointers ws, const void* d_out, float* d_topk_weights,
                       int64_t num_tokens) {
  router_grad(ws, d_out, d_topk_weights, num_tokens);
}
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads)
    pull_scaled_rows_kernel(layout::WorkspacePointers ws, int expert_begin, int expert_end) {
  pull_scaled_rows(ws, expert_begin, expert_end);
}

}  // namespace pounce::kernels::reverse_combine
