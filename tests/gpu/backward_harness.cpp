#include "backward_harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <random>

#include "reference/bf16.h"
#include "reference/reference.h"
#include "src/gpu_backend.h"
#include "src/state.h"

namespace pounce::gpu_test {

using reference::bf16_bits_to_float;
using reference::float_to_bf16_bits;

const char* const kOutputNames[kNumOutputs] = {"d_x",         "d_topk_weights", "d_routed.gate",
                                               "d_routed.up", "d_routed.down",  "d_shared.gate",
                                               "d_shared.up", "d_shared.down"};

namespace {

bool is_routed(int output) {
  return output >= kFirstWeightGrad && output < kFirstWeightGrad + 3;
}

// Shapes of the outputs for T tokens; the shared gradients are {} without a shared expert.
std::vector<std::vector<int64_t>> output_dims(const Shape& s, int64_t T) {
  const int64_t El = s.num_local_experts(), I = s.intermediate, H = s.hidden, Is = s.shared_intermediate;
  std::vector<std::vector<int64_t>> dims = {
      {T, H}, {T, s.num_topk}, {El, I, H}, {El, I, H}, {El, H, I}, {}, {}, {}};
  if (Is > 0) {
    dims[5] = {Is, H};
    dims[6] = {Is, H};
    dims[7] = {H, Is};
  }
  return dims;
}

int64_t numel(const std::vector<int64_t>& dims) {
  if (dims.empty()) return 0;
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

DType output_dtype(int output, GradMode mode) {
  if (output == 0) return DType::kBF16;
  if (output == 1) return DType::kFP32;
  return mode == GradMode::kStoreBf16 ? DType::kBF16 : DType::kFP32;
}

template <typename T>
std::vector<T> reinterpret(const std::vector<uint8_t>& raw) {
  std::vector<T> values(raw.size() / sizeof(T));
  std::memcpy(values.data(), raw.data(), values.size() * sizeof(T));
  return values;
}

std::vector<double> to_double(const std::vector<uint8_t>& raw, DType dtype) {
  if (dtype == DType::kBF16) return reference::bf16_to_double(reinterpret<uint16_t>(raw));
  const std::vector<float> values = reinterpret<float>(raw);
  return std::vector<double>(values.begin(), values.end());
}

// Random main_grad contents for the accumulate run, at capacity.
std::vector<std::vector<float>> make_prefill(const Shape& s, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  const std::vector<std::vector<int64_t>> dims = output_dims(s, s.max_tokens);
  std::vector<std::vector<float>> prefill(kNumWeightGrads);
  for (int w = 0; w < kNumWeightGrads; ++w) {
    prefill[w].resize(numel(dims[kFirstWeightGrad + w]));
    for (float& v : prefill[w]) v = dist(gen);
  }
  return prefill;
}

// The inputs of the forward that recompute_forward_context has to undo: same tokens, other routing and x.
Call other_call(const Call& call) {
  return sparse_routing(call.num_tokens, call.seed + 1000);
}

// One rank's share of `calls` (see the header comment); fills results[call][rank]. `graph`: also capture
// forward + backward once (first call) and replay it for every call. Throws only on setup failures; a
// failing step is recorded and the rank carries on, so that every rank issues the same collective calls.
void run_backward_rank(const Model& m, const std::vector<Call>& calls,
                       const std::vector<std::vector<RankData>>& data, bool graph, const Config& config,
                       const Group& group, int rank, BackwardResults& results) {
  const Shape& s = m.shape;
  Workspace workspace(group, s, config);
  gpu::GpuWorkspace& gpu_ws = *workspace.state().gpu;
  DeviceWeights weights(m, rank, rank, config.precision);
  DeviceInputs in(s), other_in(s);
  DeviceBackward grads(s, rank);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t graph_exec = nullptr;

  for (size_t c = 0; c < calls.size(); ++c) {
    const Call& call = calls[c];
    const int64_t T = call.num_tokens[rank];
    BackwardResult& res = results[c][rank];
    res.prefill = make_prefill(s, call.seed * 131u + static_cast<uint32_t>(rank));
    in.upload(s, data[c][rank], call.idx_int64, stream);
    other_in.upload(s, make_rank_data(s, other_call(call), rank), false, stream);
    grads.upload_d_out(data[c][rank].d_out, stream);
    ForwardArgs fwd = in.args(s, T, call.idx_int64, rank);
    ForwardArgs other_fwd = other_in.args(s, T, false, rank);
    for (ForwardArgs* a : {&fwd, &other_fwd}) {
      a->routed = weights.routed;
      a->shared = weights.shared;
      a->routed_fp8 = weights.routed_fp8;
    }

    // Launches, synchronises and reads the device error record; a topk_idx report is expected on a bad-id
    // call, anything else becomes the call's error.
    auto step = [&](const std::string& what, const std::function<void()>& launch) {
      try {
        launch();
        CUDA_OK(cudaStreamSynchronize(stream));
        gpu::check_device_errors(gpu_ws);
      } catch (const std::exception& error) {
        cudaStreamSynchronize(stream);
        const std::string message = error.what();
        if (call.bad_id != 0 && message.find("topk_idx value out of range") != std::string::npos) {
          ++res.routing_errors;
        } else if (res.error.empty()) {
          res.error = what + ": " + message;
        }
      }
    };
    auto run_forward = [&](const ForwardArgs& a) {
      in.out.poison(stream);
      forward(workspace, a, stream);
    };
    auto run_backward = [&](GradMode mode) {
      grads.prepare(mode, res.prefill, stream);
      backward(workspace, grads.args(fwd, T, mode), stream);
    };
    auto read_out = [&] { return download<uint16_t>(in.out.ptr, T * s.hidden); };
    auto fp32_run = [&](const std::string& label) {
      res.fp32_runs.emplace_back(label, grads.read(GradMode::kStoreF32, T));
    };

    if (graph) {
      if (graph_exec == nullptr) {   // captured on the first call (T per rank fixed), replayed on every call
        step("graph warm-up", [&] {  // lazy module loading and first-call setup outside the capture
          run_forward(fwd);
          run_backward(GradMode::kStoreF32);
        });
        cudaGraph_t captured;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        forward(workspace, fwd, stream);
        backward(workspace, grads.args(fwd, T, GradMode::kStoreF32), stream);
        CUDA_OK(cudaStreamEndCapture(stream, &captured));
        CUDA_OK(cudaGraphInstantiate(&graph_exec, captured, 0));
        CUDA_OK(cudaGraphDestroy(captured));
      }
      step("CUDA graph replay", [&] {
        in.out.poison(stream);
        grads.prepare(GradMode::kStoreF32, res.prefill, stream);
        CUDA_OK(cudaGraphLaunch(graph_exec, stream));
      });
      fp32_run("forward + backward replayed from a CUDA graph");
    }
    step("forward", [&] { run_forward(fwd); });
    res.out[0] = read_out();
    step("backward", [&] { run_backward(GradMode::kStoreF32); });
    fp32_run("backward after forward");
    step("backward again", [&] { run_backward(GradMode::kStoreF32); });
    fp32_run("backward again on the same context");
    step("backward into bf16", [&] { run_backward(GradMode::kStoreBf16); });
    res.bf16_run = grads.read(GradMode::kStoreBf16, T);
    step("backward accumulating", [&] { run_backward(GradMode::kAccumulateF32); });
    res.accumulate_run = grads.read(GradMode::kAccumulateF32, T);
    step("forward again", [&] { run_forward(fwd); });
    res.out[1] = read_out();
    step("backward after forward again", [&] { run_backward(GradMode::kStoreF32); });
    fp32_run("backward after re-running forward");
    step("forward of other routing", [&] { run_forward(other_fwd); });
    step("recompute_forward_context", [&] { recompute_forward_context(workspace, fwd, stream); });
    step("backward after recompute", [&] { run_backward(GradMode::kStoreF32); });
    fp32_run("backward after another forward and recompute_forward_context");
  }
  if (graph_exec != nullptr) CUDA_OK(cudaGraphExecDestroy(graph_exec));
  CUDA_OK(cudaStreamDestroy(stream));
  // The workspace is destroyed here, on every rank's thread concurrently (collective deregistration).
}

// ---- checks ----

std::vector<double> slice(const std::vector<double>& v, int64_t begin, int64_t count) {
  return std::vector<double>(v.begin() + begin, v.begin() + begin + count);
}

const std::vector<double>& reference_output(const reference::RankGradients& g, int output) {
  const std::vector<double>* tensors[kNumOutputs] = {&g.d_x,         &g.d_topk_weights, &g.d_routed.gate,
                                                     &g.d_routed.up, &g.d_routed.down,  &g.d_shared.gate,
                                                     &g.d_shared.up, &g.d_shared.down};
  return *tensors[output];
}

// Weight gradient `output` of one rank against the reference, one expert (slice) at a time: the fp32 run
// within the §6 bound (exact zeros for an expert without rows); the bf16 run exactly the fp32 run rounded
// and within the bound of the bf16-rounded reference; the accumulate run exactly prefill + the fp32 run
// (one fp32 addition) and, minus the prefill, within the bound plus that addition's rounding.
void check_weight_grad(const std::string& where, int output, const std::vector<int64_t>& dims,
                       const std::vector<int64_t>& rows_per_slice, const BackwardResult& res,
                       const std::vector<double>& ref, const std::vector<double>& ref64,
                       double noise_factor) {
  const std::string name = where + " " + kOutputNames[output];
  const std::vector<float> fp32 = reinterpret<float>(res.fp32_runs[0].second.outputs[output]);
  const std::vector<float> acc = reinterpret<float>(res.accumulate_run.outputs[output]);
  const std::vector<uint16_t> bf16 = reinterpret<uint16_t>(res.bf16_run.outputs[output]);
  const std::vector<float>& prefill = res.prefill[output - kFirstWeightGrad];
  ASSERT_EQ(fp32.size(), ref.size()) << name;
  ASSERT_EQ(bf16.size(), ref.size()) << name;
  ASSERT_EQ(acc.size(), ref.size()) << name;
  for (size_t i = 0; i < fp32.size(); ++i) {
    if (bf16[i] != float_to_bf16_bits(fp32[i])) {
      FAIL() << name << coordinate(dims, i) << ": the bf16 run is not the fp32 run rounded (fp32 " << fp32[i]
             << ", bf16 " << bf16_bits_to_float(bf16[i]) << ")";
    }
    const float sum = prefill[i] + fp32[i];
    if (!same_bits(acc[i], sum)) {
      FAIL() << name << coordinate(dims, i) << ": accumulated " << acc[i] << " but prefill " << prefill[i]
             << " + gradient " << fp32[i] << " = " << sum;
    }
  }
  const int64_t num_slices = static_cast<int64_t>(rows_per_slice.size());
  const int64_t per_slice = static_cast<int64_t>(ref.size()) / num_slices;
  const std::vector<int64_t> slice_dims(dims.end() - 2, dims.end());  // [I, H], [H, I], [Is, H] or [H, Is]
  for (int64_t e = 0; e < num_slices; ++e) {
    const std::string slice_name = is_routed(output) ? name + "[expert " + std::to_string(e) + "]" : name;
    const int64_t begin = e * per_slice;
    std::vector<double> gpu(per_slice), gpu_bf16(per_slice), ref_bf16_rounded(per_slice), added(per_slice);
    double max_acc = 0;
    for (int64_t i = 0; i < per_slice; ++i) {
      gpu[i] = fp32[begin + i];
      gpu_bf16[i] = bf16_bits_to_float(bf16[begin + i]);
      ref_bf16_rounded[i] = bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(ref[begin + i])));
      added[i] = static_cast<double>(acc[begin + i]) - static_cast<double>(prefill[begin + i]);
      max_acc = std::max(max_acc, std::fabs(static_cast<double>(acc[begin + i])));
    }
    if (rows_per_slice[e] == 0) {  // no rows: exact zeros (bf16 and accumulate follow from the exact checks)
      const auto nonzero = std::find_if(gpu.begin(), gpu.end(), [](double v) { return v != 0.0; });
      if (nonzero != gpu.end()) {
        ADD_FAILURE() << slice_name << coordinate(slice_dims, nonzero - gpu.begin()) << " = " << *nonzero
                      << " but this expert received no rows";
      }
      continue;
    }
    const std::vector<double> r = slice(ref, begin, per_slice), r64 = slice(ref64, begin, per_slice);
    EXPECT_EQ(compare_close(slice_name + " (fp32)", slice_dims, gpu, r, r64, nullptr, 0, noise_factor), "");
    EXPECT_EQ(compare_close(slice_name + " (bf16)", slice_dims, gpu_bf16, ref_bf16_rounded, r64, nullptr, 0,
                            noise_factor),
              "");
    EXPECT_EQ(compare_close(slice_name + " (accumulated - prefill)", slice_dims, added, r, r64, nullptr,
                            std::ldexp(max_acc, -23), noise_factor),
              "");
  }
}

void check_backward_call(const Model& m, const Call& call, const std::vector<RankData>& data,
                         const std::vector<BackwardResult>& results, const std::string& label,
                         Precision precision) {
  const Shape& s = m.shape;
  const int64_t R = s.num_ranks, El = s.num_local_experts(), E = s.num_experts, k = s.num_topk;
  // The GPU skips (and reports) an out-of-range id: the reference sees an unused slot there.
  std::vector<RankData> ref_data = data;
  for (RankData& d : ref_data) {
    for (int32_t& id : d.topk_idx) id = id >= E ? -1 : id;
  }
  reference::testing::Case c = make_reference_case(m, ref_data, precision);
  const auto ref = reference::backward(c.problem, c.ranks, c.routed, c.shared);
  c.problem.numerics = reference::Numerics::kFp64;
  const auto ref64 = reference::backward(c.problem, c.ranks, c.routed, c.shared);
  std::vector<reference::RankGradients> bf16_layer;  // FP8 only: the BF16 layer, for the error budget
  if (precision == Precision::kFP8) {
    c.problem.numerics = reference::Numerics::kBf16;
    c.problem.precision = Precision::kBF16;
    bf16_layer = reference::backward(c.problem, c.ranks, c.routed, c.shared);
  }
  std::vector<int64_t> expert_rows(E, 0);  // pairs per global expert over the group
  for (const RankData& d : ref_data) {
    for (int32_t id : d.topk_idx) {
      if (id >= 0) ++expert_rows[id];
    }
  }

  int64_t routing_errors = 0;
  for (int64_t r = 0; r < R; ++r) {
    const BackwardResult& res = results[r];
    const std::string where = label + " rank " + std::to_string(r);
    const int64_t T = call.num_tokens[r];
    ASSERT_EQ(res.error, "") << where;
    routing_errors += res.routing_errors;
    ASSERT_EQ(bitwise_difference("out", res.out[0], res.out[1]), "")
        << where << ": the two forward outputs differ";
    ASSERT_FALSE(res.fp32_runs.empty()) << where;
    const Snapshot& first = res.fp32_runs[0].second;
    for (const auto& [run_label, run] : res.fp32_runs) {
      EXPECT_EQ(snapshot_difference(first, run), "")
          << where << ": '" << run_label << "' differs bitwise from '" << res.fp32_runs[0].first << "'";
      EXPECT_TRUE(run.tail_poisoned) << where << ": '" << run_label
                                     << "' wrote d_x or d_topk_weights rows >= T";
    }
    for (const Snapshot* run : {&res.bf16_run, &res.accumulate_run}) {
      EXPECT_TRUE(run->tail_poisoned) << where << ": wrote d_x or d_topk_weights rows >= T";
      for (int o = 0; o < kFirstWeightGrad; ++o) {
        EXPECT_EQ(bitwise_difference(kOutputNames[o], run->outputs[o], first.outputs[o]), "")
            << where << ": " << kOutputNames[o] << " depends on the weight-gradient dtype or accumulation";
      }
    }

    const std::vector<std::vector<int64_t>> dims = output_dims(s, T);
    // d_x (bf16) and d_topk_weights (fp32) against the reference; an unused slot's router gradient is 0.
    for (int o = 0; o < kFirstWeightGrad; ++o) {
      EXPECT_EQ(compare_close(where + " " + kOutputNames[o], dims[o],
                              to_double(first.outputs[o], output_dtype(o, GradMode::kStoreF32)),
                              reference_output(ref[r], o), reference_output(ref64[r], o), nullptr, 0,
                              noise_factor_for(precision)),
                "");
    }
    const std::vector<float> d_topk = reinterpret<float>(first.outputs[1]);
    for (int64_t i = 0; i < T * k; ++i) {
      if (ref_data[r].topk_idx[i] < 0) {
        EXPECT_EQ(d_topk[i], 0.0f) << where << " d_topk_weights" << coordinate(dims[1], i)
                                   << " of an unused slot";
      }
    }
    // Weight gradients per local expert (rows: pairs routed to it from the whole group), shared per rank.
    for (int o = kFirstWeightGrad; o < kNumOutputs; ++o) {
      if (dims[o].empty()) continue;
      std::vector<int64_t> rows_per_slice = {T};
      if (is_routed(o))
        rows_per_slice.assign(expert_rows.begin() + r * El, expert_rows.begin() + (r + 1) * El);
      check_weight_grad(where, o, dims[o], rows_per_slice, res, reference_output(ref[r], o),
                        reference_output(ref64[r], o), noise_factor_for(precision));
    }
    if (precision != Precision::kFP8) continue;
    for (int o = 0; o < kNumOutputs; ++o) {  // every output is a gradient; the fp32 run
      if (dims[o].empty()) continue;
      EXPECT_EQ(fp8_budget_difference(where + " " + kOutputNames[o],
                                      to_double(first.outputs[o], output_dtype(o, GradMode::kStoreF32)),
                                      reference_output(bf16_layer[r], o), true),
                "");
    }
  }
  if (call.bad_id != 0) {
    EXPECT_GT(routing_errors, 0) << label << ": the out-of-range expert id was not reported";
  } else {
    EXPECT_EQ(routing_errors, 0) << label;
  }
}

}  // namespace

