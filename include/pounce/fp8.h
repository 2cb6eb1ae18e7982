// Block-scaled FP8 weights (docs/design.md §1): E4M3 data with power-of-two (UE8M0) scales per 128x128 block,
// in both orientations so forward (x·Wᵀ) and backward (dy·W) both read K-major tiles.
#pragma once

#include "pounce/layer.h"

namespace pounce {

struct Fp8Tensor {
  TensorView data;   // fp8e4m3 [El, N, K]
  TensorView scale;  // fp32 [El, ceil(N/128), ceil(K/128)], every entry a power of two
};

struct Fp8Weights {
  Fp8Tensor gate, up, down;        // forward orientation: as the bf16 weights
  Fp8Tensor gate_t, up_t, down_t;  // backward orientation: [El, H, I], [El, H, I], [El, I, H]
};

// Quantizes bf16 routed weights into caller-allocated `out` (every view sized as documented above; data may
// be fp8e4m3 or uint8 views of the e4m3 bits): scale = 2^ceil(log2(amax / 448)) per 128x128 block (1 for an
// all-zero block), data = e4m3(w / scale) rounded to nearest even; partial blocks at the N and K edges.
// Runs where the tensors are, all on the CPU or all on one CUDA device: on a GPU one stream-ordered launch
// on `stream` (a cudaStream_t; null = the default stream) for every expert and both orientations, bitwise
// equal to the CPU result. Non-finite weights are rejected on the CPU; on a GPU their block's scale is NaN.
void quantize_weights_fp8(const ExpertWeights& routed, const Fp8Weights& out, void* stream = nullptr);

}  // namespace pounce
