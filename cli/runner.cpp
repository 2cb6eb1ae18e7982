#include "cli/runner.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>

#include "pounce/error.h"
#include "pounce/fp8.h"
#include "pounce/group.h"
#include "pounce/layer.h"
#include "pounce/workspace.h"
#include "reference/bf16.h"
#include "cli/telemetry.h"

namespace pounce::cli {

// ---- per-rank driver -----------------------------------------------------------------------------------

void RankRunner::use_input_set(int set_idx) {
  POUNCE_CHECK(set_idx == 0, "this runner has a single input set; RunRequest::num_input_sets must be 1");
}

int64_t input_set_shift(int64_t num_tokens, int set_idx, int num_sets) {
  return num_sets > 0 ? static_cast<int64_t>(set_idx) * num_tokens / num_sets : 0;
}

BackwardArgs rank_views(const Shape& shape, int64_t num_tokens, const RankBuffers& buffers, DType wgrad,
                        DeviceKind device, int device_idx) {
  const int64_t T = num_tokens, H = shape.hidden, I = shape.intermediate, k = shape.num_topk;
  const int64_t El = shape.num_local_experts(), Is = shape.shared_intermediate;
  auto view = [&](void* data, DType dtype, std::vector<int64_t> dims) {
    return TensorView(data, dtype, std::move(dims), device, device_idx);
  };
  auto weights = [&](void* const(&data)[3], DType dtype, std::vector<int64_t> up, std::vector<int64_t> down) {
    return ExpertWeights{view(data[0], dtype, up), view(data[1], dtype, up), view(data[2], dtype, down)};
  };
  BackwardArgs args;
  ForwardArgs& f = args.inputs;
  f.x = view(buffers.x, DType::kBF16, {T, H});
  f.topk_idx = view(buffers.topk_idx, DType::kInt32, {T, k});
  f.topk_weights = view(buffers.topk_weights, DType::kFP32, {T, k});
  f.routed = weights(buffers.routed, DType::kBF16, {El, I, H}, {El, H, I});
  f.out = view(buffers.out, DType::kBF16, {T, H});
  args.d_out = view(buffers.d_out, DType::kBF16, {T, H});
  args.d_x = view(buffers.d_x, DType::kBF16, {T, H});
  args.d_topk_weights = view(buffers.d_topk_weights, DType::kFP32, {T, k});
  args.d_routed = weights(buffers.d_routed, wgrad, {El, I, H}, {El, H, I});
  if (Is > 0) {
    f.shared = weights(buffers.shared, DType::kBF16, {Is, H}, {H, Is});
    args.d_shared = weights(buffers.d_shared, wgrad, {Is, H}, {H, Is});
  }
  return args;
}

std::array<Fp8Extents, kNumFp8Tensors> fp8_weight_extents(const Shape& shape) {
  const int64_t El = shape.num_local_experts(), H = shape.hidden, I = shape.intermediate;
  auto extents = [El](int64_t n, int64_t k) {
    return Fp8Extents{{El, n, k}, {El, (n + kFp8Block - 1) / kFp8Block, (k + kFp8Block - 1) / kFp8Block}};
  };
  return {extents(I, H), extents(I, H), extents(H, I), extents(H, I), extents(H, I), extents(I, H)};
}

int64_t numel_of(const std::vector<int64_t>& extents) {
  int64_t n = 1;
  for (int64_t extent : extents) n *= extent;
  return n;
}

Fp8Weights fp8_weight_views(const Shape& shape, void* const (&data)[kNumFp8Tensors],
                            void* const (&scale)[kNumFp8Tensors], DeviceKind device, int device_idx) {
  const std::array<Fp8Extents, kNumFp8Tensors> extents = fp8_weight_extents(shape);
  Fp8Weights weights;
  Fp8Tensor* tensors[kNumFp8Tensors] = {&weights.gate,   &weights.up,   &weights.down,
                                        &weights.gate_t, &weights.up_t, &weights.down_t};
  for (int i = 0; i < kNumFp8Tensors; ++i) {
    tensors[i]->data = TensorView(data[i], DType::kFP8E4M3, extents[i].data, device, device_idx);
    tensors[i]->scale = TensorView(scale[i], DType::kFP32, extents[i].scale, device, device_idx);
  }
  return weights;
}

void bind_input_set(BackwardArgs& args, const std::vector<InputSetData>& sets, int set_idx) {
  POUNCE_CHECK(set_idx >= 0 && set_idx < static_cast<int>(sets.size()), "input set ", set_idx,
               " does not exist; this runner has ", sets.size());
  const InputSetData& set = sets[set_idx];
  args.inputs.x.data = set.x;
  args.inputs.topk_idx.data = set.topk_idx;
  args.inputs.topk_weights.data = set.topk_weights;
  args.d_out.data = set.d_out;
}

RankResult drive_rank(RankRunner& runner, const RunRequest& request, int rank, std::barrier<>* align) {
  RankResult result;
  result.weight_quantize_ms = runner.weight_quantize_ms();
  const int total = request.warmup + request.iters;
  const int num_sets = std::max(1, request.num_input_sets);
  // The last run is compared with the first run on the same input set (none when no earlier run had it).
  const int repeat_reference = (total - 1) % num_sets;
  const bool repeat_check = repeat_reference < total - 1;
  auto meet = [align] {
    if (align != nullptr) align->arrive_and_wait();
  };
  bool backward = request.run_backward;
  std::vector<uint8_t> first;
  for (int run = 0; run < total; ++run) {
    const bool last = run == total - 1;
    runner.use_input_set(run % num_sets);
    if (run == 0 || last) runner.poison();
    if (rank == 0 && request.progress != nullptr)
      request.progress->stage("forward" + std::string(backward ? " + backward" : "") + ", run " +
                              std::to_string(run + 1) + " of " + std::to_string(total));
    meet();
    const bool timed = run >= request.warmup;
    const double forward_ms = [&] {
      const TimedWork on_gpu(timed);
      return runner.forward();
    }();
    double backward_ms = 0.0;
    if (backward) {
      meet();
      try {
        const TimedWork on_gpu(timed);
        backward_ms = runner.backward();
        result.backward_ran = true;
      } catch (const Error& error) {
        // Reported, not fatal: the forward results still stand (e.g. a GPU backward not implemented yet).
        const std::string message = error.what();
        result.backward_error = message.rfind("pounce: ", 0) == 0 ? message.substr(8) : message;
        result.backward_ran = false;
        backward = false;
      }
    }
    if (run >= request.warmup) {
      result.forward_ms.push_back(forward_ms);
      if (backward) result.backward_ms.push_back(backward_ms);
    }
    if (run == 0 && request.plan != nullptr)
      result.observed =
          gather_rank(*request.plan, request.problem->shape, rank, runner.outputs(*request.plan, backward));
    if (repeat_check && run == repeat_reference) first = runner.snapshot(backward);
    if (repeat_check && last) result.repeat_bitwise_equal = runner.snapshot(backward) == first;
  }
  if (!backward) result.backward_ms.clear();
  return result;
}

RunOutcome combine(std::vector<RankResult> results) {
  RunOutcome outcome;
  if (results.empty()) return outcome;
  outcome.backward_ran = true;
  for (const RankResult& rank : results) {
    outcome.backward_ran &= rank.backward_ran;
    if (outcome.backward_error.empty()) outcome.backward_error = rank.backward_error;
    if (rank.repeat_bitwise_equal)
      outcome.repeat_bitwise_equal =
          outcome.repeat_bitwise_equal.value_or(true) && *rank.repeat_bitwise_equal;
    if (rank.weight_quantize_ms)
      outcome.weight_quantize_ms =
          std::max(outcome.weight_quantize_ms.value_or(0.0), *rank.weight_quantize_ms);
    outcome.observed.append(rank.observed);
  }
  // Per run, the maximum over ranks of `time(rank, run)`, over the runs every rank timed `member` for.
  auto per_run_max = [&](auto member, auto time) {
    size_t runs = (results[0].*member).size();
    for (const RankResult& rank : results) runs = std::min(runs, (rank.*member).size());
    std::vector<double> out(runs, 0.0);
    for (const RankResult& rank : results)
      for (size_t i = 0; i < runs; ++i) out[i] = std::max(out[i], time(rank, i));
    return out;
  };
  auto forward = [](const RankResult& rank, size_t i) { return rank.forward_ms[i]; };
  auto backward = [](const RankResult& rank, size_t i) { return rank.backward_ms[i]; };
  outcome.forward_ms = per_run_max(&RankResult::forward_ms, forward);
  if (outcome.backward_ran) {
    outcome.backward_ms = per_run_max(&RankResult::backward_ms, backward);
    // The slowest rank of each whole step, not the sum of the two passes' slowest ranks.
    outcome.forward_backward_ms =
        per_run_max(&RankResult::backward_ms,
                    [&](const RankResult& rank, size_t i) { return forward(rank, i) + backward(rank, i); });
  }
  return outcome;
}

// ---- CPU backend ---------------------------------------------------------------------------------------

namespace {

using Clock = std::chrono::steady_clock;

ElementReader bf16_reader(const void* data) {
  const auto* bits = static_cast<const uint16_t*>(data);
  return [bits](int64_t i) { return static_cast<double>(reference::bf16_bits_to_float(bits[i])); };
}

ElementReader fp32_reader(const void* data) {
  const auto* values = static_cast<const float*>(data);
  return [values](int64_t i) { return static_cast<double>(values[i]); };
}

void* mutable_data(const void* data) {
  return const_cast<void*>(data);
}  // views are read-only for inputs

// `rows` rows of `width` elements each, starting at row `shift` and wrapping around.
template <typename T>
std::vector<T> rotate_rows(const std::vector<T>& rows, int64_t width, int64_t shift) {
  std::vector<T> out(rows.size());
  std::rotate_copy(rows.begin(), rows.begin() + shift * width, rows.end(), out.begin());
  return out;
}

// Host memory with room for `numel` fp32 values (so it also holds bf16); operator new aligns it to 16 bytes.
struct HostBuffer {
  std::vector<float> storage;
  explicit HostBuffer(int64_t numel = 0) : storage(numel) {}
  void* data() { return storage.data(); }
  size_t bytes() const { return storage.size() * sizeof(float); }
};

class CpuRankRunner final : public RankRunner {
 public:
  CpuRankRunner(const Group& group, const RunRequest& request, int rank)
      : request_(request),
        shape_(request.problem->shape),
        workspace_(group, request.problem->shape, request.config) {
    const HostRank& in = request.problem->ranks[rank];
    const HostWeights& shared = request.problem->shared;
    const int64_t T = in.num_tokens, H = shape_.hidden, I = shape_.intermediate, k = shape_.num_topk;
    const int64_t El = shape_.num_local_experts(), Is = shape_.shared_intermediate;
    const DType wgrad = request.wgrad_fp32 ? DType::kFP32 : DType::kBF16;

    out_ = HostBuffer(T * H);
    d_x_ = HostBuffer(T * H);
    d_topk_ = HostBuffer(T * k);
    for (HostBuffer& grad : d_routed_) grad = HostBuffer(El * I * H);
    for (HostBuffer& grad : d_shared_) grad = HostBuffer(Is * H);

    args_ = rank_views(
        shape_, T,
        {mutable_data(in.x.data()),
         mutable_data(in.topk_idx.data()),
         mutable_data(in.topk_weights.data()),
         mutable_data(in.d_out.data()),
         {mutable_data(in.routed.gate.data()), mutable_data(in.routed.up.data()),
          mutable_data(in.routed.down.data())},
         {mutable_data(shared.gate.data()), mutable_data(shared.up.data()), mutable_data(shared.down.data())},
         out_.data(),
         d_x_.data(),
         d_topk_.data(),
         {d_routed_[0].data(), d_routed_[1].data(), d_routed_[2].data()},
         {d_shared_[0].data(), d_shared_[1].data(), d_shared_[2].data()}},
        wgrad);
    if (!in.routed.b_gate.empty()) {  // `pounce run --biases`: biases b_gate, b_up [El, I], b_down [El, H]
      const std::vector<uint16_t>* biases[3] = {&in.routed.b_gate, &in.routed.b_up, &in.routed.b_down};
      TensorView* views[3] = {&args_.inputs.routed.b_gate, &args_.inputs.routed.b_up,
                              &args_.inputs.routed.b_down};
      TensorView* grads[3] = {&args_.d_routed.b_gate, &args_.d_routed.b_up, &args_.d_routed.b_down};
      for (int b = 0; b < 3; ++b) {
        const int64_t cols = b == 2 ? H : I;
        d_biases_[b] = HostBuffer(El * cols);
        *views[b] = TensorView(mutable_data(biases[b]->data()), DType::kBF16, {El, cols});
        *grads[b] = TensorView(d_biases_[b].data(), wgrad, {El, cols});
      }
    }
    sets_.push_back(
        {args_.inputs.x.data, args_.inputs.topk_idx.data, args_.inputs.topk_weights.data, args_.d_out.data});
    for (int set_idx = 1; set_idx < request.num_input_sets; ++set_idx) {
      const int64_t shift = input_set_shift(T, set_idx, request.num_input_sets);
      rotated_.push_back({rotate_rows(in.x, H, shift), rotate_rows(in.d_out, H, shift),
                          rotate_rows(in.topk_idx, k, shift), rotate_rows(in.topk_weights, k, shift)});
    }
    for (RotatedSet& set : rotated_)
      sets_.push_back({set.x.data(), set.topk_idx.data(), set.topk_weights.data(), set.d_out.data()});
    if (request.config.precision == Precision::kFP8) quantize_weights();
  }

