// Macrobatches of the receive schedule (kernels/sched/macrobatches.cuh), checked on the CPU: they tile the
// routed rows exactly, each fits the ring, whole experts are never cut unless larger than the ring (then
// at multiples of the ring from the expert's first row, pieces alone in their macrobatch), and the greedy
// packing closes a macrobatch only when the next expert does not fit.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/layout/workspace_layout.cuh"
#include "kernels/sched/macrobatches.cuh"

namespace {

using pounce::kernels::sched::max_macrobatches;
using pounce::kernels::sched::plan_macrobatches;

std::vector<int32_t> plan(const std::vector<int32_t>& offsets, int32_t ring) {
  const int32_t groups = static_cast<int32_t>(offsets.size()) - 1;
  std::vector<int32_t> bounds(max_macrobatches(groups, offsets.back(), ring) + 1, -1);
  const int32_t count = plan_macrobatches(offsets.data(), groups, ring, bounds.data());
  bounds.resize(count + 1);
  return bounds;
}

void check(const std::vector<int32_t>& offsets, int32_t ring) {
  const std::vector<int32_t> bounds = plan(offsets, ring);
  const int32_t groups = static_cast<int32_t>(offsets.size()) - 1;
  ASSERT_LE(static_cast<int32_t>(bounds.size()) - 1, max_macrobatches(groups, offsets.back(), ring));
  ASSERT_EQ(bounds.front(), offsets.front());
  if (offsets.back() == offsets.front()) {
    EXPECT_EQ(bounds.size(), 1u) << "no rows, no macrobatch";
    return;
  }
  ASSERT_EQ(bounds.back(), offsets.back()) << "the rows are covered to the end";
  for (size_t b = 0; b + 1 < bounds.size(); ++b) {
    ASSERT_LT(bounds[b], bounds[b + 1]) << "macrobatch " << b << " is empty or out of order";
    ASSERT_LE(bounds[b + 1] - bounds[b], ring) << "macrobatch " << b << " exceeds the ring";
  }
  for (int32_t g = 0; g < groups; ++g) {
    const int32_t begin = offsets[g], end = offsets[g + 1];
    for (size_t b = 1; b + 1 < bounds.size(); ++b) {
      const int32_t cut = bounds[b];
      if (cut <= begin || cut >= end) continue;
      // A cut inside an expert: only a split one, at a multiple of the ring from its start.
      ASSERT_GT(end - begin, ring) << "expert " << g << " fits the ring but is cut at " << cut;
      ASSERT_EQ((cut - begin) % ring, 0) << "expert " << g << " cut off the ring grid";
    }
    if (end - begin > ring) {  // its pieces are alone: cuts at its first and last row
      EXPECT_NE(std::find(bounds.begin(), bounds.end(), begin), bounds.end()) << "split expert " << g;
      EXPECT_NE(std::find(bounds.begin(), bounds.end(), end), bounds.end()) << "split expert " << g;
    }
  }
  // Greedy: a macrobatch of whole experts closes only when the expert after it would not fit (a piece of
  // a split expert is closed by design).
  auto inside_split_expert = [&](int32_t first, int32_t last) {
    for (int32_t g = 0; g < groups; ++g) {
      if (offsets[g + 1] - offsets[g] > ring && offsets[g] <= first && last <= offsets[g + 1]) return true;
    }
    return false;
  };
  for (size_t b = 0; b + 2 < bounds.size(); ++b) {
    if (inside_split_expert(bounds[b], bounds[b + 1])) continue;
    const int32_t close = bounds[b + 1];
    for (int32_t g = 0; g < groups; ++g) {
      if (offsets[g] != close || offsets[g + 1] == offsets[g] || offsets[g + 1] - offsets[g] > ring) continue;
      EXPECT_GT(offsets[g + 1] - bounds[b], ring)
          << "macrobatch " << b << " closed although expert " << g << " fit";
    }
  }
}

TEST(Macrobatches, NoRowsNoMacrobatch) {
  EXPECT_EQ(plan({0, 0, 0, 0}, 256).size(), 1u);
  check({0, 0, 0, 0}, 256);
}

TEST(Macrobatches, EverythingFitsInOne) {
  const std::vector<int32_t> bounds = plan({0, 128, 256, 256, 512}, 512);
  EXPECT_EQ(bounds, (std::vector<int32_t>{0, 512}));
}

TEST(Macrobatches, GreedyWholeExperts) {
  // 3 experts of 256 rows, ring 512: two fit, the third starts a new macrobatch.
  EXPECT_EQ(plan({0, 256, 512, 768}, 512), (std::vector<int32_t>{0, 512, 768}));
  check({0, 256, 512, 768}, 512);
}

TEST(Macrobatches, AllTokensToOneExpertIsSplit) {
  // The middle expert holds 1280 rows, ring 512: pieces 512, 512, 256, each alone.
  const std::vector<int32_t> offsets = {0, 128, 1408, 1536};
  EXPECT_EQ(plan(offsets, 512), (std::vector<int32_t>{0, 128, 640, 1152, 1408, 1536}));
  check(offsets, 512);
}

TEST(Macrobatches, RandomSchedules) {
  std::mt19937 gen(23);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  for (int i = 0; i < 500; ++i) {
    const int groups = pick(1, 40);
    std::vector<int32_t> offsets(groups + 1, 0);
    for (int g = 0; g < groups; ++g) offsets[g + 1] = offsets[g] + 128 * (pick(0, 3) == 0 ? 0 : pick(1, 12));
    const int32_t ring = 128 * pick(1, 16);
    SCOPED_TRACE(::testing::Message() << "case " << i << ": " << groups << " experts, ring " << ring);
    check(offsets, ring);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// The GPU ring (kernels/sched/macrobatch_plan.cuh) packs only experts that fit it: then no expert is cut and
// the count stays within WorkspaceLayout::max_macrobatches (two neighbours hold more than the ring), which
// sizes the plan's tables. Segments up to the ring, totals up to the capacity.
TEST(Macrobatches, RingOfWholeExpertsStaysWithinTheLayoutBound) {
  std::mt19937 gen(29);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  for (int i = 0; i < 500; ++i) {
    const int groups = pick(1, 64);
    const int32_t ring = 128 * pick(1, 16);
    const int64_t capacity = 128 * pick(1, 200);
    std::vector<int32_t> offsets(groups + 1, 0);
    for (int g = 0; g < groups; ++g) {
      const int32_t rows = 128 * (pick(0, 2) == 0 ? 0 : pick(1, ring / 128));
      offsets[g + 1] = static_cast<int32_t>(std::min<int64_t>(offsets[g] + rows, capacity));
    }
    const int64_t bound = 2 * (capacity / ring) + 1;  // WorkspaceLayout::max_macrobatches with a ring
    SCOPED_TRACE(::testing::Message()
                 << "case " << i << ": " << groups << " experts, ring " << ring << ", capacity " << capacity);
    const std::vector<int32_t> bounds = plan(offsets, ring);
    EXPECT_LE(static_cast<int64_t>(bounds.size()) - 1, bound);
    for (int32_t g = 0; g < groups; ++g) {
      if (offsets[g + 1] == offsets[g]) continue;
      const auto inside = std::upper_bound(bounds.begin(), bounds.end(), offsets[g]);
      ASSERT_NE(inside, bounds.end());
      EXPECT_LE(offsets[g + 1], *inside) << "expert " << g << " is cut";
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// A ring below the worst case shrinks the eight routed row buffers to ring rows and sizes the plan for
// 2 * floor(rows_capacity / ring) + 1 macrobatches; the default (0) and a ring at the worst case keep the
// layout without a ring.
TEST(Macrobatches, RingShrinksTheRoutedRowBuffers) {
  using pounce::kernels::layout::WorkspaceLayout;
  // deepseek-v3 at EP8, 4096 tokens per rank: 32 local experts, top-8
  const WorkspaceLayout worst = WorkspaceLayout::make(4096, 7168, 2048, 2048, 256, 8, 8, 0);
  const WorkspaceLayout same = WorkspaceLayout::make(4096, 7168, 2048, 2048, 256, 8, 8, worst.rows_capacity);
  const int64_t ring = 2 * 8 * 4096;
  const WorkspaceLayout small = WorkspaceLayout::make(4096, 7168, 2048, 2048, 256, 8, 8, ring);
  EXPECT_EQ(worst.ring_rows, worst.rows_capacity);
  EXPECT_EQ(worst.max_macrobatches, 1);
  EXPECT_EQ(same.local_bytes, worst.local_bytes);
  EXPECT_EQ(small.ring_rows, ring);
  EXPECT_EQ(small.max_macrobatches, 2 * (worst.rows_capacity / ring) + 1);
  const int64_t routed_row_bytes = 2 * (4 * 7168 + 4 * 2048);  // x, y, dy, dx; g, u, act, d_g|d_u (2I)
  EXPECT_EQ(small.loc_x_rows % 256, 0);
  EXPECT_LT(small.local_bytes, worst.local_bytes - (worst.rows_capacity - ring) * routed_row_bytes * 9 / 10)
      << "the routed row buffers shrink to the ring";
}

}  // namespace
