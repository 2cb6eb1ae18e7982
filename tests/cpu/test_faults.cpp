// Faults on the CPU backend (docs/reliability.md): ranks that disagree on a workspace's Shape or Config,
// mismatched call sequences, one rank driven from two threads, a peer that stops, bad environment values.
// Each ends in an error on every rank involved, within the timeout and never as a hang or a crash, with
// no output written (a call the group evaluated and failed leaves NaN outputs, as on GPUs), and the group (or
// a new one, after a peer is gone) keeps working.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "api_fixtures.h"
#include "kernels/layout/workspace_layout.cuh"
#include "pounce/pounce.h"
#include "src/validation.h"

namespace pounce {
namespace {

using namespace pounce::api_testing;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Sets an environment variable for the scope (each ctest test is its own process; the guard also keeps a
// whole-binary run clean).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

bool contains(const std::string& text, const std::string& needle) {
  return text.find(needle) != std::string::npos;
}

bool untouched(const RankData& data) {
  for (uint16_t bits : data.out)
    if (bits != kPoisonBf16) return false;
  for (uint16_t bits : data.d_x)
    if (bits != kPoisonBf16) return false;
  for (float value : data.d_w_gate)
    if (!std::isnan(value)) return false;
  return true;
}

// ---- workspace creation: every field of Shape and Config agrees, or every rank names the first that differs

struct FieldChange {
  const char* name;
  std::function<void(Shape&, Config&)> change;
};

const std::vector<FieldChange>& field_changes() {
  static const std::vector<FieldChange> kChanges = {
      {"shape.max_tokens", [](Shape& s, Config&) { s.max_tokens = 48; }},
      {"shape.hidden", [](Shape& s, Config&) { s.hidden = 128; }},
      {"shape.intermediate", [](Shape& s, Config&) { s.intermediate = 128; }},
      {"shape.num_experts", [](Shape& s, Config&) { s.num_experts = 4; }},
      {"shape.num_topk", [](Shape& s, Config&) { s.num_topk = 3; }},
      {"shape.shared_intermediate", [](Shape& s, Config&) { s.shared_intermediate = 0; }},
      {"shape.num_ranks", [](Shape& s, Config&) { s.num_ranks = 1; }},
      {"config.forward_comm_sms", [](Shape&, Config& c) { c.forward_comm_sms = 8; }},
      {"config.backward_comm_sms", [](Shape&, Config& c) { c.backward_comm_sms = 8; }},
      {"config.minibatch_size", [](Shape&, Config& c) { c.minibatch_size = 256; }},
      {"config.macrobatch_size", [](Shape&, Config& c) { c.macrobatch_size = 128; }},
      {"config.activation.kind", [](Shape&, Config& c) { c.activation.kind = ActivationKind::kGptOss; }},
      {"config.activation.clamp_limit", [](Shape&, Config& c) { c.activation.clamp_limit = 7.0f; }},
      {"config.activation.alpha", [](Shape&, Config& c) { c.activation.alpha = 1.5f; }},
      {"config.precision", [](Shape&, Config& c) { c.precision = Precision::kFP8; }},
      {"config.deterministic", [](Shape&, Config& c) { c.deterministic = false; }},
      {"config.backend", [](Shape&, Config& c) { c.backend = Backend::kCpu; }},
      {"config.kernel_path", [](Shape&, Config& c) { c.kernel_path = KernelPath::kStaged; }},
      {"config.backward_kernel_path", [](Shape&, Config& c) { c.backward_kernel_path = KernelPath::kFused; }},
      {"config.combine", [](Shape&, Config& c) { c.combine = CombineMode::kPush; }},
  };
  return kChanges;
}

class WorkspaceAgreement : public ::testing::TestWithParam<int> {};

// Rank 1 changes one field: both ranks fail naming it (with both values when each is valid on its own; a
// value rank 1 may not pass at all, like num_ranks = 1 on a group of 2, fails as rank 1's own error).
TEST_P(WorkspaceAgreement, FirstDifferingFieldIsNamedOnEveryRank) {
  const FieldChange& field = field_changes()[GetParam()];
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "10");
  auto groups = Group::create_cpu(2);
  const auto start = Clock::now();
  auto errors = on_every_rank(2, [&](int r) {
    Shape shape = small_shape(2);
    Config config;
    if (r == 1) field.change(shape, config);
    Workspace workspace(groups[r], shape, config);
  });
  EXPECT_LT(seconds_since(start), 2.0) << "a disagreement must fail at once";
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(errors[r], field.name)) << "rank " << r << " said: " << errors[r];
    EXPECT_TRUE(contains(errors[r], "on rank 0 but") || contains(errors[r], "rank 1 rejected its inputs") ||
                (r == 1 && !errors[r].empty()))
        << errors[r];
  }
}