std::string snapshot_difference(const Snapshot& a, const Snapshot& b) {
  for (int o = 0; o < kNumOutputs; ++o) {
    const size_t bytes = a.element_bytes[o];
    const std::string difference =
        bitwise_difference(kOutputNames[o], a.outputs[o].data(), a.outputs[o].size() / bytes,
                           b.outputs[o].data(), b.outputs[o].size() / bytes, bytes);
    if (!difference.empty()) return difference;
  }
  return "";
}

// ---- device side ----

DeviceBackward::DeviceBackward(const Shape& s, int device)
    : shape_(s), device_(device), d_out_(s.max_tokens * s.hidden) {
  const std::vector<std::vector<int64_t>> dims = output_dims(s, s.max_tokens);
  for (int o = 0; o < kNumOutputs; ++o) {
    for (GradMode mode : {GradMode::kStoreF32, GradMode::kStoreBf16}) {
      const int b = slot(o, mode);
      if (buffers_[o][b] || dims[o].empty()) continue;
      buffers_[o][b].emplace(numel(dims[o]) * size_of(output_dtype(o, mode)));
    }
  }
}

void DeviceBackward::upload_d_out(const std::vector<uint16_t>& d_out, cudaStream_t stream) {
  if (!d_out.empty())
    CUDA_OK(cudaMemcpyAsync(d_out_.ptr, d_out.data(), d_out.size() * 2, cudaMemcpyHostToDevice, stream));
}

