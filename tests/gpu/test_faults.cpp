// Fault and error paths (docs/design.md §6): each ends in an error the caller can read, never a hang, a trap,
// a segfault or a write out of bounds, and the next call is clean. An out-of-range expert id (forward:
// reported, out NaN, raised by pounce::check_errors right after the call; backward: skipped like a
// -1 slot, as the CPU reference is told); a peer that never calls forward (rank 0's barrier wait times out
// with a record naming the barrier and the peer); a token sending more rows than the smallest macrobatch
// ring holds (reported, slots poisoned, nothing routed computed); a ring below one expert's rows (rejected
// when the workspace is created); backward without a matching forward (rejected, as on the CPU backend).
// Results that are computed are checked against the CPU reference through forward_harness.h and
// backward_harness.h.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "backward_harness.h"
#include "forward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"
#include "kernels/layout/workspace_layout.cuh"
#include "src/gpu_backend.h"
#include "src/state.h"

namespace pounce::gpu_test {
namespace {

TEST(Faults, ForwardOutOfRangeExpertIdIsReportedNotWritten) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 128, 64, 4, 2, 0, 1), Activation::swiglu(), 16);
  Call bad = random_routing({64}, 31);
  bad.bad_id = 1000;
  Call good = random_routing({64}, 32);
  std::vector<std::vector<RankData>> data = {{make_rank_data(m.shape, bad, 0)},
                                             {make_rank_data(m.shape, good, 0)}};
  const ForwardResults results = run_forward(m, data, {bad, good}, ForwardMode::kEagerTwice);
  EXPECT_NE(results[0][0].error.find("topk_idx value out of range"), std::string::npos)
      << results[0][0].error;
  // The error was reported and cleared: the next call with valid routing succeeds.
  check_forward_call(m, good, data[1], results[1], "after the bad call");
}

// pounce::check_errors with synchronize raises the bad id right after the failing call, not at the next
// call, and clears it: a second check finds nothing, and the next valid call runs clean and writes out.
TEST(Faults, CheckErrorsRaisesRightAfterTheFailingCall) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 128, 64, 4, 2, 0, 1), Activation::swiglu(), 19);
  Call bad = random_routing({64}, 33);
  bad.bad_id = 1000;
  const RankData bad_data = make_rank_data(m.shape, bad, 0);
  const RankData good_data = make_rank_data(m.shape, random_routing({64}, 34), 0);
  std::string after_bad, checked_again, after_good;
  int64_t written = 0;
  run_ranks(1, [&](const Group& group, int rank) {
    Workspace workspace(group, m.shape, Config{});
    DeviceWeights weights(m, rank, rank);
    DeviceInputs in(m.shape);
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto error_of = [](const std::function<void()>& body) -> std::string {
      try {
        body();
      } catch (const Error& error) {
        return error.what();
      }
      return "";
    };
    auto forward_then_check = [&](const RankData& d) {
      in.upload(m.shape, d, false, stream);
      in.out.poison(stream);
      ForwardArgs args = in.args(m.shape, 64, false, rank);
      args.routed = weights.routed;
      return error_of([&] {
        forward(workspace, args, stream);
        check_errors(workspace, stream, /*synchronize=*/true);
      });
    };
    after_bad = forward_then_check(bad_data);
    checked_again = error_of([&] { check_errors(workspace, stream, /*synchronize=*/true); });
    after_good = forward_then_check(good_data);
    const std::vector<uint16_t> out = download<uint16_t>(in.out.ptr, 64 * m.shape.hidden);
    written = count_unpoisoned(out.data(), out.data() + out.size());
    CUDA_OK(cudaStreamDestroy(stream));
  });
  EXPECT_NE(after_bad.find("topk_idx value out of range"), std::string::npos)
      << "check_errors right after the bad call must raise it; got '" << after_bad << "'";
  EXPECT_NE(after_bad.find("= 1000"), std::string::npos) << after_bad;
  EXPECT_EQ(checked_again, "") << "the record must be cleared once raised";
  EXPECT_EQ(after_good, "") << "the valid call after the bad one must run clean";
  EXPECT_EQ(written, 64 * m.shape.hidden) << "the valid call must write every element of out";
}

// Every element of `bytes` is the NaN the layer writes into a failing call's outputs (bf16 0x7FC0, fp32
// 0x7FC00000): neither the tests' 0xFF poison nor a computed value.
bool all_layer_nan(const std::vector<uint8_t>& bytes, size_t element_bytes) {
  for (size_t i = 0; i < bytes.size(); i += element_bytes) {
    uint32_t bits = 0;
    std::memcpy(&bits, bytes.data() + i, element_bytes);
    if (bits != (element_bytes == 2 ? 0x7FC0u : 0x7FC00000u)) return false;
  }
  return !bytes.empty();
}

