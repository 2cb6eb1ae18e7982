// The workspace: every buffer a forward/backward pair needs, sized once from the maximum shape and
// reused across calls and layers (DeepEP's "the buffer is the API"). On GPUs the communicated regions
// live in NCCL symmetric memory. The workspace also holds the forward context (schedule, routed
// activations of the resident macrobatch, expert outputs per (token, slot)) that backward consumes.
#pragma once

#include <cstdint>
#include <memory>

#include "pounce/config.h"
#include "pounce/group.h"
#include "pounce/shape.h"

namespace pounce {

struct WorkspaceBytes {
  int64_t symmetric = 0;  // peers read or write it (NCCL window on GPUs)
  int64_t local = 0;      // private to the rank
  int64_t total() const { return symmetric + local; }
};

struct WorkspaceState;  // backend-private

class Workspace {
 public:
  // Allocates on the group's backend. Collective on GPUs: every rank calls it with equal shape/config
  // (mismatches are detected and reported on every rank).
  Workspace(const Group& group, const Shape& shape, const Config& config);
  ~Workspace();
  Workspace(Workspace&&) noexcept;
  Workspace& operator=(Workspace&&) noexcept;

  // The size formula (docs/design.md spells out every region): a pure function of shape and config.
  static WorkspaceBytes bytes_required(const Shape& shape, const Config& config);

  const Shape& shape() const;
  const Config& config() const;
  const Group& group() const;
  WorkspaceState& state() const { return *state_; }

 private:
  std::unique_ptr<WorkspaceState> state_;
};

}  // namespace pounce
