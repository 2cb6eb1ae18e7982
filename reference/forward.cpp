// Forward of the whole expert-parallel group (docs/design.md §1, §2), simulating the EP protocol:
//   1. dispatch: every expert owner pulls the x rows its receive schedule names from the source ranks;
//   2. experts:  the MLP of each row (rows are independent, so a row's place in the schedule is moot);
//   3. combine:  each y row is pushed into the owner's private slot y[src][token, slot];
//   4. out[t] = round(ys[t] + sum_{j ascending, idx >= 0} w[t, j] * y[t, j]), one accumulator that
//      starts at ys[t].
// Nothing depends on how the experts are split over ranks, so 1, 2, 4 or 8 ranks give bitwise-equal
// outputs for the same global batch. Precision::kFP8 runs fp8_forward.cpp instead.
#include "reference/detail.h"
#include "reference/fp8_detail.h"

namespace pounce::reference {
namespace {

using detail::RowChunk;

constexpr int64_t kRowsPerChunk = 64;
constexpr int64_t kTokensPerChunk = 64;

template <typename T>
std::vector<RankForward> forward_t(const Problem& p, const std::vector<RankInputs>& ranks,
                                   const std::vector<Weights>& routed_per_rank, const Weights& shared) {
  const int64_t R = p.num_ranks, H = p.hidden, I = p.intermediate, Is = p.shared_intermediate, k = p.num_topk;
  const detail::GroupData<T> group =
      detail::make_group_data<T>(p, ranks, routed_per_rank, shared, /*for_backward=*/false);

  // Owner-side buffers: the slots combine pushes into, and the shared expert's output.
  std::vector<std::vector<T>> y(R), ys(R);  // [R][T_r, k, H], [R][T_r, H]
  for (int64_t r = 0; r < R; ++r) {
    y[r].assign(ranks[r].num_tokens * k * H, T(0));
    ys[r].assign(ranks[r].num_tokens * H, T(0));
  }

  // Steps 1-3 for routed rows, and the shared expert on each rank's own tokens.
  const std::vector<RowChunk> chunks = detail::make_row_chunks(p, ranks, group.schedules, kRowsPerChunk);
  parallel_for(static_cast<int64_t>(chunks.size()), p.num_threads, [&](int64_t task) {
    const RowChunk& c = chunks[task];
    const int64_t rows = c.end - c.begin;
    if (c.expert == RowChunk::kSharedExpert) {
      std::vector<T> gu(rows * 2 * Is), a(rows * Is);
      detail::mlp_forward_rows(group.shared, p.activation, group.x[c.rank].data() + c.begin * H, rows,
                               gu.data(), a.data(), ys[c.rank].data() + c.begin * H);
      return;
    }
    const std::vector<ScheduleRow>& schedule = group.schedules[c.rank].rows;
    std::vector<T> x_rows(rows * H), gu(rows * 2 * I), a(rows * I), y_rows(rows * H);
    for (int64_t m = 0; m < rows; ++m) {  // dispatch: pull
      const ScheduleRow& row = schedule[c.begin + m];
      const T* src = group.x[row.src_rank].data() + row.src_token * H;
      std::copy(src, src + H, x_rows.data() + m * H);
    }
    detail::mlp_forward_rows(group.experts[c.rank][c.expert], p.activation, x_rows.data(), rows, gu.data(),
                             a.data(), y_rows.data());
    for (int64_t m = 0; m < rows; ++m) {  // combine: push into the owner's (token, slot)
      const ScheduleRow& row = schedule[c.begin + m];
      std::copy(y_rows.data() + m * H, y_rows.data() + (m + 1) * H,
                y[row.src_rank].data() + (row.src_token * k + row.slot) * H);
    }
  });

  // Step 4 on every owner, token by token.
  std::vector<RankForward> result(R);
  for (int64_t r = 0; r < R; ++r) result[r].out.assign(ranks[r].num_tokens * H, 0.0);
  const std::vector<RowChunk> token_chunks = detail::make_token_chunks(ranks, kTokensPerChunk);
  parallel_for(static_cast<int64_t>(token_chunks.size()), p.num_threads, [&](int64_t task) {
    const RowChunk& c = token_chunks[task];
    detail::combine_tokens(ranks[c.rank].topk_idx, group.topk_weights[c.rank].data(), ys[c.rank].data(),
                           y[c.rank].data(), k, H, c.begin, c.end, result[c.rank].out.data());
  });

  for (int64_t r = 0; r < R; ++r) {
    result[r].y = detail::to_double(y[r]);
    result[r].ys = detail::to_double(ys[r]);
  }
  return result;
}

}  // namespace

std::vector<RankForward> forward(const Problem& problem, const std::vector<RankInputs>& ranks,
                                 const std::vector<Weights>& routed_per_rank, const Weights& shared) {
  detail::validate_inputs(problem, ranks, routed_per_rank, shared, /*need_d_out=*/false);
  if (problem.precision == Precision::kFP8) {
    if (problem.numerics == Numerics::kBf16)
      return detail::fp8_forward_t<float>(problem, ranks, routed_per_rank, shared);
    return detail::fp8_forward_t<double>(problem, ranks, routed_per_rank, shared);
  }
  if (problem.numerics == Numerics::kBf16) return forward_t<float>(problem, ranks, routed_per_rank, shared);
  return forward_t<double>(problem, ranks, routed_per_rank, shared);
}

}  // namespace pounce::reference
