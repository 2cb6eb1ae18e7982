// The MoE layer after the router (docs/design.md §1): forward, backward, recompute of the forward context.
// All calls are stream-ordered, allocate nothing, and read no routing counts on the host, so a GPU
// forward+backward can be captured in a CUDA graph and replayed with new routing.
#pragma once

#include "pounce/tensor.h"
#include "pounce/workspace.h"

namespace pounce {

// Routed weights: gate/up [El, I, H], down [El, H, I]. Shared weights: gate/up [Is, H], down [H, Is].
// Weights may be row-strided views read in place (TensorView::strides), such as the halves of a fused
// gate_up [El, 2I, H] (gate = [:, :I], up = [:, I:]) or its interleaved rows (docs/design.md §5).
// Routed experts may have biases (GPT-OSS), each optional (empty = none), dense bf16 like the weights:
// g = x·w_gate^T + b_gate, u = x·w_up^T + b_up, y = a·w_down^T + b_down, each added to the fp32
// accumulator before the bf16 rounding point (docs/design.md §1). The shared expert has none. As weight
// gradients (BackwardArgs::d_routed) the bias fields are the biases' gradients: dtype and accumulation as
// the weight gradients', dense, each left empty when not wanted, and given only for a bias that is given.
// Biases are CPU-backend only for now: a GPU workspace rejects them.
struct ExpertWeights {
  TensorView gate;
  TensorView up;
  TensorView down;
  TensorView b_gate = {};  // [El, I]
  TensorView b_up = {};    // [El, I]
  TensorView b_down = {};  // [El, H]

  bool has_biases() const { return !b_gate.is_none() || !b_up.is_none() || !b_down.is_none(); }
};

struct Fp8Weights;

struct ForwardArgs {
  TensorView x;             // [T, H] bf16, T <= max_tokens (T may differ per rank and per call)
  TensorView topk_idx;      // [T, k] int32 or int64: global expert id, or -1 for an unused slot
  TensorView topk_weights;  // [T, k] fp32, used as given
  ExpertWeights routed;     // bf16
  ExpertWeights shared;     // bf16; left empty when shape.shared_intermediate == 0
  const Fp8Weights* routed_fp8 = nullptr;  // required when config.precision == kFP8
  TensorView out;                          // [T, H] bf16, written
};

struct BackwardArgs {
  ForwardArgs inputs;         // the same inputs the forward of this workspace saw (out is not read)
  TensorView d_out;           // [T, H] bf16
  TensorView d_x;             // [T, H] bf16, written
  TensorView d_topk_weights;  // [T, k] fp32, written: <d_out[t], y[t, j]>, no division by the weight
  // dtype bf16 or fp32; shapes as the weights. Dense, or gate and up as the two halves of one [El, 2I, H]
  // tensor (written in place). A gradient left empty is not computed (frozen weights: no GEMM runs for it).
  ExpertWeights d_routed;
  ExpertWeights d_shared;                // same (dense only); empty when there is no shared expert
  bool accumulate_weight_grads = false;  // add into fp32 tensors (main_grad) instead of overwriting
};

void forward(Workspace& workspace, const ForwardArgs& args, void* stream = nullptr);
void backward(Workspace& workspace, const BackwardArgs& args, void* stream = nullptr);
// Rebuilds the forward context bitwise equal to what forward saved, without writing `out`
// (activation checkpointing: run forward, drop the workspace for other layers, recompute, backward).
void recompute_forward_context(Workspace& workspace, const ForwardArgs& args, void* stream = nullptr);

// Raises the device-side failure that earlier calls on this workspace recorded (a bounded wait on a peer
// timed out, a topk_idx value out of range, a schedule or macrobatch overflow) as pounce::Error naming the
// wait or the argument with its counters, and clears the record. The failing call's outputs are NaN (and so
// are those of calls queued behind it before the record was cleared: docs/reliability.md). GPU kernels record
// a failure instead of trapping, so the call that launched them cannot throw it; every call checks on entry,
// so it surfaces at the next call on the workspace at the latest, and this check lets a step end on it
// instead.
//   synchronize = false (the default): one read of host-mapped memory, no CUDA call, nothing waited for
//     (cheap enough for every step; legal while `stream` is being captured into a CUDA graph). It sees the
//     failures of calls whose kernels have ended: a call just launched may still be running, and its
//     failure then shows at a later check.
//   synchronize = true: first waits for `stream`'s work (a host sync), so every call on it so far is
//     checked; run it after a CUDA graph's replay. Refused while `stream` is being captured.
// On the CPU backend each call throws its errors itself (nothing is deferred): this returns at once.
// Not collective: each rank checks its own workspace.
void check_errors(Workspace& workspace, void* stream = nullptr, bool synchronize = false);

}  // namespace pounce
