// The staged GPU forward (src/gpu/staged_forward.cu) against the CPU reference of the whole EP group.
//
// Every case goes through the public API (Group::create_nccl_local, Workspace, pounce::forward), one
// thread per GPU. Each call runs twice with `out` poisoned (0xFFFF, a bf16 NaN) before each run; the two
// results must be bitwise equal. Checked against reference::forward (Numerics::kBf16, inputs converted
// from bf16 to double):
//   - the receive schedule rows and segment offsets read back from the workspace equal
//     reference::build_schedule exactly;
//   - y per (token, used slot) and out within rounding-order noise (docs/design.md §6): max|gpu - ref64| <=
//     2 * max|ref_bf16 - ref64| + atol per tensor (GEMM accumulation order differs from the reference's).
// The model, test data, device buffers and the §6 comparison are shared with the backward test
// (staged_fixtures.h).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference/reference.h"
#include "src/gpu_backend.h"
#include "src/state.h"
#include "staged_fixtures.h"

namespace {

using namespace pounce::staged_test;  // NOLINT(build/namespaces): the shared fixtures

// ---- reference ----

struct Expected {
  std::vector<pounce::reference::RankForward> forward;     // [R] bf16 rounding points
  std::vector<pounce::reference::RankForward> forward64;   // [R] fp64, no rounding: the noise yardstick
  std::vector<pounce::reference::RankSchedule> schedules;  // [R]
};

Expected run_reference(const Model& m, const std::vector<RankData>& data) {
  ReferenceCase c = make_reference_case(m, data);
  Expected e;
  e.forward = pounce::reference::forward(c.problem, c.ranks, c.routed, c.shared);
  c.problem.numerics = pounce::reference::Numerics::kFp64;
  e.forward64 = pounce::reference::forward(c.problem, c.ranks, c.routed, c.shared);
  c.problem.numerics = pounce::reference::Numerics::kBf16;
  for (int64_t r = 0; r < m.shape.num_ranks; ++r)
    e.schedules.push_back(pounce::reference::build_schedule(c.problem, c.ranks, r));
  return e;
}

// ---- GPU side: one thread per rank ----

struct RankResult {
  std::vector<uint16_t> out[2];       // [T, H] per run
  std::vector<uint16_t> y_slots;      // [T, k, H], second run
  std::vector<int32_t> schedule;      // [rows][4]
  std::vector<int32_t> group_offset;  // [El + 1]
  std::vector<int32_t> group_rows;    // [El]
  std::string error;                  // check_device_errors / exception text ("" = none)
};

// How each rank drives its calls: eager twice (default: the fused kernel, Config's default path), through a
// captured CUDA graph, or the staged chain first and the fused kernel second (check_call then demands
// fused == staged bitwise, docs/design.md §6).
enum class Mode { kEagerTwice, kGraphVsEager, kStagedVsFused };

// One rank's share of `calls` on `device` through `group`; fills results[call][rank]. Throws on failure.
void run_rank(const Model& m, const std::vector<std::vector<RankData>>& data, const std::vector<Call>& calls,
              Mode mode, const pounce::Group& group, int rank, int device,
              std::vector<std::vector<RankResult>>& results, const pounce::Config& tuning) {
  const pounce::Shape& s = m.shape;
  CUDA_OK(cudaSetDevice(device));
  pounce::Config config = tuning;
  config.activation = m.activation;
  pounce::Workspace workspace(group, s, config);
  pounce::gpu::GpuWorkspace& gpu_ws = *workspace.state().gpu;
  DeviceWeights weights(m, rank, rank);
  DeviceInputs in(s);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t graph_exec = nullptr;

  for (size_t c = 0; c < calls.size(); ++c) {
    const Call& call = calls[c];
    const RankData& d = data[c][rank];
    const int64_t T = call.num_tokens[rank];
    RankResult& res = results[c][rank];
    in.upload(s, d, call.idx_int64, stream);
    pounce::ForwardArgs args = in.args(s, T, call.idx_int64, rank);
    args.routed = weights.routed;
    args.shared = weights.shared;
    for (int run = 0; run < 2; ++run) {
      CUDA_OK(cudaMemsetAsync(in.out, 0xFF, std::max<int64_t>(T, 1) * s.hidden * 2, stream));
      try {
        if (mode == Mode::kGraphVsEager && run == 0) {
          if (graph_exec == nullptr) {  // captured once, on the first call; replayed with new routing
            pounce::forward(workspace, args, stream);  // warm-up: lazy module loading outside capture
            CUDA_OK(cudaStreamSynchronize(stream));
            CUDA_OK(cudaMemsetAsync(in.out, 0xFF, std::max<int64_t>(T, 1) * s.hidden * 2, stream));
            cudaGraph_t graph;
            CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            pounce::forward(workspace, args, stream);
            CUDA_OK(cudaStreamEndCapture(stream, &graph));
            CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));
            CUDA_OK(cudaGraphDestroy(graph));
          }
          CUDA_OK(cudaGraphLaunch(graph_exec, stream));
        } else {
          if (mode == Mode::kStagedVsFused) {
            pounce::gpu::set_kernel_path(gpu_ws,
                                         run == 0 ? pounce::KernelPath::kStaged : pounce::KernelPath::kFused);
          }
          pounce::forward(workspace, args, stream);
        }
        CUDA_OK(cudaStreamSynchronize(stream));
        pounce::gpu::check_device_errors(gpu_ws);
      } catch (const std::exception& error) {
        res.error = error.what();
        CUDA_OK(cudaStreamSynchronize(stream));
      }
      res.out[run].resize(T * s.hidden);
      if (T > 0) CUDA_OK(cudaMemcpy(res.out[run].data(), in.out, T * s.hidden * 2, cudaMemcpyDeviceToHost));
    }
    const pounce::gpu::ForwardContextView ctx = pounce::gpu::forward_context(gpu_ws);
    if (res.error.empty()) {
      // recompute_forward_context rebuilds the context bitwise (y slots poisoned first), leaves out
      // alone.
      std::vector<uint16_t> y_before(T * s.num_topk * s.hidden), y_after(y_before.size());
      if (T > 0)
        CUDA_OK(cudaMemcpy(y_before.data(), ctx.y_slots, y_before.size() * 2, cudaMemcpyDeviceToHost));
      CUDA_OK(cudaMemset(const_cast<void*>(ctx.y_slots), 0xFF, y_before.size() * 2));
      CUDA_OK(cudaMemsetAsync(in.out, 0xFF, std::max<int64_t>(T, 1) * s.hidden * 2, stream));
      pounce::recompute_forward_context(workspace, args, stream);
      CUDA_OK(cudaStreamSynchronize(stream));
      pounce::gpu::check_device_errors(gpu_ws);
      if (T > 0) CUDA_OK(cudaMemcpy(y_after.data(), ctx.y_slots, y_after.size() * 2, cudaMemcpyDeviceToHost));
      std::vector<uint16_t> out_after(T * s.hidden);
      if (T > 0) CUDA_OK(cudaMemcpy(out_after.data(), in.out, out_after.size() * 2, cudaMemcpyDeviceToHost));
      const std::vector<int32_t> idx = d.topk_idx;
      for (size_t i = 0; i < y_before.size(); ++i) {
        if (idx[i / s.hidden] >= 0 && y_before[i] != y_after[i]) {
          res.error = "recompute_forward_context: y slot element " + std::to_string(i) + " differs";
          break;
        }
      }
      for (uint16_t v : out_after) {
        if (v != kPoison) {
          res.error = "recompute_forward_context wrote out";
          break;
        }
      }
    }
    const int64_t El = s.num_local_experts();
    res.group_offset.resize(El + 1);
    CUDA_OK(cudaMemcpy(res.group_offset.data(), ctx.group_row_offset, (El + 1) * 4, cudaMemcpyDeviceToHost));
    res.group_rows.resize(El);
    CUDA_OK(cudaMemcpy(res.group_rows.data(), ctx.group_rows, El * 4, cudaMemcpyDeviceToHost));
    const int64_t rows = std::min<int64_t>(res.group_offset[El], ctx.rows_capacity);
    res.schedule.resize(rows * 4);
    if (rows > 0) CUDA_OK(cudaMemcpy(res.schedule.data(), ctx.schedule, rows * 16, cudaMemcpyDeviceToHost));
    res.y_slots.resize(T * s.num_topk * s.hidden);
    if (T > 0) {
      CUDA_OK(cudaMemcpy(res.y_slots.data(), ctx.y_slots, res.y_slots.size() * 2, cudaMemcpyDeviceToHost));
    }
  }
  if (graph_exec != nullptr) CUDA_OK(cudaGraphExecDestroy(graph_exec));
  CUDA_OK(cudaStreamDestroy(stream));
  // The workspace is destroyed here, on every rank's thread concurrently (collective deregistration).
}

