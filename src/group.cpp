#include "pounce/group.h"

#include "pounce/error.h"
#include "src/state.h"

namespace pounce {

std::vector<Group> Group::create_cpu(int num_ranks) {
  POUNCE_CHECK(num_ranks >= 1 && num_ranks <= 1024, "num_ranks = ", num_ranks, " must be in [1, 1024]");
  auto state = std::make_shared<GroupState>();
  state->backend = Backend::kCpu;
  state->num_ranks = num_ranks;
  state->cpu = std::make_shared<CpuGroup>(num_ranks);
  std::vector<Group> groups;
  for (int rank = 0; rank < num_ranks; ++rank) groups.push_back(Group(state, rank));
  return groups;
}

std::vector<uint8_t> Group::new_unique_id() {
  return gpu::new_unique_id();
}

Group Group::create_nccl(int rank, int num_ranks, const std::vector<uint8_t>& unique_id) {
  POUNCE_CHECK(num_ranks >= 1, "num_ranks = ", num_ranks, " must be at least 1");
  POUNCE_CHECK(rank >= 0 && rank < num_ranks, "rank = ", rank, " must be in [0, num_ranks = ", num_ranks,
               ")");
  auto state = std::make_shared<GroupState>();
  state->backend = Backend::kGpu;
  state->num_ranks = num_ranks;
  state->gpu = gpu::create_group(rank, num_ranks, unique_id);
  return Group(state, rank);
}

Group Group::create_nccl_from_env() {
  auto state = std::make_shared<GroupState>();
  state->backend = Backend::kGpu;
  int rank = 0;
  state->gpu = gpu::create_group_from_env(&rank, &state->num_ranks);
  return Group(state, rank);
}

std::vector<Group> Group::create_nccl_local(int num_ranks) {
  std::vector<Group> groups;
  int rank = 0;
  for (auto& gpu_group : gpu::create_local_groups(num_ranks)) {
    auto state = std::make_shared<GroupState>();
    state->backend = Backend::kGpu;
    state->num_ranks = num_ranks;
    state->gpu = std::move(gpu_group);
    groups.push_back(Group(state, rank++));
  }
  return groups;
}

int Group::rank() const {
  return rank_;
}
int Group::num_ranks() const {
  return state_->num_ranks;
}
Backend Group::backend() const {
  return state_->backend;
}

}  // namespace pounce
