// The CPU backend: the API end to end on the reference (rank 0 evaluates the group for everyone).
#pragma once

#include <string>
#include <vector>

#include "pounce/layer.h"
#include "src/state.h"

namespace pounce::cpu {

// Every call below is collective over the group's threads, and `local_error` is this rank's validation
// error ("" = none): all ranks fail together, each with the same reason, when any rank has one, when the
// ranks make different calls or pass different workspaces, or (creation) when any field of their Shape or
// Config differs.
void create_workspace(WorkspaceState& state, const std::string& local_error);
void forward(WorkspaceState& state, const ForwardArgs& args, const std::string& local_error, bool write_out);
void backward(WorkspaceState& state, const BackwardArgs& args, const std::string& local_error);

// "" when the ranks' records agree; else why not, as rank `rank` reports it (the first check that fails:
// the call, the workspace, a rank's own error, the workspace's fields).
std::string disagreement(const std::vector<CpuRecord>& records, int rank);
const char* to_string(CpuCall call);

}  // namespace pounce::cpu
