// The fused forward's task list over macrobatches (kernels/sched/macrobatch_tasks.cuh), checked on the CPU:
// every tile of every macrobatch exactly once, in its ring and at the right schedule block; every tile of a
// macrobatch before every tile of the next (what the ring-reuse waits rely on); down tiles after the gate/up
// tiles of their m-block; routed units numbered across macrobatches and never spanning two; one macrobatch
// covering every row gives forward_tasks.cuh's list exactly; sparse tickets match the walk.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/sched/forward_tasks.cuh"
#include "kernels/sched/macrobatch_tasks.cuh"
#include "kernels/sched/macrobatches.cuh"
#include "task_list_checks.h"

namespace {

using pounce::kernels::sched::ForwardTaskCursor;
using pounce::kernels::sched::ForwardTaskShape;
using pounce::kernels::sched::MacrobatchTask;
using pounce::kernels::sched::MacrobatchTaskCursor;
using pounce::kernels::sched::MacrobatchTaskShape;
using pounce::kernels::sched::Task;
using pounce::kernels::sched::TaskKind;
constexpr int32_t kBlockM = 128;

bool routed(TaskKind kind) {
  return kind == TaskKind::kGateUp || kind == TaskKind::kDown;
}
bool gate_up(TaskKind kind) {
  return kind == TaskKind::kGateUp || kind == TaskKind::kSharedGateUp;
}

// Expert segments of `rows_per_expert` (each padded to 128) -> the planned macrobatch bounds.
std::vector<int32_t> plan_bounds(const std::vector<int32_t>& rows_per_expert, int32_t ring_rows) {
  std::vector<int32_t> offsets = {0};
  for (int32_t rows : rows_per_expert)
    offsets.push_back(offsets.back() + (rows + kBlockM - 1) / kBlockM * kBlockM);
  const int32_t groups = static_cast<int32_t>(rows_per_expert.size());
  std::vector<int32_t> bounds(pounce::kernels::sched::max_macrobatches(groups, offsets.back(), ring_rows) +
                              1);
  const int32_t count =
      pounce::kernels::sched::plan_macrobatches(offsets.data(), groups, ring_rows, bounds.data());
  bounds.resize(count + 1);
  return bounds;
}

void check(const ForwardTaskShape& base, const std::vector<int32_t>& bounds, int32_t ring_rows) {
  const MacrobatchTaskShape shape{base, bounds.data(), static_cast<int32_t>(bounds.size()) - 1};
  const std::vector<MacrobatchTask> tasks = pounce::test::walk<MacrobatchTaskCursor, MacrobatchTask>(shape);
  const int32_t routed_blocks = (bounds.back() - bounds.front()) / kBlockM;
  ASSERT_EQ(static_cast<int64_t>(tasks.size()),
            int64_t{base.shared_m_blocks} * (base.shared_gate_up_n + base.shared_down_n) +
                int64_t{routed_blocks} * (base.gate_up_n + base.down_n));

  std::map<std::tuple<bool, bool, int32_t, int32_t>, size_t> ticket_of;  // (routed, gate/up, block, n)
  std::map<int32_t, int32_t> unit_macrobatch;
  int32_t last_macrobatch = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const MacrobatchTask& mt = tasks[t];
    const Task& task = mt;
    ASSERT_NE(task.kind, TaskKind::kEnd);
    ASSERT_GE(mt.macrobatch, last_macrobatch) << "ticket " << t << " goes back to an earlier macrobatch";
    last_macrobatch = mt.macrobatch;
    if (routed(task.kind)) {
      const int32_t b = mt.macrobatch;
      ASSERT_LT(b + 1, static_cast<int32_t>(bounds.size()));
      ASSERT_GE(task.m_block, 0);
      ASSERT_LT(task.m_block * kBlockM, bounds[b + 1] - bounds[b])
          << "ticket " << t << " outside its macrobatch";
      ASSERT_LE((task.m_block + 1) * kBlockM, ring_rows) << "ticket " << t << " outside the ring";
      ASSERT_EQ(mt.schedule_block, bounds[b] / kBlockM + task.m_block) << "ticket " << t;
      const auto it = unit_macrobatch.emplace(task.unit, b).first;
      ASSERT_EQ(it->second, b) << "routed unit " << task.unit << " spans two macrobatches";
    } else {
      ASSERT_EQ(mt.macrobatch, 0) << "shared tiles belong to the first list";
      ASSERT_EQ(mt.schedule_block, task.m_block);
    }
    const int32_t n_blocks = routed(task.kind)
                                 ? (gate_up(task.kind) ? base.gate_up_n : base.down_n)
                                 : (gate_up(task.kind) ? base.shared_gate_up_n : base.shared_down_n);
    ASSERT_LT(task.n_block, n_blocks);
    ASSERT_TRUE(
        ticket_of
            .emplace(std::make_tuple(routed(task.kind), gate_up(task.kind), mt.schedule_block, task.n_block),
                     t)
            .second)
        << "tile handed out twice, ticket " << t;
  }
  // Routed units: numbered 0, 1, ... across macrobatches, in macrobatch order.
  int32_t expected_unit = 0, previous_macrobatch = 0;
  for (const auto& [unit, b] : unit_macrobatch) {
    ASSERT_EQ(unit, expected_unit++);
    ASSERT_GE(b, previous_macrobatch);
    previous_macrobatch = b;
  }
  // Down tiles after every gate/up tile of their m-block.
  for (size_t t = 0; t < tasks.size(); ++t) {
    const MacrobatchTask& mt = tasks[t];
    if (gate_up(mt.kind)) continue;
    const bool is_routed = routed(mt.kind);
    for (int32_t n = 0; n < (is_routed ? base.gate_up_n : base.shared_gate_up_n); ++n) {
      ASSERT_LT(ticket_of.at(std::make_tuple(is_routed, true, mt.schedule_block, n)), t);
    }
  }
  pounce::test::expect_sparse_tickets_match<MacrobatchTaskCursor>(
      shape, tasks, [](const MacrobatchTask& got, const MacrobatchTask& want, int32_t ticket) {
        EXPECT_EQ(got.kind, want.kind) << "ticket " << ticket;
        EXPECT_EQ(got.m_block, want.m_block) << "ticket " << ticket;
        EXPECT_EQ(got.n_block, want.n_block) << "ticket " << ticket;
        EXPECT_EQ(got.unit, want.unit) << "ticket " << ticket;
        EXPECT_EQ(got.macrobatch, want.macrobatch) << "ticket " << ticket;
        EXPECT_EQ(got.schedule_block, want.schedule_block) << "ticket " << ticket;
      });
}