// A failing call leaves NaN in every output, whether the failure is its own or that of an earlier call on
// the stream that nobody checked in between: here a CUDA graph of forward + backward replayed with an
// out-of-range id in the routing (the forward records it; the backward, replayed right after it, poisons
// d_x, d_topk_weights and every weight gradient too). Valid replays before and after are finite and clean.
// On both kernel paths.
TEST(Faults, FailingCallsLeaveNaNInEveryOutput) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 128, 64, 4, 2, 0, 1), Activation::swiglu(), 23);
  Call bad = random_routing({64}, 41);
  bad.bad_id = 1000;
  const RankData bad_data = make_rank_data(m.shape, bad, 0);
  const RankData good_data = make_rank_data(m.shape, random_routing({64}, 42), 0);
  for (const KernelPath path : {KernelPath::kFused, KernelPath::kStaged}) {
    SCOPED_TRACE(path == KernelPath::kFused ? "fused kernels" : "staged kernels");
    Config config;
    config.kernel_path = config.backward_kernel_path = path;
    struct Replay {
      std::string error;
      std::vector<uint8_t> out;
      Snapshot grads;
    };
    std::vector<Replay> replays;
    run_ranks(1, [&](const Group& group, int rank) {
      Workspace workspace(group, m.shape, config);
      DeviceWeights weights(m, rank, rank);
      DeviceInputs in(m.shape);
      DeviceBackward grads(m.shape, rank);
      cudaStream_t stream;
      CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      ForwardArgs fwd = in.args(m.shape, 64, false, rank);
      fwd.routed = weights.routed;
      const BackwardArgs bwd = grads.args(fwd, 64, GradMode::kStoreF32);
      in.upload(m.shape, good_data, false, stream);
      grads.upload_d_out(good_data.d_out, stream);
      forward(workspace, fwd, stream);  // lazy loading and first-call setup outside the capture
      backward(workspace, bwd, stream);
      check_errors(workspace, stream, /*synchronize=*/true);
      cudaGraph_t captured;
      cudaGraphExec_t graph;
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      forward(workspace, fwd, stream);
      backward(workspace, bwd, stream);
      CUDA_OK(cudaStreamEndCapture(stream, &captured));
      CUDA_OK(cudaGraphInstantiate(&graph, captured, 0));
      CUDA_OK(cudaGraphDestroy(captured));
      for (const RankData* d : {&good_data, &bad_data, &good_data}) {
        in.upload(m.shape, *d, false, stream);
        grads.upload_d_out(d->d_out, stream);
        in.out.poison(stream);
        grads.prepare(GradMode::kStoreF32, {}, stream);
        CUDA_OK(cudaGraphLaunch(graph, stream));
        Replay replay;
        try {
          check_errors(workspace, stream, /*synchronize=*/true);
        } catch (const Error& error) {
          replay.error = error.what();
        }
        replay.out = download<uint8_t>(in.out.ptr, 64 * m.shape.hidden * sizeof(uint16_t));
        replay.grads = grads.read(GradMode::kStoreF32, 64);
        replays.push_back(std::move(replay));
      }
      CUDA_OK(cudaGraphExecDestroy(graph));
      CUDA_OK(cudaStreamDestroy(stream));
    });
    ASSERT_EQ(replays.size(), 3u);
    for (int r : {0, 2}) {
      EXPECT_EQ(replays[r].error, "") << "valid replay " << r;
      std::vector<uint16_t> out(replays[r].out.size() / 2);
      std::memcpy(out.data(), replays[r].out.data(), replays[r].out.size());
      EXPECT_EQ(count_unpoisoned(out.data(), out.data() + out.size()), static_cast<int64_t>(out.size()))
          << "valid replay " << r << " must write every byte of out";
      EXPECT_FALSE(all_layer_nan(replays[r].out, 2)) << "valid replay " << r;
    }
    const Replay& failed = replays[1];
    EXPECT_NE(failed.error.find("topk_idx value out of range"), std::string::npos) << failed.error;
    EXPECT_TRUE(all_layer_nan(failed.out, 2)) << "out of the failing forward";
    for (int o = 0; o < kNumOutputs; ++o) {
      if (failed.grads.outputs[o].empty()) continue;
      EXPECT_TRUE(all_layer_nan(failed.grads.outputs[o], failed.grads.element_bytes[o]))
          << kOutputNames[o] << " of the backward replayed after the failing forward";
      EXPECT_FALSE(all_layer_nan(replays[2].grads.outputs[o], replays[2].grads.element_bytes[o]))
          << kOutputNames[o] << " of the valid replay after it";
    }
  }
}