  void use_input_set(int set_idx) override { bind_input_set(args_, sets_, set_idx); }

  std::optional<double> weight_quantize_ms() const override { return weight_quantize_ms_; }

  void poison() override {
    for (HostBuffer* buffer : all_outputs()) {
      if (buffer->bytes() > 0)
        std::memset(buffer->data(), 0xff, buffer->bytes());  // absent biases: no storage
    }
  }

  double forward() override {
    const auto start = Clock::now();
    pounce::forward(workspace_, args_.inputs);
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }

  double backward() override {
    const auto start = Clock::now();
    pounce::backward(workspace_, args_);
    return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
  }

  RankOutputs outputs(const CheckPlan&, bool with_backward) override {
    RankOutputs readers;
    readers[Field::kOut] = bf16_reader(out_.data());
    if (!with_backward) return readers;
    readers[Field::kDX] = bf16_reader(d_x_.data());
    readers[Field::kDTopkWeights] = fp32_reader(d_topk_.data());
    auto grad_reader = request_.wgrad_fp32 ? fp32_reader : bf16_reader;
    readers[Field::kDRoutedGate] = grad_reader(d_routed_[0].data());
    readers[Field::kDRoutedUp] = grad_reader(d_routed_[1].data());
    readers[Field::kDRoutedDown] = grad_reader(d_routed_[2].data());
    if (args_.inputs.routed.has_biases()) {
      readers[Field::kDRoutedBGate] = grad_reader(d_biases_[0].data());
      readers[Field::kDRoutedBUp] = grad_reader(d_biases_[1].data());
      readers[Field::kDRoutedBDown] = grad_reader(d_biases_[2].data());
    }
    if (shape_.has_shared_expert()) {
      readers[Field::kDSharedGate] = grad_reader(d_shared_[0].data());
      readers[Field::kDSharedUp] = grad_reader(d_shared_[1].data());
      readers[Field::kDSharedDown] = grad_reader(d_shared_[2].data());
    }
    return readers;
  }