void DeviceBackward::prepare(GradMode mode, const std::vector<std::vector<float>>& prefill,
                             cudaStream_t stream) {
  for (int o = 0; o < kNumOutputs; ++o) {
    const std::optional<DeviceBuffer<uint8_t>>& buffer = buffers_[o][slot(o, mode)];
    if (!buffer) continue;
    if (mode == GradMode::kAccumulateF32 && o >= kFirstWeightGrad) {
      CUDA_OK(cudaMemcpyAsync(buffer->ptr, prefill[o - kFirstWeightGrad].data(), buffer->count,
                              cudaMemcpyHostToDevice, stream));
    } else {
      buffer->poison(stream);
    }
  }
}

BackwardArgs DeviceBackward::args(const ForwardArgs& inputs, int64_t T, GradMode mode) const {
  const std::vector<std::vector<int64_t>> dims = output_dims(shape_, T);
  TensorView views[kNumOutputs];
  for (int o = 0; o < kNumOutputs; ++o) {
    if (!dims[o].empty())
      views[o] =
          TensorView(buffer(o, slot(o, mode)), output_dtype(o, mode), dims[o], DeviceKind::kCuda, device_);
  }
  BackwardArgs a;
  a.inputs = inputs;
  a.d_out = TensorView(d_out_.ptr, DType::kBF16, {T, shape_.hidden}, DeviceKind::kCuda, device_);
  a.d_x = views[0];
  a.d_topk_weights = views[1];
  a.d_routed = {views[2], views[3], views[4]};
  a.d_shared = {views[5], views[6], views[7]};
  a.accumulate_weight_grads = mode == GradMode::kAccumulateF32;
  return a;
}

