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
//   (biases given) d_b_down[e] [H] = sum_rows dy, d_b_gate[e] [I] = sum_rows d_g, d_b_up[e] = sum_rows d_u
// with the weight sums in T over the expert's rows in receive-schedule order (the shared expert: the
// rank's tokens ascending), not rounded: the caller picks the output dtype. Precision::kFP8 runs
// fp8_backward.cpp instead.
#include "reference/detail.h"
#include "reference/fp8_detail.h"

namespace pounce::reference {
namespace {

using detail::GradTask;
using detail::GradTensor;
using detail::RowChunk;
using detail::RowsForGrad;

constexpr int64_t kRowsPerChunk = 64;
constexpr int64_t kTokensPerChunk = 64;
constexpr int64_t kGradRowsPerTask = 32;

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
  std::vector<RankGradients> result;
  const std::vector<GradTask> tasks =
      detail::plan_gradient_tasks(p, ranks, d_topk, kTokensPerChunk, kGradRowsPerTask, result);
  std::vector<GradTask> all_tasks = tasks;
  for (int64_t r = 0; r < R; ++r) {  // bias gradients: one task per expert, for the biases given
    const Weights& w = routed_per_rank[r];
    if (!ranks[r].routed_weight_grads || !w.has_biases()) continue;
    Weights& d = result[r].d_routed;
    if (!w.b_gate.empty()) d.b_gate.assign(El * I, 0.0);
    if (!w.b_up.empty()) d.b_up.assign(El * I, 0.0);
    if (!w.b_down.empty()) d.b_down.assign(El * H, 0.0);
    for (int64_t le = 0; le < El; ++le) all_tasks.push_back({r, le, GradTensor::kBias, 0, 1});
  }

  parallel_for(static_cast<int64_t>(all_tasks.size()), p.num_threads, [&](int64_t task_idx) {
    const GradTask& task = all_tasks[task_idx];
    const int64_t r = task.rank;
    if (task.expert == GradTask::kCombine) {
      detail::combine_d_x_tokens(ranks[r].topk_idx, d_xs[r].data(), d_x_pair[r].data(), k, H, task.begin,
                                 task.end, result[r].d_x.data());
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
    if (task.tensor == GradTensor::kBias) {
      auto at = [](std::vector<double>& v, int64_t offset) {
        return v.empty() ? nullptr : v.data() + offset;
      };
      detail::bias_gradient_rows(rows, H, at(out->b_gate, task.expert * I), at(out->b_up, task.expert * I),
                                 at(out->b_down, task.expert * H));
      return;
    }
    double* dest = task.tensor == GradTensor::kGate ? out->gate.data() + out_offset_in
                   : task.tensor == GradTensor::kUp ? out->up.data() + out_offset_in
                                                    : out->down.data() + out_offset_down;
    detail::weight_gradient_rows(rows, H, task.tensor, task.begin, task.end, dest);
  });
  return result;
}

}  // namespace

std::vector<RankGradients> backward(const Problem& problem, const std::vector<RankInputs>& ranks,
                                    const std::vector<Weights>& routed_per_rank, const Weights& shared) {
  detail::validate_inputs(problem, ranks, routed_per_rank, shared, /*need_d_out=*/true);
  if (problem.precision == Precision::kFP8) {
    if (problem.numerics == Numerics::kBf16)
      return detail::fp8_backward_t<float>(problem, ranks, routed_per_rank, shared, nullptr);
    return detail::fp8_backward_t<double>(problem, ranks, routed_per_rank, shared, nullptr);
  }
  if (problem.numerics == Numerics::kBf16) return backward_t<float>(problem, ranks, routed_per_rank, shared);
  return backward_t<double>(problem, ranks, routed_per_rank, shared);
}

}  // namespace pounce::reference
