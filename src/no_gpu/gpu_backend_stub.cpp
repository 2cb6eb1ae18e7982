// Built when no CUDA toolkit was found: the GPU entry points explain how to get a GPU build.
#include "pounce/error.h"
#include "src/gpu_backend.h"

namespace pounce::gpu {
namespace {
[[noreturn]] void no_cuda(const char* what) {
  detail::fail(what,
               " needs the GPU backend, but this build of Pounce has no CUDA device code (nvcc was not ",
               "found at configure time); install the CUDA toolkit and rebuild, or use the CPU backend");
}
}  // namespace

int device_count() {
  return 0;
}
std::string describe_devices() {
  return {};
}
std::string nccl_runtime_version() {
  return {};
}
std::vector<uint8_t> new_unique_id() {
  no_cuda("Group::new_unique_id");
}
std::shared_ptr<GpuGroup> create_group(int, int, const std::vector<uint8_t>&) {
  no_cuda("Group::create_nccl");
}
std::vector<std::shared_ptr<GpuGroup>> create_local_groups(int) {
  no_cuda("Group::create_nccl_local");
}
std::shared_ptr<GpuGroup> create_group_from_env(int*, int*) {
  no_cuda("Group::create_nccl_from_env");
}
GpuWorkspacePtr create_workspace(std::shared_ptr<GpuGroup>, int, const Shape&, const Config&,
                                 const Environment&) {
  no_cuda("a GPU workspace");
}
void forward(GpuWorkspace&, const ForwardArgs&, void*) {
  no_cuda("forward");
}
void backward(GpuWorkspace&, const BackwardArgs&, void*) {
  no_cuda("backward");
}
void recompute_forward_context(GpuWorkspace&, const ForwardArgs&, void*) {
  no_cuda("recompute_forward_context");
}
void check_device_errors(GpuWorkspace&) {}
void synchronize(GpuWorkspace&, void*) {}
int device_of(const GpuWorkspace&) {
  return -1;
}
void inject_wait_failure(GpuWorkspace&, int32_t) {
  no_cuda("inject_wait_failure");
}
void set_kernel_path(GpuWorkspace&, KernelPath) {}

}  // namespace pounce::gpu
