// CPU reference of the whole expert-parallel group in one process (docs/design.md §1, §2, §6).
//
// Plain loops, shapes in comments, parallelised over threads. Two numerics:
//   kBf16 — reproduces the rounding points of docs/design.md §1 (fp32 accumulate, bf16 at g, u, a, y, out)
//           and the backward rounding points in docs/design.md;
//   kFp64 — no rounding anywhere, fp64 accumulate: the oracle for tolerances and finite differences.
// Every rank's tensors are held as double; in kBf16 mode inputs must be bf16-representable.
//
// Two precisions (Problem::precision, as Config::precision): kBF16, and kFP8, where the routed experts
// run block-scaled E4M3 with every quantization point of docs/design.md §1 "FP8 mode" (fp8_forward.cpp,
// fp8_backward.cpp; the shared expert stays BF16). kFP8 with kBf16 numerics is the FP8 oracle; with kFp64
// it keeps the same quantization points (the values reach the quantizer through fp32) and drops the bf16
// rounding points, accumulating in fp64: the noise yardstick of the FP8 GPU tests.
#pragma once

#include <cstdint>
#include <vector>

#include "pounce/config.h"
#include "pounce/shape.h"

namespace pounce::reference {

enum class Numerics { kBf16, kFp64 };

struct Problem {
  int64_t hidden = 0;               // H
  int64_t intermediate = 0;         // I
  int64_t num_experts = 0;          // E
  int64_t num_topk = 0;             // k
  int64_t shared_intermediate = 0;  // Is, 0 = none
  int64_t num_ranks = 1;            // R
  int64_t block_m = 128;            // schedule padding
  Activation activation;
  Numerics numerics = Numerics::kBf16;
  Precision precision = Precision::kBF16;  // kFP8: block_m must be a multiple of 128 (kFp8Block)
  int num_threads = 0;                     // 0 = hardware concurrency

  int64_t num_local_experts() const { return num_experts / num_ranks; }