// Fault injection at every named wait (gpu::inject_wait_failure): each wait of the layer, failed at once on
// one call as if its bound had run out, ends that call in the error naming it (raised by check_errors right
// after the call), NaN in every output of the call, and the next call runs clean, bitwise equal to the call
// before the failure. Each wait where the layer uses it: the barriers on both paths (one rank has no peer to
// wait for, so the injected barrier fails against itself), the fused forward's and backward's waits, the
// macrobatch ring's (the smallest ring: four macrobatches), the staged GEMMs' stage rings.
TEST(Faults, InjectedFailureAtEveryWaitIsNamedAndTheNextCallIsClean) {
  SKIP_UNLESS_GPUS(1);
  using kernels::layout::WaitId;
  // The fused waits' and the handoff's failures cost one bound (the other side waits it out): keep it short.
  const ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "0.3");
  const Model m = make_model(make_shape(128, 128, 64, 4, 2, 0, 1), Activation::swiglu(), 29);
  const RankData d = make_rank_data(m.shape, random_routing({128}, 43), 0);
  struct Injection {
    WaitId wait;
    KernelPath path;
    bool ring;      // the smallest macrobatch ring
    bool backward;  // the wait is the backward's (the forward before it runs clean)
    const char* error;
    bool push = false;  // the push combine (one rank scatters by default): its communication CTAs wait
  };
  constexpr KernelPath kFused = KernelPath::kFused, kStaged = KernelPath::kStaged;
  const std::vector<Injection> injections = {
      {WaitId::kRoutingBarrier, kStaged, false, false, "waited at the forward routing barrier"},
      {WaitId::kRoutingBarrier, kFused, false, false, "waited at the forward routing barrier"},
      {WaitId::kCombineBarrier, kStaged, false, false, "waited at the forward combine barrier"},
      {WaitId::kCombineBarrier, kFused, false, false, "waited at the forward combine barrier"},
      {WaitId::kBackwardInputsBarrier, kStaged, false, true, "waited at the backward inputs (d_out staged)"},
      {WaitId::kBackwardInputsBarrier, kFused, false, true, "waited at the backward inputs (d_out staged)"},
      {WaitId::kBackwardCombineBarrier, kStaged, false, true, "waited at the backward combine (d_x pushed)"},
      {WaitId::kBackwardCombineBarrier, kFused, false, true, "waited at the backward combine (d_x pushed)"},
      {WaitId::kFusedRowsReady, kFused, false, false, "fused forward: minibatch rows pulled"},
      {WaitId::kFusedGateUpDone, kFused, false, false, "fused forward: gate/up tiles of an m-block"},
      {WaitId::kFusedRowsDone, kFused, false, false, "fused forward: down tiles of a minibatch", true},
      {WaitId::kFusedTaskHandoff, kFused, false, false, "fused kernel: task or stage handoff"},
      {WaitId::kFusedTaskHandoff, kFused, false, true, "fused kernel: task or stage handoff"},
      {WaitId::kFusedBackwardRowsReady, kFused, false, true, "fused backward: minibatch dy rows pulled"},
      {WaitId::kFusedActGradDone, kFused, false, true, "fused backward: d_a tiles of an m-block"},
      {WaitId::kFusedBackwardRowsDone, kFused, false, true, "fused backward: d_x tiles of a minibatch", true},
      {WaitId::kFusedGridStep, kFused, false, false, "fused forward: a grid-wide step"},
      {WaitId::kFusedReplayRowsReady, kFused, true, true, "minibatch x rows pulled again"},
      {WaitId::kFusedReplayDone, kFused, true, true, "fused backward: replayed gate/up tiles"},
      {WaitId::kFusedRingFree, kFused, true, false, "fused forward: the previous macrobatch's ring rows"},
      {WaitId::kStagedGemm, kStaged, false, false, "GPU wait timed out inside a staged GEMM on rank 0"},
      {WaitId::kStagedGemm, kStaged, false, true, "GPU wait timed out inside a staged GEMM on rank 0"},
      {WaitId::kStagedGemm, kStaged, true, true, "GPU wait timed out inside a staged GEMM on rank 0"},
  };
  for (const Injection& injection : injections) {
    const std::string label = "wait " + std::to_string(static_cast<int>(injection.wait)) + ", " +
                              (injection.path == kFused ? "fused" : "staged") +
                              (injection.ring ? ", macrobatch ring" : "") + (injection.push ? ", push" : "") +
                              (injection.backward ? ", backward" : ", forward");
    SCOPED_TRACE(label);
    Config config;
    config.kernel_path = config.backward_kernel_path = injection.path;
    if (injection.ring) config.macrobatch_size = smallest_ring(m.shape);
    if (injection.push) config.combine = CombineMode::kPush;
    // [0] the clean call before, [1] the failing one, [2] the clean one after.
    std::string errors[3];
    std::vector<uint8_t> outs[3];
    Snapshot grads[3];
    run_ranks(1, [&](const Group& group, int rank) {
      Workspace workspace(group, m.shape, config);
      DeviceWeights weights(m, rank, rank);
      DeviceInputs in(m.shape);
      DeviceBackward backward_outputs(m.shape, rank);
      cudaStream_t stream;
      CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      ForwardArgs fwd = in.args(m.shape, 128, false, rank);
      fwd.routed = weights.routed;
      const BackwardArgs bwd = backward_outputs.args(fwd, 128, GradMode::kStoreF32);
      auto inject = [&](Workspace& w) {
        gpu::inject_wait_failure(*w.state().gpu, static_cast<int32_t>(injection.wait));
      };
      in.upload(m.shape, d, false, stream);
      backward_outputs.upload_d_out(d.d_out, stream);
      for (int call = 0; call < 3; ++call) {
        in.out.poison(stream);
        backward_outputs.prepare(GradMode::kStoreF32, {}, stream);
        const bool failing = call == 1;
        try {
          if (failing && !injection.backward) inject(workspace);
          forward(workspace, fwd, stream);
          check_errors(workspace, stream, /*synchronize=*/true);
          // A failed forward leaves no context to differentiate: its call ends here (the throw).
          if (failing && injection.backward) inject(workspace);
          backward(workspace, bwd, stream);
          check_errors(workspace, stream, /*synchronize=*/true);
        } catch (const Error& error) {
          errors[call] = error.what();
        }
        CUDA_OK(cudaStreamSynchronize(stream));
        outs[call] = download<uint8_t>(in.out.ptr, 128 * m.shape.hidden * sizeof(uint16_t));
        grads[call] = backward_outputs.read(GradMode::kStoreF32, 128);
      }
      CUDA_OK(cudaStreamDestroy(stream));
    });
    EXPECT_EQ(errors[0], "") << "the clean call before the injection";
    EXPECT_NE(errors[1].find(injection.error), std::string::npos)
        << "the injected failure must be raised naming its wait; got '" << errors[1] << "'";
    EXPECT_EQ(errors[2], "") << "the call after the injected failure must run clean";
    // A failing forward leaves NaN in out; a failing backward (after a clean forward, whose out stands) NaN
    // in every gradient.
    if (!injection.backward) {
      EXPECT_TRUE(all_layer_nan(outs[1], 2)) << "out of the failing forward";
    } else {
      EXPECT_EQ(outs[1], outs[0]) << "out of the clean forward before the failing backward";
      for (int o = 0; o < kNumOutputs; ++o) {
        if (grads[1].outputs[o].empty()) continue;
        EXPECT_TRUE(all_layer_nan(grads[1].outputs[o], grads[1].element_bytes[o])) << kOutputNames[o];
      }
    }
    EXPECT_EQ(outs[2], outs[0]) << "out after the failure must equal out before it, bitwise";
    EXPECT_EQ(snapshot_difference(grads[2], grads[0]), "") << "gradients after the failure";
  }
}

