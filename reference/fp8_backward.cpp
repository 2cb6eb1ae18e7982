// Backward of the whole expert-parallel group in FP8 mode (docs/design.md §1 "FP8 mode"), simulating the
// EP protocol as backward.cpp does; the shared expert and every rounding point not listed are as in BF16.
//
// Phase 1, per routed row (src, t, j) of expert e on its owner (rows are independent):
//   reverse-dispatch: pull x_q[src][t] (bits and 1x128 scales), d_out[src][t], w = topk_weights[src][t, j]
//   recompute:        g, u, a, a_q, y exactly as fp8_forward.cpp
//   d_topk_weights[t, j] = <d_out[t], y>                                     as BF16; pushed to the owner
//   d_y = round(w * d_out[t]);  d_y_q = q1x128_H(d_y);  d_a = round(d_y_q · w_down_t_q^T)              [I]
//   d_g, d_u = round(act'(g, u) d_a);  d_g_q, d_u_q = q1x128_I(d_g), q1x128_I(d_u)                   [I]
//   d_x_pair = round(d_g_q · w_gate_t_q^T + d_u_q · w_up_t_q^T)             [H]; pushed to the owner
// Phase 2, per 128-row block of the owner's schedule rows (blocks never straddle expert segments: block_m
// is a multiple of 128): the token-axis copies x_t (from the dequantized x_q rows), a_t, d_y_t, d_g_t,
// d_u_t, 128x1 blocks, padding rows zero.
// Phase 3:
//   d_x[t] = round(d_xs[t] + sum_{j ascending, idx >= 0} d_x_pair[t, j])
//   d_w_down[e] = d_y_t^T a_t,  d_w_gate[e] = d_g_t^T x_t,  d_w_up[e] = d_u_t^T x_t over the expert's rows in
//   receive-schedule order, promoted per 128-row block (fp8_detail.h), not rounded.
// The 128-row blocks hold different rows when the experts are split over ranks differently, so unlike
// out, y, d_x and d_topk_weights the routed weight gradients depend on the split (within FP8 noise).
#include "reference/fp8_detail.h"

