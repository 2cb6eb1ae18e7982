// Host-side checks of every argument before anything is written: shapes, dtypes, devices, alignment,
// aliasing, and (on host-resident routing) expert ids. Each failure throws pounce::Error naming the
// argument, its value and the fix.
#pragma once

#include "pounce/layer.h"

namespace pounce {

// `check_out`: forward writes args.out; recompute_forward_context and backward do not read it.
void validate_forward_args(const Workspace& workspace, const ForwardArgs& args, bool check_out);
void validate_backward_args(const Workspace& workspace, const BackwardArgs& args);

}  // namespace pounce
