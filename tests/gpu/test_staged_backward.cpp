// The staged GPU backward (src/gpu/staged_backward.cu) against reference::backward of the whole EP group.
//
// Every case goes through the public API (Group::create_nccl_local, Workspace, pounce::forward, backward,
// recompute_forward_context), one thread per GPU, every rank running the same steps in lockstep. Per call:
//   forward; backward into fp32 weight gradients    -> checked against the reference (below)
//   backward again on the same context               -> bitwise equal: backward leaves the context alone
//   backward into bf16 weight gradients              -> d_x, d_topk_weights bitwise equal; weights exactly
//                                                       bf16(the fp32 run's), and within tolerance
//   backward adding into random fp32 main_grad       -> weights exactly fp32(prefill + the fp32 run's)
//   forward again; backward                          -> bitwise equal (determinism), out bitwise equal
//   forward of other routing; recompute_forward_context; backward -> bitwise equal (checkpointing)
//   [graph cases] forward + backward captured once in a CUDA graph, replayed with each call's inputs
//                 copied into the captured buffers   -> bitwise equal to eager
// Before each run every output is poisoned with 0xFF bytes (a bf16 and an fp32 NaN) at max_tokens capacity;
// d_x and d_topk_weights rows at or beyond T must keep the poison.
// Reference (Numerics::kBf16 rounding points; Numerics::kFp64 the exact answer), docs/design.md §6 per tensor:
// max|gpu - ref64| <= 2 * max|ref_bf16 - ref64| + atol for d_x, d_topk_weights (fp32 values), each local
// expert's d_routed.{gate,up,down} and d_shared.{gate,up,down}. Exact: an unused slot's d_topk_weights is 0;
// an expert without rows (and the shared expert of a rank without tokens) gets exact zeros, and nothing is
// added to main_grad.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference/reference.h"
#include "src/gpu_backend.h"
#include "src/state.h"
#include "staged_fixtures.h"