INSTANTIATE_TEST_SUITE_P(Fields, WorkspaceAgreement, ::testing::Range(0, WorkspaceFields::kCount),
                         [](const ::testing::TestParamInfo<int>& info) {
                           std::string name = field_changes()[info.param].name;
                           for (char& c : name) c = c == '.' ? '_' : c;
                           return name;
                         });

// A rank whose Shape does not fit its group fails at once, before meeting its peers (who, when they come,
// fail at once naming its error).
TEST(WorkspaceAgreement, RankWithAnInvalidShapeFailsAtOnce) {
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "10");
  auto groups = Group::create_cpu(2);
  Shape shape = small_shape(2);
  shape.num_ranks = 1;
  const auto start = Clock::now();
  try {
    Workspace workspace(groups[0], shape, Config{});
    FAIL() << "a shape for 1 rank was accepted by a group of 2";
  } catch (const Error& error) {
    EXPECT_TRUE(contains(error.what(), "shape.num_ranks = 1 but the group has 2 ranks")) << error.what();
  }
  EXPECT_LT(seconds_since(start), 0.5);
  try {
    Workspace workspace(groups[1], small_shape(2), Config{});
    FAIL() << "the peer of a rank that failed was accepted";
  } catch (const Error& error) {
    EXPECT_TRUE(contains(error.what(), "rank 0 rejected its inputs: shape.num_ranks = 1")) << error.what();
  }
  EXPECT_LT(seconds_since(start), 0.5);
}

TEST(WorkspaceAgreement, EveryFieldIsCompared) {
  ASSERT_EQ(field_changes().size(), static_cast<size_t>(WorkspaceFields::kCount));
  for (int field = 0; field < WorkspaceFields::kCount; ++field) {
    EXPECT_STREQ(WorkspaceFields::name(field), field_changes()[field].name);
    Shape shape = small_shape(2);
    Config config;
    const WorkspaceFields before = WorkspaceFields::of(shape, config);
    field_changes()[field].change(shape, config);
    const WorkspaceFields after = WorkspaceFields::of(shape, config);
    for (int other = 0; other < WorkspaceFields::kCount; ++other)
      EXPECT_EQ(before.values[other] != after.values[other], other == field)
          << "changing " << field_changes()[field].name << " moved " << WorkspaceFields::name(other);
  }
}

TEST(WorkspaceAgreement, MessageGivesEachRanksValue) {
  auto groups = Group::create_cpu(3);
  auto errors = on_every_rank(3, [&](int r) {
    Shape shape = small_shape(2);
    shape.num_ranks = 3;
    shape.num_experts = 6;
    Config config;
    if (r == 1) config.minibatch_size = 256;  // a later field
    if (r == 2) shape.hidden = 128, config.activation.clamp_limit = 0.5f;
    Workspace workspace(groups[r], shape, config);
  });
  for (const auto& error : errors)
    EXPECT_TRUE(contains(error,
                         "ranks created the workspace with different shape.hidden: 64 on rank 0 but 128 "
                         "on rank 2; every rank of the group must pass the same Shape and Config"))
        << error;
}

TEST(WorkspaceAgreement, FloatFieldsPrintTheirValues) {
  Config other;
  other.activation.clamp_limit = 0.25f;
  other.activation.alpha = 1.5f;
  const std::string message = workspace_disagreement(
      {WorkspaceFields::of(small_shape(2), Config{}), WorkspaceFields::of(small_shape(2), other)});
  EXPECT_TRUE(contains(message, "config.activation.clamp_limit: none on rank 0 but 0.25 on rank 1"))
      << message;
  other.activation.clamp_limit.reset();
  EXPECT_TRUE(contains(workspace_disagreement({WorkspaceFields::of(small_shape(2), Config{}),
                                               WorkspaceFields::of(small_shape(2), other)}),
                       "config.activation.alpha: 1.702 on rank 0 but 1.5 on rank 1"));
}

