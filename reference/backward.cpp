// Backward of the whole expert-parallel group, simulating the EP protocol as forward.cpp does.
//
// Phase 1, per routed row (src, t, j) of expert e on its owner (rows are independent):
//   reverse-dispatch: pull x[src][t], d_out[src][t] and w = topk_weights[src][t, j]
//   recompute:        g, u, a, y exactly as forward
//   d_topk_weights[t, j] = <d_out[t], y>             one accumulator, h ascending; pushed to the owner
//   dy   = round(w * d_out[t])                                                   [H]
//   d_a  = round(dy · w_down[e])                                                 [I]
//   d_g, d_u = round(act'(g, u) d_a)                                             [I], [I]
//   d_x_pair = round(sum_i d_g[i] w_gate[e][i, :] + d_u[i] w_up[e][i, :])       [H]; pushed to the owner
// and the shared expert the same way on every rank's own tokens with dy = d_out (no weight).
// Phase 2:
//   d_x[t] = round(d_xs[t] + sum_{j ascending, idx >= 0} d_x_pair[t, j]), one accumulator from d_xs[t]
//   d_w_down[e] [H, I] = sum_rows dy ⊗ a,  d_w_gate[e] [I, H] = sum_rows d_g ⊗ x,  d_w_up = sum d_u ⊗ x
// with the weight sums in T over the expert's rows in receive-schedule order (the shared expert: the
// rank's tokens ascending), not rounded: the caller picks the output dtype.
#include "reference/detail.h"

namespace pounce::reference {
namespace {

using detail::RowChunk;

constexpr int64_t kRowsPerChunk = 64;
constexpr int64_t kTokensPerChunk = 64;
constexpr int64_t kGradRowsPerTask = 32;

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

enum class GradTensor { kGate, kUp, kDown };

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
    detail::matmul(rows.dy + begin, 1, H, rows.a, end - begin, M, I, block.data());
    for (int64_t n = 0; n < (end - begin) * I; ++n) out[begin * I + n] = static_cast<double>(block[n]);
  } else {
    // d_w_gate[i, h] = sum_m d_g[m, i] * x[m, h]; d_w_up likewise with d_u
    const int64_t column = tensor == GradTensor::kGate ? 0 : 1;
    block.resize((end - begin) * H);
    detail::matmul(rows.d_gu + 2 * begin + column, 2, 2 * I, rows.x, end - begin, M, H, block.data());
    for (int64_t n = 0; n < (end - begin) * H; ++n) out[begin * H + n] = static_cast<double>(block[n]);
  }
}