namespace {

using namespace pounce::staged_test;  // NOLINT(build/namespaces): the shared fixtures
using pounce::DeviceKind;
using pounce::DType;
using pounce::TensorView;
using pounce::reference::bf16_bits_to_float;
using pounce::reference::float_to_bf16_bits;

enum class GradMode { kStoreF32, kStoreBf16, kAccumulateF32 };

// The outputs of one backward run, in this order everywhere below.
constexpr int kNumOutputs = 8;
constexpr int kFirstWeightGrad = 2;
constexpr int kNumWeightGrads = kNumOutputs - kFirstWeightGrad;
const char* const kOutputNames[kNumOutputs] = {"d_x",         "d_topk_weights", "d_routed.gate",
                                               "d_routed.up", "d_routed.down",  "d_shared.gate",
                                               "d_shared.up", "d_shared.down"};

bool is_routed(int output) {
  return output >= kFirstWeightGrad && output < kFirstWeightGrad + 3;
}

// Shapes of the outputs for T tokens; the shared gradients are {} without a shared expert.
std::vector<std::vector<int64_t>> output_dims(const pounce::Shape& s, int64_t T) {
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

// One run's outputs as raw bytes (T rows of d_x and d_topk_weights), so equality is bitwise even for NaNs.
struct Snapshot {
  std::vector<std::vector<uint8_t>> outputs;  // [kNumOutputs]
  bool tail_poisoned = true;                  // d_x and d_topk_weights rows >= T still hold the poison
};

std::vector<double> to_double(const std::vector<uint8_t>& raw, DType dtype) {
  if (dtype == DType::kBF16) {
    std::vector<uint16_t> bits(raw.size() / 2);
    std::memcpy(bits.data(), raw.data(), raw.size());
    return pounce::reference::bf16_to_double(bits);
  }
  std::vector<float> values(raw.size() / 4);
  std::memcpy(values.data(), raw.data(), raw.size());
  return std::vector<double>(values.begin(), values.end());
}

std::vector<float> to_float(const std::vector<uint8_t>& raw) {
  std::vector<float> values(raw.size() / 4);
  std::memcpy(values.data(), raw.data(), raw.size());
  return values;
}

// ---- device side ----

// d_out and every backward output of one rank at max_tokens capacity, at fixed addresses (a captured graph
// replays with them). d_x and d_topk_weights have one buffer for every mode; the weight gradients one in fp32
// (store and accumulate runs) and one in bf16.
class DeviceBackward {
 public:
  DeviceBackward(const pounce::Shape& s, int device) : shape_(s), device_(device) {
    d_out_ = device_copy(std::vector<uint16_t>{}, s.max_tokens * s.hidden);
    const std::vector<std::vector<int64_t>> dims = output_dims(s, s.max_tokens);
    for (int o = 0; o < kNumOutputs; ++o) {
      for (GradMode mode : {GradMode::kStoreF32, GradMode::kStoreBf16}) {
        const int b = slot(o, mode);
        if (buffers_[o][b] != nullptr || dims[o].empty()) continue;
        capacity_bytes_[o][b] = numel(dims[o]) * pounce::size_of(output_dtype(o, mode));
        buffers_[o][b] = device_copy(std::vector<uint8_t>{}, capacity_bytes_[o][b]);
      }
    }
  }
  ~DeviceBackward() {
    cudaFree(d_out_);
    for (auto& pair : buffers_) {
      for (void* buffer : pair) cudaFree(buffer);
    }
  }
  DeviceBackward(const DeviceBackward&) = delete;
  DeviceBackward& operator=(const DeviceBackward&) = delete;

  void upload_d_out(const std::vector<uint16_t>& d_out, cudaStream_t stream) {
    if (!d_out.empty())
      CUDA_OK(cudaMemcpyAsync(d_out_, d_out.data(), d_out.size() * 2, cudaMemcpyHostToDevice, stream));
  }

  // Poisons every output of `mode`; when accumulating, the weight gradients start from `prefill` instead.
  void prepare(GradMode mode, const std::vector<std::vector<float>>& prefill, cudaStream_t stream) {
    for (int o = 0; o < kNumOutputs; ++o) {
      const int b = slot(o, mode);
      if (capacity_bytes_[o][b] == 0) continue;
      if (mode == GradMode::kAccumulateF32 && o >= kFirstWeightGrad) {
        CUDA_OK(cudaMemcpyAsync(buffers_[o][b], prefill[o - kFirstWeightGrad].data(), capacity_bytes_[o][b],
                                cudaMemcpyHostToDevice, stream));
      } else {
        CUDA_OK(cudaMemsetAsync(buffers_[o][b], 0xFF, capacity_bytes_[o][b], stream));
      }
    }
  }

  pounce::BackwardArgs args(const pounce::ForwardArgs& inputs, int64_t T, GradMode mode) const {
    const std::vector<std::vector<int64_t>> dims = output_dims(shape_, T);
    TensorView views[kNumOutputs];
    for (int o = 0; o < kNumOutputs; ++o) {
      if (!dims[o].empty())
        views[o] = TensorView(buffers_[o][slot(o, mode)], output_dtype(o, mode), dims[o], DeviceKind::kCuda,
                              device_);
    }
    pounce::BackwardArgs a;
    a.inputs = inputs;
    a.d_out = TensorView(d_out_, DType::kBF16, {T, shape_.hidden}, DeviceKind::kCuda, device_);
    a.d_x = views[0];
    a.d_topk_weights = views[1];
    a.d_routed = {views[2], views[3], views[4]};
    a.d_shared = {views[5], views[6], views[7]};
    a.accumulate_weight_grads = mode == GradMode::kAccumulateF32;
    return a;
  }

  // Reads the outputs of `mode` after the stream was synchronised.
  Snapshot read(GradMode mode, int64_t T) const {
    const std::vector<std::vector<int64_t>> dims = output_dims(shape_, T);
    Snapshot snap;
    snap.outputs.resize(kNumOutputs);
    for (int o = 0; o < kNumOutputs; ++o) {
      const int b = slot(o, mode);
      const int64_t bytes = numel(dims[o]) * pounce::size_of(output_dtype(o, mode));
      // d_x and d_topk_weights whole, to see that nothing beyond T was written.
      std::vector<uint8_t> all(o < kFirstWeightGrad ? capacity_bytes_[o][b] : bytes);
      if (!all.empty()) CUDA_OK(cudaMemcpy(all.data(), buffers_[o][b], all.size(), cudaMemcpyDeviceToHost));
      snap.tail_poisoned &= std::all_of(all.begin() + bytes, all.end(), [](uint8_t v) { return v == 0xFF; });
      snap.outputs[o].assign(all.begin(), all.begin() + bytes);
    }
    return snap;
  }

 private:
  static int slot(int output, GradMode mode) {
    return output >= kFirstWeightGrad && mode == GradMode::kStoreBf16 ? 1 : 0;
  }

  pounce::Shape shape_;
  int device_;
  void* d_out_ = nullptr;
  void* buffers_[kNumOutputs][2] = {};  // [output][slot]
  int64_t capacity_bytes_[kNumOutputs][2] = {};
};

struct RankBackwardResult {
  std::string error;             // the first unexpected failure ("" = none)
  int64_t routing_errors = 0;    // "topk_idx value out of range" reports (expected on a bad-id call only)
  std::vector<uint16_t> out[2];  // forward outputs: first and repeated forward
  std::vector<std::pair<std::string, Snapshot>> fp32_runs;  // every fp32 run, labelled
  Snapshot bf16_run, accumulate_run;
  std::vector<std::vector<float>> prefill;  // [kNumWeightGrads] what the accumulate run added into
};

// Random main_grad contents for the accumulate run, at capacity.
std::vector<std::vector<float>> make_prefill(const pounce::Shape& s, uint32_t seed) {
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
  return {call.num_tokens, Routing::kSparse, false, call.seed + 1000};
}

// One rank's share of `calls` (see the file comment); fills results[call][rank]. `graph`: also capture
// forward + backward once (first call) and replay it for every call. Throws only on setup failures; a
// failing step is recorded and the rank carries on, so that every rank issues the same collective calls.
void run_rank(const Model& m, const std::vector<Call>& calls, const std::vector<std::vector<RankData>>& data,
              bool graph, const pounce::Config& config, const pounce::Group& group, int rank,
              std::vector<std::vector<RankBackwardResult>>& results) {
  const pounce::Shape& s = m.shape;
  pounce::Workspace workspace(group, s, config);
  pounce::gpu::GpuWorkspace& gpu_ws = *workspace.state().gpu;
  DeviceWeights weights(m, rank, rank);
  DeviceInputs in(s), other_in(s);
  DeviceBackward grads(s, rank);
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t graph_exec = nullptr;

  for (size_t c = 0; c < calls.size(); ++c) {
    const Call& call = calls[c];
    const int64_t T = call.num_tokens[rank];
    RankBackwardResult& res = results[c][rank];
    res.prefill = make_prefill(s, call.seed * 131u + static_cast<uint32_t>(rank));
    in.upload(s, data[c][rank], call.idx_int64, stream);
    other_in.upload(s, make_rank_data(s, other_call(call), rank), false, stream);
    grads.upload_d_out(data[c][rank].d_out, stream);
    pounce::ForwardArgs fwd = in.args(s, T, call.idx_int64, rank);
    pounce::ForwardArgs other_fwd = other_in.args(s, T, false, rank);
    for (pounce::ForwardArgs* a : {&fwd, &other_fwd}) {
      a->routed = weights.routed;
      a->shared = weights.shared;
    }

    // Launches, synchronises and reads the device error record; a topk_idx report is expected on a bad-id
    // call, anything else becomes the call's error.
    auto step = [&](const std::string& what, const std::function<void()>& launch) {
      try {
        launch();
        CUDA_OK(cudaStreamSynchronize(stream));
        pounce::gpu::check_device_errors(gpu_ws);
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
    auto poison_out = [&] { CUDA_OK(cudaMemsetAsync(in.out, 0xFF, s.max_tokens * s.hidden * 2, stream)); };
    auto forward = [&](const pounce::ForwardArgs& a) {
      poison_out();
      pounce::forward(workspace, a, stream);
    };
    auto backward = [&](GradMode mode) {
      grads.prepare(mode, res.prefill, stream);
      pounce::backward(workspace, grads.args(fwd, T, mode), stream);
    };
    auto read_out = [&](std::vector<uint16_t>& out) {
      out.resize(T * s.hidden);
      if (T > 0) CUDA_OK(cudaMemcpy(out.data(), in.out, out.size() * 2, cudaMemcpyDeviceToHost));
    };
    auto fp32_run = [&](const std::string& label) {
      res.fp32_runs.emplace_back(label, grads.read(GradMode::kStoreF32, T));
    };

    if (graph) {
      if (graph_exec == nullptr) {   // captured on the first call (T per rank fixed), replayed on every call
        step("graph warm-up", [&] {  // lazy module loading and first-call setup outside the capture
          forward(fwd);
          backward(GradMode::kStoreF32);
        });
        cudaGraph_t captured;
        CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
        pounce::forward(workspace, fwd, stream);
        pounce::backward(workspace, grads.args(fwd, T, GradMode::kStoreF32), stream);
        CUDA_OK(cudaStreamEndCapture(stream, &captured));
        CUDA_OK(cudaGraphInstantiate(&graph_exec, captured, 0));
        CUDA_OK(cudaGraphDestroy(captured));
      }
      step("CUDA graph replay", [&] {
        poison_out();
        grads.prepare(GradMode::kStoreF32, res.prefill, stream);
        CUDA_OK(cudaGraphLaunch(graph_exec, stream));
      });
      fp32_run("forward + backward replayed from a CUDA graph");
    }
    step("forward", [&] { forward(fwd); });
    read_out(res.out[0]);
    step("backward", [&] { backward(GradMode::kStoreF32); });
    fp32_run("backward after forward");
    step("backward again", [&] { backward(GradMode::kStoreF32); });
    fp32_run("backward again on the same context");
    step("backward into bf16", [&] { backward(GradMode::kStoreBf16); });
    res.bf16_run = grads.read(GradMode::kStoreBf16, T);
    step("backward accumulating", [&] { backward(GradMode::kAccumulateF32); });
    res.accumulate_run = grads.read(GradMode::kAccumulateF32, T);
    step("forward again", [&] { forward(fwd); });
    read_out(res.out[1]);
    step("backward after forward again", [&] { backward(GradMode::kStoreF32); });
    fp32_run("backward after re-running forward");
    step("forward of other routing", [&] { forward(other_fwd); });
    step("recompute_forward_context", [&] { pounce::recompute_forward_context(workspace, fwd, stream); });
    step("backward after recompute", [&] { backward(GradMode::kStoreF32); });
    fp32_run("backward after another forward and recompute_forward_context");
  }
  if (graph_exec != nullptr) CUDA_OK(cudaGraphExecDestroy(graph_exec));
  CUDA_OK(cudaStreamDestroy(stream));
  // The workspace is destroyed here, on every rank's thread concurrently (collective deregistration).
}

// ---- checks ----

// "" when `a` and `b` are bitwise equal, else the first output and byte that differ.
std::string first_difference(const Snapshot& a, const Snapshot& b) {
  for (int o = 0; o < kNumOutputs; ++o) {
    if (a.outputs[o] == b.outputs[o]) continue;
    if (a.outputs[o].size() != b.outputs[o].size()) return std::string(kOutputNames[o]) + " (sizes differ)";
    const auto at = std::mismatch(a.outputs[o].begin(), a.outputs[o].end(), b.outputs[o].begin()).first;
    return std::string(kOutputNames[o]) + " at byte " + std::to_string(at - a.outputs[o].begin());
  }
  return "";
}

std::vector<double> slice(const std::vector<double>& v, int64_t begin, int64_t count) {
  return std::vector<double>(v.begin() + begin, v.begin() + begin + count);
}

const std::vector<double>& reference_output(const pounce::reference::RankGradients& g, int output) {
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
                       const std::vector<int64_t>& rows_per_slice, const RankBackwardResult& res,
                       const std::vector<double>& ref, const std::vector<double>& ref64) {
  const std::string name = where + " " + kOutputNames[output];
  const std::vector<float> fp32 = to_float(res.fp32_runs[0].second.outputs[output]);
  const std::vector<float> acc = to_float(res.accumulate_run.outputs[output]);
  const std::vector<uint8_t>& bf16_raw = res.bf16_run.outputs[output];
  std::vector<uint16_t> bf16(bf16_raw.size() / 2);
  std::memcpy(bf16.data(), bf16_raw.data(), bf16_raw.size());
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
    if (std::memcmp(&acc[i], &sum, sizeof(float)) != 0) {
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
    EXPECT_EQ(compare_close(slice_name + " (fp32)", slice_dims, gpu, r, r64), "");
    EXPECT_EQ(compare_close(slice_name + " (bf16)", slice_dims, gpu_bf16, ref_bf16_rounded, r64), "");
    EXPECT_EQ(compare_close(slice_name + " (accumulated - prefill)", slice_dims, added, r, r64, nullptr,
                            std::ldexp(max_acc, -23)),
              "");
  }
}

void check_backward_call(const Model& m, const Call& call, const std::vector<RankData>& data,
                         const std::vector<RankBackwardResult>& results, const std::string& label) {
  const pounce::Shape& s = m.shape;
  const int64_t R = s.num_ranks, El = s.num_local_experts(), E = s.num_experts, k = s.num_topk;
  // The GPU skips (and reports) an out-of-range id: the reference sees an unused slot there.
  std::vector<RankData> ref_data = data;
  for (RankData& d : ref_data) {
    for (int32_t& id : d.topk_idx) id = id >= E ? -1 : id;
  }
  ReferenceCase c = make_reference_case(m, ref_data);
  const auto ref = pounce::reference::backward(c.problem, c.ranks, c.routed, c.shared);
  c.problem.numerics = pounce::reference::Numerics::kFp64;
  const auto ref64 = pounce::reference::backward(c.problem, c.ranks, c.routed, c.shared);
  std::vector<int64_t> expert_rows(E, 0);  // pairs per global expert over the group
  for (const RankData& d : ref_data) {
    for (int32_t id : d.topk_idx) {
      if (id >= 0) ++expert_rows[id];
    }
  }

  int64_t routing_errors = 0;
  for (int64_t r = 0; r < R; ++r) {
    const RankBackwardResult& res = results[r];
    const std::string where = label + " rank " + std::to_string(r);
    const int64_t T = call.num_tokens[r];
    ASSERT_EQ(res.error, "") << where;
    routing_errors += res.routing_errors;
    ASSERT_TRUE(res.out[0] == res.out[1]) << where << ": the two forward outputs differ";
    ASSERT_FALSE(res.fp32_runs.empty()) << where;
    const Snapshot& first = res.fp32_runs[0].second;
    for (const auto& [run_label, run] : res.fp32_runs) {
      EXPECT_EQ(first_difference(first, run), "")
          << where << ": '" << run_label << "' differs bitwise from '" << res.fp32_runs[0].first << "'";
      EXPECT_TRUE(run.tail_poisoned) << where << ": '" << run_label
                                     << "' wrote d_x or d_topk_weights rows >= T";
    }
    for (const Snapshot* run : {&res.bf16_run, &res.accumulate_run}) {
      EXPECT_TRUE(run->tail_poisoned) << where << ": wrote d_x or d_topk_weights rows >= T";
      for (int o = 0; o < kFirstWeightGrad; ++o) {
        EXPECT_TRUE(run->outputs[o] == first.outputs[o])
            << where << ": " << kOutputNames[o] << " depends on the weight-gradient dtype or accumulation";
      }
    }

    const std::vector<std::vector<int64_t>> dims = output_dims(s, T);
    // d_x (bf16) and d_topk_weights (fp32) against the reference; an unused slot's router gradient is 0.
    for (int o = 0; o < kFirstWeightGrad; ++o) {
      EXPECT_EQ(compare_close(where + " " + kOutputNames[o], dims[o],
                              to_double(first.outputs[o], output_dtype(o, GradMode::kStoreF32)),
                              reference_output(ref[r], o), reference_output(ref64[r], o)),
                "");
    }
    const std::vector<float> d_topk = to_float(first.outputs[1]);
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
                        reference_output(ref64[r], o));
    }
  }
  if (call.bad_id != 0) {
    EXPECT_GT(routing_errors, 0) << label << ": the out-of-range expert id was not reported";
  } else {
    EXPECT_EQ(routing_errors, 0) << label;
  }
}

// Runs and checks `calls`; returns results[call][rank]. `config`'s activation is the model's.
std::vector<std::vector<RankBackwardResult>> run_and_check(const Model& m, const std::vector<Call>& calls,
                                                           bool graph, const std::string& name,
                                                           pounce::Config config = {}) {
  config.activation = m.activation;
  const std::vector<std::vector<RankData>> data = make_call_data(m.shape, calls);
  const int R = static_cast<int>(m.shape.num_ranks);
  std::vector<std::vector<RankBackwardResult>> results(calls.size(), std::vector<RankBackwardResult>(R));
  run_ranks(R, [&](const pounce::Group& group, int rank) {
    run_rank(m, calls, data, graph, config, group, rank, results);
  });
  for (size_t c = 0; c < calls.size(); ++c) {
    check_backward_call(m, calls[c], data[c], results[c], name + " call " + std::to_string(c));
  }
  return results;
}

// Two runs of the same calls (another path, another config) gave bitwise the same forward outputs and every
// gradient: each fp32 run, the bf16 and the accumulate run.
void expect_bitwise_equal(const std::vector<std::vector<RankBackwardResult>>& a,
                          const std::vector<std::vector<RankBackwardResult>>& b, const std::string& name) {
  ASSERT_EQ(a.size(), b.size()) << name;
  for (size_t c = 0; c < a.size(); ++c) {
    for (size_t r = 0; r < a[c].size(); ++r) {
      const std::string where = name + " call " + std::to_string(c) + " rank " + std::to_string(r);
      const RankBackwardResult &x = a[c][r], &y = b[c][r];
      EXPECT_TRUE(x.out[0] == y.out[0]) << where << ": forward outputs differ";
      ASSERT_EQ(x.fp32_runs.size(), y.fp32_runs.size()) << where;
      ASSERT_FALSE(x.fp32_runs.empty()) << where;
      for (size_t i = 0; i < x.fp32_runs.size(); ++i) {
        EXPECT_EQ(first_difference(x.fp32_runs[i].second, y.fp32_runs[i].second), "")
            << where << ": " << x.fp32_runs[i].first;
      }
      EXPECT_EQ(first_difference(x.bf16_run, y.bf16_run), "") << where << ": bf16 weight gradients";
      EXPECT_EQ(first_difference(x.accumulate_run, y.accumulate_run), "") << where << ": accumulate";
    }
  }
}

// `activation` with a clamp low enough that the test data reaches it (GPT-OSS's preset 7 never would).
pounce::Activation clamped(pounce::Activation activation, float limit) {
  activation.clamp_limit = limit;
  return activation;
}

// ---- tests ----

TEST(StagedBackward, OneRankSwiGLU) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(300, 256, 128, 8, 2, 0, 1), pounce::Activation::swiglu(), 51);
  run_and_check(m,
                {{{300}, Routing::kRandom, false, 52},
                 {{1}, Routing::kRandom, true, 53},
                 {{0}, Routing::kRandom, false, 54},
                 {{127}, Routing::kAllToOneExpert, false, 55},
                 {{300}, Routing::kFewExperts, false, 56}},
                false, "one rank swiglu");
}

