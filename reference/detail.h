// Internals shared by the reference's schedule, forward and backward; not part of the interface.
//
// Every routine is templated on the arithmetic type T:
//   T = float  emulates Numerics::kBf16: fp32 accumulate, bf16 rounding at the points of docs/design.md §1;
//   T = double is Numerics::kFp64: fp64 everywhere, round_point() is the identity.
// Products of two bf16 values are exact in fp32, so FMA contraction cannot change a kBf16 dot product;
// the reference is still built with -ffp-contract=off so every other expression is reproducible too.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <vector>

#include "reference/bf16.h"
#include "reference/parallel.h"
#include "reference/reference.h"

namespace pounce::reference::detail {

// ---- rounding points ---------------------------------------------------------------------------------

template <typename T>
T round_point(T value);
template <>
inline float round_point(float value) {
  return round_bf16(value);
}
template <>
inline double round_point(double value) {
  return value;
}

// ---- activation in T (activation.cpp) ----------------------------------------------------------------

template <typename T>
T activation_t(const Activation& act, T g, T u);
template <typename T>
void activation_backward_t(const Activation& act, T g, T u, T d_a, T* d_g, T* d_u);

// ---- validation (validate.cpp): throws pounce::Error naming the argument, its value and the fix --------

void validate_problem(const Problem& problem);
void validate_routing(const Problem& problem, const std::vector<RankInputs>& ranks);
void validate_inputs(const Problem& problem, const std::vector<RankInputs>& ranks,
                     const std::vector<Weights>& routed_per_rank, const Weights& shared, bool need_d_out);

// build_schedule() without validation; forward and backward validate once and build every rank's.
RankSchedule build_schedule_unchecked(const Problem& problem, const std::vector<RankInputs>& ranks,
                                      int64_t rank);

// ---- matmul ------------------------------------------------------------------------------------------

// c[rows, cols] = A[rows, depth] · b[depth, cols] with A(i, k) = a[i * a_stride_i + k * a_stride_k].
// Every c element is one accumulator in T summed over k ascending; c is overwritten, not rounded.
// The 4x8 register tile and the edge loop give bitwise-equal elements, so a result never depends on
// where a row sits in a chunk.
template <typename T>
void matmul(const T* a, int64_t a_stride_i, int64_t a_stride_k, const T* b, int64_t rows, int64_t depth,
            int64_t cols, T* c) {
  constexpr int64_t kTileRows = 4;
  constexpr int64_t kTileCols = 8;
  for (int64_t i0 = 0; i0 < rows; i0 += kTileRows) {
    const int64_t tile_rows = std::min(kTileRows, rows - i0);
    for (int64_t j0 = 0; j0 < cols; j0 += kTileCols) {
      const int64_t tile_cols = std::min(kTileCols, cols - j0);
      if (tile_rows == kTileRows && tile_cols == kTileCols) {
        T acc[kTileRows][kTileCols] = {};
        for (int64_t k = 0; k < depth; ++k) {
          const T* b_row = b + k * cols + j0;
          for (int64_t ii = 0; ii < kTileRows; ++ii) {
            const T a_ik = a[(i0 + ii) * a_stride_i + k * a_stride_k];
            for (int64_t jj = 0; jj < kTileCols; ++jj) acc[ii][jj] += a_ik * b_row[jj];
          }
        }
        for (int64_t ii = 0; ii < kTileRows; ++ii) {
          for (int64_t jj = 0; jj < kTileCols; ++jj) c[(i0 + ii) * cols + j0 + jj] = acc[ii][jj];
        }
      } else {
        for (int64_t ii = 0; ii < tile_rows; ++ii) {
          for (int64_t jj = 0; jj < tile_cols; ++jj) {
            T acc = 0;
            for (int64_t k = 0; k < depth; ++k) {
              acc += a[(i0 + ii) * a_stride_i + k * a_stride_k] * b[k * cols + j0 + jj];
            }
            c[(i0 + ii) * cols + j0 + jj] = acc;
          }
        }
      }
    }
  }
}

// ---- one expert MLP in the layouts its row loops read contiguously -------------------------------------

template <typename T>
struct ExpertMatrices {
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I (or Is)
  std::vector<T> gate_up_t;  // [H, 2I]: column i is gate row i, column I + i is up row i
  std::vector<T> down_t;     // [I, H]
  std::vector<T> down;       // [H, I]  backward only
  std::vector<T> gate_up;    // [2I, H]: row 2i is gate row i, row 2i + 1 is up row i; backward only
  std::vector<T> bias_gu;    // [2I] b_gate then b_up (zeros for one not given); empty: no biases
  std::vector<T> bias_down;  // [H]; empty: no down bias
};

// gate, up [I, H], down [H, I] in double -> T; optional biases b_gate, b_up [I], b_down [H] (null: none).
template <typename T>
ExpertMatrices<T> make_expert_matrices(const double* gate, const double* up, const double* down,
                                       int64_t hidden, int64_t intermediate, bool for_backward,
                                       const double* b_gate = nullptr, const double* b_up = nullptr,
                                       const double* b_down = nullptr) {
  const int64_t H = hidden, I = intermediate;
  ExpertMatrices<T> m;
  m.hidden = H;
  m.intermediate = I;
  m.gate_up_t.resize(H * 2 * I);
  m.down_t.resize(I * H);
  for (int64_t i = 0; i < I; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      m.gate_up_t[h * 2 * I + i] = static_cast<T>(gate[i * H + h]);
      m.gate_up_t[h * 2 * I + I + i] = static_cast<T>(up[i * H + h]);
      m.down_t[i * H + h] = static_cast<T>(down[h * I + i]);
    }
  }
  if (for_backward) {
    m.down.resize(H * I);
    for (int64_t n = 0; n < H * I; ++n) m.down[n] = static_cast<T>(down[n]);
    m.gate_up.resize(2 * I * H);
    for (int64_t i = 0; i < I; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        m.gate_up[(2 * i) * H + h] = static_cast<T>(gate[i * H + h]);
        m.gate_up[(2 * i + 1) * H + h] = static_cast<T>(up[i * H + h]);
      }
    }
  }
  if (b_gate != nullptr || b_up != nullptr) {
    m.bias_gu.assign(2 * I, T(0));
    for (int64_t i = 0; i < I; ++i) {
      if (b_gate != nullptr) m.bias_gu[i] = static_cast<T>(b_gate[i]);
      if (b_up != nullptr) m.bias_gu[I + i] = static_cast<T>(b_up[i]);
    }
  }
  if (b_down != nullptr) m.bias_down.assign(b_down, b_down + H);
  return m;
}