// Every tensor of a call must be on the workspace's GPU: one that claims another device index (all of the
// call's tensors at once too, which used to pass by agreeing with each other) is rejected before anything is
// queued, naming the argument and the workspace's device; out is left alone.
TEST(Faults, TensorsOnAnotherDeviceIndexAreRejected) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 128, 64, 4, 2, 0, 1), Activation::swiglu(), 24);
  const RankData d = make_rank_data(m.shape, random_routing({64}, 44), 0);
  std::string one_tensor, every_tensor;
  std::vector<uint16_t> out;
  run_ranks(1, [&](const Group& group, int rank) {
    Workspace workspace(group, m.shape, Config{});
    DeviceWeights weights(m, rank, rank);
    DeviceInputs in(m.shape);
    in.upload(m.shape, d, false, nullptr);
    in.out.poison(nullptr);
    ForwardArgs args = in.args(m.shape, 64, false, rank);
    args.routed = weights.routed;
    ForwardArgs elsewhere = args;
    elsewhere.topk_weights.device_id = rank + 1;
    try {
      forward(workspace, elsewhere, nullptr);
    } catch (const Error& error) {
      one_tensor = error.what();
    }
    ForwardArgs all_elsewhere = in.args(m.shape, 64, false, rank + 1);
    all_elsewhere.routed = weights.routed;
    for (TensorView* w : {&all_elsewhere.routed.gate, &all_elsewhere.routed.up, &all_elsewhere.routed.down})
      w->device_id = rank + 1;
    try {
      forward(workspace, all_elsewhere, nullptr);
    } catch (const Error& error) {
      every_tensor = error.what();
    }
    CUDA_OK(cudaDeviceSynchronize());
    out = download<uint16_t>(in.out.ptr, 64 * m.shape.hidden);
  });
  EXPECT_NE(one_tensor.find("argument 'topk_weights'"), std::string::npos) << one_tensor;
  EXPECT_NE(one_tensor.find("(device index 1) but the workspace is on cuda:0"), std::string::npos)
      << one_tensor;
  EXPECT_NE(every_tensor.find("argument 'x'"), std::string::npos) << every_tensor;
  EXPECT_NE(every_tensor.find("the workspace is on cuda:0"), std::string::npos) << every_tensor;
  EXPECT_EQ(count_unpoisoned(out.data(), out.data() + out.size()), 0) << "a rejected call must not write out";
}

