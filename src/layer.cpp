// The public entry points: validate every argument, then hand over to the group's backend.
#include "pounce/layer.h"

#include "pounce/error.h"
#include "src/cpu_backend.h"
#include "src/state.h"
#include "src/validation.h"

namespace pounce {
namespace {

// On the CPU backend a rank's validation error is shared with its peers (they fail together instead of
// waiting for it); on GPUs each process throws at once and its peers' bounded waits report the absence.
template <typename Validate>
std::string validation_error(Validate&& validate) {
  try {
    validate();
  } catch (const Error& error) {
    return std::string(error.what()).substr(8);  // drop the "pounce: " prefix; it is added again
  }
  return {};
}

}  // namespace

void forward(Workspace& workspace, const ForwardArgs& args, void* stream) {
  WorkspaceState& state = workspace.state();
  if (workspace.group().backend() == Backend::kCpu) {
    cpu::forward(state, args, validation_error([&] { validate_forward_args(workspace, args, true); }), true);
    return;
  }
  validate_forward_args(workspace, args, true);
  gpu::forward(*state.gpu, args, stream);
}

void recompute_forward_context(Workspace& workspace, const ForwardArgs& args, void* stream) {
  WorkspaceState& state = workspace.state();
  if (workspace.group().backend() == Backend::kCpu) {
    cpu::forward(state, args, validation_error([&] { validate_forward_args(workspace, args, false); }),
                 false);
    return;
  }
  validate_forward_args(workspace, args, false);
  gpu::recompute_forward_context(*state.gpu, args, stream);
}

void backward(Workspace& workspace, const BackwardArgs& args, void* stream) {
  WorkspaceState& state = workspace.state();
  if (workspace.group().backend() == Backend::kCpu) {
    cpu::backward(state, args, validation_error([&] { validate_backward_args(workspace, args); }));
    return;
  }
  validate_backward_args(workspace, args);
  gpu::backward(*state.gpu, args, stream);
}

void check_errors(Workspace& workspace, void* stream, bool synchronize) {
  if (workspace.group().backend() == Backend::kCpu) return;  // CPU calls throw their errors themselves
  gpu::GpuWorkspace& gpu_workspace = *workspace.state().gpu;
  if (synchronize) gpu::synchronize(gpu_workspace, stream);
  gpu::check_device_errors(gpu_workspace);
}

}  // namespace pounce
