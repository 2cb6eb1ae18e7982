// CPU backend: every call is collective over the R threads of a CpuGroup, in two rounds of its exchange
// (src/host_barrier.h), each rank posting by value:
//
//   "arguments": each rank posts its record (call, workspace, fields, tokens, validation error) and its
//                inputs converted for the reference; every rank checks the R records the same way, so all
//                throw the same error, or all go on (a rank whose own checks failed posts its error and
//                throws at once; its peers throw that error when they arrive)
//   "results":   rank 0 evaluates the group with reference::forward/backward and posts each rank's part
//                (or the failure); each rank takes its own and writes its outputs
//
// A round never reads a peer's memory: a mismatch (forward against backward, different workspaces, one rank
// from two threads, a peer that stopped) is an error on every rank, never a read of the wrong arguments.
#include "src/cpu_backend.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/layout/workspace_layout.cuh"
#include "pounce/error.h"
#include "reference/bf16.h"

namespace pounce::cpu {
namespace {

using reference::float_to_bf16_bits;

// A view's elements in row-major order, read through its strides (weights may be row-strided views).
std::vector<double> to_double(const TensorView& view) {
  if (view.is_dense()) {
    if (view.dtype == DType::kBF16) return reference::bf16_to_double(view.as<uint16_t>(), view.numel());
    const float* values = view.as<float>();
    return std::vector<double>(values, values + view.numel());
  }
  std::vector<double> out(view.numel());
  for (int64_t i = 0; i < view.numel(); ++i) {
    const int64_t at = view.offset_of(i);
    out[i] = view.dtype == DType::kBF16 ? reference::bf16_bits_to_float(view.as<uint16_t>()[at])
                                        : view.as<float>()[at];
  }
  return out;
}

std::vector<int32_t> to_int32(const TensorView& view) {
  std::vector<int32_t> out(view.numel());
  if (view.dtype == DType::kInt32) {
    const int32_t* values = view.as<int32_t>();  // null for T = 0, which memcpy may not take
    std::copy(values, values + out.size(), out.begin());
  } else {
    const int64_t* values = view.as<int64_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int32_t>(values[i]);
  }
  return out;
}

// Writes `values` (row-major) into a bf16 or fp32 view through its strides; `accumulate` adds into fp32
// (main_grad). An empty view is a gradient nobody asked for (frozen weights): nothing is written.
void store(const std::vector<double>& values, const TensorView& view, bool accumulate = false) {
  if (view.is_none()) return;
  for (size_t i = 0; i < values.size(); ++i) {
    const int64_t at = view.offset_of(static_cast<int64_t>(i));
    if (view.dtype == DType::kBF16) {
      view.as<uint16_t>()[at] = float_to_bf16_bits(static_cast<float>(values[i]));
    } else if (accumulate) {
      view.as<float>()[at] += static_cast<float>(values[i]);
    } else {
      view.as<float>()[at] = static_cast<float>(values[i]);
    }
  }
}

// A failed call's outputs, as the GPU backend leaves them (kernels/common/finish_call.cuh): NaN everywhere,
// so nothing trains on stale values. Accumulated gradients (main_grad) too.
void fill_nan(const TensorView& view) {
  if (view.is_none()) return;
  for (int64_t i = 0; i < view.numel(); ++i) {
    const int64_t at = view.offset_of(i);
    if (view.dtype == DType::kBF16) {
      view.as<uint16_t>()[at] = 0x7FC0;
    } else {
      view.as<float>()[at] = std::numeric_limits<float>::quiet_NaN();
    }
  }
}

void fill_nan(const ExpertWeights& grads) {
  for (const TensorView* view :
       {&grads.gate, &grads.up, &grads.down, &grads.b_gate, &grads.b_up, &grads.b_down})
    fill_nan(*view);
}

// The GPU's macrobatch ring holds whole experts (kernels/sched/macrobatch_plan.cuh): an expert whose padded
// rows exceed it, which only a token naming that expert in several slots can cause, fails the call there
// with the routed experts computing nothing. The CPU backend fails the same calls with the same message, so
// a routing that runs here runs on GPUs. "" when the routing fits (or there is no ring).
std::string macrobatch_overflow(const WorkspaceState& state,
                                const std::vector<reference::RankInputs>& inputs) {
  const Shape& s = state.shape;
  const auto layout = kernels::layout::WorkspaceLayout::make(s.max_tokens, s.hidden, s.intermediate,
                                                             s.shared_intermediate, s.num_experts, s.num_topk,
                                                             s.num_ranks, state.config.macrobatch_size);
  if (layout.ring_rows >= layout.rows_capacity) return "";
  std::vector<int64_t> rows(s.num_experts, 0);
  for (const reference::RankInputs& rank : inputs)
    for (const int32_t expert : rank.topk_idx)
      if (expert >= 0 && expert < s.num_experts) ++rows[expert];
  const int64_t El = s.num_local_experts();
  for (int64_t owner = 0; owner < s.num_ranks; ++owner) {
    int64_t largest = 0, largest_expert = 0;  // the first expert with the most rows, as the GPU plan picks
    for (int64_t e = 0; e < El; ++e) {
      const int64_t padded = kernels::layout::round_up(rows[owner * El + e], kernels::layout::kBlockM);
      if (padded > largest) largest = padded, largest_expert = e;
    }
    if (largest > layout.ring_rows)
      return "macrobatch overflow on rank " + std::to_string(owner) + ": local expert " +
             std::to_string(largest_expert) + " receives " + std::to_string(largest) +
             " rows (padded) but config.macrobatch_size is " + std::to_string(layout.ring_rows) +
             "; a token names the same expert in several slots. The routed experts computed nothing in this "
             "call; raise macrobatch_size (0 = the worst case) or give every token distinct experts";
  }
  return "";
}

reference::Problem make_problem(const WorkspaceState& state) {
  return reference::Problem::of(state.shape, state.config.activation, state.config.precision);
}

// An empty bias stays empty (no bias), as the reference takes it.
reference::Weights to_weights(const ExpertWeights& weights) {
  auto optional = [](const TensorView& view) {
    return view.is_none() ? std::vector<double>{} : to_double(view);
  };
  return {to_double(weights.gate),  to_double(weights.up),  to_double(weights.down),
          optional(weights.b_gate), optional(weights.b_up), optional(weights.b_down)};
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

bool any_given(const ExpertWeights& weights) {
  return !weights.gate.is_none() || !weights.up.is_none() || !weights.down.is_none() || weights.has_biases();
}

CpuGroup& group_of(WorkspaceState& state) {
  return *state.group.state().cpu;
}

// Round "arguments": posts `post` and returns every rank's record (rank 0 also takes every rank's inputs
// into `inputs` and `routed`, and its own shared weights into `shared`). Throws on every rank, with the same
// reason, when the records disagree.
uint64_t exchange_arguments(WorkspaceState& state, CpuPost post, std::vector<reference::RankInputs>* inputs,
                            std::vector<reference::Weights>* routed, reference::Weights* shared) {
  CpuGroup& group = group_of(state);
  const int rank = state.group.rank();
  const std::string what = std::string(to_string(post.record.call)) + ": arguments";
  if (!post.record.error.empty()) {  // this rank's call failed on its own: tell the peers, fail at once
    const std::string error = post.record.error;
    group.exchange.leave(rank, "arguments", what, state.environment.peer_timeout, std::move(post));
    throw Error(error);
  }
  std::vector<CpuRecord> records;
  const uint64_t round = group.exchange.exchange(rank, "arguments", what, state.environment.peer_timeout,
                                                 std::move(post), [&](std::vector<CpuPost>& posts) {
                                                   for (CpuPost& peer : posts) records.push_back(peer.record);
                                                   if (rank != 0 || inputs == nullptr) return;
                                                   for (CpuPost& peer : posts) {
                                                     inputs->push_back(std::move(peer.inputs));
                                                     routed->push_back(std::move(peer.routed));
                                                   }
                                                   *shared = std::move(posts[0].shared);
                                                 });
  const std::string error = disagreement(records, rank);
  if (!error.empty()) throw Error(error);
  return round;
}

// Round "results": rank 0 runs `evaluate(results)` for the group and posts it; every rank takes its part
// with take(results), or on the group's failure runs fail() (NaN outputs) and rethrows it. A round that
// never completes (a peer gone) throws without touching anything.
template <typename Evaluate, typename Take, typename Fail>
void exchange_results(WorkspaceState& state, CpuCall call, Evaluate&& evaluate, Take&& take, Fail&& fail) {
  CpuGroup& group = group_of(state);
  const int rank = state.group.rank();
  CpuPost post;
  if (rank == 0) {
    try {
      evaluate(post);
    } catch (const std::exception& error) {
      post.group_error = error.what();
    }
  }
  std::string group_error;
  group.exchange.exchange(rank, "results", std::string(to_string(call)) + ": results",
                          state.environment.peer_timeout, std::move(post), [&](std::vector<CpuPost>& posts) {
                            group_error = posts[0].group_error;
                            if (group_error.empty()) take(posts[0]);
                          });
  if (!group_error.empty()) {
    fail();
    throw Error(std::string(to_string(call)) + " failed on the group: " + group_error);
  }
}

CpuPost record_of(const WorkspaceState& state, CpuCall call, int64_t num_tokens, const std::string& error) {
  CpuPost post;
  post.record = {call, state.cpu_id, WorkspaceFields::of(state.shape, state.config), num_tokens, error};
  return post;
}

// This rank's inputs converted for the reference (skipped after a validation error: its views may be
// anything); a conversion failure becomes the rank's error.
void add_inputs(const WorkspaceState& state, const ForwardArgs& args, const TensorView* d_out,
                CpuPost& post) {
  if (!post.record.error.empty()) return;
  try {
    post.inputs = to_inputs(args, d_out);
    post.routed = to_weights(args.routed);
    if (state.group.rank() == 0 && state.shape.has_shared_expert()) post.shared = to_weights(args.shared);
  } catch (const std::exception& error) {
    post.record.error = std::string("its inputs could not be read: ") + error.what();
  }
}

std::string describe_workspace(uint64_t id) {
  return id == 0 ? "none" : "the workspace created at group step " + std::to_string(id);
}

}  // namespace

const char* to_string(CpuCall call) {
  switch (call) {
    case CpuCall::kCreateWorkspace:
      return "workspace creation";
    case CpuCall::kForward:
      return "forward";
    case CpuCall::kRecompute:
      return "recompute_forward_context";
    case CpuCall::kBackward:
      return "backward";
  }
  return "?";
}

std::string disagreement(const std::vector<CpuRecord>& records, int rank) {
  const CpuRecord& first = records[0];
  std::string others;
  for (size_t peer = 1; peer < records.size(); ++peer)
    if (records[peer].call != first.call)
      others += (others.empty() ? "" : ", ") + std::string(to_string(records[peer].call)) + " on rank " +
                std::to_string(peer);
  if (!others.empty())
    return std::string("the ranks of the group made different calls: ") + to_string(first.call) +
           " on rank 0 but " + others + "; every rank must make the same calls in the same order";
  for (size_t peer = 1; peer < records.size(); ++peer)
    if (records[peer].workspace_id != first.workspace_id)
      others += (others.empty() ? "" : ", ") + describe_workspace(records[peer].workspace_id) + " on rank " +
                std::to_string(peer);
  if (!others.empty())
    return std::string("the ranks called ") + to_string(first.call) +
           " on different workspaces: " + describe_workspace(first.workspace_id) + " on rank 0 but " +
           others + "; each rank must pass its own workspace of the same collective creation";
  for (size_t peer = 0; peer < records.size(); ++peer) {
    if (records[peer].error.empty()) continue;
    return static_cast<int>(peer) == rank
               ? records[peer].error
               : "rank " + std::to_string(peer) + " rejected its inputs: " + records[peer].error;
  }
  std::vector<WorkspaceFields> fields;
  for (const CpuRecord& record : records) fields.push_back(record.fields);
  return workspace_disagreement(fields);
}

void create_workspace(WorkspaceState& state, const std::string& local_error) {
  // The creating round's number names the workspace on every rank (each rank holds its own state).
  state.cpu_id = exchange_arguments(state, record_of(state, CpuCall::kCreateWorkspace, 0, local_error),
                                    nullptr, nullptr, nullptr);
}

void forward(WorkspaceState& state, const ForwardArgs& args, const std::string& local_error, bool write_out) {
  const CpuCall call = write_out ? CpuCall::kForward : CpuCall::kRecompute;
  const int64_t num_tokens = local_error.empty() ? args.x.shape[0] : 0;
  CpuPost post = record_of(state, call, num_tokens, local_error);
  add_inputs(state, args, nullptr, post);
  std::vector<reference::RankInputs> inputs;
  std::vector<reference::Weights> routed;
  reference::Weights shared;
  exchange_arguments(state, std::move(post), &inputs, &routed, &shared);
  reference::RankForward mine;
  state.cpu_context.valid = false;  // until this call's context is in
  exchange_results(
      state, call,
      [&](CpuPost& results) {
        const std::string overflow = macrobatch_overflow(state, inputs);
        if (!overflow.empty()) throw std::runtime_error(overflow);  // the group's failure, posted as is
        results.forward = reference::forward(make_problem(state), inputs, routed, shared);
      },
      [&](CpuPost& results) { mine = std::move(results.forward[state.group.rank()]); },
      [&] {
        if (write_out) fill_nan(args.out);
      });
  if (write_out) store(mine.out, args.out);
  state.cpu_context.valid = true;
  state.cpu_context.num_tokens = num_tokens;
  state.cpu_context.saved = std::move(mine);
}

void backward(WorkspaceState& state, const BackwardArgs& args, const std::string& local_error) {
  std::string error = local_error;
  if (error.empty() && !state.cpu_context.valid)
    error =
        "backward called before forward (or recompute_forward_context) on this workspace; run forward first";
  if (error.empty() && state.cpu_context.num_tokens != args.inputs.x.shape[0])
    error = "backward got " + std::to_string(args.inputs.x.shape[0]) + " tokens but the saved forward had " +
            std::to_string(state.cpu_context.num_tokens) + "; pass the inputs of the matching forward";
  const int64_t num_tokens = error.empty() ? args.inputs.x.shape[0] : 0;
  CpuPost post = record_of(state, CpuCall::kBackward, num_tokens, error);
  add_inputs(state, args.inputs, &args.d_out, post);
  // Frozen experts: the gradients this rank left empty are not computed (its experts' and its tokens').
  post.inputs.routed_weight_grads = any_given(args.d_routed);
  post.inputs.shared_weight_grads = any_given(args.d_shared);
  std::vector<reference::RankInputs> inputs;
  std::vector<reference::Weights> routed;
  reference::Weights shared;
  exchange_arguments(state, std::move(post), &inputs, &routed, &shared);
  reference::RankGradients mine;
  exchange_results(
      state, CpuCall::kBackward,
      [&](CpuPost& results) {
        results.gradients = reference::backward(make_problem(state), inputs, routed, shared);
      },
      [&](CpuPost& results) { mine = std::move(results.gradients[state.group.rank()]); },
      [&] {
        fill_nan(args.d_x);
        fill_nan(args.d_topk_weights);
        fill_nan(args.d_routed);
        if (state.shape.has_shared_expert()) fill_nan(args.d_shared);
      });
  store(mine.d_x, args.d_x);
  store(mine.d_topk_weights, args.d_topk_weights);
  store(mine.d_routed.gate, args.d_routed.gate, args.accumulate_weight_grads);
  store(mine.d_routed.up, args.d_routed.up, args.accumulate_weight_grads);
  store(mine.d_routed.down, args.d_routed.down, args.accumulate_weight_grads);
  store(mine.d_routed.b_gate, args.d_routed.b_gate, args.accumulate_weight_grads);
  store(mine.d_routed.b_up, args.d_routed.b_up, args.accumulate_weight_grads);
  store(mine.d_routed.b_down, args.d_routed.b_down, args.accumulate_weight_grads);
  if (state.shape.has_shared_expert()) {
    store(mine.d_shared.gate, args.d_shared.gate, args.accumulate_weight_grads);
    store(mine.d_shared.up, args.d_shared.up, args.accumulate_weight_grads);
    store(mine.d_shared.down, args.d_shared.down, args.accumulate_weight_grads);
  }
}

}  // namespace pounce::cpu