ForwardTaskShape base_shape(int32_t shared_m_blocks, int32_t unit_blocks) {
  ForwardTaskShape base{};
  base.shared_m_blocks = shared_m_blocks;
  base.unit_blocks = unit_blocks;
  base.shared_gate_up_n = 2, base.shared_down_n = 3, base.gate_up_n = 4, base.down_n = 5;
  return base;
}

TEST(MacrobatchTasks, SeveralMacrobatchesWithSplitExpert) {
  // Ring of 8 m-blocks; expert 2 (20 blocks) is split into 8 + 8 + 4.
  const int32_t ring = 8 * kBlockM;
  const std::vector<int32_t> bounds = plan_bounds({300, 700, 20 * kBlockM, 1, 0, 900}, ring);
  ASSERT_GT(bounds.size(), 4u);
  for (int32_t unit_blocks : {1, 3, 8}) {
    check(base_shape(3, unit_blocks), bounds, ring);
    check(base_shape(0, unit_blocks), bounds, ring);
  }
}

TEST(MacrobatchTasks, RandomExperts) {
  std::mt19937 gen(7);
  for (int trial = 0; trial < 40; ++trial) {
    std::vector<int32_t> rows(std::uniform_int_distribution<int>(1, 12)(gen));
    for (int32_t& r : rows) r = std::uniform_int_distribution<int32_t>(0, 3000)(gen);
    const int32_t ring = std::uniform_int_distribution<int32_t>(1, 12)(gen) * kBlockM;
    check(base_shape(std::uniform_int_distribution<int32_t>(0, 4)(gen),
                     std::uniform_int_distribution<int32_t>(1, 6)(gen)),
          plan_bounds(rows, ring), ring);
  }
}

TEST(MacrobatchTasks, NoRoutedRowsLeavesTheSharedList) {
  check(base_shape(3, 2), plan_bounds({0, 0}, 4 * kBlockM), 4 * kBlockM);
  check(base_shape(0, 2), plan_bounds({}, 4 * kBlockM), 4 * kBlockM);
}

// A ring holding every row: one macrobatch, exactly today's list.
TEST(MacrobatchTasks, OneMacrobatchIsTheForwardList) {
  const std::vector<int32_t> bounds = plan_bounds({300, 700, 129, 0, 900}, 1 << 20);
  ASSERT_EQ(bounds.size(), 2u);
  ForwardTaskShape base = base_shape(2, 3);
  const MacrobatchTaskShape shape{base, bounds.data(), 1};
  base.routed_m_blocks = bounds[1] / kBlockM;
  const auto expected = pounce::test::walk<ForwardTaskCursor, Task>(base);
  const auto got = pounce::test::walk<MacrobatchTaskCursor, MacrobatchTask>(shape);
  ASSERT_EQ(got.size(), expected.size());
  for (size_t t = 0; t < got.size(); ++t) {
    EXPECT_EQ(got[t].kind, expected[t].kind) << "ticket " << t;
    EXPECT_EQ(got[t].m_block, expected[t].m_block) << "ticket " << t;
    EXPECT_EQ(got[t].n_block, expected[t].n_block) << "ticket " << t;
    EXPECT_EQ(got[t].unit, expected[t].unit) << "ticket " << t;
    EXPECT_EQ(got[t].schedule_block, expected[t].m_block) << "ticket " << t;
  }
}

}  // namespace