  // A layer of `shape` as the library runs it: its schedule padding (kBlockM) and rounding points (kBf16).
  static Problem of(const Shape& shape, const Activation& activation, Precision precision) {
    Problem p;
    p.hidden = shape.hidden;
    p.intermediate = shape.intermediate;
    p.num_experts = shape.num_experts;
    p.num_topk = shape.num_topk;
    p.shared_intermediate = shape.shared_intermediate;
    p.num_ranks = shape.num_ranks;
    p.block_m = kBlockM;
    p.activation = activation;
    p.precision = precision;
    return p;
  }
};

struct RankInputs {
  int64_t num_tokens = 0;            // T (may differ per rank)
  std::vector<double> x;             // [T, H]
  std::vector<int32_t> topk_idx;     // [T, k], -1 = unused slot
  std::vector<double> topk_weights;  // [T, k]
  std::vector<double> d_out;         // [T, H], backward only
  // Backward only: whether this rank's weight gradients are computed (its experts' routed ones, its tokens'
  // shared ones). false (frozen experts) skips their work and leaves RankGradients' vectors empty.
  bool routed_weight_grads = true;
  bool shared_weight_grads = true;
};

struct Weights {
  std::vector<double> gate;  // routed [El, I, H] / shared [Is, H]
  std::vector<double> up;    // routed [El, I, H] / shared [Is, H]
  std::vector<double> down;  // routed [El, H, I] / shared [H, Is]
  // Routed expert biases (docs/design.md §1), each optional (empty = none); the shared expert has none.
  // As gradients (RankGradients::d_routed) a bias's gradient is present exactly when the bias was given.
  std::vector<double> b_gate = {};  // [El, I], added to g before its rounding point
  std::vector<double> b_up = {};    // [El, I], added to u before its rounding point
  std::vector<double> b_down = {};  // [El, H], added to y before its rounding point
  bool has_biases() const { return !b_gate.empty() || !b_up.empty() || !b_down.empty(); }
};

// One row of a rank's receive schedule: which (source rank, token, top-k slot) it holds.
struct ScheduleRow {
  int32_t src_rank = -1;  // -1 = padding row
  int32_t src_token = -1;
  int32_t slot = -1;
  bool is_padding() const { return src_rank < 0; }
  bool operator==(const ScheduleRow&) const = default;
};

struct RankSchedule {
  std::vector<int64_t> expert_num_rows;    // [El] true rows per local expert
  std::vector<int64_t> expert_row_offset;  // [El + 1] padded offsets (multiples of block_m)
  std::vector<int64_t> recv_from_rank;     // [R] pairs received from each source rank
  std::vector<ScheduleRow> rows;           // [expert_row_offset[El]]
};

// Receive schedule of `rank` (docs/design.md §2): grouped by local expert, each segment padded to block_m,
// sources interleaved round-robin, ascending (token, slot) within a source.
RankSchedule build_schedule(const Problem& problem, const std::vector<RankInputs>& ranks, int64_t rank);

struct RankForward {
  std::vector<double> out;  // [T, H]
  std::vector<double> y;    // [T, k, H] routed expert output per (token, slot); 0 for unused slots
  std::vector<double> ys;   // [T, H] shared expert output (0 when Is = 0)
};

struct RankGradients {
  std::vector<double> d_x;             // [T, H]
  std::vector<double> d_topk_weights;  // [T, k]
  Weights d_routed;                    // per local expert, shapes as Weights; empty when not asked for
  Weights d_shared;                    // this rank's tokens only (data parallel); empty when Is = 0 or not
                                       // asked for
};

// Throws pounce::Error on bad input (expert id out of range, size mismatches) before computing.
std::vector<RankForward> forward(const Problem& problem, const std::vector<RankInputs>& ranks,
                                 const std::vector<Weights>& routed_per_rank, const Weights& shared);

std::vector<RankGradients> backward(const Problem& problem, const std::vector<RankInputs>& ranks,
                                    const std::vector<Weights>& routed_per_rank, const Weights& shared);

// ---- FP8 mode's operands, for tests (docs/design.md §1 "FP8 mode") ------------------------------------

// One tensor [rows, cols] in block-scaled E4M3: value(r, c) = e4m3_to_float(q[r, c]) * scale of its block.
struct Fp8Blocks {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t block_rows = 1;    // 1 (1x128 blocks along the row), 128 (128x1 along the token axis, 128x128)
  int64_t block_cols = 128;  // 128, or 1 for the token-axis copies
  std::vector<uint8_t> q;    // [rows, cols] e4m3 (fn) bits
  std::vector<float> scale;  // [ceil(rows / block_rows), ceil(cols / block_cols)], powers of two
  double value(int64_t r, int64_t c) const;
};

// The routed experts' quantized operands and GEMM accumulators of one rank in FP8 mode. Row tensors have
// one row per receive-schedule row of the rank (build_schedule(); padding rows are zero, quantize to 0 with
// scale 1); the *_acc tensors are the GEMMs' accumulators before the bf16 rounding point (fp32 values in
// kBf16 numerics). The token-axis copies ("q128x1_T") quantize the row tensors in 128-row blocks that
// start at each expert segment's first row (segments start at multiples of block_m, itself a multiple of
// 128, so these are the blocks of the whole row tensor): the operands of the weight-gradient GEMMs.
struct RankFp8Trace {
  Fp8Blocks x_q;                 // [T_r, H] q1x128_H(x) of this rank's own tokens, at the source
  std::vector<double> g_acc;     // [rows, I] x_q · w_gate_q^T
  std::vector<double> u_acc;     // [rows, I] x_q · w_up_q^T
  std::vector<double> a;         // [rows, I] bf16(act(bf16(g_acc), bf16(u_acc)))
  Fp8Blocks a_q;                 // [rows, I] q1x128_I(a)
  std::vector<double> y_acc;     // [rows, H] a_q · w_down_q^T
  std::vector<double> d_y;       // [rows, H] bf16(w * d_out)
  Fp8Blocks d_y_q;               // [rows, H] q1x128_H(d_y)
  std::vector<double> d_a_acc;   // [rows, I] d_y_q · w_down_t_q^T
  std::vector<double> d_g, d_u;  // [rows, I] bf16(act'(g, u) bf16(d_a_acc))
  Fp8Blocks d_g_q, d_u_q;        // [rows, I] q1x128_I
  std::vector<double> d_x_acc;   // [rows, H] d_g_q · w_gate_t_q^T + d_u_q · w_up_t_q^T, one accumulator
  // [rows, cols] in 128x1 blocks: x from the pulled x_q rows (dequantized: x reaches the expert as FP8),
  // the others from the bf16 tensors above. d_w_down = d_y_t^T a_t, d_w_gate = d_g_t^T x_t, d_w_up = d_u_t^T
  // x_t.
  Fp8Blocks x_t, a_t, d_y_t, d_g_t, d_u_t;
};

// The FP8 backward's operands of every rank (problem.precision must be kFP8); backward() returns the
// gradients computed from exactly these.
std::vector<RankFp8Trace> fp8_trace(const Problem& problem, const std::vector<RankInputs>& ranks,
                                    const std::vector<Weights>& routed_per_rank, const Weights& shared);

// Activation and its derivative in fp32/fp64 (clamp masks included).
double activation(const Activation& act, double g, double u);
void activation_backward(const Activation& act, double g, double u, double d_a, double* d_g, double* d_u);

// FP8 block quantization (docs/design.md §1): E4M3 with power-of-two scale per block_rows x block_cols block;
// scale = 2^ceil(log2(amax / 448)) (1 for an all-zero block). in [rows, cols] -> q [rows, cols],
// scale [ceil(rows/block_rows), ceil(cols/block_cols)].
void quantize_fp8_blocks(const float* in, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                         uint8_t* q, float* scale);
void dequantize_fp8_blocks(const uint8_t* q, const float* scale, int64_t rows, int64_t cols,
                           int64_t block_rows, int64_t block_cols, float* out);

}  // namespace pounce::reference
