// Built when no CUDA toolkit was found: the GPU entry points explain how to get a GPU build.
#include <algorithm>

#include "pounce/error.h"
#include "src/gpu_backend.h"

namespace pounce::gpu {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  detail::fail(what, " needs the GPU backend, but this build of Pounce has no CUDA device code (nvcc was not ",
               "found at configure time); install the CUDA toolkit and rebuild, or use the CPU backend");
}
}  // namespace

int device_count() { return 0; }
std::string describe_devices() { return {}; }
std::string nccl_runtime_version() { return {}; }
std::vector<uint8_t> new_unique_id() { no_cuda("Group::new_unique_id"); }
std::shared_ptr<GpuGroup> create_group(int, int, const std::vector<uint8_t>&) { no_cuda("Group::create_nccl"); }
std::vector<std::shared_ptr<GpuGroup>> create_local_groups(int) { no_cuda("Group::create_nccl_local"); }
GpuWorkspacePtr create_workspace(std::shared_ptr<GpuGroup>, int, const Shape&, const Config&) {
  no_cuda("a GPU workspace");
}
void forward(GpuWorkspace&, const ForwardArgs&, void*) { no_cuda("forward"); }
void backward(GpuWorkspace&, const BackwardArgs&, void*) { no_cuda("backward"); }
void recompute_forward_context(GpuWorkspace&, const ForwardArgs&, void*) { no_cuda("recompute_forward_context"); }
void check_device_errors(GpuWorkspace&) {}

}  // namespace pounce::gpu

namespace pounce::gpu {

// TODO(#3): share one formula with kernels/layout once the GPU workspace layout lands.
WorkspaceBytes workspace_bytes(const Shape& s, const Config& config) {
  const int64_t local_experts = s.num_local_experts();
  const int64_t pairs = s.num_ranks * s.max_tokens * std::min(s.num_topk, local_experts);
  const int64_t rows = (pairs + local_experts * (kBlockM - 1) + kBlockM - 1) / kBlockM * kBlockM;
  const int64_t ring = config.macrobatch_size > 0 ? std::min(config.macrobatch_size, rows) : rows;
  const int64_t tokens_padded = (s.max_tokens + kBlockM - 1) / kBlockM * kBlockM;
  WorkspaceBytes bytes;
  bytes.symmetric = s.max_tokens * s.hidden * 2                 // x
                    + s.num_ranks * s.max_tokens * s.num_topk * 4  // topk_idx of every rank
                    + 2 * s.max_tokens * s.num_topk * s.hidden * 2  // y slots, d_x slots
                    + s.max_tokens * s.hidden * 2                // d_out
                    + 4096;                                      // counts and barrier flags
  bytes.local = rows * 12 + (local_experts + 1) * 4             // schedule
                + ring * (2 * s.hidden + 3 * s.intermediate) * 2  // rows x, y; g, u, a
                + tokens_padded * (3 * s.shared_intermediate) * 2;  // shared g, u, a
  return bytes;
}

}  // namespace pounce::gpu