// Runs `calls` on R GPUs of this process, one thread each; results[call][rank].
std::vector<std::vector<RankResult>> run_on_gpus(const Model& m,
                                                 const std::vector<std::vector<RankData>>& data,
                                                 const std::vector<Call>& calls, Mode mode,
                                                 const pounce::Config& tuning = {}) {
  const int R = static_cast<int>(m.shape.num_ranks);
  std::vector<std::vector<RankResult>> results(calls.size(), std::vector<RankResult>(R));
  run_ranks(R, [&](const pounce::Group& group, int rank) {
    run_rank(m, data, calls, mode, group, rank, rank, results, tuning);
  });
  return results;
}

// ---- checks ----

// `only_rank` >= 0: this process ran that rank alone (one process per GPU); the others are not checked.
void check_call(const Model& m, const Call& call, const std::vector<RankData>& data,
                const std::vector<RankResult>& results, const std::string& label, int only_rank = -1) {
  const pounce::Shape& s = m.shape;
  const int64_t R = s.num_ranks, El = s.num_local_experts(), k = s.num_topk, H = s.hidden;
  const Expected expected = run_reference(m, data);
  for (int64_t r = 0; r < R; ++r) {
    if (only_rank >= 0 && r != only_rank) continue;
    const RankResult& res = results[r];
    const std::string where = label + " rank " + std::to_string(r);
    ASSERT_EQ(res.error, "") << where;
    // Determinism: two runs, bitwise equal (kStagedVsFused: the staged chain, then the fused kernel).
    ASSERT_EQ(res.out[0], res.out[1]) << where << ": the two runs differ";
    // Schedule: exactly the reference's.
    const pounce::reference::RankSchedule& ref = expected.schedules[r];
    for (int64_t e = 0; e <= El; ++e) {
      ASSERT_EQ(res.group_offset[e], ref.expert_row_offset[e]) << where << ": group_row_offset[" << e << "]";
    }
    for (int64_t e = 0; e < El; ++e) {  // what the GEMMs skip padding by (GroupedRows::group_rows)
      ASSERT_EQ(res.group_rows[e], ref.expert_num_rows[e]) << where << ": group_rows[" << e << "]";
    }
    ASSERT_EQ(static_cast<int64_t>(res.schedule.size()) / 4, static_cast<int64_t>(ref.rows.size())) << where;
    for (size_t row = 0; row < ref.rows.size(); ++row) {
      const pounce::reference::ScheduleRow got{res.schedule[row * 4], res.schedule[row * 4 + 1],
                                               res.schedule[row * 4 + 2]};
      ASSERT_EQ(got, ref.rows[row]) << where << ": schedule row " << row << " is (" << got.src_rank << ", "
                                    << got.src_token << ", " << got.slot << "), reference ("
                                    << ref.rows[row].src_rank << ", " << ref.rows[row].src_token << ", "
                                    << ref.rows[row].slot << ")";
    }
    // y per used (token, slot), then out.
    const int64_t T = call.num_tokens[r];
    std::vector<bool> used(T * k * H, false);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        if (data[r].topk_idx[t * k + j] >= 0) std::fill_n(used.begin() + (t * k + j) * H, H, true);
      }
    }
    EXPECT_EQ(compare_close(where + " y", {T, k, H}, pounce::reference::bf16_to_double(res.y_slots),
                            expected.forward[r].y, expected.forward64[r].y, &used),
              "");
    EXPECT_EQ(compare_close(where + " out", {T, H}, pounce::reference::bf16_to_double(res.out[0]),
                            expected.forward[r].out, expected.forward64[r].out),
              "");
  }
}

