// The fused forward kernel's task list (kernels/sched/forward_tasks.cuh), checked on the CPU: every tile
// exactly once, every down tile after all gate/up tiles of its m-block (the deadlock-freedom argument), and
// a cursor fed the increasing but sparse tickets one CTA sees gives the same tasks as a sequential walk.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "kernels/sched/forward_tasks.cuh"
#include "task_list_checks.h"

namespace {

using pounce::kernels::sched::ForwardTaskCursor;
using pounce::kernels::sched::ForwardTaskShape;
using pounce::kernels::sched::Task;
using pounce::kernels::sched::TaskKind;

std::vector<Task> walk(const ForwardTaskShape& shape) {
  return pounce::test::walk<ForwardTaskCursor, Task>(shape);
}

bool is_gate_up(TaskKind kind) {
  return kind == TaskKind::kGateUp || kind == TaskKind::kSharedGateUp;
}
bool is_shared(TaskKind kind) {
  return kind == TaskKind::kSharedGateUp || kind == TaskKind::kSharedDown;
}

void check_shape(const ForwardTaskShape& shape) {
  const std::vector<Task> tasks = walk(shape);
  const int64_t expected = int64_t{shape.shared_m_blocks} * (shape.shared_gate_up_n + shape.shared_down_n) +
                           int64_t{shape.routed_m_blocks} * (shape.gate_up_n + shape.down_n);
  ASSERT_EQ(static_cast<int64_t>(tasks.size()), expected);
  // (shared, gate_up, m, n) -> ticket; each once, inside its GEMM's extents.
  std::map<std::tuple<bool, bool, int32_t, int32_t>, size_t> ticket_of;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const Task& task = tasks[t];
    ASSERT_NE(task.kind, TaskKind::kEnd);
    const bool shared = is_shared(task.kind), gate_up = is_gate_up(task.kind);
    const int32_t m_blocks = shared ? shape.shared_m_blocks : shape.routed_m_blocks;
    const int32_t n_blocks = shared ? (gate_up ? shape.shared_gate_up_n : shape.shared_down_n)
                                    : (gate_up ? shape.gate_up_n : shape.down_n);
    ASSERT_GE(task.m_block, 0);
    ASSERT_LT(task.m_block, m_blocks) << "ticket " << t;
    ASSERT_GE(task.n_block, 0);
    ASSERT_LT(task.n_block, n_blocks) << "ticket " << t;
    if (!shared) {
      ASSERT_EQ(task.unit, task.m_block / shape.unit_blocks) << "routed unit of ticket " << t;
    }
    ASSERT_TRUE(ticket_of.emplace(std::make_tuple(shared, gate_up, task.m_block, task.n_block), t).second)
        << "tile handed out twice, ticket " << t;
  }
  // Down tiles come after every gate/up tile of their m-block.
  for (size_t t = 0; t < tasks.size(); ++t) {
    const Task& task = tasks[t];
    if (is_gate_up(task.kind)) continue;
    const bool shared = is_shared(task.kind);
    const int32_t gate_up_n = shared ? shape.shared_gate_up_n : shape.gate_up_n;
    for (int32_t n = 0; n < gate_up_n; ++n) {
      ASSERT_LT(ticket_of.at(std::make_tuple(shared, true, task.m_block, n)), t)
          << "down tile at ticket " << t << " before a gate/up tile it reads";
    }
  }
  // A CTA's cursor sees sparse increasing tickets: same tasks as the sequential walk, then the end.
  pounce::test::expect_sparse_tickets_match<ForwardTaskCursor>(
      shape, tasks, [](const Task& got, const Task& want, int32_t ticket) {
        EXPECT_EQ(got.kind, want.kind) << "ticket " << ticket;
        EXPECT_EQ(got.m_block, want.m_block) << "ticket " << ticket;
        EXPECT_EQ(got.n_block, want.n_block) << "ticket " << ticket;
        EXPECT_EQ(got.unit, want.unit) << "ticket " << ticket;
      });
}

TEST(ForwardTasks, EmptyListEndsAtOnce) {
  check_shape({0, 0, 8, 2, 3, 4, 5});
  Task task{};
  ForwardTaskCursor cursor({0, 0, 8, 2, 3, 4, 5});
  EXPECT_FALSE(cursor.at(0, task));
}

TEST(ForwardTasks, SharedOnlyRoutedOnlyAndBoth) {
  check_shape({5, 0, 2, 3, 2, 6, 8});
  check_shape({0, 17, 8, 3, 2, 6, 8});
  check_shape({64, 512, 8, 16, 28, 6, 8});  // deepseek-like shared expert, qwen3-like routed extents
  check_shape({1, 1, 1, 1, 1, 1, 1});
}

TEST(ForwardTasks, RandomShapes) {
  std::mt19937 gen(7);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  for (int i = 0; i < 200; ++i) {
    const ForwardTaskShape shape{pick(0, 20), pick(0, 60), pick(1, 12), pick(1, 5),
                                 pick(1, 5),  pick(1, 5),  pick(1, 5)};
    SCOPED_TRACE(::testing::Message() << "shape " << i << ": shared " << shape.shared_m_blocks << ", routed "
                                      << shape.routed_m_blocks << ", unit " << shape.unit_blocks);
    check_shape(shape);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
