// Launch and numerics configuration (docs/design.md §2). Zero means "let the heuristic choose".
#pragma once

#include <cstdint>

#include "pounce/shape.h"

namespace pounce {

enum class Precision { kBF16, kFP8 };
enum class Backend { kAuto, kCpu, kGpu };
// How the GPU backend runs a pass: one persistent fused kernel between the token-side prologue and epilogue,
// or the chain of standalone stage kernels (the debugging oracle; bitwise the same result), or kAuto: the
// one measured faster for the shape (forward: the fused kernel; backward: the fused kernel when I >= 1024,
// where its GEMMs are long, else the stage kernels; docs/design.md "Fused backward").
enum class KernelPath { kFused, kStaged, kAuto };
// How the fused kernels return the second GEMM's rows (down forward, d_x backward) to their tokens' owners:
// the communication CTAs push each finished minibatch (kPush), or the GEMM epilogue scatters its tiles
// straight into the owners' slots (kScatter). kAuto: push with several ranks and I < 1024 (short mainloops,
// transfer-heavy), scatter otherwise. Both give bitwise the same result; the staged path ignores it.
enum class CombineMode { kAuto, kPush, kScatter };

struct Config {
  int forward_comm_sms = 0;    // SMs that move tokens in the forward kernel; 0 = heuristic
  int backward_comm_sms = 0;   // same for the backward kernel
  int64_t minibatch_size = 0;  // rows per dispatch->GEMM handoff counter; 0 = heuristic
  // Rows of the routed activation ring; 0 = the dropless worst case (R * max_tokens * k rows, padded).
  // Smaller saves memory: the routed experts then run in macrobatches of whole experts and the backward
  // replays all but the last (docs/design.md, "Macrobatch ring"). At least round_up(R * max_tokens, 128), the
  // rows one expert can receive when every token names distinct experts; a token naming one expert in several
  // slots may need more (the call then fails with a clear error, NaN outputs, on every backend).
  int64_t macrobatch_size = 0;
  Activation activation;
  // kFP8: block-scaled FP8 routed experts (docs/design.md §1); pass ForwardArgs::routed_fp8. On GPUs FP8 runs
  // the staged kernels whatever kernel_path and backward_kernel_path say: the fused kernels are BF16 only.
  Precision precision = Precision::kBF16;
  bool deterministic = true;  // false is rejected for now: every path is deterministic
  Backend backend = Backend::kAuto;
  KernelPath kernel_path = KernelPath::kFused;  // forward (and recompute_forward_context)
  // Backward: on 2 x H200 the fused backward kernel is 4 % (gpt-oss-120b) and 3 % (deepseek-v3) faster than
  // the stage kernels, 7 % slower on qwen3-30b-a3b (docs/design.md, "Fused backward"); kAuto picks by shape.
  // Both give bitwise the same gradients.
  KernelPath backward_kernel_path = KernelPath::kAuto;
  CombineMode combine = CombineMode::kAuto;
};

// GEMM tile height: every expert segment of the receive schedule is padded to a multiple of it.
inline constexpr int64_t kBlockM = 128;
// FP8 block sizes (docs/design.md §1): 1x128 activations, 128x128 weights.
inline constexpr int64_t kFp8Block = 128;

// Throws pounce::Error when a field is out of range for `shape`.
void validate(const Config& config, const Shape& shape);

const char* to_string(Precision precision);
const char* to_string(Backend backend);
const char* to_string(KernelPath path);
const char* to_string(CombineMode mode);
const char* to_string(ActivationKind kind);

}  // namespace pounce
