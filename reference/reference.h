// CPU reference of the whole expert-parallel group in one process (docs/design.md §1, §2, §6).
//
// Plain loops, shapes in comments, parallelised over threads. Two numerics:
//   kBf16 — reproduces the rounding points of docs/design.md §1 (fp32 accumulate, bf16 at g, u, a, y, out)
//           and the backward rounding points in docs/design.md;
//   kFp64 — no rounding anywhere, fp64 accumulate: the oracle for tolerances and finite differences.
// Every rank's tensors are held as double; in kBf16 mode inputs must be bf16-representable.
#pragma once

#include <cstdint>
#include <vector>

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
  int num_threads = 0;  // 0 = hardware concurrency

  int64_t num_local_experts() const { return num_experts / num_ranks; }
};

struct RankInputs {
  int64_t num_tokens = 0;            // T (may differ per rank)
  std::vector<double> x;             // [T, H]
  std::vector<int32_t> topk_idx;     // [T, k], -1 = unused slot
  std::vector<double> topk_weights;  // [T, k]
  std::vector<double> d_out;         // [T, H], backward only
};

struct Weights {
  std::vector<double> gate;  // routed [El, I, H] / shared [Is, H]
  std::vector<double> up;    // routed [El, I, H] / shared [Is, H]
  std::vector<double> down;  // routed [El, H, I] / shared [H, Is]
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
  Weights d_routed;                    // per local expert, shapes as Weights
  Weights d_shared;                    // this rank's tokens only (data parallel); empty when Is = 0
};

// Throws pounce::Error on bad input (expert id out of range, size mismatches) before computing.
std::vector<RankForward> forward(const Problem& problem, const std::vector<RankInputs>& ranks,
                                 const std::vector<Weights>& routed_per_rank, const Weights& shared);

std::vector<RankGradients> backward(const Problem& problem, const std::vector<RankInputs>& ranks,
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