// I = 192: the weight gradients' second 128-row tile is half empty.
TEST(StagedBackward, OneRankSharedGptOssClamp) {
  SKIP_UNLESS_GPUS(1);
  const Model m =
      make_model(make_shape(300, 256, 192, 8, 4, 128, 1), clamped(pounce::Activation::gpt_oss(), 1.0f), 61);
  run_and_check(m,
                {{{300}, Routing::kRandom, false, 62},
                 {{127}, Routing::kSparse, true, 63},
                 {{1}, Routing::kAllToOneExpert, false, 64}},
                false, "one rank shared gpt-oss");
}

TEST(StagedBackward, TwoRanksSharedTopEightSwiGLUClamp) {
  SKIP_UNLESS_GPUS(2);
  const Model m =
      make_model(make_shape(300, 256, 128, 8, 8, 128, 2), clamped(pounce::Activation::swiglu(), 1.5f), 71);
  run_and_check(m,
                {{{0, 300}, Routing::kRandom, false, 72},
                 {{127, 1}, Routing::kRandom, true, 73},
                 {{300, 127}, Routing::kAllToOneExpert, false, 74},
                 {{300, 300}, Routing::kFewExperts, false, 75}},
                false, "two ranks top-8");
}

TEST(StagedBackward, TwoRanksTopOneGptOssClamp) {
  SKIP_UNLESS_GPUS(2);
  const Model m =
      make_model(make_shape(300, 256, 192, 8, 1, 0, 2), clamped(pounce::Activation::gpt_oss(), 1.0f), 81);
  run_and_check(m, {{{300, 127}, Routing::kRandom, false, 82}, {{1, 0}, Routing::kSparse, false, 83}}, false,
                "two ranks top-1");
}