// `tuning`: the Config fields the test varies (minibatch, macrobatch, combine); the activation is the model's.
void run_and_check(const Model& m, const std::vector<Call>& calls, Mode mode, const std::string& name,
                   const pounce::Config& tuning = {}) {
  const std::vector<std::vector<RankData>> data = make_call_data(m.shape, calls);
  const auto results = run_on_gpus(m, data, calls, mode, tuning);
  for (size_t c = 0; c < calls.size(); ++c) {
    check_call(m, calls[c], data[c], results[c], name + " call " + std::to_string(c));
  }
}

// ---- tests ----

TEST(StagedForward, OneRankSmall) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(100, 128, 64, 4, 2, 0, 1), pounce::Activation::swiglu(), 11);
  run_and_check(m,
                {{{100}, Routing::kRandom, false, 1},
                 {{37}, Routing::kRandom, true, 2},
                 {{0}, Routing::kRandom, false, 3},
                 {{1}, Routing::kAllToOneExpert, false, 4},
                 {{100}, Routing::kFewExperts, false, 5}},
                Mode::kEagerTwice, "one rank small");
}

TEST(StagedForward, OneRankMediumSharedGptOss) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(600, 256, 192, 8, 4, 128, 1), pounce::Activation::gpt_oss(), 12);
  run_and_check(m,
                {{{513}, Routing::kRandom, true, 6},
                 {{600}, Routing::kSparse, false, 7},
                 {{129}, Routing::kAllToOneExpert, false, 8}},
                Mode::kEagerTwice, "one rank medium");
}

