// Host-side checks of every argument before anything is written: shapes, dtypes, devices (kind and index),
// alignment, aliasing (every output against every input and against the other outputs), and (on
// host-resident routing) expert ids. Each failure throws pounce::Error naming the argument, its value and
// the fix. Also the cross-rank agreement of a workspace's Shape and Config, which every backend checks.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "pounce/error.h"
#include "pounce/layer.h"

namespace pounce {

// `check_out`: forward writes args.out; recompute_forward_context and backward do not read it.
void validate_forward_args(const Workspace& workspace, const ForwardArgs& args, bool check_out);
void validate_backward_args(const Workspace& workspace, const BackwardArgs& args);

// Expert biases (ExpertWeights::b_*, and their gradients when `d_routed` is given) run on the CPU backend
// in BF16 only for now: throws pounce::Error naming the arguments and the fix on a GPU or in FP8. Both
// validate_*_args call it; nothing is launched or written before.
void check_expert_biases_supported(Backend backend, Precision precision, const ExpertWeights& routed,
                                   const ExpertWeights* d_routed);

// Every field of Shape and Config as one integer (floats by their bits, an unset clamp as -1), so ranks can
// compare them by value: the CPU backend exchanges them between its threads; on GPUs they are plain bytes
// to all-gather over the group's communicator before anything is allocated.
struct WorkspaceFields {
  static constexpr int kCount = 20;
  std::array<int64_t, kCount> values{};

  static WorkspaceFields of(const Shape& shape, const Config& config);
  static const char* name(int field);                 // "shape.hidden", "config.activation.clamp_limit"
  static std::string show(int field, int64_t value);  // "2048", "gpt-oss", "none", "1.702"
  bool operator==(const WorkspaceFields&) const = default;
};

// "" when every rank passed the same fields; else the first field that differs, the value of each rank
// that differs from rank 0 and the fix (the same text on every rank).
std::string workspace_disagreement(const std::vector<WorkspaceFields>& ranks);

// Runs `check` and returns its pounce::Error's message without the "pounce: " prefix ("" when it passed):
// the CPU backend shares a rank's error with its peers, which then fail together instead of waiting.
template <typename Check>
std::string error_of(Check&& check) {
  try {
    check();
  } catch (const Error& error) {
    return std::string(error.what()).substr(8);
  }
  return {};
}

}  // namespace pounce