// Issue #7: 4 and 8 ranks where that many GPUs are visible.
TEST(StagedBackward, FourAndEightRanks) {
  if (visible_gpus() < 4) GTEST_SKIP() << "needs 4 or 8 GPUs, " << visible_gpus() << " visible: skipped";
  for (int R : {4, 8}) {
    if (visible_gpus() < R) continue;
    const Model m = make_model(make_shape(300, 256, 128, 2 * R, 4, 128, R),
                               clamped(pounce::Activation::swiglu(), 1.5f), 130 + R);
    std::vector<int64_t> uneven(R, 300);
    for (int r = 0; r < R; ++r) uneven[r] = (r * 97) % 301;  // rank 0 has none
    run_and_check(m,
                  {{uneven, Routing::kRandom, false, 131},
                   {std::vector<int64_t>(R, 300), Routing::kAllToOneExpert, true, 132},
                   {std::vector<int64_t>(R, 127), Routing::kFewExperts, false, 133}},
                  false, std::to_string(R) + " ranks");
  }
}

TEST(StagedBackward, CudaGraphReplaysForwardAndBackward) {
  SKIP_UNLESS_GPUS(1);
  const int R = visible_gpus() >= 2 ? 2 : 1;
  const Model m = make_model(make_shape(256, 256, 128, 8, 4, 128, R), pounce::Activation::swiglu(), 91);
  // Same T per rank in every call (the captured shapes), new routing and data each call.
  const std::vector<int64_t> tokens = R == 2 ? std::vector<int64_t>{256, 190} : std::vector<int64_t>{190};
  const std::vector<Call> calls = {{tokens, Routing::kRandom, false, 92},
                                   {tokens, Routing::kAllToOneExpert, false, 93},
                                   {tokens, Routing::kSparse, false, 94}};
  run_and_check(m, calls, true, "cuda graph");
  // With the smallest macrobatch ring, on both paths: every possible macrobatch's launches are in the graph,
  // those past the call's count find no rows.
  for (const pounce::KernelPath path : {pounce::KernelPath::kStaged, pounce::KernelPath::kFused}) {
    pounce::Config ringed;
    ringed.kernel_path = ringed.backward_kernel_path = path;
    ringed.macrobatch_size = (R * 256 + pounce::kBlockM - 1) / pounce::kBlockM * pounce::kBlockM;
    run_and_check(m, calls, true, std::string("cuda graph, macrobatch ring, ") + pounce::to_string(path),
                  ringed);
  }
}