// c[r, n] += bias[n] for rows x cols (the bias enters the fp32 accumulator before the rounding point).
template <typename T>
void add_bias_rows(const std::vector<T>& bias, int64_t rows, int64_t cols, T* c) {
  if (bias.empty()) return;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t n = 0; n < cols; ++n) c[r * cols + n] += bias[n];
  }
}

// Forward of `rows` independent rows (docs/design.md §1):
//   gu = round(x · [w_gate; w_up]^T + [b_gate; b_up])  [rows, 2I]   (g in columns [0, I), u in [I, 2I))
//   a  = round(act(g, u))                              [rows, I]
//   y  = round(a · w_down^T + b_down)                  [rows, H]
template <typename T>
void mlp_forward_rows(const ExpertMatrices<T>& w, const Activation& act, const T* x, int64_t rows, T* gu,
                      T* a, T* y) {
  const int64_t H = w.hidden, I = w.intermediate;
  matmul(x, H, 1, w.gate_up_t.data(), rows, H, 2 * I, gu);
  add_bias_rows(w.bias_gu, rows, 2 * I, gu);
  for (int64_t n = 0; n < rows * 2 * I; ++n) gu[n] = round_point(gu[n]);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      a[r * I + i] = round_point(activation_t<T>(act, gu[r * 2 * I + i], gu[r * 2 * I + I + i]));
    }
  }
  matmul(a, I, 1, w.down_t.data(), rows, I, H, y);
  add_bias_rows(w.bias_down, rows, H, y);
  for (int64_t n = 0; n < rows * H; ++n) y[n] = round_point(y[n]);
}