Snapshot DeviceBackward::read(GradMode mode, int64_t T) const {
  const std::vector<std::vector<int64_t>> dims = output_dims(shape_, T);
  Snapshot snap;
  snap.outputs.resize(kNumOutputs);
  for (int o = 0; o < kNumOutputs; ++o) {
    const int b = slot(o, mode);
    snap.element_bytes.push_back(size_of(output_dtype(o, mode)));
    const size_t bytes = numel(dims[o]) * snap.element_bytes[o];
    const size_t capacity = buffers_[o][b] ? buffers_[o][b]->count : 0;
    // d_x and d_topk_weights whole, to see that nothing beyond T was written.
    const std::vector<uint8_t> all = download<uint8_t>(buffer(o, b), o < kFirstWeightGrad ? capacity : bytes);
    snap.tail_poisoned &= count_unpoisoned(all.data() + bytes, all.data() + all.size()) == 0;
    snap.outputs[o].assign(all.begin(), all.begin() + bytes);
  }
  return snap;
}

// ---- drivers ----

BackwardResults check_backward(const Model& m, const std::vector<Call>& calls, bool graph,
                               const std::string& name, Config config) {
  config.activation = m.activation;
  const std::vector<std::vector<RankData>> data = make_call_data(m.shape, calls);
  const int R = static_cast<int>(m.shape.num_ranks);
  BackwardResults results(calls.size(), std::vector<BackwardResult>(R));
  run_ranks(R, [&](const Group& group, int rank) {
    run_backward_rank(m, calls, data, graph, config, group, rank, results);
  });
  for (size_t c = 0; c < calls.size(); ++c) {
    check_backward_call(m, calls[c], data[c], results[c], name + " call " + std::to_string(c),
                        config.precision);
  }
  return results;
}