// Chunks of local experts (config.minibatch_size) and the communication SM counts only schedule the work:
// one chunk on 1 comm SM and one chunk per expert on 7 give bitwise-equal outputs and gradients.
TEST(StagedBackward, ChunksAndCommSmsDoNotChangeResults) {
  SKIP_UNLESS_GPUS(1);
  const int R = visible_gpus() >= 2 ? 2 : 1;
  const Model m = make_model(make_shape(300, 256, 128, 8, 4, 128, R), pounce::Activation::swiglu(), 121);
  const std::vector<int64_t> tokens = R == 2 ? std::vector<int64_t>{300, 127} : std::vector<int64_t>{300};
  const std::vector<Call> calls = {{tokens, Routing::kRandom, false, 122},
                                   {tokens, Routing::kFewExperts, false, 123}};
  pounce::Config one_chunk, many_chunks;
  one_chunk.minibatch_size = 10 * pounce::kBlockM;  // >= max_tokens * k: a single chunk
  one_chunk.forward_comm_sms = one_chunk.backward_comm_sms = 1;
  many_chunks.minibatch_size = pounce::kBlockM;  // clamped to one chunk per local expert
  many_chunks.forward_comm_sms = many_chunks.backward_comm_sms = 7;
  const auto a = run_and_check(m, calls, false, "one chunk", one_chunk);
  const auto b = run_and_check(m, calls, false, "a chunk per expert", many_chunks);
  for (size_t c = 0; c < calls.size(); ++c) {
    for (int r = 0; r < R; ++r) {
      const std::string where = "call " + std::to_string(c) + " rank " + std::to_string(r);
      ASSERT_FALSE(a[c][r].fp32_runs.empty() || b[c][r].fp32_runs.empty()) << where;
      EXPECT_TRUE(a[c][r].out[0] == b[c][r].out[0]) << where << ": forward outputs differ";
      EXPECT_EQ(first_difference(a[c][r].fp32_runs[0].second, b[c][r].fp32_runs[0].second), "") << where;
    }
  }
}