// ---- mismatched call sequences ----------------------------------------------------------------------

enum class Step { kForward, kRecompute, kBackward, kOtherWorkspaceForward, kCreate };

void run_step(Step step, Workspace& workspace, Workspace& other, RankData& data, const Shape& shape,
              const Group& group) {
  switch (step) {
    case Step::kForward:
      return forward(workspace, data.forward_args(shape));
    case Step::kRecompute:
      return recompute_forward_context(workspace, data.forward_args(shape));
    case Step::kBackward:
      return backward(workspace, data.backward_args(shape));
    case Step::kOtherWorkspaceForward:
      return forward(other, data.forward_args(shape));
    case Step::kCreate: {
      Workspace fresh(group, shape, Config{});
      return;
    }
  }
}

struct Mismatch {
  const char* name;
  Step rank0, rank1;
  const char* needle;
};

class MismatchedCalls : public ::testing::TestWithParam<Mismatch> {};

// Both ranks hold two workspaces and ran one forward on the first; then they make different calls: every
// rank fails at once with the same reason, nothing is written, and the next matched calls work.
TEST_P(MismatchedCalls, FailOnEveryRankThenTheGroupWorks) {
  const Mismatch& m = GetParam();
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "10");
  const Shape shape = small_shape(2);
  auto groups = Group::create_cpu(2);
  std::vector<RankData> data, fresh;
  for (int r = 0; r < 2; ++r) data.emplace_back(shape, 16, r, 5), fresh.emplace_back(shape, 16, r, 5);
  std::vector<std::string> mismatch_errors(2);
  double mismatch_seconds = 0;
  auto errors = on_every_rank(2, [&](int r) {
    Workspace workspace(groups[r], shape, Config{}), other(groups[r], shape, Config{});
    forward(workspace, fresh[r].forward_args(shape));
    const auto start = Clock::now();
    try {
      run_step(r == 0 ? m.rank0 : m.rank1, workspace, other, data[r], shape, groups[r]);
    } catch (const Error& error) {
      mismatch_errors[r] = error.what();
    }
    if (r == 0) mismatch_seconds = seconds_since(start);
    forward(workspace, fresh[r].forward_args(shape));  // the group is still usable
    backward(workspace, fresh[r].backward_args(shape));
  });
  EXPECT_LT(mismatch_seconds, 2.0) << "a mismatch must fail at once, not at the timeout";
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r << " after the mismatch";
    EXPECT_TRUE(contains(mismatch_errors[r], m.needle)) << "rank " << r << " said: " << mismatch_errors[r];
    EXPECT_TRUE(untouched(data[r])) << "rank " << r << " wrote outputs of a mismatched call";
    EXPECT_FALSE(untouched(fresh[r])) << "rank " << r << "'s matched calls after the mismatch wrote nothing";
  }
  EXPECT_EQ(mismatch_errors[0].substr(mismatch_errors[0].find(':')),
            mismatch_errors[1].substr(mismatch_errors[1].find(':')))
      << "the ranks must report the same reason";
}

INSTANTIATE_TEST_SUITE_P(
    Sequences, MismatchedCalls,
    ::testing::Values(Mismatch{"ForwardAgainstBackward", Step::kForward, Step::kBackward,
                               "made different calls: forward on rank 0 but backward on rank 1"},
                      Mismatch{
                          "BackwardAgainstRecompute", Step::kBackward, Step::kRecompute,
                          "made different calls: backward on rank 0 but recompute_forward_context on rank 1"},
                      Mismatch{"ForwardAgainstWorkspaceCreation", Step::kForward, Step::kCreate,
                               "made different calls: forward on rank 0 but workspace creation on rank 1"},
                      Mismatch{"DifferentWorkspaces", Step::kForward, Step::kOtherWorkspaceForward,
                               "called forward on different workspaces"}),
    [](const ::testing::TestParamInfo<Mismatch>& info) { return std::string(info.param.name); });