// Data backward of `rows` rows, given the forward's gu and the output gradient dy [rows, H]:
//   d_a  = round(dy · w_down)                         [rows, I]   (scratch)
//   d_gu = round(act'(g, u) d_a), d_g at 2i, d_u at 2i+1 [rows, 2I]
//   d_x  = round(sum_i d_g[i] w_gate[i, :] + d_u[i] w_up[i, :])  [rows, H], one accumulator, i ascending
template <typename T>
void mlp_backward_rows(const ExpertMatrices<T>& w, const Activation& act, const T* gu, const T* dy,
                       int64_t rows, T* d_a, T* d_gu, T* d_x) {
  const int64_t H = w.hidden, I = w.intermediate;
  matmul(dy, H, 1, w.down.data(), rows, H, I, d_a);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < I; ++i) {
      T d_g, d_u;
      activation_backward_t<T>(act, gu[r * 2 * I + i], gu[r * 2 * I + I + i], round_point(d_a[r * I + i]),
                               &d_g, &d_u);
      d_gu[r * 2 * I + 2 * i] = round_point(d_g);
      d_gu[r * 2 * I + 2 * i + 1] = round_point(d_u);
    }
  }
  matmul(d_gu, 2 * I, 1, w.gate_up.data(), rows, 2 * I, H, d_x);
  for (int64_t n = 0; n < rows * H; ++n) d_x[n] = round_point(d_x[n]);
}

// ---- the whole group's inputs in T, every rank's schedule, and the row chunks tasks work on -------------

template <typename T>
struct GroupData {
  std::vector<RankSchedule> schedules;                  // [R]
  std::vector<std::vector<T>> x;                        // [R][T_r, H]
  std::vector<std::vector<T>> topk_weights;             // [R][T_r, k]
  std::vector<std::vector<T>> d_out;                    // [R][T_r, H], backward only
  std::vector<std::vector<ExpertMatrices<T>>> experts;  // [R][El]
  ExpertMatrices<T> shared;                             // unused when Is = 0
};

template <typename T>
std::vector<T> to_t(const std::vector<double>& values) {
  return std::vector<T>(values.begin(), values.end());
}

// What every group layout (GroupData, Fp8GroupData) holds per rank: the schedule, x, the top-k weights and
// (backward) d_out, in T. Sizes its `experts` to [R] for the caller to fill.
template <typename T, typename Group>
void fill_rank_inputs(const Problem& p, const std::vector<RankInputs>& ranks, bool for_backward,
                      Group& group) {
  const int64_t R = p.num_ranks;
  group.x.resize(R);
  group.topk_weights.resize(R);
  group.d_out.resize(R);
  group.experts.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    group.schedules.push_back(build_schedule_unchecked(p, ranks, r));
    group.x[r] = to_t<T>(ranks[r].x);
    group.topk_weights[r] = to_t<T>(ranks[r].topk_weights);
    if (for_backward) group.d_out[r] = to_t<T>(ranks[r].d_out);
  }
}