namespace pounce::reference::detail {
namespace {

constexpr int64_t kRowsPerChunk = 64;
constexpr int64_t kTokensPerChunk = 64;
constexpr int64_t kGradRowsPerTask = 32;

template <typename T>
Fp8Blocks to_blocks(const QuantT<T>& t) {
  return {t.rows, t.cols, t.block_rows, t.block_cols, t.bits, t.scale};
}

template <typename T>
RankFp8Trace make_trace(const QuantT<T>& x_q, const Fp8Rows<T>& r) {
  RankFp8Trace trace;
  trace.x_q = to_blocks(x_q);
  trace.g_acc = to_double(r.g_acc);
  trace.u_acc = to_double(r.u_acc);
  trace.a = to_double(r.a);
  trace.a_q = to_blocks(r.a_q);
  trace.y_acc = to_double(r.y_acc);
  trace.d_y = to_double(r.d_y);
  trace.d_y_q = to_blocks(r.d_y_q);
  trace.d_a_acc = to_double(r.d_a_acc);
  trace.d_g = to_double(r.d_g);
  trace.d_u = to_double(r.d_u);
  trace.d_g_q = to_blocks(r.d_g_q);
  trace.d_u_q = to_blocks(r.d_u_q);
  trace.d_x_acc = to_double(r.d_x_acc);
  trace.x_t = to_blocks(r.x_t);
  trace.a_t = to_blocks(r.a_t);
  trace.d_y_t = to_blocks(r.d_y_t);
  trace.d_g_t = to_blocks(r.d_g_t);
  trace.d_u_t = to_blocks(r.d_u_t);
  return trace;
}

}  // namespace

template <typename T>
std::vector<RankGradients> fp8_backward_t(const Problem& p, const std::vector<RankInputs>& ranks,
                                          const std::vector<Weights>& routed_per_rank, const Weights& shared,
                                          std::vector<RankFp8Trace>* trace) {
  const int64_t R = p.num_ranks, El = p.num_local_experts(), H = p.hidden, I = p.intermediate,
                Is = p.shared_intermediate, k = p.num_topk;
  const Fp8GroupData<T> group = make_fp8_group_data<T>(p, ranks, routed_per_rank, shared, true);

  std::vector<Fp8Rows<T>> rows(R);
  std::vector<std::vector<T>> shared_a(R), shared_d_gu(R), d_xs(R);  // BF16 shared expert
  std::vector<std::vector<T>> d_x_pair(R), d_topk(R);                // owner slots [T_r, k, H], [T_r, k]
  for (int64_t r = 0; r < R; ++r) {
    const int64_t T_r = ranks[r].num_tokens;
    rows[r].resize(group.schedules[r].expert_row_offset[El], H, I, /*for_backward=*/true);
    shared_a[r].resize(T_r * Is);
    shared_d_gu[r].resize(T_r * 2 * Is);
    d_xs[r].assign(T_r * H, T(0));
    d_x_pair[r].assign(T_r * k * H, T(0));
    d_topk[r].assign(T_r * k, T(0));
  }

  // ---- phase 1: per-row data gradients -----------------------------------------------------------------
  const std::vector<RowChunk> chunks = make_row_chunks(p, ranks, group.schedules, kRowsPerChunk);
  parallel_for(static_cast<int64_t>(chunks.size()), p.num_threads, [&](int64_t task) {
    const RowChunk& c = chunks[task];
    const int64_t num_rows = c.end - c.begin;
    if (c.expert == RowChunk::kSharedExpert) {  // BF16, dy = d_out (weight 1)
      std::vector<T> gu(num_rows * 2 * Is), d_a(num_rows * Is), ys(num_rows * H);
      const T* x = group.x[c.rank].data() + c.begin * H;
      mlp_forward_rows(group.shared, p.activation, x, num_rows, gu.data(),
                       shared_a[c.rank].data() + c.begin * Is, ys.data());
      mlp_backward_rows(group.shared, p.activation, gu.data(), group.d_out[c.rank].data() + c.begin * H,
                        num_rows, d_a.data(), shared_d_gu[c.rank].data() + c.begin * 2 * Is,
                        d_xs[c.rank].data() + c.begin * H);
      return;
    }
    const std::vector<ScheduleRow>& schedule = group.schedules[c.rank].rows;
    Fp8Rows<T>& r = rows[c.rank];
    for (int64_t m = c.begin; m < c.end; ++m) {  // reverse-dispatch: pull x_q and d_out
      const ScheduleRow& row = schedule[m];
      copy_quantized_rows(group.x_q[row.src_rank], row.src_token, 1, r.x_q, m);
      const T* d_out_src = group.d_out[row.src_rank].data() + row.src_token * H;
      std::copy(d_out_src, d_out_src + H, r.d_out.data() + m * H);
    }
    const Fp8Expert<T>& expert = group.experts[c.rank][c.expert];
    fp8_mlp_forward_rows(expert, p.activation, r, c.begin, num_rows, rank_name(c.rank));
    for (int64_t m = c.begin; m < c.end; ++m) {
      const ScheduleRow& row = schedule[m];
      T dot = 0;
      for (int64_t h = 0; h < H; ++h) dot += r.d_out[m * H + h] * r.y[m * H + h];
      d_topk[row.src_rank][row.src_token * k + row.slot] = dot;  // push
      const T w = group.topk_weights[row.src_rank][row.src_token * k + row.slot];
      for (int64_t h = 0; h < H; ++h) r.d_y[m * H + h] = round_point(w * r.d_out[m * H + h]);
    }
    fp8_mlp_backward_rows(expert, p.activation, r, c.begin, num_rows, rank_name(c.rank));
    for (int64_t m = c.begin; m < c.end; ++m) {  // reverse-combine: push into the owner's (token, slot)
      const ScheduleRow& row = schedule[m];
      std::copy(r.d_x.data() + m * H, r.d_x.data() + (m + 1) * H,
                d_x_pair[row.src_rank].data() + (row.src_token * k + row.slot) * H);
    }
  });

  // ---- phase 2: token-axis copies, one task per 128-row block ------------------------------------------
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (rank, first row)
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t m = 0; m < group.schedules[r].expert_row_offset[El]; m += kQuantBlock)
      blocks.push_back({r, m});
  }
  parallel_for(static_cast<int64_t>(blocks.size()), p.num_threads, [&](int64_t task) {
    fp8_token_axis_block(rows[blocks[task].first], blocks[task].second, rank_name(blocks[task].first));
  });

  // ---- phase 3: d_x combine and weight gradients -------------------------------------------------------
  std::vector<RankGradients> result;
  const std::vector<GradTask> tasks =
      plan_gradient_tasks(p, ranks, d_topk, kTokensPerChunk, kGradRowsPerTask, result);

  parallel_for(static_cast<int64_t>(tasks.size()), p.num_threads, [&](int64_t task_idx) {
    const GradTask& task = tasks[task_idx];
    const int64_t r = task.rank;
    if (task.expert == GradTask::kCombine) {
      combine_d_x_tokens(ranks[r].topk_idx, d_xs[r].data(), d_x_pair[r].data(), k, H, task.begin, task.end,
                         result[r].d_x.data());
      return;
    }
    if (task.expert == RowChunk::kSharedExpert) {
      const RowsForGrad<T> shared_rows = {ranks[r].num_tokens, Is,
                                          group.x[r].data(),   group.d_out[r].data(),
                                          shared_a[r].data(),  shared_d_gu[r].data()};
      Weights& out = result[r].d_shared;
      double* dest = task.tensor == GradTensor::kGate ? out.gate.data()
                     : task.tensor == GradTensor::kUp ? out.up.data()
                                                      : out.down.data();
      weight_gradient_rows(shared_rows, H, task.tensor, task.begin, task.end, dest);
      return;
    }
    const Fp8Rows<T>& rr = rows[r];
    const int64_t first = group.schedules[r].expert_row_offset[task.expert];
    const int64_t num_rows = group.schedules[r].expert_num_rows[task.expert];
    const QuantT<T>& lhs = task.tensor == GradTensor::kGate ? rr.d_g_t
                           : task.tensor == GradTensor::kUp ? rr.d_u_t
                                                            : rr.d_y_t;
    const QuantT<T>& rhs = task.tensor == GradTensor::kDown ? rr.a_t : rr.x_t;
    const int64_t cols = rhs.cols;
    std::vector<T> block((task.end - task.begin) * cols);
    matmul_fp8_token_axis(lhs, rhs, first, num_rows, task.begin, task.end, block.data());
    Weights& out = result[r].d_routed;
    double* dest = task.tensor == GradTensor::kGate ? out.gate.data() + task.expert * I * H
                   : task.tensor == GradTensor::kUp ? out.up.data() + task.expert * I * H
                                                    : out.down.data() + task.expert * H * I;
    for (size_t n = 0; n < block.size(); ++n) dest[task.begin * cols + n] = static_cast<double>(block[n]);
  });

  if (trace != nullptr) {
    trace->clear();
    for (int64_t r = 0; r < R; ++r) trace->push_back(make_trace(group.x_q[r], rows[r]));
  }
  return result;
}