  std::vector<uint8_t> snapshot(bool with_backward) override {
    std::vector<uint8_t> bytes;
    auto add = [&](HostBuffer& buffer) {
      const auto* begin = static_cast<const uint8_t*>(buffer.data());
      bytes.insert(bytes.end(), begin, begin + buffer.bytes());
    };
    add(out_);
    if (with_backward) {
      add(d_x_);
      add(d_topk_);
    }
    return bytes;
  }

 private:
  std::vector<HostBuffer*> all_outputs() {
    return {&out_,         &d_x_,         &d_topk_,      &d_routed_[0], &d_routed_[1], &d_routed_[2],
            &d_shared_[0], &d_shared_[1], &d_shared_[2], &d_biases_[0], &d_biases_[1], &d_biases_[2]};
  }

  // The routed weights in FP8, into host buffers: once, before the runs and outside every timed call, as a
  // trainer quantizes them once per optimizer step; timed on its own.
  void quantize_weights() {
    const std::array<Fp8Extents, kNumFp8Tensors> extents = fp8_weight_extents(shape_);
    void* data[kNumFp8Tensors];
    void* scale[kNumFp8Tensors];
    for (int i = 0; i < kNumFp8Tensors; ++i) {
      fp8_data_[i] = HostBuffer((numel_of(extents[i].data) + 3) / 4);  // e4m3 bytes in fp32 storage
      fp8_scale_[i] = HostBuffer(numel_of(extents[i].scale));
      data[i] = fp8_data_[i].data();
      scale[i] = fp8_scale_[i].data();
    }
    fp8_ = fp8_weight_views(shape_, data, scale);
    const auto start = Clock::now();
    pounce::quantize_weights_fp8(args_.inputs.routed, fp8_);
    weight_quantize_ms_ = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    args_.inputs.routed_fp8 = &fp8_;
  }