// Inputs must have passed validate_inputs().
template <typename T>
GroupData<T> make_group_data(const Problem& p, const std::vector<RankInputs>& ranks,
                             const std::vector<Weights>& routed_per_rank, const Weights& shared,
                             bool for_backward) {
  const int64_t R = p.num_ranks, El = p.num_local_experts(), H = p.hidden, I = p.intermediate;
  GroupData<T> group;
  fill_rank_inputs<T>(p, ranks, for_backward, group);
  // [R * El] expert layouts, built in parallel: each task fills its own slot.
  std::vector<ExpertMatrices<T>> flat(R * El);
  parallel_for(R * El, p.num_threads, [&](int64_t task) {
    const int64_t r = task / El, le = task % El;
    const Weights& w = routed_per_rank[r];
    flat[task] = make_expert_matrices<T>(w.gate.data() + le * I * H, w.up.data() + le * I * H,
                                         w.down.data() + le * H * I, H, I, for_backward,
                                         w.b_gate.empty() ? nullptr : w.b_gate.data() + le * I,
                                         w.b_up.empty() ? nullptr : w.b_up.data() + le * I,
                                         w.b_down.empty() ? nullptr : w.b_down.data() + le * H);
  });
  for (int64_t r = 0; r < R; ++r) {
    group.experts[r].assign(std::make_move_iterator(flat.begin() + r * El),
                            std::make_move_iterator(flat.begin() + (r + 1) * El));
  }
  if (p.shared_intermediate > 0) {
    group.shared = make_expert_matrices<T>(shared.gate.data(), shared.up.data(), shared.down.data(), H,
                                           p.shared_intermediate, for_backward);
  }
  return group;
}

// Rows [begin, end) of one task: schedule rows of local expert `expert` on `rank` (padding excluded),
// or, for expert = kSharedExpert, tokens of `rank` through the shared expert.
struct RowChunk {
  static constexpr int64_t kSharedExpert = -1;
  int64_t rank = 0;
  int64_t expert = 0;
  int64_t begin = 0;
  int64_t end = 0;
};

inline std::vector<RowChunk> make_row_chunks(const Problem& p, const std::vector<RankInputs>& ranks,
                                             const std::vector<RankSchedule>& schedules,
                                             int64_t rows_per_chunk) {
  std::vector<RowChunk> chunks;
  for (int64_t r = 0; r < p.num_ranks; ++r) {
    const RankSchedule& s = schedules[r];
    for (int64_t le = 0; le < p.num_local_experts(); ++le) {
      const int64_t first = s.expert_row_offset[le], last = first + s.expert_num_rows[le];
      for (int64_t m = first; m < last; m += rows_per_chunk) {
        chunks.push_back({r, le, m, std::min(m + rows_per_chunk, last)});
      }
    }
    if (p.shared_intermediate > 0) {
      for (int64_t t = 0; t < ranks[r].num_tokens; t += rows_per_chunk) {
        chunks.push_back({r, RowChunk::kSharedExpert, t, std::min(t + rows_per_chunk, ranks[r].num_tokens)});
      }
    }
  }
  return chunks;
}

// Token ranges [begin, end) of every rank, for the per-token combine tasks (expert is unused).
inline std::vector<RowChunk> make_token_chunks(const std::vector<RankInputs>& ranks,
                                               int64_t tokens_per_chunk) {
  std::vector<RowChunk> chunks;
  for (size_t r = 0; r < ranks.size(); ++r) {
    for (int64_t t = 0; t < ranks[r].num_tokens; t += tokens_per_chunk) {
      chunks.push_back({static_cast<int64_t>(r), 0, t, std::min(t + tokens_per_chunk, ranks[r].num_tokens)});
    }
  }
  return chunks;
}

// ---- weight gradients (backward.cpp; the shared expert of fp8_backward.cpp)
// --------------------------------

// Per-row tensors kept from phase 1 for one expert's weight gradients.
template <typename T>
struct RowsForGrad {
  int64_t num_rows = 0;
  int64_t intermediate = 0;  // I or Is
  const T* x = nullptr;      // [num_rows, H]
  const T* dy = nullptr;     // [num_rows, H]
  const T* a = nullptr;      // [num_rows, I]
  const T* d_gu = nullptr;   // [num_rows, 2I], d_g at 2i, d_u at 2i + 1
};

// kBias: the expert's bias gradients (backward.cpp), one task per expert.
enum class GradTensor { kGate, kUp, kDown, kBias };

