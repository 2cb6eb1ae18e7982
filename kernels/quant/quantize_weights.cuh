// Routed weights to block-scaled FP8 in both orientations (pounce::quantize_weights_fp8 on GPUs,
// docs/design.md §1 "FP8 mode"; the CPU twin is src/fp8.cpp over reference/fp8.cpp quantize_fp8_blocks,
// bitwise the same):
//   W [El, N, K] bf16 -> q [El, N, K] e4m3, scale [El, ceil(N/128), ceil(K/128)]   (128x128 blocks)
//                        q_t [El, K, N] = q transposed, scale_t [El, ceil(K/128), ceil(N/128)] = scale
//                        transposed
// (square blocks: the transposed tensor's blocks are the transposed blocks, with the same amax).
//
// One launch for every block of up to three tensors (gate, up, down) of every local expert; a CTA of 256
// threads quantizes one 128x128 block at a time (grid-stride): thread t owns column t % 128 and rows
// t / 128 + 2j (64 bf16 values in registers, two to a word), the block amax goes through warp shuffles and
// shared memory, the e4m3 bytes go to q row by row (a warp stores 32 consecutive bytes of a row) and through
// a shared tile to q_t (thread t then owns row t % 128 of the block, so a warp stores 32 consecutive bytes of
// a q_t row). Blocks past the tensor's edge (N or K not a multiple of 128) read zeros and store nothing
// there. Nothing waits on another CTA; the launch is stream-ordered.
#pragma once

#include <cstdint>

#include "kernels/quant/fp8_quant.cuh"