// Rank 0 runs one forward more than rank 1: the second call fails on both ranks; the third (backward on
// both) is in step again and works.
TEST(MismatchedCalls, OneCallAheadFailsThenTheRanksAreInStepAgain) {
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "10");
  const Shape shape = small_shape(2);
  auto groups = Group::create_cpu(2);
  std::vector<RankData> data;
  for (int r = 0; r < 2; ++r) data.emplace_back(shape, 16, r, 9);
  std::vector<std::string> second(2);
  auto errors = on_every_rank(2, [&](int r) {
    Workspace workspace(groups[r], shape, Config{});
    forward(workspace, data[r].forward_args(shape));
    try {
      if (r == 0)
        forward(workspace, data[r].forward_args(shape));
      else
        backward(workspace, data[r].backward_args(shape));
    } catch (const Error& error) {
      second[r] = error.what();
    }
    backward(workspace, data[r].backward_args(shape));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(second[r], "made different calls")) << second[r];
    EXPECT_EQ(errors[r], "");
    for (uint16_t bits : data[r].d_x) ASSERT_NE(bits, kPoisonBf16) << "the backward in step must run";
  }
}

// The ranks pass workspaces of two different groups: neither group's peers ever arrive, so each rank's call
// ends after the timeout (not a hang, not a crash).
TEST(MismatchedCalls, WorkspacesOfDifferentGroupsTimeOut) {
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "0.3");
  const Shape shape = small_shape(2);
  auto a = Group::create_cpu(2), b = Group::create_cpu(2);
  const auto start = Clock::now();
  auto errors = on_every_rank(2, [&](int r) { Workspace workspace(r == 0 ? a[0] : b[1], shape, Config{}); });
  EXPECT_LT(seconds_since(start), 1.5);
  EXPECT_TRUE(contains(errors[0], "rank(s) 1 of 2 never arrived")) << errors[0];
  EXPECT_TRUE(contains(errors[1], "rank(s) 0 of 2 never arrived")) << errors[1];
}

// ---- one rank driven from two threads ---------------------------------------------------------------

// Two threads call forward as rank 0 of a group of two; rank 1 never comes. Before, two arrivals made a
// full barrier and both read rank 1's missing arguments (a crash); now both fail at once.
TEST(TwoThreadsOneRank, BothFailAtOnceWithoutThePeer) {
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "10");
  const Shape shape = small_shape(2);
  auto groups = Group::create_cpu(2);
  std::vector<RankData> data;
  for (int t = 0; t < 2; ++t) data.emplace_back(shape, 16, 0, 3 + t);
  const auto start = Clock::now();
  auto errors = on_every_rank(2, [&](int t) {
    Workspace workspace(groups[0], shape, Config{});  // both threads: rank 0
    forward(workspace, data[t].forward_args(shape));
  });
  EXPECT_LT(seconds_since(start), 2.0);
  for (const auto& error : errors) EXPECT_TRUE(contains(error, "rank 0 arrived twice")) << error;
  for (auto& rank : data) EXPECT_TRUE(untouched(rank));
}

// Two threads as rank 0 and one as rank 1, after a good workspace creation: the duplicate breaks the group,
// every thread fails (the late rank 1 at once), and nothing is written.
TEST(TwoThreadsOneRank, EveryThreadFailsAndNothingIsWritten) {
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "10");
  const Shape shape = small_shape(2);
  auto groups = Group::create_cpu(2);
  std::vector<RankData> data;
  for (int t = 0; t < 3; ++t) data.emplace_back(shape, 16, t == 2 ? 1 : 0, 3 + t);
  std::vector<std::optional<Workspace>> workspaces(2);
  auto created = on_every_rank(2, [&](int r) { workspaces[r].emplace(groups[r], shape, Config{}); });
  ASSERT_EQ(created[0], "");
  ASSERT_EQ(created[1], "");
  const auto start = Clock::now();
  auto errors = on_every_rank(3, [&](int t) {
    if (t == 2) std::this_thread::sleep_for(milliseconds(200));  // both rank-0 threads arrive first
    forward(*workspaces[t == 2 ? 1 : 0], data[t].forward_args(shape));
  });
  EXPECT_LT(seconds_since(start), 2.0);
  for (int t = 0; t < 3; ++t) {
    EXPECT_TRUE(contains(errors[t], "rank 0 arrived twice")) << "thread " << t << ": " << errors[t];
    EXPECT_TRUE(untouched(data[t]));
  }
}

// ---- a peer that stops --------------------------------------------------------------------------------