TEST(StagedForward, TwoRanksSmallShared) {
  SKIP_UNLESS_GPUS(2);
  const Model m = make_model(make_shape(200, 128, 64, 8, 2, 64, 2), pounce::Activation::swiglu(), 13);
  run_and_check(m,
                {{{100, 37}, Routing::kRandom, false, 9},
                 {{200, 200}, Routing::kRandom, true, 10},
                 {{0, 130}, Routing::kRandom, false, 11},
                 {{0, 0}, Routing::kRandom, false, 12},
                 {{1, 127}, Routing::kSparse, false, 13}},
                Mode::kEagerTwice, "two ranks small");
}

TEST(StagedForward, TwoRanksMediumAdversarial) {
  SKIP_UNLESS_GPUS(2);
  pounce::Activation clamped = pounce::Activation::swiglu();
  clamped.clamp_limit = 1.5f;
  const Model m = make_model(make_shape(1000, 256, 128, 16, 8, 0, 2), clamped, 14);
  run_and_check(m,
                {{{1000, 777}, Routing::kRandom, false, 15},
                 {{1000, 1000}, Routing::kAllToOneExpert, false, 16},
                 {{300, 999}, Routing::kFewExperts, true, 17},
                 {{5, 1000}, Routing::kSparse, false, 18}},
                Mode::kEagerTwice, "two ranks medium");
}

// docs/design.md §6 shape matrix at the large end: 4096 tokens per rank, top-1 and top-8, with a shared expert.
TEST(StagedForward, TwoRanksLargeTopOneAndTopEight) {
  SKIP_UNLESS_GPUS(2);
  for (int64_t k : {1, 8}) {
    const Model m =
        make_model(make_shape(4096, 256, 128, 16, k, 128, 2), pounce::Activation::swiglu(), 20 + k);
    run_and_check(
        m, {{{4096, 4096}, Routing::kRandom, false, 21}, {{4096, 127}, Routing::kAllToOneExpert, true, 22}},
        Mode::kEagerTwice, "two ranks large k=" + std::to_string(k));
  }
}

// Issue #7: 4 and 8 ranks where that many GPUs are visible: more peers in the routing exchange, schedule
// and transfers, unequal T per rank and a rank without tokens.
TEST(StagedForward, FourAndEightRanks) {
  if (visible_gpus() < 4) GTEST_SKIP() << "needs 4 or 8 GPUs, " << visible_gpus() << " visible: skipped";
  for (int R : {4, 8}) {
    if (visible_gpus() < R) continue;
    const Model m =
        make_model(make_shape(300, 256, 128, 2 * R, 4, 64, R), pounce::Activation::swiglu(), 40 + R);
    std::vector<int64_t> uneven(R, 300), single(R, 1);
    for (int r = 0; r < R; ++r) uneven[r] = (r * 97) % 301;  // rank 0 has none
    run_and_check(m,
                  {{uneven, Routing::kRandom, false, 41},
                   {std::vector<int64_t>(R, 300), Routing::kAllToOneExpert, true, 42},
                   {single, Routing::kFewExperts, false, 43}},
                  Mode::kEagerTwice, std::to_string(R) + " ranks");
  }
}