// The forward reports the bad id and skips that slot; backward then runs like the reference with -1 there,
// writes nothing out of bounds, and the next call is clean.
TEST(Faults, BackwardOutOfRangeExpertIdIsSkippedAndReported) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 256, 128, 8, 2, 0, 1), Activation::swiglu(), 101);
  Call bad = random_routing({64}, 102);
  bad.bad_id = 1000;
  check_backward(m, {bad, random_routing({64}, 103)});
}

TEST(Faults, MissingPeerTimesOutWithARecordNotAHang) {
  SKIP_UNLESS_GPUS(2);
  const ScopedEnv timeout("POUNCE_PEER_TIMEOUT_S", "1");  // read once, when each workspace is created
  const Model m = make_model(make_shape(64, 128, 64, 4, 2, 0, 2), Activation::swiglu(), 17);
  const Call call = random_routing({64, 64}, 41);
  std::string rank0_error, thread_error;
  std::atomic<bool> rank0_done{false};
  try {
    run_ranks(2, [&](const Group& group, int rank) {
      Workspace workspace(group, m.shape, Config{});
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
      ForwardArgs args = in.args(m.shape, 64, false, rank);
      args.routed = weights.routed;
      forward(workspace, args, nullptr);
      CUDA_OK(cudaDeviceSynchronize());
      try {
        gpu::check_device_errors(*workspace.state().gpu);
      } catch (const Error& error) {
        rank0_error = error.what();
      }
    });
  } catch (const std::exception& error) {
    thread_error = error.what();
  }
  ASSERT_EQ(thread_error, "");
  EXPECT_NE(rank0_error.find("GPU wait timed out: rank 0 waited at the forward routing barrier for rank 1"),
            std::string::npos)
      << rank0_error;
}

// Ranks creating one workspace with different shapes or configs would write at wrong offsets or wait at
// different barriers: creation compares them first, and every rank fails naming the first field that differs.
TEST(Faults, RanksDisagreeingOnTheWorkspaceFailOnEveryRank) {
  SKIP_UNLESS_GPUS(2);
  const Shape shape = make_shape(64, 128, 64, 4, 2, 0, 2);
  for (const bool config_differs : {false, true}) {
    std::string errors[2];
    run_ranks(2, [&](const Group& group, int rank) {
      Shape mine = shape;
      Config config;
      if (rank == 1 && !config_differs) mine.max_tokens = 128;
      if (rank == 1 && config_differs) config.backward_kernel_path = KernelPath::kStaged;
      try {
        Workspace workspace(group, mine, config);
      } catch (const Error& error) {
        errors[rank] = error.what();
      }
    });
    const std::string field = config_differs ? "config.backward_kernel_path" : "shape.max_tokens";
    for (int rank = 0; rank < 2; ++rank) {
      EXPECT_NE(errors[rank].find("ranks created the workspace with different " + field), std::string::npos)
          << "rank " << rank << ": '" << errors[rank] << "'";
    }
    EXPECT_EQ(errors[0], errors[1]) << "every rank reports the same disagreement";
  }
}