template <typename T>
std::vector<RankGradients> backward_t(const Problem& p, const std::vector<RankInputs>& ranks,
                                      const std::vector<Weights>& routed_per_rank, const Weights& shared) {
  const int64_t R = p.num_ranks, El = p.num_local_experts(), H = p.hidden, I = p.intermediate,
                Is = p.shared_intermediate, k = p.num_topk;
  const detail::GroupData<T> group =
      detail::make_group_data<T>(p, ranks, routed_per_rank, shared, /*for_backward=*/true);

  // Expert side, one row per schedule row of the owner (padding rows stay unused).
  std::vector<std::vector<T>> rows_x(R), rows_dy(R), rows_a(R), rows_d_gu(R);
  // Shared expert, one row per token of the rank.
  std::vector<std::vector<T>> shared_a(R), shared_d_gu(R), d_xs(R);
  // Owner side: the slots the reverse-combine pushes into.
  std::vector<std::vector<T>> d_x_pair(R), d_topk(R);  // [T_r, k, H], [T_r, k]
  for (int64_t r = 0; r < R; ++r) {
    const int64_t num_rows = group.schedules[r].expert_row_offset[El], T_r = ranks[r].num_tokens;
    rows_x[r].resize(num_rows * H);
    rows_dy[r].resize(num_rows * H);
    rows_a[r].resize(num_rows * I);
    rows_d_gu[r].resize(num_rows * 2 * I);
    shared_a[r].resize(T_r * Is);
    shared_d_gu[r].resize(T_r * 2 * Is);
    d_xs[r].assign(T_r * H, T(0));
    d_x_pair[r].assign(T_r * k * H, T(0));
    d_topk[r].assign(T_r * k, T(0));
  }

  // ---- phase 1: per-row data gradients -----------------------------------------------------------------
  const std::vector<RowChunk> chunks = detail::make_row_chunks(p, ranks, group.schedules, kRowsPerChunk);
  parallel_for(static_cast<int64_t>(chunks.size()), p.num_threads, [&](int64_t task) {
    const RowChunk& c = chunks[task];
    const int64_t rows = c.end - c.begin;
    std::vector<T> y_rows(rows * H), d_x_rows(rows * H);
    if (c.expert == RowChunk::kSharedExpert) {
      std::vector<T> gu(rows * 2 * Is), d_a(rows * Is);
      const T* x = group.x[c.rank].data() + c.begin * H;
      const T* dy = group.d_out[c.rank].data() + c.begin * H;  // the shared expert has weight 1
      T* a = shared_a[c.rank].data() + c.begin * Is;
      T* d_gu = shared_d_gu[c.rank].data() + c.begin * 2 * Is;
      detail::mlp_forward_rows(group.shared, p.activation, x, rows, gu.data(), a, y_rows.data());
      detail::mlp_backward_rows(group.shared, p.activation, gu.data(), dy, rows, d_a.data(), d_gu,
                                d_xs[c.rank].data() + c.begin * H);
      return;
    }
    const std::vector<ScheduleRow>& schedule = group.schedules[c.rank].rows;
    T* x = rows_x[c.rank].data() + c.begin * H;
    T* dy = rows_dy[c.rank].data() + c.begin * H;
    T* a = rows_a[c.rank].data() + c.begin * I;
    T* d_gu = rows_d_gu[c.rank].data() + c.begin * 2 * I;
    std::vector<T> d_out_rows(rows * H), gu(rows * 2 * I), d_a(rows * I);
    for (int64_t m = 0; m < rows; ++m) {  // reverse-dispatch: pull x and d_out
      const ScheduleRow& row = schedule[c.begin + m];
      const T* x_src = group.x[row.src_rank].data() + row.src_token * H;
      const T* d_out_src = group.d_out[row.src_rank].data() + row.src_token * H;
      std::copy(x_src, x_src + H, x + m * H);
      std::copy(d_out_src, d_out_src + H, d_out_rows.data() + m * H);
    }
    const detail::ExpertMatrices<T>& expert = group.experts[c.rank][c.expert];
    detail::mlp_forward_rows(expert, p.activation, x, rows, gu.data(), a, y_rows.data());
    for (int64_t m = 0; m < rows; ++m) {
      const ScheduleRow& row = schedule[c.begin + m];
      T dot = 0;
      for (int64_t h = 0; h < H; ++h) dot += d_out_rows[m * H + h] * y_rows[m * H + h];
      d_topk[row.src_rank][row.src_token * k + row.slot] = dot;  // push
      const T w = group.topk_weights[row.src_rank][row.src_token * k + row.slot];
      for (int64_t h = 0; h < H; ++h) dy[m * H + h] = detail::round_point(w * d_out_rows[m * H + h]);
    }
    detail::mlp_backward_rows(expert, p.activation, gu.data(), dy, rows, d_a.data(), d_gu, d_x_rows.data());
    for (int64_t m = 0; m < rows; ++m) {  // reverse-combine: push into the owner's (token, slot)
      const ScheduleRow& row = schedule[c.begin + m];
      std::copy(d_x_rows.data() + m * H, d_x_rows.data() + (m + 1) * H,
                d_x_pair[row.src_rank].data() + (row.src_token * k + row.slot) * H);
    }
  });

  // ---- phase 2: d_x combine and weight gradients ---------------------------------------------------------
  std::vector<RankGradients> result(R);
  std::vector<GradTask> tasks;
  for (const RowChunk& c : detail::make_token_chunks(ranks, kTokensPerChunk)) {
    tasks.push_back({c.rank, GradTask::kCombine, GradTensor::kGate, c.begin, c.end});
  }
  auto add_weight_tasks = [&](int64_t r, int64_t expert, int64_t inter) {
    for (GradTensor tensor : {GradTensor::kGate, GradTensor::kUp, GradTensor::kDown}) {
      const int64_t out_rows = tensor == GradTensor::kDown ? H : inter;
      for (int64_t b = 0; b < out_rows; b += kGradRowsPerTask) {
        tasks.push_back({r, expert, tensor, b, std::min(b + kGradRowsPerTask, out_rows)});
      }
    }
  };
  for (int64_t r = 0; r < R; ++r) {
    RankGradients& g = result[r];
    g.d_x.assign(ranks[r].num_tokens * H, 0.0);
    g.d_topk_weights = detail::to_double(d_topk[r]);
    g.d_routed.gate.assign(El * I * H, 0.0);
    g.d_routed.up.assign(El * I * H, 0.0);
    g.d_routed.down.assign(El * H * I, 0.0);
    for (int64_t le = 0; le < El; ++le) add_weight_tasks(r, le, I);
    if (Is > 0) {
      g.d_shared.gate.assign(Is * H, 0.0);
      g.d_shared.up.assign(Is * H, 0.0);
      g.d_shared.down.assign(H * Is, 0.0);
      add_weight_tasks(r, RowChunk::kSharedExpert, Is);
    }
  }

  parallel_for(static_cast<int64_t>(tasks.size()), p.num_threads, [&](int64_t task_idx) {
    const GradTask& task = tasks[task_idx];
    const int64_t r = task.rank;
    if (task.expert == GradTask::kCombine) {
      const std::vector<int32_t>& topk_idx = ranks[r].topk_idx;
      std::vector<T> acc(H);
      for (int64_t t = task.begin; t < task.end; ++t) {
        std::copy(d_xs[r].data() + t * H, d_xs[r].data() + (t + 1) * H, acc.data());
        for (int64_t j = 0; j < k; ++j) {
          if (topk_idx[t * k + j] < 0) continue;
          const T* pair = d_x_pair[r].data() + (t * k + j) * H;
          for (int64_t h = 0; h < H; ++h) acc[h] += pair[h];
        }
        for (int64_t h = 0; h < H; ++h) result[r].d_x[t * H + h] = detail::round_point(acc[h]);
      }
      return;
    }
    RowsForGrad<T> rows;
    Weights* out = nullptr;
    int64_t out_offset_in = 0, out_offset_down = 0;  // the expert's first element in gate/up and in down
    if (task.expert == RowChunk::kSharedExpert) {
      rows = {ranks[r].num_tokens,  Is, group.x[r].data(), group.d_out[r].data(), shared_a[r].data(),
              shared_d_gu[r].data()};
      out = &result[r].d_shared;
    } else {
      const int64_t first = group.schedules[r].expert_row_offset[task.expert];
      rows = {group.schedules[r].expert_num_rows[task.expert],
              I,
              rows_x[r].data() + first * H,
              rows_dy[r].data() + first * H,
              rows_a[r].data() + first * I,
              rows_d_gu[r].data() + first * 2 * I};
      out = &result[r].d_routed;
      out_offset_in = task.expert * I * H;
      out_offset_down = task.expert * H * I;
    }
    double* dest = task.tensor == GradTensor::kGate ? out->gate.data() + out_offset_in
                   : task.tensor == GradTensor::kUp ? out->up.data() + out_offset_in
                                                    : out->down.data() + out_offset_down;
    weight_gradient_rows(rows, H, task.tensor, task.begin, task.end, dest);
  });
  return result;
}

}  // namespace

std::vector<RankGradients> backward(const Problem& problem, const std::vector<RankInputs>& ranks,
                                    const std::vector<Weights>& routed_per_rank, const Weights& shared) {
  detail::validate_inputs(problem, ranks, routed_per_rank, shared, /*need_d_out=*/true);
  if (problem.numerics == Numerics::kBf16) return backward_t<float>(problem, ranks, routed_per_rank, shared);
  return backward_t<double>(problem, ranks, routed_per_rank, shared);
}

}  // namespace pounce::reference