// The fused kernel against the staged chain, bitwise, with both combines (push by the communication CTAs,
// scatter from the down epilogues), over minibatches of one m-block (many handoffs, down tiles waiting on
// gate/up tiles in flight) and the default; routing from uniform to all tokens on one expert, T = 0 on a
// rank, shared expert and both activations.
TEST(FusedForward, EqualsStagedBitwise) {
  SKIP_UNLESS_GPUS(1);
  pounce::Activation clamped = pounce::Activation::gpt_oss();
  clamped.clamp_limit = 2.0f;
  for (int R = 1; R <= std::min(2, visible_gpus()); ++R) {
    const Model shared = make_model(make_shape(700, 256, 192, 8, 4, 128, R), clamped, 31);
    const Model routed =
        make_model(make_shape(1000, 256, 128, 16, 8, 0, R), pounce::Activation::swiglu(), 32);
    auto tokens = [R](int64_t a, int64_t b) {
      return R == 2 ? std::vector<int64_t>{a, b} : std::vector<int64_t>{a};
    };
    for (pounce::CombineMode combine : {pounce::CombineMode::kPush, pounce::CombineMode::kScatter}) {
      for (int64_t minibatch : {int64_t{128}, int64_t{0}}) {
        pounce::Config tuning;
        tuning.combine = combine;
        tuning.minibatch_size = minibatch;
        const std::string label = " ranks " + std::to_string(R) + " combine " + pounce::to_string(combine) +
                                  " minibatch " + std::to_string(minibatch);
        run_and_check(shared,
                      {{tokens(700, 513), Routing::kRandom, false, 33},
                       {tokens(0, 700), Routing::kAllToOneExpert, true, 34},
                       {tokens(129, 1), Routing::kSparse, false, 35}},
                      Mode::kStagedVsFused, "fused vs staged, shared expert" + label, tuning);
        run_and_check(routed,
                      {{tokens(1000, 999), Routing::kRandom, false, 36},
                       {tokens(1000, 1000), Routing::kAllToOneExpert, false, 37},
                       {tokens(300, 0), Routing::kFewExperts, true, 38}},
                      Mode::kStagedVsFused, "fused vs staged" + label, tuning);
      }
    }
  }
}

TEST(StagedForward, CudaGraphReplaysNewRouting) {
  SKIP_UNLESS_GPUS(1);
  const int R = visible_gpus() >= 2 ? 2 : 1;
  const Model m = make_model(make_shape(256, 128, 128, 8, 4, 64, R), pounce::Activation::swiglu(), 15);
  // Same T per rank across calls (the captured shape), different routing each call. Run 0 replays the
  // graph captured on call 0, run 1 is eager: check_call demands bitwise equality and the reference.
  const std::vector<int64_t> tokens = R == 2 ? std::vector<int64_t>{256, 190} : std::vector<int64_t>{190};
  run_and_check(m,
                {{tokens, Routing::kRandom, false, 21},
                 {tokens, Routing::kAllToOneExpert, false, 22},
                 {tokens, Routing::kSparse, false, 23}},
                Mode::kGraphVsEager, "cuda graph");
}

TEST(StagedForward, OutOfRangeExpertIdIsReportedNotWritten) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 128, 64, 4, 2, 0, 1), pounce::Activation::swiglu(), 16);
  Call bad{{64}, Routing::kRandom, false, 31};
  bad.bad_id = 1000;
  Call good{{64}, Routing::kRandom, false, 32};
  std::vector<std::vector<RankData>> data = {{make_rank_data(m.shape, bad, 0)},
                                             {make_rank_data(m.shape, good, 0)}};
  const auto results = run_on_gpus(m, data, {bad, good}, Mode::kEagerTwice);
  EXPECT_NE(results[0][0].error.find("topk_idx value out of range"), std::string::npos)
      << results[0][0].error;
  // The error was reported and cleared: the next call with valid routing succeeds.
  check_call(m, good, data[1], results[1], "after the bad call");
}