// A token naming one expert in every slot sends it more rows than the smallest ring holds: the call reports
// it, computes nothing routed, poisons the owners' slots (NaN outputs, never stale ones), writes nothing out
// of bounds, and the next call is clean.
TEST(Faults, MacrobatchOverflowIsReportedNotWritten) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(128, 128, 64, 4, 2, 0, 1), Activation::swiglu(), 18);
  Call crowded = random_routing({128}, 36);
  Call good = random_routing({128}, 37);
  std::vector<std::vector<RankData>> data = {{make_rank_data(m.shape, crowded, 0)},
                                             {make_rank_data(m.shape, good, 0)}};
  for (int32_t& e : data[0][0].topk_idx) e = 1;  // 256 rows for expert 1, the ring holds 128
  for (const ForwardMode mode : {ForwardMode::kEagerTwice, ForwardMode::kStagedVsFused}) {
    Config ringed;
    ringed.macrobatch_size = smallest_ring(m.shape);  // kBlockM
    const ForwardResults results = run_forward(m, data, {crowded, good}, mode, ringed);
    EXPECT_NE(results[0][0].error.find("macrobatch overflow"), std::string::npos) << results[0][0].error;
    // Every (token, slot) of the crowded call was poisoned with 0x7FC0 NaNs: its owner's sum is NaN, never a
    // stale value (the fresh workspace's slots held zeros).
    const std::vector<uint16_t>& slots = results[0][0].y_slots;
    ASSERT_EQ(slots.size(), static_cast<size_t>(128 * 2 * 128));
    EXPECT_EQ(std::count(slots.begin(), slots.end(), uint16_t{0x7FC0}), static_cast<long>(slots.size()))
        << "an overflowing call must poison its slots";
    check_forward_call(m, good, data[1], results[1], "after the overflowing call");
  }
}

TEST(Faults, MacrobatchBelowOneExpertsRowsIsRejected) {
  SKIP_UNLESS_GPUS(1);
  const Shape s = make_shape(1024, 128, 64, 4, 2, 0, 1);
  std::vector<Group> groups = Group::create_nccl_local(1);
  Config config;
  config.macrobatch_size = 4 * kBlockM;  // below max_tokens = 1024
  try {
    Workspace workspace(groups[0], s, config);
    FAIL() << "a macrobatch below one expert's rows was accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("macrobatch_size"), std::string::npos) << error.what();
  }
}

// The CPU backend's contract (tests/cpu/test_api.cpp): backward needs the forward context of the same
// tokens, and says so instead of computing from a stale or missing context.
TEST(Faults, BackwardWithoutMatchingForwardIsRejected) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 256, 128, 8, 2, 0, 1), Activation::swiglu(), 111);
  const Call call = random_routing({64}, 112);
  const RankData d = make_rank_data(m.shape, call, 0);
  std::string before_forward, mismatched_tokens;
  run_ranks(1, [&](const Group& group, int rank) {
    Workspace workspace(group, m.shape, Config{});
    DeviceWeights weights(m, rank, rank);
    DeviceInputs in(m.shape);
    DeviceBackward grads(m.shape, rank);
    in.upload(m.shape, d, false, nullptr);
    grads.upload_d_out(d.d_out, nullptr);
    auto args_for = [&](int64_t T) {
      ForwardArgs fwd = in.args(m.shape, T, false, rank);
      fwd.routed = weights.routed;
      return fwd;
    };
    auto backward_error = [&](int64_t T) -> std::string {
      try {
        backward(workspace, grads.args(args_for(T), T, GradMode::kStoreF32), nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        gpu::check_device_errors(*workspace.state().gpu);
      } catch (const Error& error) {
        return error.what();
      }
      return "";
    };
    before_forward = backward_error(64);
    forward(workspace, args_for(64), nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    mismatched_tokens = backward_error(32);
  });
  EXPECT_NE(before_forward.find("run forward first"), std::string::npos)
      << "backward before any forward must throw and say to run forward first; got '" << before_forward
      << "'";
  EXPECT_NE(mismatched_tokens.find("matching forward"), std::string::npos)
      << "backward with 32 tokens after a forward of 64 must throw; got '" << mismatched_tokens << "'";
}

}  // namespace
}  // namespace pounce::gpu_test
