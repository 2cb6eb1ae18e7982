// The CPU backend: the API end to end on the reference (rank 0 evaluates the group for everyone).
#pragma once

#include <string>

#include "pounce/layer.h"
#include "src/state.h"

namespace pounce::cpu {

// Collective over the group's threads: checks every rank passed the same shape and config.
void create_workspace(WorkspaceState& state);

// `local_error` is this rank's validation error ("" = none); all ranks fail together when any has one.
void forward(WorkspaceState& state, const ForwardArgs& args, const std::string& local_error, bool write_out);
void backward(WorkspaceState& state, const BackwardArgs& args, const std::string& local_error);

}  // namespace pounce::cpu
