// Where a pass spends its time, on the host side, all of it (the device side: kernels/fused/profile.cuh).
// Under POUNCE_PROFILE_STAGES (read once per workspace: WorkspacePointers::profile_tiles) every forward and
// backward prints on stderr the milliseconds between its stage marks on the caller's stream (StageTimer;
// waits for the comm stream included), and a fused pass also its grid steps' milestones and its tiles' time
// per task kind. Off by default: when on, each pass synchronises its stream at the end, and nothing is
// printed while a stream is being captured.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "src/gpu/gpu_state.h"

namespace pounce::gpu {

class StageTimer {
 public:
  // Times the pass when the workspace profiles (POUNCE_PROFILE_STAGES, src/environment.h).
  StageTimer(const char* pass, const kernels::layout::WorkspacePointers& p, cudaStream_t stream)
      : pass_(pass), rank_(p.rank), stream_(stream), enabled_(p.profile_tiles != 0) {
    mark("start");
  }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

  void mark(const char* stage) {
    if (!enabled_) return;
    cudaEvent_t event;
    POUNCE_CUDA(cudaEventCreate(&event));
    POUNCE_CUDA(cudaEventRecord(event, stream_));
    marks_.emplace_back(stage, event);
  }

  ~StageTimer() {
    if (!enabled_ || marks_.empty()) return;
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(stream_, &capture);
    if (std::uncaught_exceptions() > 0 || capture != cudaStreamCaptureStatusNone) {  // nothing to report
      for (auto& [name, event] : marks_) cudaEventDestroy(event);
      return;
    }
    cudaStreamSynchronize(stream_);
    std::string line = std::string("pounce profile rank ") + std::to_string(rank_) + " " + pass_ + ":";
    for (size_t i = 1; i < marks_.size(); ++i) {
      float ms = 0.0f;
      cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second);
      char item[96];
      std::snprintf(item, sizeof(item), " %s %.3f", marks_[i].first, ms);
      line += item;
    }
    std::fprintf(stderr, "%s ms\n", line.c_str());
    for (auto& [name, event] : marks_) cudaEventDestroy(event);
  }

 private:
  const char* pass_;
  int rank_;
  cudaStream_t stream_;
  bool enabled_;
  std::vector<std::pair<const char*, cudaEvent_t>> marks_;
};

// Under POUNCE_PROFILE_STAGES, after a fused kernel: its consumer warpgroups' time per task kind (named in
// `kinds` by enum value), waiting for the tasks of each kind, and the producers' time finding them, summed
// over warpgroups and producers (kernels/layout kFusedTileProfile). Synchronises the stream;
// skipped while capturing. Then the timeline from the first consumer warpgroup's start: its first task, the
// kernel's `milestones` (%globaltimer ns, 0 = not reached) and the earliest and latest time a warpgroup ran
// out of tasks (the tail).
inline void report_tile_profile(const kernels::layout::WorkspacePointers& p, const char* pass,
                                std::initializer_list<const char*> kinds, cudaStream_t stream,
                                std::initializer_list<std::pair<const char*, uint64_t>> milestones = {}) {
  if (p.profile_tiles == 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone)
    return;
  unsigned long long slots[kernels::layout::kNumProfileSlots] = {};
  if (cudaMemcpyAsync(slots, p.fused_counters + kernels::layout::kFusedTileProfile, sizeof(slots),
                      cudaMemcpyDeviceToHost, stream) != cudaSuccess ||
      cudaStreamSynchronize(stream) != cudaSuccess)
    return;
  std::string line =
      std::string("pounce profile rank ") + std::to_string(p.rank) + " fused " + pass + " tiles:";
  double busy_ms = 0.0, handoff_ms = 0.0;
  int kind = 0;
  for (const char* name : kinds) {
    const unsigned long long tasks = slots[kernels::layout::kProfileKindTasks + kind];
    const double ms = slots[kernels::layout::kProfileKindNs + kind] * 1e-6;
    const double waited_ms = slots[kernels::layout::kProfileHandoffNs + kind] * 1e-6;
    const double scheduled_ms = slots[kernels::layout::kProfileSchedulerNs + kind] * 1e-6;
    busy_ms += ms;
    handoff_ms += waited_ms;
    if (tasks > 0) {
      char item[200];
      std::snprintf(item, sizeof(item), " %s %llu x %.1f us (waited %.2f ms, found in %.2f ms),", name, tasks,
                    ms * 1e3 / tasks, waited_ms, scheduled_ms);
      line += item;
    }
    ++kind;
  }
  char tail[160];
  std::snprintf(tail, sizeof(tail), " waiting for tasks %.1f %% of the warpgroups' time",
                100.0 * handoff_ms / std::max(busy_ms + handoff_ms, 1e-9));
  std::fprintf(stderr, "%s%s\n", line.c_str(), tail);

  // Inside the tasks (SM clocks): the clock they ran at, the wait for the first stage, the mainloop, the
  // epilogue (until its last store is issued) and the count; then the waits for each kind's tasks by length.
  kind = 0;
  for (const char* name : kinds) {
    const unsigned long long tasks = slots[kernels::layout::kProfileKindTasks + kind];
    const double ns = static_cast<double>(slots[kernels::layout::kProfileKindNs + kind]);
    const double clocks = static_cast<double>(slots[kernels::layout::kProfileKindClocks + kind]);
    if (tasks > 0 && ns > 0 && clocks > 0) {
      const double ghz = clocks / ns;
      const double first = slots[kernels::layout::kProfileFirstStageClocks + kind] / ghz / tasks * 1e-3;
      const double mainloop = slots[kernels::layout::kProfileMainloopClocks + kind] / ghz / tasks * 1e-3;
      const double count = slots[kernels::layout::kProfileCountClocks + kind] / ghz / tasks * 1e-3;
      const double whole = ns / tasks * 1e-3;
      std::string waits;
      for (int bin = 0; bin < kernels::layout::kProfileWaitBins; ++bin) {
        const unsigned long long n =
            slots[kernels::layout::kProfileWaitBinTasks + kernels::layout::kProfileWaitBins * kind + bin];
        if (n == 0) continue;
        char item[96];
        const double from_us = bin == 0 ? 0.0 : (kernels::layout::kProfileFirstWaitBinNs << (bin - 1)) * 1e-3;
        std::snprintf(
            item, sizeof(item), " %s%.2f us: %llu (%.2f ms)",
            bin == 0 ? "<" : ">=", bin == 0 ? kernels::layout::kProfileFirstWaitBinNs * 1e-3 : from_us, n,
            slots[kernels::layout::kProfileWaitBinNs + kernels::layout::kProfileWaitBins * kind + bin] *
                1e-6);
        waits += item;
      }
      std::fprintf(
          stderr,
          "pounce profile rank %d fused %s %s: %.2f GHz, per task %.2f us = first stage %.2f + mainloop "
          "%.2f + epilogue %.2f + count %.2f; waits for it:%s\n",
          p.rank, pass, name, ghz, whole, first, mainloop, whole - first - mainloop - count, count,
          waits.c_str());
    }
    ++kind;
  }

  const uint64_t start = ~slots[kernels::layout::kProfileStartInverted];
  auto since_start = [&](uint64_t at) { return at != 0 && at >= start ? (at - start) * 1e-6 : -1.0; };
  std::string timeline = std::string("pounce profile rank ") + std::to_string(p.rank) + " fused " + pass +
                         " timeline (ms from the first consumer start):";
  char item[160];
  std::snprintf(item, sizeof(item), " first task %.3f,",
                since_start(~slots[kernels::layout::kProfileFirstTaskInverted]));
  timeline += item;
  for (const auto& [name, at] : milestones) {
    std::snprintf(item, sizeof(item), " %s %.3f,", name, since_start(at));
    timeline += item;
  }
  std::snprintf(item, sizeof(item), " out of tasks %.3f..%.3f",
                since_start(~slots[kernels::layout::kProfileOutOfTasksInverted]),
                since_start(slots[kernels::layout::kProfileOutOfTasks]));
  std::fprintf(stderr, "%s%s\n", timeline.c_str(), item);
}

