// Backend-private state behind pounce::Group and pounce::Workspace.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "pounce/group.h"
#include "pounce/workspace.h"
#include "reference/reference.h"
#include "src/environment.h"
#include "src/gpu_backend.h"
#include "src/host_barrier.h"
#include "src/validation.h"

namespace pounce {

// What one rank of a CPU group calls; every rank of the group must make the same calls in the same order.
enum class CpuCall { kCreateWorkspace, kForward, kRecompute, kBackward };

// What a rank says about its call, which every rank compares before anything is evaluated.
struct CpuRecord {
  CpuCall call = CpuCall::kCreateWorkspace;
  uint64_t workspace_id = 0;  // the group round that created the workspace; 0 in a creation
  WorkspaceFields fields;     // the workspace's shape and config (a creation: the ones asked for)
  int64_t num_tokens = 0;
  std::string error;  // this rank's validation error ("" = none)
};

// One rank's share of a round of the CPU group's exchange (src/cpu_backend.cpp), by value: nothing a
// peer reads points into a rank's arguments.
struct CpuPost {
  // Round "arguments": the record, and when its error is empty this rank's inputs as the reference takes
  // them (rank 0 reads them all; the shared expert's weights are replicas, so only rank 0 posts them).
  CpuRecord record;
  reference::RankInputs inputs;
  reference::Weights routed;
  reference::Weights shared;
  // Round "results", rank 0 only: the group's evaluation, each rank's part taken by that rank.
  std::string group_error;
  std::vector<reference::RankForward> forward;
  std::vector<reference::RankGradients> gradients;
};

// R simulated ranks in one process. Each call is collective: every rank posts its arguments (and any
// validation error), rank 0 evaluates the whole group with the reference, each rank takes its part.
struct CpuGroup {
  explicit CpuGroup(int num_ranks) : num_ranks(num_ranks), exchange(num_ranks) {}
  const int num_ranks;
  HostExchange<CpuPost> exchange;
};

struct GroupState {
  Backend backend = Backend::kCpu;
  int num_ranks = 1;
  std::shared_ptr<CpuGroup> cpu;       // kCpu: shared by the R Group handles of the process
  std::shared_ptr<gpu::GpuGroup> gpu;  // kGpu: this rank's communicator
};

// What backward needs from forward on the CPU backend.
struct CpuForwardContext {
  bool valid = false;
  int64_t num_tokens = 0;
  reference::RankForward saved;  // y per (token, slot), shared expert output, out
};

struct WorkspaceState {
  WorkspaceState(const Group& group, const Shape& shape, const Config& config)
      : group(group), shape(shape), config(config), environment(Environment::read()) {}
  Group group;
  Shape shape;
  Config config;
  Environment environment;
  // The device index its tensors must be on: 0 on the CPU backend, the workspace's GPU on GPUs.
  int device_id = 0;
  uint64_t cpu_id = 0;  // CPU backend: the group round that created it, the same on every rank
  CpuForwardContext cpu_context;
  gpu::GpuWorkspacePtr gpu{nullptr, nullptr};
};

}  // namespace pounce