Shape three_rank_shape(int64_t ranks) {
  Shape shape = small_shape(ranks);
  shape.num_experts = 6;  // divisible by 3 and by the 2 survivors
  return shape;
}

// Runs forward + backward on a fresh group of `ranks` and returns each rank's outputs (the healthy baseline).
std::vector<RankData> healthy_run(int64_t ranks, uint64_t seed) {
  const Shape shape = three_rank_shape(ranks);
  std::vector<RankData> data;
  for (int r = 0; r < ranks; ++r) data.emplace_back(shape, 20, r, seed);
  auto groups = Group::create_cpu(static_cast<int>(ranks));
  auto errors = on_every_rank(static_cast<int>(ranks), [&](int r) {
    Workspace workspace(groups[r], shape, Config{});
    forward(workspace, data[r].forward_args(shape));
    backward(workspace, data[r].backward_args(shape));
  });
  for (const auto& error : errors) EXPECT_EQ(error, "");
  return data;
}

enum class StopAfter { kNothing, kCreation, kForward, kBackward };

class KilledPeer : public ::testing::TestWithParam<StopAfter> {};

// Three ranks; rank 2 stops after some step (its thread returns, as a killed process stops calling). Each
// survivor's next call fails within POUNCE_PEER_TIMEOUT_S plus a little, naming rank 2; the old group then
// fails at once; dropping the old workspaces does not block; the stopped rank coming back fails at once; and
// the survivors' new group of two gives bitwise what a group of two that never saw a fault gives.
TEST_P(KilledPeer, SurvivorsFailWithinTheTimeoutThenANewGroupWorks) {
  const StopAfter stop = GetParam();
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "0.5");
  const Shape shape = three_rank_shape(3);
  auto groups = Group::create_cpu(3);
  std::vector<RankData> data;
  for (int r = 0; r < 3; ++r) data.emplace_back(shape, 20, r, 4);
  std::vector<std::optional<Workspace>> zombie_workspace(3);
  std::vector<double> fail_seconds(3, 0), old_group_seconds(3, 0), teardown_seconds(3, 0);
  std::vector<std::string> fail_errors(3), old_group_errors(3);
  auto errors = on_every_rank(3, [&](int r) {
    std::optional<Workspace> workspace;
    const bool stops = r == 2;
    // Every rank makes the calls up to `stop`; then rank 2 stops and the survivors try the next one.
    auto done = [&](StopAfter step) { return static_cast<int>(stop) >= static_cast<int>(step); };
    if (done(StopAfter::kCreation)) workspace.emplace(groups[r], shape, Config{});
    if (done(StopAfter::kForward)) forward(*workspace, data[r].forward_args(shape));
    if (done(StopAfter::kBackward)) backward(*workspace, data[r].backward_args(shape));
    if (stops) {
      if (workspace) zombie_workspace[r].emplace(std::move(*workspace));
      return;  // stops participating
    }
    auto start = Clock::now();
    try {
      if (!workspace)
        workspace.emplace(groups[r], shape, Config{});
      else if (stop == StopAfter::kCreation)
        forward(*workspace, data[r].forward_args(shape));
      else if (stop == StopAfter::kForward)
        backward(*workspace, data[r].backward_args(shape));
      else
        forward(*workspace, data[r].forward_args(shape));
    } catch (const Error& error) {
      fail_errors[r] = error.what();
    }
    fail_seconds[r] = seconds_since(start);
    start = Clock::now();
    try {
      if (workspace)
        backward(*workspace, data[r].backward_args(shape));
      else
        Workspace again(groups[r], shape, Config{});
    } catch (const Error& error) {
      old_group_errors[r] = error.what();
    }
    old_group_seconds[r] = seconds_since(start);
    start = Clock::now();
    workspace.reset();
    teardown_seconds[r] = seconds_since(start);
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("survivor rank " + std::to_string(r));
    EXPECT_EQ(errors[r], "");
    EXPECT_TRUE(contains(fail_errors[r], "never arrived")) << fail_errors[r];
    EXPECT_LT(fail_seconds[r], 0.5 + 1.0) << "the error must come within the timeout plus a little";
    EXPECT_TRUE(contains(old_group_errors[r], "this group is unusable since")) << old_group_errors[r];
    EXPECT_LT(old_group_seconds[r], 0.1) << "a broken group fails at once";
    EXPECT_LT(teardown_seconds[r], 0.1) << "tearing down after a fault must not block";
  }
  // A survivor reports the stopped rank; with three ranks the other survivor may have been the one that saw
  // the timeout, so at least one names rank 2 directly.
  EXPECT_TRUE(contains(fail_errors[0] + fail_errors[1], "rank(s) 2 of 3 never arrived"))
      << fail_errors[0] << "\n"
      << fail_errors[1];
  // The stopped rank comes back: its next call fails at once.
  const auto back = Clock::now();
  try {
    if (zombie_workspace[2])
      forward(*zombie_workspace[2], data[2].forward_args(shape));
    else
      Workspace late(groups[2], shape, Config{});
    ADD_FAILURE() << "a call on the broken group succeeded";
  } catch (const Error& error) {
    EXPECT_TRUE(contains(error.what(), "this group is unusable since")) << error.what();
  }
  EXPECT_LT(seconds_since(back), 0.1);

  // Recovery: the survivors build a new group of two and run a step; equal to a group that never saw a fault.
  const Shape survivors = three_rank_shape(2);
  std::vector<RankData> after;
  for (int r = 0; r < 2; ++r) after.emplace_back(survivors, 20, r, 8);
  auto new_groups = Group::create_cpu(2);
  auto recovered = on_every_rank(2, [&](int r) {
    Workspace workspace(new_groups[r], survivors, Config{});
    forward(workspace, after[r].forward_args(survivors));
    backward(workspace, after[r].backward_args(survivors));
  });
  const std::vector<RankData> baseline = healthy_run(2, 8);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(recovered[r], "");
    EXPECT_EQ(after[r].out, baseline[r].out);
    EXPECT_EQ(after[r].d_x, baseline[r].d_x);
    for (size_t i = 0; i < after[r].d_w_gate.size(); ++i)
      ASSERT_EQ(after[r].d_w_gate[i], baseline[r].d_w_gate[i]);
  }
}

