#include "forward_harness.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <exception>

#include "reference/bf16.h"
#include "reference/reference.h"
#include "src/gpu_backend.h"
#include "src/state.h"

namespace pounce::gpu_test {

namespace {

struct Expected {
  std::vector<reference::RankForward> forward;     // [R] bf16 rounding points
  std::vector<reference::RankForward> forward64;   // [R] fp64, no rounding: the noise yardstick
  std::vector<reference::RankForward> bf16_layer;  // [R] FP8 only: the BF16 layer, for the error budget
  std::vector<reference::RankSchedule> schedules;  // [R]
};

Expected run_reference(const Model& m, const std::vector<RankData>& data, Precision precision) {
  reference::testing::Case c = make_reference_case(m, data, precision);
  Expected e;
  e.forward = reference::forward(c.problem, c.ranks, c.routed, c.shared);
  c.problem.numerics = reference::Numerics::kFp64;
  e.forward64 = reference::forward(c.problem, c.ranks, c.routed, c.shared);
  c.problem.numerics = reference::Numerics::kBf16;
  if (precision == Precision::kFP8) {
    c.problem.precision = Precision::kBF16;
    e.bf16_layer = reference::forward(c.problem, c.ranks, c.routed, c.shared);
    c.problem.precision = precision;
  }
  for (int64_t r = 0; r < m.shape.num_ranks; ++r)
    e.schedules.push_back(reference::build_schedule(c.problem, c.ranks, r));
  return e;
}

// recompute_forward_context rebuilds the context bitwise (y slots poisoned first) and leaves out alone;
// "" when it did, else what went wrong.
std::string check_recompute(Workspace& workspace, const ForwardArgs& args, const DeviceInputs& in,
                            const std::vector<int32_t>& topk_idx, const Shape& s, int64_t T,
                            cudaStream_t stream) {
  gpu::GpuWorkspace& gpu_ws = *workspace.state().gpu;
  const gpu::ForwardContextView ctx = gpu::forward_context(gpu_ws);
  const size_t slot_elements = T * s.num_topk * s.hidden;
  std::vector<uint16_t> y_before = download<uint16_t>(ctx.y_slots, slot_elements);
  poison(const_cast<void*>(ctx.y_slots), slot_elements * 2, stream);
  in.out.poison(stream);
  recompute_forward_context(workspace, args, stream);
  CUDA_OK(cudaStreamSynchronize(stream));
  gpu::check_device_errors(gpu_ws);
  std::vector<uint16_t> y_after = download<uint16_t>(ctx.y_slots, slot_elements);
  const std::vector<uint16_t> out_after = download<uint16_t>(in.out.ptr, T * s.hidden);
  for (size_t i = 0; i < slot_elements; ++i) {  // unused slots hold nothing to rebuild
    if (topk_idx[i / s.hidden] < 0) y_before[i] = y_after[i] = kPoison;
  }
  if (count_unpoisoned(out_after.data(), out_after.data() + out_after.size()) != 0)
    return "recompute_forward_context wrote out";
  return bitwise_difference("recompute_forward_context: y slots", y_before, y_after);
}

}  // namespace

void run_forward_rank(const Model& m, const std::vector<std::vector<RankData>>& data,
                      const std::vector<Call>& calls, ForwardMode mode, const Group& group, int rank,
                      int device, ForwardResults& results, const Config& tuning) {
  const Shape& s = m.shape;
  CUDA_OK(cudaSetDevice(device));
  Config config = tuning;
  config.activation = m.activation;
  Workspace workspace(group, s, config);
  gpu::GpuWorkspace& gpu_ws = *workspace.state().gpu;
  DeviceWeights weights(m, rank, device, config.precision);
  DeviceInputs in(s);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t graph_exec = nullptr;

  for (size_t c = 0; c < calls.size(); ++c) {
    const Call& call = calls[c];
    const RankData& d = data[c][rank];
    const int64_t T = call.num_tokens[rank];
    ForwardResult& res = results[c][rank];
    in.upload(s, d, call.idx_int64, stream);
    ForwardArgs args = in.args(s, T, call.idx_int64, device);
    args.routed = weights.routed;
    args.shared = weights.shared;
    args.routed_fp8 = weights.routed_fp8;
    for (int run = 0; run < 2; ++run) {
      in.out.poison(stream);
      try {
        if (mode == ForwardMode::kGraphVsEager && run == 0) {
          if (graph_exec == nullptr) {         // captured once, on the first call; replayed with new routing
            forward(workspace, args, stream);  // warm-up: lazy module loading outside capture
            CUDA_OK(cudaStreamSynchronize(stream));
            in.out.poison(stream);
            cudaGraph_t graph;
            CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            forward(workspace, args, stream);
            CUDA_OK(cudaStreamEndCapture(stream, &graph));
            CUDA_OK(cudaGraphInstantiate(&graph_exec, graph, 0));
            CUDA_OK(cudaGraphDestroy(graph));
          }
          CUDA_OK(cudaGraphLaunch(graph_exec, stream));
        } else {
          if (mode == ForwardMode::kStagedVsFused)
            gpu::set_kernel_path(gpu_ws, run == 0 ? KernelPath::kStaged : KernelPath::kFused);
          forward(workspace, args, stream);
        }
        CUDA_OK(cudaStreamSynchronize(stream));
        gpu::check_device_errors(gpu_ws);
      } catch (const std::exception& error) {
        res.error = error.what();
        CUDA_OK(cudaStreamSynchronize(stream));
      }
      res.out[run] = download<uint16_t>(in.out.ptr, T * s.hidden);
    }
    if (res.error.empty()) res.error = check_recompute(workspace, args, in, d.topk_idx, s, T, stream);
    const gpu::ForwardContextView ctx = gpu::forward_context(gpu_ws);
    const int64_t El = s.num_local_experts();
    res.group_offset = download<int32_t>(ctx.group_row_offset, El + 1);
    res.group_rows = download<int32_t>(ctx.group_rows, El);
    const int64_t rows = std::min<int64_t>(res.group_offset[El], ctx.rows_capacity);
    res.schedule = download<int32_t>(ctx.schedule, rows * 4);
    res.y_slots = download<uint16_t>(ctx.y_slots, T * s.num_topk * s.hidden);
    for (size_t i = 0; i < res.y_slots.size(); ++i) {  // an unused slot holds nothing: runs compare bitwise
      if (d.topk_idx[i / s.hidden] < 0) res.y_slots[i] = kPoison;
    }
  }
  if (graph_exec != nullptr) CUDA_OK(cudaGraphExecDestroy(graph_exec));
  CUDA_OK(cudaStreamDestroy(stream));
  // The workspace is destroyed here, on every rank's thread concurrently (collective deregistration).
}

ForwardResults run_forward(const Model& m, const std::vector<std::vector<RankData>>& data,
                           const std::vector<Call>& calls, ForwardMode mode, const Config& tuning) {
  const int R = static_cast<int>(m.shape.num_ranks);
  ForwardResults results(calls.size(), std::vector<ForwardResult>(R));
  run_ranks(R, [&](const Group& group, int rank) {
    run_forward_rank(m, data, calls, mode, group, rank, rank, results, tuning);
  });
  return results;
}

void check_forward_call(const Model& m, const Call& call, const std::vector<RankData>& data,
                        const std::vector<ForwardResult>& results, const std::string& label, int only_rank,
                        Precision precision) {
  const Shape& s = m.shape;
  const int64_t R = s.num_ranks, El = s.num_local_experts(), k = s.num_topk, H = s.hidden;
  const Expected expected = run_reference(m, data, precision);
  for (int64_t r = 0; r < R; ++r) {
    if (only_rank >= 0 && r != only_rank) continue;
    const ForwardResult& res = results[r];
    const std::string where = label + " rank " + std::to_string(r);
    ASSERT_EQ(res.error, "") << where;
    // Determinism: two runs, bitwise equal (kStagedVsFused: the staged chain, then the fused kernel).
    ASSERT_EQ(bitwise_difference("out", res.out[0], res.out[1]), "") << where << ": the two runs differ";
    // Schedule: exactly the reference's.
    const reference::RankSchedule& ref = expected.schedules[r];
    for (int64_t e = 0; e <= El; ++e) {
      ASSERT_EQ(res.group_offset[e], ref.expert_row_offset[e]) << where << ": group_row_offset[" << e << "]";
    }
    for (int64_t e = 0; e < El; ++e) {  // what the GEMMs skip padding by (GroupedRows::group_rows)
      ASSERT_EQ(res.group_rows[e], ref.expert_num_rows[e]) << where << ": group_rows[" << e << "]";
    }
    ASSERT_EQ(static_cast<int64_t>(res.schedule.size()) / 4, static_cast<int64_t>(ref.rows.size())) << where;
    for (size_t row = 0; row < ref.rows.size(); ++row) {
      const reference::ScheduleRow got{res.schedule[row * 4], res.schedule[row * 4 + 1],
                                       res.schedule[row * 4 + 2]};
      ASSERT_EQ(got, ref.rows[row]) << where << ": schedule row " << row << " is (" << got.src_rank << ", "
                                    << got.src_token << ", " << got.slot << "), reference ("
                                    << ref.rows[row].src_rank << ", " << ref.rows[row].src_token << ", "
                                    << ref.rows[row].slot << ")";
    }
    // y per used (token, slot), then out.
    const int64_t T = call.num_tokens[r];
    std::vector<bool> used(T * k * H, false);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        if (data[r].topk_idx[t * k + j] >= 0) std::fill_n(used.begin() + (t * k + j) * H, H, true);
      }
    }
    EXPECT_EQ(
        compare_close(where + " y", {T, k, H}, reference::bf16_to_double(res.y_slots), expected.forward[r].y,
                      expected.forward64[r].y, &used, 0, noise_factor_for(precision)),
        "");
    EXPECT_EQ(
        compare_close(where + " out", {T, H}, reference::bf16_to_double(res.out[0]), expected.forward[r].out,
                      expected.forward64[r].out, nullptr, 0, noise_factor_for(precision)),
        "");
    if (precision == Precision::kFP8) {
      EXPECT_EQ(fp8_budget_difference(where + " y", reference::bf16_to_double(res.y_slots),
                                      expected.bf16_layer[r].y, false, &used),
                "");
      EXPECT_EQ(fp8_budget_difference(where + " out", reference::bf16_to_double(res.out[0]),
                                      expected.bf16_layer[r].out, false),
                "");
    }
  }
}