// The fused backward kernel against the staged chain, bitwise: every fp32 run (including after recompute),
// the bf16 and the accumulate run, with both combines (push by the communication CTAs, scatter from the d_x
// epilogues), minibatches of one m-block (many handoffs, d_x tiles waiting on d_a tiles in flight, weight
// gradients waiting on units still being pulled) and the default; uniform routing, all tokens on one
// expert, T = 0 on a rank, shared expert and both activations (clamped). Both paths also meet the reference.
TEST(FusedBackward, EqualsStagedBitwise) {
  SKIP_UNLESS_GPUS(1);
  for (int R = 1; R <= std::min(2, visible_gpus()); ++R) {
    const Model shared = make_model(make_shape(300, 256, 192, 8, 4, 128, R),
                                    clamped(pounce::Activation::gpt_oss(), 1.0f), 141);
    const Model routed =
        make_model(make_shape(500, 256, 128, 16, 8, 0, R), clamped(pounce::Activation::swiglu(), 1.5f), 142);
    auto tokens = [R](int64_t a, int64_t b) {
      return R == 2 ? std::vector<int64_t>{a, b} : std::vector<int64_t>{a};
    };
    for (pounce::CombineMode combine : {pounce::CombineMode::kPush, pounce::CombineMode::kScatter}) {
      for (int64_t minibatch : {int64_t{128}, int64_t{0}}) {
        const std::string label = " ranks " + std::to_string(R) + " combine " + pounce::to_string(combine) +
                                  " minibatch " + std::to_string(minibatch);
        for (const Model* m : {&shared, &routed}) {
          const std::vector<Call> calls =
              m == &shared ? std::vector<Call>{{tokens(300, 255), Routing::kRandom, false, 143},
                                               {tokens(0, 300), Routing::kAllToOneExpert, true, 144}}
                           : std::vector<Call>{{tokens(500, 499), Routing::kRandom, false, 145},
                                               {tokens(129, 0), Routing::kFewExperts, false, 146}};
          pounce::Config staged, fused;
          staged.kernel_path = staged.backward_kernel_path = pounce::KernelPath::kStaged;
          fused.kernel_path = fused.backward_kernel_path = pounce::KernelPath::kFused;
          staged.minibatch_size = fused.minibatch_size = minibatch;
          fused.combine = combine;
          const std::string name = (m == &shared ? "shared expert" : "routed only") + label;
          const auto a = run_and_check(*m, calls, false, "staged, " + name, staged);
          const auto b = run_and_check(*m, calls, false, "fused, " + name, fused);
          expect_bitwise_equal(a, b, name);
        }
      }
    }
  }
}

