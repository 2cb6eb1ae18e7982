// build_schedule() (docs/design.md §2) on hand-computed cases, and its invariants on random routing.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "reference_fixtures.h"

namespace pounce::reference {
namespace {

constexpr ScheduleRow kPad{};

Problem small_problem(int64_t num_ranks, int64_t num_experts, int64_t k, int64_t block_m) {
  Problem p;
  p.hidden = 8;
  p.intermediate = 4;
  p.num_experts = num_experts;
  p.num_topk = k;
  p.num_ranks = num_ranks;
  p.block_m = block_m;
  return p;
}

RankInputs routing_only(int64_t num_tokens, std::vector<int32_t> topk_idx) {
  RankInputs in;
  in.num_tokens = num_tokens;
  in.topk_idx = std::move(topk_idx);
  return in;
}

// 2 ranks, 4 experts (2 local each), k = 2, block_m = 4.
//   rank 0: t0 -> {1, 2}, t1 -> {1, 1} (same expert twice), t2 -> {-1, 3}
//   rank 1: t0 -> {0, 1}, t1 -> {3, -1}, t2 -> {1, 0}
TEST(ReferenceSchedule, HandComputedTwoRanks) {
  const Problem p = small_problem(2, 4, 2, 4);
  const std::vector<RankInputs> ranks = {routing_only(3, {1, 2, 1, 1, -1, 3}),
                                         routing_only(3, {0, 1, 3, -1, 1, 0})};

  // Rank 0 owns experts 0 and 1.
  //   expert 0: src 1 gives (t0, j0), (t2, j1); src 0 gives nothing.
  //   expert 1: src 0 gives (0,0), (1,0), (1,1); src 1 gives (0,1), (2,0); round-robin:
  //             s0#0, s1#0, s0#1, s1#1, s0#2 -> 5 rows, padded to 8.
  const RankSchedule s0 = build_schedule(p, ranks, 0);
  EXPECT_EQ(s0.expert_num_rows, (std::vector<int64_t>{2, 5}));
  EXPECT_EQ(s0.expert_row_offset, (std::vector<int64_t>{0, 4, 12}));
  EXPECT_EQ(s0.recv_from_rank, (std::vector<int64_t>{3, 4}));
  const std::vector<ScheduleRow> rows0 = {
      {1, 0, 0}, {1, 2, 1}, kPad,      kPad,                                    // expert 0
      {0, 0, 0}, {1, 0, 1}, {0, 1, 0}, {1, 2, 0}, {0, 1, 1}, kPad, kPad, kPad,  // expert 1
  };
  EXPECT_EQ(s0.rows, rows0);

  // Rank 1 owns experts 2 and 3.
  //   expert 2: src 0 gives (0,1).
  //   expert 3: src 0 gives (2,1); src 1 gives (1,0).
  const RankSchedule s1 = build_schedule(p, ranks, 1);
  EXPECT_EQ(s1.expert_num_rows, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(s1.expert_row_offset, (std::vector<int64_t>{0, 4, 8}));
  EXPECT_EQ(s1.recv_from_rank, (std::vector<int64_t>{2, 1}));
  const std::vector<ScheduleRow> rows1 = {
      {0, 0, 1}, kPad,      kPad, kPad,  // expert 2
      {0, 2, 1}, {1, 1, 0}, kPad, kPad,  // expert 3
  };
  EXPECT_EQ(s1.rows, rows1);
}

// 3 ranks with an empty source, an empty expert, a count that is an exact multiple of block_m, and
// one source that outlasts the others in the round-robin.
//   6 experts, 2 local each, k = 2, block_m = 2.
//   rank 0: t0 -> {4, 5}, t1 -> {4, -1}, t2 -> {4, 4}
//   rank 1: T = 0
//   rank 2: t0 -> {5, 4}
TEST(ReferenceSchedule, HandComputedEmptySourceAndExpert) {
  const Problem p = small_problem(3, 6, 2, 2);
  const std::vector<RankInputs> ranks = {routing_only(3, {4, 5, 4, -1, 4, 4}), routing_only(0, {}),
                                         routing_only(1, {5, 4})};
  // Rank 0 and 1 receive nothing: every segment is empty and every offset 0.
  for (int64_t r : {0, 1}) {
    const RankSchedule s = build_schedule(p, ranks, r);
    EXPECT_EQ(s.expert_num_rows, (std::vector<int64_t>{0, 0})) << "rank " << r;
    EXPECT_EQ(s.expert_row_offset, (std::vector<int64_t>{0, 0, 0})) << "rank " << r;
    EXPECT_EQ(s.recv_from_rank, (std::vector<int64_t>{0, 0, 0})) << "rank " << r;
    EXPECT_TRUE(s.rows.empty()) << "rank " << r;
  }
  // Rank 2, expert 4: src 0 gives (0,0), (1,0), (2,0), (2,1); src 2 gives (0,1).
  //   round-robin: s0#0, s2#0, s0#1, s0#2, s0#3 -> 5 rows, padded to 6.
  // Expert 5: src 0 gives (0,1); src 2 gives (0,0) -> 2 rows, no padding.
  const RankSchedule s2 = build_schedule(p, ranks, 2);
  EXPECT_EQ(s2.expert_num_rows, (std::vector<int64_t>{5, 2}));
  EXPECT_EQ(s2.expert_row_offset, (std::vector<int64_t>{0, 6, 8}));
  EXPECT_EQ(s2.recv_from_rank, (std::vector<int64_t>{5, 0, 2}));
  const std::vector<ScheduleRow> rows2 = {
      {0, 0, 0}, {2, 0, 1}, {0, 1, 0}, {0, 2, 0}, {0, 2, 1}, kPad,  // expert 4
      {0, 0, 1}, {2, 0, 0},                                         // expert 5
  };
  EXPECT_EQ(s2.rows, rows2);
}

// On random routing: every used (src, token, slot) appears exactly once over all ranks, on its expert's
// segment; segments are padded exactly; per-source order is ascending; counts add up.
TEST(ReferenceSchedule, InvariantsOnRandomRouting) {
  std::mt19937 rng(1234);
  for (int64_t R : {1, 2, 4, 8}) {
    Problem p = small_problem(R, 16, 4, 8);
    std::vector<RankInputs> ranks;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t T = std::uniform_int_distribution<int64_t>(0, 40)(rng);
      ranks.push_back(routing_only(T, testing::random_routing(rng, T, 4, 16, 0.15)));
    }
    std::map<std::tuple<int32_t, int32_t, int32_t>, int> seen;
    for (int64_t r = 0; r < R; ++r) {
      const RankSchedule s = build_schedule(p, ranks, r);
      const int64_t El = p.num_local_experts();
      ASSERT_EQ(static_cast<int64_t>(s.rows.size()), s.expert_row_offset[El]);
      int64_t total = 0;
      for (int64_t le = 0; le < El; ++le) {
        const int64_t first = s.expert_row_offset[le], count = s.expert_num_rows[le];
        EXPECT_EQ(s.expert_row_offset[le + 1] - first, (count + 7) / 8 * 8);
        std::vector<std::pair<int32_t, int32_t>> last_from_src(R, {-1, -1});
        for (int64_t m = first; m < s.expert_row_offset[le + 1]; ++m) {
          const ScheduleRow& row = s.rows[m];
          if (m >= first + count) {
            EXPECT_TRUE(row.is_padding());
            continue;
          }
          ASSERT_FALSE(row.is_padding());
          EXPECT_EQ(ranks[row.src_rank].topk_idx[row.src_token * 4 + row.slot], r * El + le);
          const std::pair<int32_t, int32_t> token_slot{row.src_token, row.slot};
          EXPECT_LT(last_from_src[row.src_rank], token_slot);
          last_from_src[row.src_rank] = token_slot;
          ++seen[{row.src_rank, row.src_token, row.slot}];
        }
        total += count;
      }
      int64_t received = 0;
      for (int64_t n : s.recv_from_rank) received += n;
      EXPECT_EQ(received, total);
    }
    size_t used = 0;
    for (const RankInputs& in : ranks) {
      for (int32_t e : in.topk_idx) used += e >= 0;
    }
    EXPECT_EQ(seen.size(), used) << "R = " << R;
    for (const auto& [pair, times] : seen) EXPECT_EQ(times, 1);
  }
}

TEST(ReferenceSchedule, RejectsBadRouting) {
  const Problem p = small_problem(2, 4, 2, 4);
  const std::vector<RankInputs> bad_id = {routing_only(1, {0, 1}), routing_only(2, {0, 1, 2, 4})};
  try {
    build_schedule(p, bad_id, 0);
    FAIL() << "expected pounce::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk_idx[rank 1][1, 1] = 4 is out of range [-1, 4)"),
              std::string::npos)
        << e.what();
  }
  const std::vector<RankInputs> short_idx = {routing_only(2, {0, 1, 2}), routing_only(0, {})};
  EXPECT_THROW(build_schedule(p, short_idx, 0), Error);
  const std::vector<RankInputs> ok = {routing_only(1, {0, 1}), routing_only(0, {})};
  EXPECT_THROW(build_schedule(p, ok, 2), Error);
  EXPECT_THROW(build_schedule(p, {ok[0]}, 0), Error);  // one RankInputs for two ranks
}

}  // namespace
}  // namespace pounce::reference
