// The environment variables Pounce reads, all of them, in one place. They are read once, when a workspace is
// created (Workspace's constructor), and hold for that workspace's calls; a bad value fails the creation with
// an error naming the variable.
//
//   POUNCE_PEER_TIMEOUT_S   seconds a wait on a peer (device flags, barriers, the CPU group's host barriers)
//                           may take before the call fails with a record of the wait; default 120 (values
//                           above 1e7 count as 1e7)
//   POUNCE_PROFILE_STAGES   set (to anything): each pass prints where its time went, stage by stage, and
//                           the fused kernels record their grid steps and tiles (synchronises; skipped
//                           while a stream is being captured)
//
// NCCL_NVLS_ENABLE is checked when a GPU group is created: Pounce never uses NVLink multicast, so it must be
// unset (Pounce then sets it to 0) or 0.
#pragma once

#include <chrono>

namespace pounce {

struct Environment {
  std::chrono::milliseconds peer_timeout{120'000};
  bool profile_stages = false;

  static Environment read();
};

}  // namespace pounce