// One small case through the fused forward and backward kernels against the reference: the case
// tools/gpu_sanitize.sh runs under compute-sanitizer (memcheck, racecheck, synccheck).
void run_one_rank_small(int64_t macrobatch_size, const std::string& name, int64_t shared_intermediate = 128) {
  const Model m = make_model(make_shape(192, 256, 128, 8, 2, shared_intermediate, 1),
                             clamped(pounce::Activation::swiglu(), 1.5f), 151);
  pounce::Config config;
  config.kernel_path = config.backward_kernel_path = pounce::KernelPath::kFused;
  config.minibatch_size = pounce::kBlockM;
  config.macrobatch_size = macrobatch_size;
  run_and_check(m, {{{192}, Routing::kRandom, false, 152}}, false, name, config);
}

TEST(FusedBackward, OneRankSmall) {
  SKIP_UNLESS_GPUS(1);
  run_one_rank_small(0, "fused backward, one rank");
}

// Issues #4 and #5, the macrobatch ring: with the smallest ring (config.macrobatch_size = num_ranks *
// max_tokens, padded) the routed experts run in several macrobatches, the backward replaying every one but
// the resident last (pull x, gate/up + activation), and every output and gradient (fp32, bf16, accumulated,
// after recompute) is bitwise the worst-case workspace's, on both paths; both also meet the reference.
// Uniform top-4 routing over 16 experts (several macrobatches, experts without rows), one expert filling the
// ring, few experts, T = 0 on a rank.
TEST(Macrobatches, RingEqualsWorstCaseBitwise) {
  SKIP_UNLESS_GPUS(1);
  for (int R = 1; R <= std::min(2, visible_gpus()); ++R) {
    const Model m = make_model(make_shape(300, 256, 128, 16, 4, 128, R),
                               clamped(pounce::Activation::swiglu(), 1.5f), 161);
    auto tokens = [R](int64_t a, int64_t b) {
      return R == 2 ? std::vector<int64_t>{a, b} : std::vector<int64_t>{a};
    };
    const std::vector<Call> calls = {{tokens(300, 255), Routing::kRandom, false, 162},
                                     {tokens(300, 300), Routing::kAllToOneExpert, false, 163},
                                     {tokens(0, 300), Routing::kFewExperts, true, 164}};
    const int64_t ring = (R * 300 + pounce::kBlockM - 1) / pounce::kBlockM * pounce::kBlockM;
    for (const pounce::KernelPath path : {pounce::KernelPath::kStaged, pounce::KernelPath::kFused}) {
      pounce::Config worst;
      worst.kernel_path = worst.backward_kernel_path = path;
      pounce::Config ringed = worst;
      ringed.macrobatch_size = ring;
      const std::string name = std::string(pounce::to_string(path)) + " ranks " + std::to_string(R);
      const auto a = run_and_check(m, calls, false, "worst case, " + name, worst);
      const auto b = run_and_check(m, calls, false, "ring of " + std::to_string(ring) + ", " + name, ringed);
      expect_bitwise_equal(a, b, name);
    }
  }
}