  // Input sets 1.. (set 0 is the problem itself): its tokens shifted by input_set_shift rows.
  struct RotatedSet {
    std::vector<uint16_t> x, d_out;
    std::vector<int32_t> topk_idx;
    std::vector<float> topk_weights;
  };

  const RunRequest& request_;
  Shape shape_;
  Workspace workspace_;
  BackwardArgs args_;
  HostBuffer out_, d_x_, d_topk_;
  HostBuffer d_routed_[3], d_shared_[3], d_biases_[3];
  std::vector<RotatedSet> rotated_;
  std::vector<InputSetData> sets_;                                   // set 0 (the problem), then rotated_
  HostBuffer fp8_data_[kNumFp8Tensors], fp8_scale_[kNumFp8Tensors];  // FP8 only
  Fp8Weights fp8_;
  std::optional<double> weight_quantize_ms_;
};

}  // namespace

RunOutcome run_ranks(int num_ranks, const RunRequest& request,
                     const std::function<std::unique_ptr<RankRunner>(int rank)>& make_runner) {
  std::vector<RankResult> results(num_ranks);
  std::vector<std::exception_ptr> errors(num_ranks);
  std::barrier<> align(num_ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < num_ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        std::unique_ptr<RankRunner> runner = make_runner(rank);
        results[rank] = drive_rank(*runner, request, rank, &align);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
      // A rank that is done (or failed) stops counting, so its peers never wait for it at `align`.
      align.arrive_and_drop();
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const std::exception_ptr& error : errors)
    if (error) std::rethrow_exception(error);
  return combine(std::move(results));
}

RunOutcome run_on_cpu(const RunRequest& request) {
  const int R = static_cast<int>(request.problem->shape.num_ranks);
  std::vector<Group> groups = Group::create_cpu(R);
  RunOutcome outcome = run_ranks(R, request, [&](int rank) -> std::unique_ptr<RankRunner> {
    return std::make_unique<CpuRankRunner>(groups[rank], request, rank);
  });
  outcome.device = "CPU reference backend, " + std::to_string(R) + " simulated rank" + (R > 1 ? "s" : "") +
                   " (one thread each)";
  return outcome;
}

}  // namespace pounce::cli