TEST(StagedForward, MissingPeerTimesOutWithARecordNotAHang) {
  SKIP_UNLESS_GPUS(2);
  const char* previous = std::getenv("POUNCE_PEER_TIMEOUT_S");
  const std::string saved = previous ? previous : "";
  setenv("POUNCE_PEER_TIMEOUT_S", "1", 1);
  const Model m = make_model(make_shape(64, 128, 64, 4, 2, 0, 2), pounce::Activation::swiglu(), 17);
  const Call call{{64, 64}, Routing::kRandom, false, 41};
  std::vector<pounce::Group> groups = pounce::Group::create_nccl_local(2);
  std::string rank0_error, thread_error;
  std::atomic<bool> rank0_done{false};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        CUDA_OK(cudaSetDevice(rank));
        pounce::Workspace workspace(groups[rank], m.shape, pounce::Config{});
        if (rank != 0) {  // rank 1 never calls forward: rank 0's barrier waits must time out
          for (int wait = 0; wait < 3000 && !rank0_done.load(); ++wait) {
            std::this_thread::sleep_for(std::chrono::milliseconds(10));
          }
          return;  // its symmetric memory stays allocated until rank 0 stopped writing into it
        }
        struct Done {
          std::atomic<bool>& flag;
          ~Done() { flag = true; }
        } done{rank0_done};
        DeviceWeights weights(m, rank, rank);
        DeviceInputs in(m.shape);
        in.upload(m.shape, make_rank_data(m.shape, call, rank), false, nullptr);
        pounce::ForwardArgs args = in.args(m.shape, 64, false, rank);
        args.routed = weights.routed;
        pounce::forward(workspace, args, nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        try {
          pounce::gpu::check_device_errors(*workspace.state().gpu);
        } catch (const pounce::Error& error) {
          rank0_error = error.what();
        }
      } catch (const std::exception& error) {
        thread_error = error.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  if (saved.empty()) {
    unsetenv("POUNCE_PEER_TIMEOUT_S");
  } else {
    setenv("POUNCE_PEER_TIMEOUT_S", saved.c_str(), 1);
  }
  ASSERT_EQ(thread_error, "");
  EXPECT_NE(rank0_error.find("GPU wait timed out: rank 0 waited at the forward routing barrier for rank 1"),
            std::string::npos)
      << rank0_error;
}

// The smallest ring (config.macrobatch_size = num_ranks * max_tokens, padded): the routed experts run in
// several macrobatches, staged then fused, both against the reference and fused == staged bitwise.
TEST(StagedForward, MacrobatchRingMatchesReference) {
  SKIP_UNLESS_GPUS(1);
  for (int R = 1; R <= std::min(2, visible_gpus()); ++R) {
    const Model m = make_model(make_shape(300, 128, 64, 16, 4, 64, R), pounce::Activation::swiglu(), 17);
    const std::vector<int64_t> tokens = R == 2 ? std::vector<int64_t>{300, 255} : std::vector<int64_t>{300};
    const std::vector<Call> calls = {{tokens, Routing::kRandom, false, 33},
                                     {tokens, Routing::kAllToOneExpert, true, 34},
                                     {tokens, Routing::kFewExperts, false, 35}};
    const std::vector<std::vector<RankData>> data = make_call_data(m.shape, calls);
    const int64_t ring = (R * 300 + pounce::kBlockM - 1) / pounce::kBlockM * pounce::kBlockM;
    pounce::Config ringed;
    ringed.macrobatch_size = ring;
    const auto results = run_on_gpus(m, data, calls, Mode::kStagedVsFused, ringed);
    for (size_t c = 0; c < calls.size(); ++c)
      check_call(m, calls[c], data[c], results[c],
                 "ring of " + std::to_string(ring) + " rows, call " + std::to_string(c));
  }
}

// A token naming one expert in every slot sends it more rows than the smallest ring holds: the call reports
// it, computes nothing routed, poisons the owners' slots (NaN outputs, never stale ones), writes nothing out
// of bounds, and the next call is clean.
TEST(StagedForward, MacrobatchOverflowIsReportedNotWritten) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(128, 128, 64, 4, 2, 0, 1), pounce::Activation::swiglu(), 18);
  Call crowded{{128}, Routing::kRandom, false, 36};
  Call good{{128}, Routing::kRandom, false, 37};
  std::vector<std::vector<RankData>> data = {{make_rank_data(m.shape, crowded, 0)},
                                             {make_rank_data(m.shape, good, 0)}};
  for (int32_t& e : data[0][0].topk_idx) e = 1;  // 256 rows for expert 1, the ring holds 128
  for (const Mode mode : {Mode::kEagerTwice, Mode::kStagedVsFused}) {
    pounce::Config smallest_ring;
    smallest_ring.macrobatch_size = pounce::kBlockM;
    const auto results = run_on_gpus(m, data, {crowded, good}, mode, smallest_ring);
    EXPECT_NE(results[0][0].error.find("macrobatch overflow"), std::string::npos) << results[0][0].error;
    // Every (token, slot) of the crowded call was poisoned with 0x7FC0 NaNs: its owner's sum is NaN, never a
    // stale value (the fresh workspace's slots held zeros).
    const std::vector<uint16_t>& slots = results[0][0].y_slots;
    ASSERT_EQ(slots.size(), static_cast<size_t>(128 * 2 * 128));
    EXPECT_EQ(std::count(slots.begin(), slots.end(), uint16_t{0x7FC0}), static_cast<long>(slots.size()))
        << "an overflowing call must poison its slots";
    check_call(m, good, data[1], results[1], "after the overflowing call");
  }
}