std::string stop_name(const ::testing::TestParamInfo<StopAfter>& info) {
  static const char* const kNames[] = {"NeverCalls", "StopsAfterCreation", "StopsAfterForward",
                                       "StopsAfterBackward"};
  return kNames[static_cast<int>(info.param)];
}

INSTANTIATE_TEST_SUITE_P(Steps, KilledPeer,
                         ::testing::Values(StopAfter::kNothing, StopAfter::kCreation, StopAfter::kForward,
                                           StopAfter::kBackward),
                         stop_name);

// ---- environment values --------------------------------------------------------------------------------

class BadPeerTimeout : public ::testing::TestWithParam<const char*> {};

// An invalid POUNCE_PEER_TIMEOUT_S fails workspace creation on every rank, naming the variable (no rank
// silently falls back to 120 s, and `inf` does not time out at once).
TEST_P(BadPeerTimeout, FailsCreationOnEveryRank) {
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", GetParam());
  auto groups = Group::create_cpu(2);
  const auto start = Clock::now();
  auto errors = on_every_rank(2, [&](int r) { Workspace workspace(groups[r], small_shape(2), Config{}); });
  EXPECT_LT(seconds_since(start), 1.0);
  for (const auto& error : errors)
    EXPECT_TRUE(contains(error, "POUNCE_PEER_TIMEOUT_S = '" + std::string(GetParam()) + "'")) << error;
}

std::string timeout_name(const ::testing::TestParamInfo<const char*>& info) {
  static const char* const kNames[] = {"abc", "zero", "negative", "inf", "nan", "empty", "unit"};
  return kNames[info.index];
}

INSTANTIATE_TEST_SUITE_P(Values, BadPeerTimeout, ::testing::Values("abc", "0", "-3", "inf", "nan", "", "5s"),
                         timeout_name);

// A huge timeout is a long wait, not an overflow into an immediate timeout.
TEST(PeerTimeout, HugeValueWaitsForALatePeer) {
  ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "1e12");
  auto groups = Group::create_cpu(2);
  auto errors = on_every_rank(2, [&](int r) {
    if (r == 1) std::this_thread::sleep_for(milliseconds(150));
    Workspace workspace(groups[r], small_shape(2), Config{});
  });
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// ---- a token naming one expert in several slots --------------------------------------------------------

