// Forward of the whole expert-parallel group in FP8 mode (docs/design.md §1 "FP8 mode"), simulating the EP
// protocol as forward.cpp does:
//   0. x_q = q1x128_H(x) on every owner, at the source (FP8 on the wire);
//   1. dispatch: every expert owner pulls the x_q rows (e4m3 bits and their 1x128 scales) it receives;
//   2. experts:  g, u = bf16(x_q · w_gate_q^T), bf16(x_q · w_up_q^T); a = bf16(act(g, u));
//                a_q = q1x128_I(a); y = bf16(a_q · w_down_q^T)   (fp8_detail.h: per-block promotion)
//   3. combine:  each y row is pushed into the owner's slot y[src][token, slot];
//   4. out[t] = round(ys[t] + sum_j w[t, j] * y[t, j]) as BF16, the shared expert's ys in BF16.
// Every quantization is row-local (1x128 blocks along the row), so as in BF16 the outputs do not depend
// on how the experts are split over ranks.
#include "reference/fp8_detail.h"

namespace pounce::reference::detail {
namespace {

constexpr int64_t kRowsPerChunk = 64;
constexpr int64_t kTokensPerChunk = 64;

}  // namespace

template <typename T>
std::vector<RankForward> fp8_forward_t(const Problem& p, const std::vector<RankInputs>& ranks,
                                       const std::vector<Weights>& routed_per_rank, const Weights& shared) {
  const int64_t R = p.num_ranks, El = p.num_local_experts(), H = p.hidden, I = p.intermediate,
                Is = p.shared_intermediate, k = p.num_topk;
  const Fp8GroupData<T> group = make_fp8_group_data<T>(p, ranks, routed_per_rank, shared, false);

  std::vector<Fp8Rows<T>> rows(R);
  std::vector<std::vector<T>> y(R), ys(R);  // [R][T_r, k, H], [R][T_r, H]
  for (int64_t r = 0; r < R; ++r) {
    rows[r].resize(group.schedules[r].expert_row_offset[El], H, I, /*for_backward=*/false);
    y[r].assign(ranks[r].num_tokens * k * H, T(0));
    ys[r].assign(ranks[r].num_tokens * H, T(0));
  }

  const std::vector<RowChunk> chunks = make_row_chunks(p, ranks, group.schedules, kRowsPerChunk);
  parallel_for(static_cast<int64_t>(chunks.size()), p.num_threads, [&](int64_t task) {
    const RowChunk& c = chunks[task];
    const int64_t num_rows = c.end - c.begin;
    if (c.expert == RowChunk::kSharedExpert) {  // BF16
      std::vector<T> gu(num_rows * 2 * Is), a(num_rows * Is);
      mlp_forward_rows(group.shared, p.activation, group.x[c.rank].data() + c.begin * H, num_rows, gu.data(),
                       a.data(), ys[c.rank].data() + c.begin * H);
      return;
    }
    const std::vector<ScheduleRow>& schedule = group.schedules[c.rank].rows;
    Fp8Rows<T>& r = rows[c.rank];
    for (int64_t m = c.begin; m < c.end; ++m) {  // dispatch: pull x_q
      copy_quantized_rows(group.x_q[schedule[m].src_rank], schedule[m].src_token, 1, r.x_q, m);
    }
    fp8_mlp_forward_rows(group.experts[c.rank][c.expert], p.activation, r, c.begin, num_rows,
                         rank_name(c.rank));
    for (int64_t m = c.begin; m < c.end; ++m) {  // combine: push into the owner's (token, slot)
      const ScheduleRow& row = schedule[m];
      std::copy(r.y.data() + m * H, r.y.data() + (m + 1) * H,
                y[row.src_rank].data() + (row.src_token * k + row.slot) * H);
    }
  });

  std::vector<RankForward> result(R);
  for (int64_t r = 0; r < R; ++r) result[r].out.assign(ranks[r].num_tokens * H, 0.0);
  const std::vector<RowChunk> token_chunks = make_token_chunks(ranks, kTokensPerChunk);
  parallel_for(static_cast<int64_t>(token_chunks.size()), p.num_threads, [&](int64_t task) {
    const RowChunk& c = token_chunks[task];
    combine_tokens(ranks[c.rank].topk_idx, group.topk_weights[c.rank].data(), ys[c.rank].data(),
                   y[c.rank].data(), k, H, c.begin, c.end, result[c.rank].out.data());
  });
  for (int64_t r = 0; r < R; ++r) {
    result[r].y = to_double(y[r]);
    result[r].ys = to_double(ys[r]);
  }
  return result;
}

template std::vector<RankForward> fp8_forward_t<float>(const Problem&, const std::vector<RankInputs>&,
                                                       const std::vector<Weights>&, const Weights&);
template std::vector<RankForward> fp8_forward_t<double>(const Problem&, const std::vector<RankInputs>&,
                                                        const std::vector<Weights>&, const Weights&);

}  // namespace pounce::reference::detail