void expect_same_backward(const BackwardResults& a, const BackwardResults& b, const std::string& name) {
  ASSERT_EQ(a.size(), b.size()) << name;
  for (size_t c = 0; c < a.size(); ++c) {
    for (size_t r = 0; r < a[c].size(); ++r) {
      const std::string where = name + " call " + std::to_string(c) + " rank " + std::to_string(r);
      const BackwardResult &x = a[c][r], &y = b[c][r];
      EXPECT_EQ(bitwise_difference("out", x.out[0], y.out[0]), "") << where << ": forward outputs differ";
      ASSERT_EQ(x.fp32_runs.size(), y.fp32_runs.size()) << where;
      ASSERT_FALSE(x.fp32_runs.empty()) << where;
      for (size_t i = 0; i < x.fp32_runs.size(); ++i) {
        EXPECT_EQ(snapshot_difference(x.fp32_runs[i].second, y.fp32_runs[i].second), "")
            << where << ": " << x.fp32_runs[i].first;
      }
      EXPECT_EQ(snapshot_difference(x.bf16_run, y.bf16_run), "") << where << ": bf16 weight gradients";
      EXPECT_EQ(snapshot_difference(x.accumulate_run, y.accumulate_run), "") << where << ": accumulate";
    }
  }
}

}  // namespace pounce::gpu_test