ForwardResults check_forward(const Model& m, const std::vector<Call>& calls, ForwardMode mode,
                             const std::string& name, const Config& tuning) {
  const std::vector<std::vector<RankData>> data = make_call_data(m.shape, calls);
  const ForwardResults results = run_forward(m, data, calls, mode, tuning);
  for (size_t c = 0; c < calls.size(); ++c) {
    check_forward_call(m, calls[c], data[c], results[c], name + " call " + std::to_string(c), -1,
                       tuning.precision);
  }
  return results;
}

void expect_same_forward(const ForwardResults& a, const ForwardResults& b, const std::string& name) {
  ASSERT_EQ(a.size(), b.size()) << name;
  for (size_t c = 0; c < a.size(); ++c) {
    ASSERT_EQ(a[c].size(), b[c].size()) << name;
    for (size_t r = 0; r < a[c].size(); ++r) {
      const std::string where = name + " call " + std::to_string(c) + " rank " + std::to_string(r);
      EXPECT_EQ(a[c][r].error + b[c][r].error, "") << where;
      EXPECT_EQ(bitwise_difference("out", a[c][r].out[0], b[c][r].out[0]), "") << where;
      EXPECT_EQ(bitwise_difference("y slots", a[c][r].y_slots, b[c][r].y_slots), "") << where;
    }
  }
}

}  // namespace pounce::gpu_test
