// The fused kernels' profile, all of it: the grid steps' milestones (layout::kFusedStepTimes, %globaltimer
// stamps stored on every launch: a few plain stores per pass) and the compute CTAs' per-task accounting
// (layout::kFusedTileProfile), which costs atomics per task and so runs only under ws.profile_tiles
// (POUNCE_PROFILE_STAGES, read once per workspace: src/environment.h). The host reads and prints both
// (src/gpu/profile.h).
#pragma once

#include <cstdint>

#include "kernels/common/flags.cuh"
#include "kernels/common/ptx.cuh"
#include "kernels/gemm/gemm_config.cuh"
#include "kernels/layout/workspace_layout.cuh"

namespace pounce::kernels::fused {

// Where the kernel's time goes (layout::kFusedStepTimes): plain stores, read by the host after the call.
__device__ __forceinline__ unsigned long long* step_times(const layout::WorkspacePointers& ws) {
  return reinterpret_cast<unsigned long long*>(ws.fused_counters + layout::kFusedStepTimes);
}

// Under ws.profile_tiles, the first thread of each consumer warpgroup adds its time per task kind and its
// waits for the tasks of each kind to the kFusedTileProfile slots, the producer thread its time finding them.
// Inside a task it marks (in shared memory, `marks`: no register held across the mainloop) the clock when the
// first stage was full, when the mainloop ended and when the last store was issued.
class TileProfile {
 public:
  __device__ TileProfile(const layout::WorkspacePointers& ws, uint64_t* marks = nullptr)
      : slots_(ws.profile_tiles != 0 && threadIdx.x % 128 == 0
                   ? reinterpret_cast<unsigned long long*>(ws.fused_counters + layout::kFusedTileProfile)
                   : nullptr),
        marks_(marks) {}
  __device__ uint64_t now() const { return slots_ != nullptr ? flags::global_timer_ns() : 0; }
  __device__ uint64_t clock() const { return slots_ != nullptr ? clock64() : 0; }
  // The task's first stage, once full (the mainloop's own wait then passes at once; a stage that never fills
  // is left to the mainloop to report). Only for tasks with K blocks.
  __device__ void mark_first_stage(uint64_t* full, uint32_t phase) const {
    if (slots_ == nullptr || marks_ == nullptr) return;
    kernels::ptx::mbarrier_wait_parity_bounded(full, phase, gemm::GemmConfig::kWaitTimeoutNs);
    marks_[0] = clock64();
  }
  __device__ void mark_multiplied() const {
    if (slots_ != nullptr && marks_ != nullptr) marks_[1] = clock64();
  }
  // Every store of the task issued: what follows is the count (count_tile_stored), if the task has one.
  __device__ void mark_stored() const {
    if (slots_ != nullptr && marks_ != nullptr) marks_[2] = clock64();
  }
  __device__ void begin_task() const {
    if (slots_ != nullptr && marks_ != nullptr) marks_[0] = marks_[1] = marks_[2] = 0;
  }
  __device__ void task(int kind, uint64_t handed_over, uint64_t finished, uint64_t handed_over_clock) {
    if (slots_ == nullptr || kind < 0 || kind >= layout::kMaxProfiledKinds) return;
    const uint64_t finished_clock = clock64();
    atomicAdd(slots_ + layout::kProfileKindNs + kind, finished - handed_over);
    atomicAdd(slots_ + layout::kProfileKindTasks + kind, 1ull);
    atomicAdd(slots_ + layout::kProfileKindClocks + kind, finished_clock - handed_over_clock);
    if (marks_ != nullptr && marks_[0] != 0 && marks_[1] >= marks_[0]) {
      atomicAdd(slots_ + layout::kProfileFirstStageClocks + kind, marks_[0] - handed_over_clock);
      atomicAdd(slots_ + layout::kProfileMainloopClocks + kind, marks_[1] - marks_[0]);
      const uint64_t stored = marks_[2] >= marks_[1] ? marks_[2] : finished_clock;
      atomicAdd(slots_ + layout::kProfileCountClocks + kind, finished_clock - stored);
    }
  }
  __device__ void handoff(int kind, uint64_t from, uint64_t to) {
    if (slots_ == nullptr || kind < 0 || kind >= layout::kMaxProfiledKinds) return;
    const uint64_t waited = to - from;
    atomicAdd(slots_ + layout::kProfileHandoffNs + kind, waited);
    int bin = 0;
    for (uint64_t limit = layout::kProfileFirstWaitBinNs;
         bin < layout::kProfileWaitBins - 1 && waited >= limit; limit *= 2)
      ++bin;
    atomicAdd(slots_ + layout::kProfileWaitBinTasks + layout::kProfileWaitBins * kind + bin, 1ull);
    atomicAdd(slots_ + layout::kProfileWaitBinNs + layout::kProfileWaitBins * kind + bin, waited);
  }
  __device__ void scheduled(int kind, uint64_t from, uint64_t to) {
    if (slots_ == nullptr || kind < 0 || kind >= layout::kMaxProfiledKinds) return;
    atomicAdd(slots_ + layout::kProfileSchedulerNs + kind, to - from);
  }
  __device__ void started(uint64_t at) { earliest(layout::kProfileStartInverted, at); }
  __device__ void first_task(uint64_t at) { earliest(layout::kProfileFirstTaskInverted, at); }
  __device__ void out_of_tasks(uint64_t at) {
    if (slots_ == nullptr) return;
    earliest(layout::kProfileOutOfTasksInverted, at);
    atomicMax(slots_ + layout::kProfileOutOfTasks, static_cast<unsigned long long>(at));
  }

 private:
  __device__ void earliest(int slot, uint64_t at) {
    if (slots_ != nullptr) atomicMax(slots_ + slot, ~static_cast<unsigned long long>(at));
  }
  unsigned long long* slots_;
  uint64_t* marks_;
};

}  // namespace pounce::kernels::fused
