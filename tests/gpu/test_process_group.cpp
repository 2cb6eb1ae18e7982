// The group from the environment torchrun or mpirun sets (Group::create_nccl_from_env), one process per GPU:
//   torchrun --no-python --nproc-per-node=2 pounce_gpu_tests --gtest_filter='ProcessGroup.*'
// Every process builds the same model and inputs from the seeds, runs its own rank through the forward of
// forward_harness.h (twice, bitwise equal, recompute_forward_context) and checks that rank against the CPU
// reference of the whole group: schedule exactly, y and out within the docs/design.md §6 bound. Skipped
// when not started by a launcher.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "forward_harness.h"
#include "gpu_fixtures.h"
#include "pounce/pounce.h"

namespace pounce::gpu_test {
namespace {

TEST(ProcessGroup, TorchrunEnvironment) {
  if (std::getenv("WORLD_SIZE") == nullptr)
    GTEST_SKIP() << "not started by torchrun/mpirun (no WORLD_SIZE); run: torchrun --no-python "
                    "--nproc-per-node=2 pounce_gpu_tests --gtest_filter='ProcessGroup.*'";
  SKIP_UNLESS_GPUS(1);
  const Group group = Group::create_nccl_from_env();
  const int R = group.num_ranks(), rank = group.rank();
  const Model m = make_model(make_shape(512, 256, 128, 4 * R, 4, 128, R), Activation::swiglu(), 31);
  std::vector<Call> calls = {random_routing(std::vector<int64_t>(R, 512), 32),
                             with_int64_idx(all_to_one_expert(std::vector<int64_t>(R, 77), 33))};
  const std::vector<std::vector<RankData>> data = make_call_data(m.shape, calls);
  ForwardResults results(calls.size(), std::vector<ForwardResult>(R));
  int device = 0;
  CUDA_OK(cudaGetDevice(&device));
  run_forward_rank(m, data, calls, ForwardMode::kEagerTwice, group, rank, device, results, Config{});
  for (size_t c = 0; c < calls.size(); ++c)
    check_forward_call(m, calls[c], data[c], results[c], "process group call " + std::to_string(c), rank);
}

}  // namespace
}  // namespace pounce::gpu_test
