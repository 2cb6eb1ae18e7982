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

namespace pounce {

// R simulated ranks in one process. Each call is collective: every rank publishes its arguments (and
// any validation error), rank 0 evaluates the whole group with the reference, each rank takes its part.
struct CpuGroup {
  explicit CpuGroup(int num_ranks)
      : num_ranks(num_ranks), barrier(num_ranks), published(num_ranks), errors(num_ranks) {}
  const int num_ranks;
  HostBarrier barrier;
  std::vector<const void*> published;  // [R] this call's arguments of each rank
  std::vector<std::string> errors;     // [R] this call's validation error of each rank ("" = none)
  std::string group_error;             // set by rank 0 when the group evaluation failed
  std::vector<reference::RankForward> forward_results;
  std::vector<reference::RankGradients> gradient_results;
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
  CpuForwardContext cpu_context;
  gpu::GpuWorkspacePtr gpu{nullptr, nullptr};
};

}  // namespace pounce
