#include "pounce/workspace.h"

#include "kernels/layout/workspace_layout.cuh"
#include "pounce/error.h"
#include "src/cpu_backend.h"
#include "src/state.h"
#include "src/validation.h"

namespace pounce {

namespace {

void check_workspace_args(const Group& group, const Shape& shape, const Config& config) {
  validate(shape);
  validate(config, shape);
  POUNCE_CHECK(shape.num_ranks == group.num_ranks(), "shape.num_ranks = ", shape.num_ranks,
               " but the group has ", group.num_ranks(), " ranks; set shape.num_ranks = group.num_ranks()");
  POUNCE_CHECK(config.backend == Backend::kAuto || config.backend == group.backend(),
               "config.backend = ", to_string(config.backend), " but the group runs on ",
               to_string(group.backend()),
               "; create the group on the backend you want (or leave config.backend = auto)");
}

}  // namespace

Workspace::Workspace(const Group& group, const Shape& shape, const Config& config) {
  if (group.backend() == Backend::kCpu) {
    // A rank's bad shape or config fails the whole group at once instead of leaving its peers waiting.
    const std::string error = error_of([&] { check_workspace_args(group, shape, config); });
    state_ = std::make_unique<WorkspaceState>(group, shape, config);
    cpu::create_workspace(*state_, error);
    return;
  }
  check_workspace_args(group, shape, config);
  state_ = std::make_unique<WorkspaceState>(group, shape, config);
  state_->gpu = gpu::create_workspace(group.state().gpu, group.rank(), shape, config, state_->environment);
  state_->device_id = gpu::device_of(*state_->gpu);
}

Workspace::~Workspace() = default;
Workspace::Workspace(Workspace&&) noexcept = default;
Workspace& Workspace::operator=(Workspace&&) noexcept = default;

WorkspaceBytes Workspace::bytes_required(const Shape& shape, const Config& config) {
  validate(shape);
  validate(config, shape);
  // One formula for every backend: kernels/layout/workspace_layout.cuh lists each region.
  const auto layout = kernels::layout::WorkspaceLayout::make(
      shape.max_tokens, shape.hidden, shape.intermediate, shape.shared_intermediate, shape.num_experts,
      shape.num_topk, shape.num_ranks, config.macrobatch_size, config.precision == Precision::kFP8);
  return {layout.symmetric_bytes, layout.local_bytes};
}

const Shape& Workspace::shape() const {
  return state_->shape;
}
const Config& Workspace::config() const {
  return state_->config;
}
const Group& Workspace::group() const {
  return state_->group;
}

}  // namespace pounce
