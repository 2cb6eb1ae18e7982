// An expert-parallel group: R ranks, one GPU each (or one simulated rank per thread on the CPU backend).
//
// On GPUs the group owns an NCCL communicator with symmetric-memory support (docs/design.md §3). On the CPU
// backend a group of R ranks lives in one process: each rank is driven by its own thread and the ranks
// meet at host barriers, the way GPUs meet at NVLink barriers.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pounce/config.h"

namespace pounce {

struct GroupState;  // backend-private

class Group {
 public:
  // R ranks of the CPU backend in this process; call forward/backward for rank r from its own thread.
  static std::vector<Group> create_cpu(int num_ranks);

  // One rank of a GPU group. `unique_id` is 128 bytes from Group::new_unique_id() on rank 0, sent to
  // the others by the caller (torch.distributed, MPI, a file). Uses the current CUDA device.
  static Group create_nccl(int rank, int num_ranks, const std::vector<uint8_t>& unique_id);
  static std::vector<uint8_t> new_unique_id();
  // One process per GPU as torchrun or mpirun start them: RANK/WORLD_SIZE/LOCAL_RANK (or OMPI_COMM_WORLD_*),
  // device = LOCAL_RANK, rendezvous through NCCL_COMM_ID or MASTER_ADDR:MASTER_PORT+1. No id exchange needed.
  static Group create_nccl_from_env();
  // All GPUs of this process, one rank each (one thread per GPU drives them).
  static std::vector<Group> create_nccl_local(int num_ranks);

  int rank() const;
  int num_ranks() const;
  Backend backend() const;
  GroupState& state() const { return *state_; }

 private:
  Group(std::shared_ptr<GroupState> state, int rank) : state_(std::move(state)), rank_(rank) {}
  std::shared_ptr<GroupState> state_;
  int rank_ = 0;
};

}  // namespace pounce