// The same small case with the smallest macrobatch ring (256 rows: four macrobatches of two experts), so the
// sanitizers also see the macrobatch plan, the per-macrobatch launches and the fused backward's replay.
// Without a shared expert the fused kernels' tiles start on routed rows alone (no shared tiles cover the
// first pulls); small enough for compute-sanitizer (tools/gpu_sanitize.sh).
TEST(FusedBackward, OneRankSmallRoutedOnly) {
  SKIP_UNLESS_GPUS(1);
  run_one_rank_small(0, "fused backward, one rank, no shared expert", 0);
}

TEST(FusedBackward, OneRankSmallRing) {
  SKIP_UNLESS_GPUS(1);
  run_one_rank_small(2 * pounce::kBlockM, "fused backward, one rank, ring");
}

// The forward reports the bad id and skips that slot; backward then runs like the reference with -1 there,
// writes nothing out of bounds, and the next call is clean.
TEST(StagedBackward, OutOfRangeExpertIdIsSkippedAndReported) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 256, 128, 8, 2, 0, 1), pounce::Activation::swiglu(), 101);
  Call bad{{64}, Routing::kRandom, false, 102};
  bad.bad_id = 1000;
  run_and_check(m, {bad, {{64}, Routing::kRandom, false, 103}}, false, "out-of-range id");
}

// The CPU backend's contract (tests/cpu/test_api.cpp): backward needs the forward context of the same
// tokens, and says so instead of computing from a stale or missing context.
TEST(StagedBackward, BackwardWithoutMatchingForwardIsRejected) {
  SKIP_UNLESS_GPUS(1);
  const Model m = make_model(make_shape(64, 256, 128, 8, 2, 0, 1), pounce::Activation::swiglu(), 111);
  const Call call{{64}, Routing::kRandom, false, 112};
  const RankData d = make_rank_data(m.shape, call, 0);
  std::string before_forward, mismatched_tokens;
  run_ranks(1, [&](const pounce::Group& group, int rank) {
    pounce::Workspace workspace(group, m.shape, pounce::Config{});
    DeviceWeights weights(m, rank, rank);
    DeviceInputs in(m.shape);
    DeviceBackward grads(m.shape, rank);
    in.upload(m.shape, d, false, nullptr);
    grads.upload_d_out(d.d_out, nullptr);
    auto args_for = [&](int64_t T) {
      pounce::ForwardArgs fwd = in.args(m.shape, T, false, rank);
      fwd.routed = weights.routed;
      return fwd;
    };
    auto backward_error = [&](int64_t T) -> std::string {
      try {
        pounce::backward(workspace, grads.args(args_for(T), T, GradMode::kStoreF32), nullptr);
        CUDA_OK(cudaDeviceSynchronize());
        pounce::gpu::check_device_errors(*workspace.state().gpu);
      } catch (const pounce::Error& error) {
        return error.what();
      }
      return "";
    };
    before_forward = backward_error(64);
    pounce::forward(workspace, args_for(64), nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    mismatched_tokens = backward_error(32);
  });
  EXPECT_NE(before_forward.find("run forward first"), std::string::npos)
      << "backward before any forward must throw and say to run forward first; got '" << before_forward
      << "'";
  EXPECT_NE(mismatched_tokens.find("matching forward"), std::string::npos)
      << "backward with 32 tokens after a forward of 64 must throw; got '" << mismatched_tokens << "'";
}

}  // namespace
