// CPU backend: every call is collective over the R threads of a CpuGroup.
//
//   publish (args, validation error) -> barrier -> any error? all throw
//   rank 0 evaluates the group with reference::forward/backward -> barrier -> each rank copies its part
//
// Each phase's shared slots are written only after a barrier that every reader of the previous phase
// has passed, so one slot per rank suffices (errors: "errors read"; results: the next call's publish).
#include "src/cpu_backend.h"

#include <cstring>

#include "pounce/error.h"
#include "reference/bf16.h"

namespace pounce::cpu {
namespace {

using reference::float_to_bf16_bits;

std::vector<double> to_double(const TensorView& view) {
  if (view.dtype == DType::kBF16) return reference::bf16_to_double(view.as<uint16_t>(), view.numel());
  const float* values = view.as<float>();
  return std::vector<double>(values, values + view.numel());
}

std::vector<int32_t> to_int32(const TensorView& view) {
  std::vector<int32_t> out(view.numel());
  if (view.dtype == DType::kInt32) {
    std::memcpy(out.data(), view.data, out.size() * sizeof(int32_t));
  } else {
    const int64_t* values = view.as<int64_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int32_t>(values[i]);
  }
  return out;
}

// Writes `values` into a bf16 or fp32 view; `accumulate` adds into fp32 (main_grad).
void store(const std::vector<double>& values, const TensorView& view, bool accumulate = false) {
  if (view.dtype == DType::kBF16) {
    uint16_t* bits = view.as<uint16_t>();
    for (size_t i = 0; i < values.size(); ++i) bits[i] = float_to_bf16_bits(static_cast<float>(values[i]));
  } else if (accumulate) {
    float* out = view.as<float>();
    for (size_t i = 0; i < values.size(); ++i) out[i] += static_cast<float>(values[i]);
  } else {
    float* out = view.as<float>();
    for (size_t i = 0; i < values.size(); ++i) out[i] = static_cast<float>(values[i]);
  }
}

reference::Problem make_problem(const WorkspaceState& state) {
  reference::Problem problem;
  problem.hidden = state.shape.hidden;
  problem.intermediate = state.shape.intermediate;
  problem.num_experts = state.shape.num_experts;
  problem.num_topk = state.shape.num_topk;
  problem.shared_intermediate = state.shape.shared_intermediate;
  problem.num_ranks = state.shape.num_ranks;
  problem.block_m = kBlockM;
  problem.activation = state.config.activation;
  problem.numerics = reference::Numerics::kBf16;
  problem.precision = state.config.precision;
  return problem;
}

reference::Weights to_weights(const ExpertWeights& weights) {
  return {to_double(weights.gate), to_double(weights.up), to_double(weights.down)};
}

reference::RankInputs to_inputs(const ForwardArgs& args, const TensorView* d_out) {
  reference::RankInputs inputs;
  inputs.num_tokens = args.x.shape[0];
  inputs.x = to_double(args.x);
  inputs.topk_idx = to_int32(args.topk_idx);
  inputs.topk_weights = to_double(args.topk_weights);
  if (d_out != nullptr) inputs.d_out = to_double(*d_out);
  return inputs;
}

CpuGroup& group_of(WorkspaceState& state) {
  return *state.group.state().cpu;
}

// Publishes this rank's arguments and error; throws on every rank when any rank rejected its inputs.
void publish(WorkspaceState& state, const void* args, const std::string& local_error, const char* call) {
  CpuGroup& group = group_of(state);
  const int rank = state.group.rank();
  group.published[rank] = args;
  group.errors[rank] = local_error;
  group.barrier.arrive_and_wait(std::string(call) + ": inputs published", rank,
                                state.environment.peer_timeout);
  std::string first_error;
  for (int peer = 0; peer < group.num_ranks && first_error.empty(); ++peer) {
    if (group.errors[peer].empty()) continue;
    first_error = peer == rank
                      ? group.errors[peer]
                      : "rank " + std::to_string(peer) + " rejected its inputs: " + group.errors[peer];
  }
  // Every rank has read the errors before anyone may publish the next call's.
  group.barrier.arrive_and_wait(std::string(call) + ": errors read", rank, state.environment.peer_timeout);
  if (!first_error.empty()) throw Error(first_error.substr(first_error.rfind("pounce: ", 0) == 0 ? 8 : 0));
}

// Rank 0 runs `evaluate` for the group; every rank waits for it and rethrows its failure.
template <typename Evaluate>
void evaluate_on_rank0(WorkspaceState& state, const char* call, Evaluate&& evaluate) {
  CpuGroup& group = group_of(state);
  const int rank = state.group.rank();
  if (rank == 0) {
    group.group_error.clear();
    try {
      evaluate(group);
    } catch (const std::exception& error) {
      group.group_error = error.what();
    }
  }
  group.barrier.arrive_and_wait(std::string(call) + ": group evaluated", rank,
                                state.environment.peer_timeout);
  if (!group.group_error.empty())
    throw Error(std::string(call) + " failed on the group: " + group.group_error);
}

}  // namespace

void create_workspace(WorkspaceState& state) {
  CpuGroup& group = group_of(state);
  const int rank = state.group.rank();
  std::string error;
  group.published[rank] = &state;
  group.barrier.arrive_and_wait("workspace: config published", rank, state.environment.peer_timeout);
  const auto& first = *static_cast<const WorkspaceState*>(group.published[0]);
  if (!(first.shape == state.shape) || !(first.config.activation == state.config.activation) ||
      first.config.precision != state.config.precision ||
      first.config.macrobatch_size != state.config.macrobatch_size)
    error = "rank " + std::to_string(rank) +
            " created its workspace with a shape or config different from rank 0's; " +
            "every rank of the group must pass the same Shape and Config";
  publish(state, &state, error, "workspace");
}

void forward(WorkspaceState& state, const ForwardArgs& args, const std::string& local_error, bool write_out) {
  publish(state, &args, local_error, "forward");
  evaluate_on_rank0(state, "forward", [&](CpuGroup& group) {
    std::vector<reference::RankInputs> inputs;
    std::vector<reference::Weights> routed;
    for (const void* published : group.published) {
      const auto& rank_args = *static_cast<const ForwardArgs*>(published);
      inputs.push_back(to_inputs(rank_args, nullptr));
      routed.push_back(to_weights(rank_args.routed));
    }
    // Shared weights are data-parallel replicas; rank 0's copy is used for the whole group.
    const auto& rank0 = *static_cast<const ForwardArgs*>(group.published[0]);
    const reference::Weights shared =
        state.shape.has_shared_expert() ? to_weights(rank0.shared) : reference::Weights{};
    group.forward_results = reference::forward(make_problem(state), inputs, routed, shared);
  });
  reference::RankForward& mine = group_of(state).forward_results[state.group.rank()];
  if (write_out) store(mine.out, args.out);
  state.cpu_context.valid = true;
  state.cpu_context.num_tokens = args.x.shape[0];
  state.cpu_context.saved = mine;
}

void backward(WorkspaceState& state, const BackwardArgs& args, const std::string& local_error) {
  std::string error = local_error;
  if (error.empty() && !state.cpu_context.valid)
    error =
        "backward called before forward (or recompute_forward_context) on this workspace; run forward first";
  if (error.empty() && state.cpu_context.num_tokens != args.inputs.x.shape[0])
    error = "backward got " + std::to_string(args.inputs.x.shape[0]) + " tokens but the saved forward had " +
            std::to_string(state.cpu_context.num_tokens) + "; pass the inputs of the matching forward";
  publish(state, &args, error, "backward");
  evaluate_on_rank0(state, "backward", [&](CpuGroup& group) {
    std::vector<reference::RankInputs> inputs;
    std::vector<reference::Weights> routed;
    for (const void* published : group.published) {
      const auto& rank_args = *static_cast<const BackwardArgs*>(published);
      inputs.push_back(to_inputs(rank_args.inputs, &rank_args.d_out));
      routed.push_back(to_weights(rank_args.inputs.routed));
    }
    const auto& rank0 = *static_cast<const BackwardArgs*>(group.published[0]);
    const reference::Weights shared =
        state.shape.has_shared_expert() ? to_weights(rank0.inputs.shared) : reference::Weights{};
    group.gradient_results = reference::backward(make_problem(state), inputs, routed, shared);
  });
  const reference::RankGradients& mine = group_of(state).gradient_results[state.group.rank()];
  store(mine.d_x, args.d_x);
  store(mine.d_topk_weights, args.d_topk_weights);
  store(mine.d_routed.gate, args.d_routed.gate, args.accumulate_weight_grads);
  store(mine.d_routed.up, args.d_routed.up, args.accumulate_weight_grads);
  store(mine.d_routed.down, args.d_routed.down, args.accumulate_weight_grads);
  if (state.shape.has_shared_expert()) {
    store(mine.d_shared.gate, args.d_shared.gate, args.accumulate_weight_grads);
    store(mine.d_shared.up, args.d_shared.up, args.accumulate_weight_grads);
    store(mine.d_shared.down, args.d_shared.down, args.accumulate_weight_grads);
  }
}

}  // namespace pounce::cpu