// One task of phase 2: output rows [begin, end) of one weight gradient, or (expert = kCombine)
// the d_x combine of tokens [begin, end) of `rank`.
struct GradTask {
  static constexpr int64_t kCombine = -2;
  int64_t rank = 0;
  int64_t expert = 0;  // local expert, RowChunk::kSharedExpert or kCombine
  GradTensor tensor = GradTensor::kGate;
  int64_t begin = 0;
  int64_t end = 0;
};

// d_weight rows [begin, end) of `tensor` from the rows' tensors; out points at row 0 of the expert's
// gradient tensor in the caller's layout (gate/up [I, H], down [H, I]).
template <typename T>
void weight_gradient_rows(const RowsForGrad<T>& rows, int64_t H, GradTensor tensor, int64_t begin,
                          int64_t end, double* out) {
  const int64_t I = rows.intermediate, M = rows.num_rows;
  std::vector<T> block;
  if (tensor == GradTensor::kDown) {
    // d_w_down[h, i] = sum_m dy[m, h] * a[m, i]
    block.resize((end - begin) * I);
    matmul(rows.dy + begin, 1, H, rows.a, end - begin, M, I, block.data());
    for (int64_t n = 0; n < (end - begin) * I; ++n) out[begin * I + n] = static_cast<double>(block[n]);
  } else {
    // d_w_gate[i, h] = sum_m d_g[m, i] * x[m, h]; d_w_up likewise with d_u
    const int64_t column = tensor == GradTensor::kGate ? 0 : 1;
    block.resize((end - begin) * H);
    matmul(rows.d_gu + 2 * begin + column, 2, 2 * I, rows.x, end - begin, M, H, block.data());
    for (int64_t n = 0; n < (end - begin) * H; ++n) out[begin * H + n] = static_cast<double>(block[n]);
  }
}

// ---- the owner-side sums over top-k slots (forward combine, backward d_x combine) ------------------------

// out[t] = round(ys[t] + sum_{j ascending, idx >= 0} w[t, j] * y[t, j]) for tokens [begin, end): one
// accumulator that starts at ys[t]. ys [T, H], y [T, k, H], w [T, k], out [T, H].
template <typename T>
void combine_tokens(const std::vector<int32_t>& topk_idx, const T* topk_weights, const T* ys, const T* y,
                    int64_t k, int64_t H, int64_t begin, int64_t end, double* out) {
  std::vector<T> acc(H);
  for (int64_t t = begin; t < end; ++t) {
    std::copy(ys + t * H, ys + (t + 1) * H, acc.data());
    for (int64_t j = 0; j < k; ++j) {
      if (topk_idx[t * k + j] < 0) continue;
      const T w = topk_weights[t * k + j];
      const T* y_tj = y + (t * k + j) * H;
      for (int64_t h = 0; h < H; ++h) acc[h] += w * y_tj[h];
    }
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = static_cast<double>(round_point(acc[h]));
  }
}

// d_x[t] = round(d_xs[t] + sum_{j ascending, idx >= 0} d_x_pair[t, j]) for tokens [begin, end).
template <typename T>
void combine_d_x_tokens(const std::vector<int32_t>& topk_idx, const T* d_xs, const T* d_x_pair, int64_t k,
                        int64_t H, int64_t begin, int64_t end, double* d_x) {
  std::vector<T> acc(H);
  for (int64_t t = begin; t < end; ++t) {
    std::copy(d_xs + t * H, d_xs + (t + 1) * H, acc.data());
    for (int64_t j = 0; j < k; ++j) {
      if (topk_idx[t * k + j] < 0) continue;
      const T* pair = d_x_pair + (t * k + j) * H;
      for (int64_t h = 0; h < H; ++h) acc[h] += pair[h];
    }
    for (int64_t h = 0; h < H; ++h) d_x[t * H + h] = static_cast<double>(round_point(acc[h]));
  }
}