TEST(StagedForward, MacrobatchBelowOneExpertsRowsIsRejected) {
  SKIP_UNLESS_GPUS(1);
  const pounce::Shape s = make_shape(1024, 128, 64, 4, 2, 0, 1);
  std::vector<pounce::Group> groups = pounce::Group::create_nccl_local(1);
  pounce::Config config;
  config.macrobatch_size = 4 * pounce::kBlockM;  // below max_tokens = 1024
  try {
    pounce::Workspace workspace(groups[0], s, config);
    FAIL() << "a macrobatch below one expert's rows was accepted";
  } catch (const pounce::Error& error) {
    EXPECT_NE(std::string(error.what()).find("macrobatch_size"), std::string::npos) << error.what();
  }
}

}  // namespace

// One process per GPU, as torchrun starts them:
//   torchrun --no-python --nproc-per-node=2 pounce_gpu_tests --gtest_filter='ProcessGroup.*'
// Every process builds the same inputs from the seed, runs its own rank, and checks it against the reference.
TEST(ProcessGroup, TorchrunEnvironment) {
  if (std::getenv("WORLD_SIZE") == nullptr)
    GTEST_SKIP() << "not started by torchrun/mpirun (no WORLD_SIZE); run: torchrun --no-python "
                    "--nproc-per-node=2 pounce_gpu_tests --gtest_filter='ProcessGroup.*'";
  SKIP_UNLESS_GPUS(1);
  const pounce::Group group = pounce::Group::create_nccl_from_env();
  const int R = group.num_ranks(), rank = group.rank();
  const Model m = make_model(make_shape(512, 256, 128, 4 * R, 4, 128, R), pounce::Activation::swiglu(), 31);
  std::vector<Call> calls = {{std::vector<int64_t>(R, 512), Routing::kRandom, false, 32},
                             {std::vector<int64_t>(R, 77), Routing::kAllToOneExpert, true, 33}};
  const std::vector<std::vector<RankData>> data = make_call_data(m.shape, calls);
  std::vector<std::vector<RankResult>> results(calls.size(), std::vector<RankResult>(R));
  int device = 0;
  CUDA_OK(cudaGetDevice(&device));
  run_rank(m, data, calls, Mode::kEagerTwice, group, rank, device, results, pounce::Config{});
  for (size_t c = 0; c < calls.size(); ++c)
    check_call(m, calls[c], data[c], results[c], "process group call " + std::to_string(c), rank);
}
