// The receive schedule of one rank (docs/design.md §2), the table that drives all four EP transfers.
//
// Rank r owns experts [r * El, (r + 1) * El). For local expert le the rows are the pairs
// (src, token, slot) with topk_idx[src][token, slot] == r * El + le:
//   - per source, in ascending (token, slot) order;
//   - sources interleaved round-robin: pair 0 of every source, then pair 1 of every source that still
//     has one, ...;
//   - the segment padded with {-1, -1, -1} rows up to a multiple of block_m.
#include "pounce/error.h"
#include "reference/detail.h"

namespace pounce::reference {
namespace detail {

RankSchedule build_schedule_unchecked(const Problem& problem, const std::vector<RankInputs>& ranks,
                                      int64_t rank) {
  const int64_t El = problem.num_local_experts(), R = problem.num_ranks, k = problem.num_topk;
  const int64_t first_expert = rank * El;

  // pairs[le][src]: rows for local expert le from source src, ascending (token, slot)
  std::vector<std::vector<std::vector<ScheduleRow>>> pairs(El, std::vector<std::vector<ScheduleRow>>(R));
  RankSchedule schedule;
  schedule.recv_from_rank.assign(R, 0);
  for (int64_t src = 0; src < R; ++src) {
    const RankInputs& in = ranks[src];
    for (int64_t t = 0; t < in.num_tokens; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        const int64_t e = in.topk_idx[t * k + j];
        if (e < first_expert || e >= first_expert + El) continue;  // -1 or another rank's expert
        pairs[e - first_expert][src].push_back(
            {static_cast<int32_t>(src), static_cast<int32_t>(t), static_cast<int32_t>(j)});
        ++schedule.recv_from_rank[src];
      }
    }
  }

  schedule.expert_num_rows.assign(El, 0);
  schedule.expert_row_offset.assign(El + 1, 0);
  for (int64_t le = 0; le < El; ++le) {
    size_t longest = 0;
    for (const auto& from_src : pairs[le]) longest = std::max(longest, from_src.size());
    for (size_t n = 0; n < longest; ++n) {
      for (const auto& from_src : pairs[le]) {
        if (n < from_src.size()) schedule.rows.push_back(from_src[n]);
      }
    }
    const int64_t count = static_cast<int64_t>(schedule.rows.size()) - schedule.expert_row_offset[le];
    const int64_t padded = (count + problem.block_m - 1) / problem.block_m * problem.block_m;
    schedule.rows.resize(schedule.expert_row_offset[le] + padded);  // padding rows are {-1, -1, -1}
    schedule.expert_num_rows[le] = count;
    schedule.expert_row_offset[le + 1] = schedule.expert_row_offset[le] + padded;
  }
  return schedule;
}

}  // namespace detail

RankSchedule build_schedule(const Problem& problem, const std::vector<RankInputs>& ranks, int64_t rank) {
  detail::validate_routing(problem, ranks);
  POUNCE_CHECK(rank >= 0 && rank < problem.num_ranks, "rank = ", rank,
               " is out of range [0, num_ranks = ", problem.num_ranks, ")");
  return detail::build_schedule_unchecked(problem, ranks, rank);
}

}  // namespace pounce::reference