// POUNCE_PROFILE_STAGES: where the fused kernel's time went, from the %globaltimer stamps of its grid steps
// (kernels/fused/grid_steps.cuh). Synchronises the stream; skipped while capturing.
inline void report_step_times(const kernels::layout::WorkspacePointers& p, cudaStream_t stream) {
  if (p.profile_tiles == 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  POUNCE_CUDA(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  unsigned long long ns[kernels::layout::kNumStepTimes] = {};
  POUNCE_CUDA(cudaMemcpyAsync(ns, p.fused_counters + kernels::layout::kFusedStepTimes, sizeof(ns),
                              cudaMemcpyDeviceToHost, stream));
  POUNCE_CUDA(cudaStreamSynchronize(stream));
  auto ms = [&](int from, int to) { return ns[from] && ns[to] ? (ns[to] - ns[from]) * 1e-6 : -1.0; };
  std::fprintf(
      stderr,
      "pounce profile rank %d fused forward inside, ms after CTA 0's start: last CTA started %.3f, x staged "
      "%.3f, routing ids stored %.3f, fenced %.3f, arrived %.3f; then ms each: routing barrier %.3f schedule "
      "%.3f (count+scan %.3f) tiles+transfers %.3f combine barrier %.3f\n",
      p.rank, ms(kernels::layout::kTimeKernelStarted, kernels::layout::kTimeLastCtaStarted),
      ms(kernels::layout::kTimeKernelStarted, kernels::layout::kTimeXStaged),
      ms(kernels::layout::kTimeKernelStarted, kernels::layout::kTimeRoutingStored),
      ms(kernels::layout::kTimeKernelStarted, kernels::layout::kTimeRoutingFenced),
      ms(kernels::layout::kTimeKernelStarted, kernels::layout::kTimeRoutingArrived),
      ms(kernels::layout::kTimeRoutingArrived, kernels::layout::kTimeRoutingReleased),
      ms(kernels::layout::kTimeRoutingReleased, kernels::layout::kTimePlacedReleased),
      ms(kernels::layout::kTimeRoutingReleased, kernels::layout::kTimeCountedReleased),
      ms(kernels::layout::kTimePlacedReleased, kernels::layout::kTimeLastFinished),
      ms(kernels::layout::kTimeLastFinished, kernels::layout::kTimeCombineBarrier));
  report_tile_profile(p, "forward", {"", "shared gate/up", "shared down", "gate/up", "down"}, stream,
                      {{"routing released", ns[kernels::layout::kTimeRoutingReleased]},
                       {"schedule placed", ns[kernels::layout::kTimePlacedReleased]},
                       {"last finished", ns[kernels::layout::kTimeLastFinished]},
                       {"combine barrier", ns[kernels::layout::kTimeCombineBarrier]}});
}

}  // namespace pounce::gpu