// Two ranks of one expert each, top-2, every token naming expert 0 twice: rank 0 receives 2 * R * T rows,
// beyond the R * T * min(k, El) rows that distinct ids can send. The layout's capacity holds them (the GPU
// backend computes them rather than dropping them) and the CPU backend computes them: every out element is
// written and finite.
TEST(DuplicateIds, BeyondDistinctIdsRowsAreHeldAndComputed) {
  Shape shape = small_shape(2);
  shape.max_tokens = 100;  // 400 rows to expert 0, padded 512; min(k, El) rows per token held 384
  shape.num_experts = 2;
  shape.shared_intermediate = 0;
  const int64_t T = shape.max_tokens;
  const auto layout = kernels::layout::WorkspaceLayout::make(
      shape.max_tokens, shape.hidden, shape.intermediate, 0, shape.num_experts, shape.num_topk, 2);
  EXPECT_GE(layout.rows_capacity, kernels::layout::round_up(2 * 2 * T, kernels::layout::kBlockM));
  std::vector<RankData> data;
  for (int r = 0; r < 2; ++r) {
    data.emplace_back(shape, T, r, 61);
    for (int32_t& expert : data[r].topk_idx) expert = 0;
  }
  auto groups = Group::create_cpu(2);
  const auto errors = on_every_rank(2, [&](int r) {
    Workspace workspace(groups[r], shape, Config{});
    forward(workspace, data[r].forward_args(shape));
    backward(workspace, data[r].backward_args(shape));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << "rank " << r;
    for (const uint16_t bits : data[r].out) ASSERT_NE(bits & 0x7F80, 0x7F80) << "rank " << r << ": out";
    for (const float grad : data[r].d_w_gate) ASSERT_TRUE(std::isfinite(grad)) << "rank " << r;
  }
}

// The macrobatch ring holds whole experts: past it (every token naming one expert twice sends it 2 * R * T
// rows, the smallest ring holds R * T), the GPU backend fails the call (kernels/sched/macrobatch_plan.cuh),
// and so does the CPU backend, on every rank with the GPU's message, out NaN on every rank, no backward
// from the failed context; the next call with distinct ids runs clean.
TEST(DuplicateIds, PastTheMacrobatchRingFailEveryRankWithNaNOutputs) {
  Shape shape = small_shape(2);
  shape.max_tokens = 64;
  shape.num_experts = 4;
  const int64_t T = shape.max_tokens;
  Config ringed;
  ringed.macrobatch_size = kernels::layout::kBlockM;  // round_up(R * T, 128): the smallest ring
  std::vector<RankData> crowded, distinct;
  for (int r = 0; r < 2; ++r) {
    crowded.emplace_back(shape, T, r, 62);
    for (int32_t& expert : crowded[r].topk_idx) expert = 1;
    distinct.emplace_back(shape, T, r, 63);
  }
  auto groups = Group::create_cpu(2);
  std::vector<std::string> backward_errors(2), clean_errors(2);
  const auto errors = on_every_rank(2, [&](int r) {
    Workspace workspace(groups[r], shape, ringed);
    try {
      forward(workspace, crowded[r].forward_args(shape));
    } catch (const Error&) {
      try {
        backward(workspace, crowded[r].backward_args(shape));
      } catch (const Error& error) {
        backward_errors[r] = error.what();
      }
      try {
        forward(workspace, distinct[r].forward_args(shape));
        backward(workspace, distinct[r].backward_args(shape));
      } catch (const Error& error) {
        clean_errors[r] = error.what();
      }
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(contains(errors[r],
                         "forward failed on the group: macrobatch overflow on rank 0: local expert 1 "
                         "receives 256 rows (padded) but config.macrobatch_size is 128"))
        << "rank " << r << ": '" << errors[r] << "'";
    for (const uint16_t bits : crowded[r].out) ASSERT_EQ(bits, 0x7FC0) << "rank " << r << ": out must be NaN";
    EXPECT_TRUE(contains(backward_errors[r], "backward called before forward"))
        << "rank " << r << ": '" << backward_errors[r] << "'";
    EXPECT_EQ(clean_errors[r], "") << "rank " << r;
    for (const uint16_t bits : distinct[r].out) ASSERT_NE(bits & 0x7F80, 0x7F80) << "rank " << r;
  }
}

}  // namespace
}  // namespace pounce