namespace pounce::kernels::quant {

// ---- config --------------------------------------------------------------------------------------------

struct QuantizeWeightsConfig {
  static constexpr int kThreads = 256;
  static constexpr int kRowsPerPass = kThreads / kBlock;          // 2
  static constexpr int kValuesPerThread = kBlock / kRowsPerPass;  // 64
  static constexpr int kTilePitch = kBlock + 4;                   // bytes; column reads hit 32 banks
  static constexpr int kMaxTensors = 3;
  static constexpr int kMinCtasPerSm = 2;  // <= 128 registers: two blocks in flight per SM
  static_assert(kThreads % kBlock == 0, "a pass covers whole block rows; fix: kThreads a multiple of 128");
  static_assert(kValuesPerThread % 2 == 0, "values convert in pairs");
};

// One bf16 [El, n, k] tensor and its two FP8 orientations (device pointers).
struct WeightQuantTensor {
  const uint16_t* in = nullptr;  // bf16 bits [El, n, k]
  uint8_t* q = nullptr;          // [El, n, k]
  float* scale = nullptr;        // [El, blocks_n, blocks_k]
  uint8_t* q_t = nullptr;        // [El, k, n]
  float* scale_t = nullptr;      // [El, blocks_k, blocks_n]
  int32_t n = 0;
  int32_t k = 0;
  int64_t first_block = 0;  // blocks of the tensors before this one, over all experts
};

struct QuantizeWeightsParams {
  WeightQuantTensor tensors[QuantizeWeightsConfig::kMaxTensors];
  int num_tensors = 0;
  int64_t num_blocks = 0;  // over all tensors and experts
};

// ---- shared storage ------------------------------------------------------------------------------------

struct QuantizeWeightsShared {
  uint8_t tile[kBlock][QuantizeWeightsConfig::kTilePitch];  // the block's e4m3 bytes, [row][col]
  float warp_amax[QuantizeWeightsConfig::kThreads / 32];
};

// ---- helpers -------------------------------------------------------------------------------------------

__host__ __device__ inline int64_t blocks_per_expert(const WeightQuantTensor& t) {
  return static_cast<int64_t>((t.n + kBlock - 1) / kBlock) * ((t.k + kBlock - 1) / kBlock);
}

__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// ---- the kernel ----------------------------------------------------------------------------------------

__global__ void __launch_bounds__(QuantizeWeightsConfig::kThreads, QuantizeWeightsConfig::kMinCtasPerSm)
    quantize_weights_kernel(const QuantizeWeightsParams params) {
  using Config = QuantizeWeightsConfig;
  __shared__ QuantizeWeightsShared ss;
  const int tid = static_cast<int>(threadIdx.x);

  for (int64_t block = blockIdx.x; block < params.num_blocks; block += gridDim.x) {
    // Which tensor, expert and 128x128 block.
    int tensor_idx = 0;
    while (tensor_idx + 1 < params.num_tensors && block >= params.tensors[tensor_idx + 1].first_block)
      ++tensor_idx;
    const WeightQuantTensor& t = params.tensors[tensor_idx];
    const int blocks_n = (t.n + kBlock - 1) / kBlock, blocks_k = (t.k + kBlock - 1) / kBlock;
    const int64_t local = block - t.first_block;
    const int64_t expert = local / blocks_per_expert(t);
    const int nb = static_cast<int>((local / blocks_k) % blocks_n), kb = static_cast<int>(local % blocks_k);
    const int row0 = nb * kBlock, col0 = kb * kBlock;
    const int rows = min(kBlock, t.n - row0), cols = min(kBlock, t.k - col0);
    const int64_t expert_elems = static_cast<int64_t>(t.n) * t.k;

    // Load: column tid % 128, rows tid / 128 + 2j, kept as bf16 pairs (rows of j and j + 1).
    const int col = tid % kBlock, row_first = tid / kBlock;
    const uint16_t* in = t.in + expert * expert_elems + static_cast<int64_t>(row0) * t.k + col0 + col;
    uint32_t pairs[Config::kValuesPerThread / 2];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < Config::kValuesPerThread; j += 2) {
      uint32_t bits[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = row_first + Config::kRowsPerPass * (j + i);
        bits[i] = row < rows && col < cols ? in[static_cast<int64_t>(row) * t.k] : 0u;
        amax = fold_amax(amax, bf16_bits_to_float(static_cast<uint16_t>(bits[i])));
      }
      pairs[j / 2] = bits[0] | (bits[1] << 16);
    }

    // Block amax: the warp, then the CTA.
    amax = lane_group_amax<32>(amax);
    if (tid % 32 == 0) ss.warp_amax[tid / 32] = amax;
    __syncthreads();
    amax = 0.0f;
#pragma unroll
    for (int w = 0; w < Config::kThreads / 32; ++w) amax = fold_amax(amax, ss.warp_amax[w]);
    const float scale = block_scale(amax);
    const float inverse = inverse_scale(scale);
    if (tid == 0) {
      t.scale[expert * blocks_n * blocks_k + nb * blocks_k + kb] = scale;
      t.scale_t[expert * blocks_n * blocks_k + kb * blocks_n + nb] = scale;
    }

    // Convert; store q and the tile.
    uint8_t* q = t.q + expert * expert_elems + static_cast<int64_t>(row0) * t.k + col0 + col;
#pragma unroll
    for (int j = 0; j < Config::kValuesPerThread; j += 2) {
      const float lo = bf16_bits_to_float(static_cast<uint16_t>(pairs[j / 2] & 0xffff));
      const float hi = bf16_bits_to_float(static_cast<uint16_t>(pairs[j / 2] >> 16));
      const uint16_t pair = ptx::cvt_e4m3x2(__fmul_rn(lo, inverse), __fmul_rn(hi, inverse));
      const uint8_t bytes[2] = {static_cast<uint8_t>(pair & 0xff), static_cast<uint8_t>(pair >> 8)};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = row_first + Config::kRowsPerPass * (j + i);
        ss.tile[row][col] = bytes[i];
        if (row < rows && col < cols) q[static_cast<int64_t>(row) * t.k] = bytes[i];
      }
    }
    __syncthreads();

    // q_t: row tid % 128 of the block (a column of q), columns tid / 128 + 2j.
    const int t_row = tid % kBlock;  // q_t column index inside the block = q row
    uint8_t* q_t = t.q_t + expert * expert_elems + static_cast<int64_t>(col0) * t.n + row0 + t_row;
#pragma unroll 8
    for (int j = 0; j < Config::kValuesPerThread; ++j) {
      const int t_col = row_first + Config::kRowsPerPass * j;  // q column = q_t row
      if (t_row < rows && t_col < cols) q_t[static_cast<int64_t>(t_col) * t.n] = ss.tile[t_row][t_col];
    }
    __syncthreads();  // the tile and warp_amax are reused by the next block
  }
}

}  // namespace pounce::kernels::quant
