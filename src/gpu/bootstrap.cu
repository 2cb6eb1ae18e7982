// One process per GPU, launched by torchrun or mpirun: the rank, the group size and the device come from
// the launcher's environment, the NCCL unique id from NCCL_COMM_ID (MASTER_ADDR:MASTER_PORT + 1 when the
// launcher did not set it), so every process derives the same id without a side channel.
#include <cuda_runtime.h>

#include <cstdlib>
#include <string>

#include "pounce/error.h"
#include "src/gpu/gpu_state.h"
#include "src/gpu_backend.h"

namespace pounce::gpu {
namespace {

// The first of `names` that is set, parsed as a non-negative integer; -1 when none is set.
int env_int(std::initializer_list<const char*> names) {
  for (const char* name : names) {
    const char* value = std::getenv(name);
    if (value == nullptr) continue;
    char* end = nullptr;
    const long parsed = std::strtol(value, &end, 10);
    POUNCE_CHECK(end != value && *end == '\0' && parsed >= 0, "environment variable ", name, " = '", value,
                 "' is not a non-negative integer");
    return static_cast<int>(parsed);
  }
  return -1;
}

}  // namespace

std::shared_ptr<GpuGroup> create_group_from_env(int* rank_out, int* num_ranks_out) {
  const int rank = env_int({"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"});
  const int num_ranks = env_int({"WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"});
  POUNCE_CHECK(rank >= 0 && num_ranks >= 1,
               "Group::create_nccl_from_env needs RANK and WORLD_SIZE (torchrun) ",
               "or OMPI_COMM_WORLD_RANK/SIZE (mpirun) in the environment; launch with torchrun --no-python ",
               "or mpirun, or use Group::create_nccl with your own unique-id exchange");
  int local_rank = env_int({"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"});
  if (local_rank < 0) local_rank = rank;
  const int devices = device_count();
  POUNCE_CHECK(local_rank < devices, "LOCAL_RANK = ", local_rank, " but only ", devices,
               " GPUs are visible; launch at most one process per GPU");
  POUNCE_CUDA(cudaSetDevice(local_rank));
  if (std::getenv("NCCL_COMM_ID") == nullptr) {
    const char* addr = std::getenv("MASTER_ADDR");
    const char* port = std::getenv("MASTER_PORT");
    POUNCE_CHECK(num_ranks == 1 || (addr != nullptr && port != nullptr),
                 "neither NCCL_COMM_ID nor MASTER_ADDR/MASTER_PORT is set; set NCCL_COMM_ID=host:port ",
                 "(the same on every rank) so the ranks can find each other");
    if (addr != nullptr && port != nullptr) {
      // The launcher's own rendezvous holds MASTER_PORT; NCCL's bootstrap root listens on the next port.
      const std::string comm_id = std::string(addr) + ":" + std::to_string(std::atoi(port) + 1);
      setenv("NCCL_COMM_ID", comm_id.c_str(), 0);
    }
  }
  *rank_out = rank;
  *num_ranks_out = num_ranks;
  return create_group(rank, num_ranks, num_ranks > 1 ? new_unique_id() : std::vector<uint8_t>{});
}

}  // namespace pounce::gpu