template std::vector<RankGradients> fp8_backward_t<float>(const Problem&, const std::vector<RankInputs>&,
                                                          const std::vector<Weights>&, const Weights&,
                                                          std::vector<RankFp8Trace>*);
template std::vector<RankGradients> fp8_backward_t<double>(const Problem&, const std::vector<RankInputs>&,
                                                           const std::vector<Weights>&, const Weights&,
                                                           std::vector<RankFp8Trace>*);

}  // namespace pounce::reference::detail

namespace pounce::reference {

std::vector<RankFp8Trace> fp8_trace(const Problem& problem, const std::vector<RankInputs>& ranks,
                                    const std::vector<Weights>& routed_per_rank, const Weights& shared) {
  POUNCE_CHECK(problem.precision == Precision::kFP8,
               "fp8_trace: problem.precision is bf16; set it to Precision::kFP8");
  detail::validate_inputs(problem, ranks, routed_per_rank, shared, /*need_d_out=*/true);
  std::vector<RankFp8Trace> trace;
  if (problem.numerics == Numerics::kBf16) {
    detail::fp8_backward_t<float>(problem, ranks, routed_per_rank, shared, &trace);
  } else {
    detail::fp8_backward_t<double>(problem, ranks, routed_per_rank, shared, &trace);
  }
  return trace;
}

}  // namespace pounce::reference
