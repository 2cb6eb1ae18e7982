// The fused backward kernel's task list (kernels/sched/backward_tasks.cuh), checked on the CPU: every data
// tile and every weight-gradient tile exactly once, d_x tiles after the d_a tiles of their m-block, every
// weight-gradient tile after all data tiles (so its waits are on smaller tickets), and a cursor fed the
// sparse increasing tickets of one CTA gives the sequential walk's tasks.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/sched/backward_tasks.cuh"
#include "task_list_checks.h"

namespace {

using pounce::kernels::sched::BackwardTask;
using pounce::kernels::sched::BackwardTaskCursor;
using pounce::kernels::sched::BackwardTaskKind;
using pounce::kernels::sched::BackwardTaskShape;
using pounce::kernels::sched::kNumWeightGrads;
using pounce::kernels::sched::WeightGradKind;

std::vector<BackwardTask> walk(const BackwardTaskShape& shape) {
  return pounce::test::walk<BackwardTaskCursor, BackwardTask>(shape);
}

bool is_data(BackwardTaskKind kind) {
  return kind != BackwardTaskKind::kWeightGrad && kind != BackwardTaskKind::kEnd &&
         kind != BackwardTaskKind::kReplayGateUp;
}
bool is_act_grad(BackwardTaskKind kind) {
  return kind == BackwardTaskKind::kActGrad || kind == BackwardTaskKind::kSharedActGrad;
}
bool is_shared(BackwardTaskKind kind) {
  return kind == BackwardTaskKind::kSharedActGrad || kind == BackwardTaskKind::kSharedDataGrad;
}

void check_shape(const BackwardTaskShape& shape) {
  const std::vector<BackwardTask> tasks = walk(shape);
  ASSERT_EQ(static_cast<int32_t>(tasks.size()), shape.num_tiles());
  const auto& d = shape.data;
  std::map<std::tuple<bool, bool, int32_t, int32_t>, size_t> data_ticket;
  std::set<std::tuple<int, int32_t, int32_t, int32_t>> weight_tiles;
  std::map<std::pair<int32_t, int32_t>, size_t> replay_ticket;
  size_t last_data = 0, first_weight = tasks.size(), first_data = tasks.size(), last_replay = 0;
  for (size_t t = 0; t < tasks.size(); ++t) {
    const BackwardTask& task = tasks[t];
    ASSERT_NE(task.kind, BackwardTaskKind::kEnd);
    if (task.kind == BackwardTaskKind::kReplayGateUp) {
      last_replay = t;
      ASSERT_GE(task.m_block, 0);
      ASSERT_LT(task.m_block, shape.replay_m_blocks) << "ticket " << t;
      ASSERT_GE(task.n_block, 0);
      ASSERT_LT(task.n_block, shape.replay_n) << "ticket " << t;
      ASSERT_EQ(task.unit, task.m_block / d.unit_blocks) << "ticket " << t;
      ASSERT_TRUE(replay_ticket.emplace(std::make_pair(task.m_block, task.n_block), t).second)
          << "replay tile handed out twice, ticket " << t;
      continue;
    }
    if (is_data(task.kind)) first_data = std::min(first_data, t);
    if (is_data(task.kind)) {
      last_data = t;
      const bool shared = is_shared(task.kind), act = is_act_grad(task.kind);
      const int32_t m_blocks = shared ? d.shared_m_blocks : d.routed_m_blocks;
      const int32_t n_blocks =
          shared ? (act ? d.shared_gate_up_n : d.shared_down_n) : (act ? d.gate_up_n : d.down_n);
      ASSERT_GE(task.m_block, 0);
      ASSERT_LT(task.m_block, m_blocks) << "ticket " << t;
      ASSERT_GE(task.n_block, 0);
      ASSERT_LT(task.n_block, n_blocks) << "ticket " << t;
      if (!shared) {
        ASSERT_EQ(task.unit, task.m_block / d.unit_blocks) << "ticket " << t;
      }
      ASSERT_TRUE(data_ticket.emplace(std::make_tuple(shared, act, task.m_block, task.n_block), t).second)
          << "data tile handed out twice, ticket " << t;
      continue;
    }
    first_weight = std::min(first_weight, t);
    const int w = static_cast<int>(task.weight);
    ASSERT_GE(w, 0);
    ASSERT_LT(w, kNumWeightGrads);
    const auto& tiles = shape.weight[w];
    ASSERT_GE(task.group, 0);
    ASSERT_LT(task.group, tiles.groups) << "ticket " << t;
    ASSERT_GE(task.m_block, 0);
    ASSERT_LT(task.m_block, tiles.m_blocks) << "ticket " << t;
    ASSERT_GE(task.n_block, 0);
    ASSERT_LT(task.n_block, tiles.n_blocks) << "ticket " << t;
    ASSERT_TRUE(weight_tiles.emplace(w, task.group, task.m_block, task.n_block).second)
        << "weight tile handed out twice, ticket " << t;
  }
  EXPECT_EQ(static_cast<int32_t>(data_ticket.size()), shape.data_tiles());
  EXPECT_EQ(static_cast<int32_t>(replay_ticket.size()), shape.replay_tiles());
  if (!replay_ticket.empty()) {  // the replay comes first: every other tile may wait on it
    EXPECT_LT(last_replay, std::min(first_data, first_weight)) << "a replay tile after a backward tile";
  }
  if (!data_ticket.empty() && first_weight < tasks.size()) {
    EXPECT_LT(last_data, first_weight) << "a weight-gradient tile before the last data tile";
  }
  // d_x tiles come after every d_a tile of their m-block.
  for (const auto& [key, t] : data_ticket) {
    const auto& [shared, act, m_block, n_block] = key;
    if (act) continue;
    const int32_t act_n = shared ? d.shared_gate_up_n : d.gate_up_n;
    for (int32_t n = 0; n < act_n; ++n)
      ASSERT_LT(data_ticket.at(std::make_tuple(shared, true, m_block, n)), t) << "d_x tile before its d_a";
  }
  // Sparse increasing tickets of one CTA.
  pounce::test::expect_sparse_tickets_match<BackwardTaskCursor>(
      shape, tasks, [](const BackwardTask& got, const BackwardTask& want, int32_t ticket) {
        EXPECT_EQ(got.kind, want.kind) << "ticket " << ticket;
        EXPECT_EQ(got.m_block, want.m_block) << "ticket " << ticket;
        EXPECT_EQ(got.n_block, want.n_block) << "ticket " << ticket;
        EXPECT_EQ(got.group, want.group) << "ticket " << ticket;
        EXPECT_EQ(got.weight, want.weight) << "ticket " << ticket;
      });
}

// Data extents {shared m, routed m, unit, shared d_a n, shared d_x n, d_a n, d_x n}; weights for El
// experts and a shared expert (or none), H and I in 64-column units of the test.
BackwardTaskShape make_shape(pounce::kernels::sched::ForwardTaskShape data, int32_t El, bool shared,
                             int32_t H_blocks, int32_t I_blocks) {
  BackwardTaskShape shape;
  shape.data = data;
  auto set = [&](WeightGradKind kind, int32_t groups, int32_t m_blocks, int32_t n_blocks) {
    shape.weight[static_cast<int>(kind)] = {groups, m_blocks, n_blocks};
  };
  set(WeightGradKind::kSharedDown, shared ? 1 : 0, H_blocks, I_blocks);
  set(WeightGradKind::kSharedGate, shared ? 1 : 0, I_blocks, H_blocks);
  set(WeightGradKind::kSharedUp, shared ? 1 : 0, I_blocks, H_blocks);
  set(WeightGradKind::kDown, El, H_blocks, I_blocks);
  set(WeightGradKind::kGate, El, I_blocks, H_blocks);
  set(WeightGradKind::kUp, El, I_blocks, H_blocks);
  return shape;
}

TEST(BackwardTasks, NoRowsStillOwesEveryWeightTile) {
  // A rank without tokens: no data tiles, but every weight gradient is written (zeros).
  const BackwardTaskShape shape = make_shape({0, 0, 8, 0, 0, 2, 3}, 4, true, 3, 2);
  check_shape(shape);
  EXPECT_EQ(shape.data_tiles(), 0);
  EXPECT_EQ(shape.num_tiles(), 3 * 6 + 4 * 3 * 6);
}

TEST(BackwardTasks, SharedAndRoutedShapes) {
  check_shape(make_shape({5, 0, 2, 1, 2, 2, 3}, 2, true, 2, 1));
  check_shape(make_shape({0, 17, 8, 0, 0, 3, 2}, 8, false, 2, 3));
  check_shape(make_shape({64, 512, 8, 8, 28, 8, 28}, 32, true, 56, 16));  // deepseek-like
  check_shape(make_shape({1, 1, 1, 1, 1, 1, 1}, 1, true, 1, 1));
}

// Macrobatch ring: the forward's gate/up tiles of the macrobatch's rows are replayed ahead of the backward,
// unit by unit (a d_a tile waits for its m-block's replay, the replay for its unit's x rows).
TEST(BackwardTasks, ReplayTilesComeFirst) {
  std::mt19937 gen(13);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  for (int i = 0; i < 100; ++i) {
    const bool shared = pick(0, 1) == 1;
    const pounce::kernels::sched::ForwardTaskShape data{
        shared ? pick(0, 20) : 0, pick(1, 60), pick(1, 12), shared ? pick(1, 5) : 0,
        shared ? pick(1, 5) : 0,  pick(1, 5),  pick(1, 5)};
    BackwardTaskShape shape = make_shape(data, pick(1, 9), shared, pick(1, 4), pick(1, 4));
    shape.replay_m_blocks = data.routed_m_blocks;
    shape.replay_n = pick(1, 6);
    SCOPED_TRACE(::testing::Message() << "shape " << i);
    check_shape(shape);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(BackwardTasks, RandomShapes) {
  std::mt19937 gen(11);
  auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); };
  for (int i = 0; i < 200; ++i) {
    const bool shared = pick(0, 1) == 1;
    const pounce::kernels::sched::ForwardTaskShape data{
        shared ? pick(0, 20) : 0, pick(0, 60), pick(1, 12), shared ? pick(1, 5) : 0,
        shared ? pick(1, 5) : 0,  pick(1, 5),  pick(1, 5)};
    SCOPED_TRACE(::testing::Message() << "shape " << i);
    check_shape(make_shape(data, pick(1, 9), shared, pick(1, 4), pick(1, 4)));
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