// The bias gradients of one expert, each one accumulator in T over its rows ascending (padding rows are
// not among them): d_b_gate[i] = sum_m d_g[m, i], d_b_up[i] = sum_m d_u[m, i], d_b_down[h] = sum_m dy[m, h].
// A null output is a bias not given.
template <typename T>
void bias_gradient_rows(const RowsForGrad<T>& rows, int64_t H, double* d_b_gate, double* d_b_up,
                        double* d_b_down) {
  const int64_t I = rows.intermediate, M = rows.num_rows;
  std::vector<T> acc_gu(2 * I, T(0)), acc_down(H, T(0));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < 2 * I; ++n) acc_gu[n] += rows.d_gu[m * 2 * I + n];
    for (int64_t h = 0; h < H; ++h) acc_down[h] += rows.dy[m * H + h];
  }
  for (int64_t i = 0; i < I; ++i) {
    if (d_b_gate != nullptr) d_b_gate[i] = static_cast<double>(acc_gu[2 * i]);
    if (d_b_up != nullptr) d_b_up[i] = static_cast<double>(acc_gu[2 * i + 1]);
  }
  if (d_b_down != nullptr) {
    for (int64_t h = 0; h < H; ++h) d_b_down[h] = static_cast<double>(acc_down[h]);
  }
}

template <typename T>
std::vector<double> to_double(const std::vector<T>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// Backward's last phase, as both precisions run it: `result` gets every rank's gradients zeroed (and
// d_topk_weights as computed); the returned tasks fill them: the d_x combine by chunks of
// `tokens_per_chunk` tokens, then blocks of `rows_per_task` output rows of each expert's gate, up and down
// gradient, the shared expert's last. A rank's weight gradients it did not ask for (RankInputs::
// *_weight_grads) get neither storage nor tasks.
template <typename T>
std::vector<GradTask> plan_gradient_tasks(const Problem& p, const std::vector<RankInputs>& ranks,
                                          const std::vector<std::vector<T>>& d_topk, int64_t tokens_per_chunk,
                                          int64_t rows_per_task, std::vector<RankGradients>& result) {
  const int64_t R = p.num_ranks, El = p.num_local_experts(), H = p.hidden, I = p.intermediate,
                Is = p.shared_intermediate;
  std::vector<GradTask> tasks;
  for (const RowChunk& c : make_token_chunks(ranks, tokens_per_chunk)) {
    tasks.push_back({c.rank, GradTask::kCombine, GradTensor::kGate, c.begin, c.end});
  }
  auto add_weight_tasks = [&](int64_t r, int64_t expert, int64_t inter) {
    for (GradTensor tensor : {GradTensor::kGate, GradTensor::kUp, GradTensor::kDown}) {
      const int64_t out_rows = tensor == GradTensor::kDown ? H : inter;
      for (int64_t b = 0; b < out_rows; b += rows_per_task) {
        tasks.push_back({r, expert, tensor, b, std::min(b + rows_per_task, out_rows)});
      }
    }
  };
  result.assign(R, RankGradients{});
  for (int64_t r = 0; r < R; ++r) {
    RankGradients& g = result[r];
    g.d_x.assign(ranks[r].num_tokens * H, 0.0);
    g.d_topk_weights = to_double(d_topk[r]);
    if (ranks[r].routed_weight_grads) {
      g.d_routed.gate.assign(El * I * H, 0.0);
      g.d_routed.up.assign(El * I * H, 0.0);
      g.d_routed.down.assign(El * H * I, 0.0);
      for (int64_t le = 0; le < El; ++le) add_weight_tasks(r, le, I);
    }
    if (Is > 0 && ranks[r].shared_weight_grads) {
      g.d_shared.gate.assign(Is * H, 0.0);
      g.d_shared.up.assign(Is * H, 0.0);
      g.d_shared.down.assign(H * Is, 0.0);
      add_weight_tasks(r, RowChunk::kSharedExpert, Is);
    }
  }
  return tasks;
}

}  // namespace pounce::reference::detail
