// The GPU side of `pounce run` / `pounce bench`: one thread per rank, each on its own device (rank r uses
// device r), inputs generated on the host and copied, timings from CUDA events on the rank's stream.
#include "cli/runner.h"

#include "pounce/error.h"

#ifdef POUNCE_HAS_CUDA

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <exception>
#include <thread>

#include "pounce/fp8.h"
#include "pounce/group.h"
#include "pounce/layer.h"
#include "pounce/workspace.h"
#include "reference/bf16.h"

#define POUNCE_CUDA_TRY(call)                                                                            \
  do {                                                                                                   \
    const cudaError_t status_ = (call);                                                                  \
    if (status_ != cudaSuccess) ::pounce::detail::fail(#call, " failed: ", cudaGetErrorString(status_)); \
  } while (0)

namespace pounce::cli {
namespace {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) POUNCE_CUDA_TRY(cudaMalloc(&ptr_, bytes_));
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    if (bytes_ > 0) POUNCE_CUDA_TRY(cudaMemcpy(ptr_, host.data(), bytes_, cudaMemcpyHostToDevice));
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);  // no throw from a destructor; a failed free is not actionable
  }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

ElementReader bf16_reader(std::shared_ptr<std::vector<uint8_t>> host) {
  return [host](int64_t i) {
    uint16_t bits;
    std::memcpy(&bits, host->data() + 2 * i, 2);
    return static_cast<double>(reference::bf16_bits_to_float(bits));
  };
}

ElementReader fp32_reader(std::shared_ptr<std::vector<uint8_t>> host) {
  return [host](int64_t i) {
    float value;
    std::memcpy(&value, host->data() + 4 * i, 4);
    return static_cast<double>(value);
  };
}

class GpuRankRunner final : public RankRunner {
 public:
  GpuRankRunner(const Group& group, const RunRequest& request, int rank)
      : request_(request),
        shape_(request.problem->shape),
        rank_(rank),
        workspace_(group, request.problem->shape, request.config) {
    const HostRank& in = request.problem->ranks[rank];
    const HostWeights& shared = request.problem->shared;
    const int64_t T = in.num_tokens, H = shape_.hidden, I = shape_.intermediate, k = shape_.num_topk;
    const int64_t El = shape_.num_local_experts(), Is = shape_.shared_intermediate;
    wgrad_bytes_ = request.wgrad_fp32 ? 4 : 2;
    const DType wgrad = request.wgrad_fp32 ? DType::kFP32 : DType::kBF16;
    POUNCE_CUDA_TRY(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    POUNCE_CUDA_TRY(cudaEventCreate(&start_));
    POUNCE_CUDA_TRY(cudaEventCreate(&stop_));

    x_ = DeviceBuffer(in.x);
    topk_idx_ = DeviceBuffer(in.topk_idx);
    topk_weights_ = DeviceBuffer(in.topk_weights);
    d_out_ = DeviceBuffer(in.d_out);
    routed_[0] = DeviceBuffer(in.routed.gate);
    routed_[1] = DeviceBuffer(in.routed.up);
    routed_[2] = DeviceBuffer(in.routed.down);
    out_ = DeviceBuffer(T * H * 2);
    d_x_ = DeviceBuffer(T * H * 2);
    d_topk_ = DeviceBuffer(T * k * 4);
    for (DeviceBuffer& grad : d_routed_) grad = DeviceBuffer(El * I * H * wgrad_bytes_);

    if (Is > 0) {
      shared_[0] = DeviceBuffer(shared.gate);
      shared_[1] = DeviceBuffer(shared.up);
      shared_[2] = DeviceBuffer(shared.down);
      for (DeviceBuffer& grad : d_shared_) grad = DeviceBuffer(Is * H * wgrad_bytes_);
    }
    args_ = rank_views(shape_, T,
                       {x_.data(),
                        topk_idx_.data(),
                        topk_weights_.data(),
                        d_out_.data(),
                        {routed_[0].data(), routed_[1].data(), routed_[2].data()},
                        {shared_[0].data(), shared_[1].data(), shared_[2].data()},
                        out_.data(),
                        d_x_.data(),
                        d_topk_.data(),
                        {d_routed_[0].data(), d_routed_[1].data(), d_routed_[2].data()},
                        {d_shared_[0].data(), d_shared_[1].data(), d_shared_[2].data()}},
                       wgrad, DeviceKind::kCuda, rank);
    make_input_sets(T, H, k);
    if (request.config.precision == Precision::kFP8) quantize_weights();
  }

  void use_input_set(int set_idx) override { bind_input_set(args_, sets_, set_idx); }

  std::optional<double> weight_quantize_ms() const override { return weight_quantize_ms_; }

  ~GpuRankRunner() override {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
  }

  void poison() override {
    for (DeviceBuffer* buffer : {&out_, &d_x_, &d_topk_, &d_routed_[0], &d_routed_[1], &d_routed_[2],
                                 &d_shared_[0], &d_shared_[1], &d_shared_[2]})
      if (buffer->bytes() > 0)
        POUNCE_CUDA_TRY(cudaMemsetAsync(buffer->data(), 0xff, buffer->bytes(), stream_));
    POUNCE_CUDA_TRY(cudaStreamSynchronize(stream_));
  }

  double forward() override {
    return timed([&] { pounce::forward(workspace_, args_.inputs, stream_); });
  }

  double backward() override {
    return timed([&] { pounce::backward(workspace_, args_, stream_); });
  }

  RankOutputs outputs(const CheckPlan& plan, bool with_backward) override {
    RankOutputs readers;
    readers[Field::kOut] = bf16_reader(download(out_, 0, out_.bytes()));
    if (!with_backward) return readers;
    readers[Field::kDX] = bf16_reader(download(d_x_, 0, d_x_.bytes()));
    readers[Field::kDTopkWeights] = fp32_reader(download(d_topk_, 0, d_topk_.bytes()));
    auto grad_reader = request_.wgrad_fp32 ? fp32_reader : bf16_reader;

    // Only the sampled experts' slices come back; `slot` maps a local expert to its place in them.
    const int64_t El = shape_.num_local_experts(), slice = shape_.intermediate * shape_.hidden;
    auto slot = std::make_shared<std::vector<int64_t>>(El, -1);
    const std::vector<int64_t>& experts = plan.experts[rank_];
    for (size_t i = 0; i < experts.size(); ++i) (*slot)[experts[i]] = static_cast<int64_t>(i);
    const Field routed_fields[3] = {Field::kDRoutedGate, Field::kDRoutedUp, Field::kDRoutedDown};
    for (int f = 0; f < 3; ++f) {
      auto host = std::make_shared<std::vector<uint8_t>>(experts.size() * slice * wgrad_bytes_);
      for (size_t i = 0; i < experts.size(); ++i)
        POUNCE_CUDA_TRY(
            cudaMemcpyAsync(host->data() + i * slice * wgrad_bytes_,
                            static_cast<uint8_t*>(d_routed_[f].data()) + experts[i] * slice * wgrad_bytes_,
                            slice * wgrad_bytes_, cudaMemcpyDeviceToHost, stream_));
      POUNCE_CUDA_TRY(cudaStreamSynchronize(stream_));
      ElementReader compact = grad_reader(host);
      readers[routed_fields[f]] = [compact, slot, slice](int64_t i) {
        const int64_t at = (*slot)[i / slice];
        return at < 0 ? std::nan("") : compact(at * slice + i % slice);
      };
    }
    if (shape_.has_shared_expert()) {
      readers[Field::kDSharedGate] = grad_reader(download(d_shared_[0], 0, d_shared_[0].bytes()));
      readers[Field::kDSharedUp] = grad_reader(download(d_shared_[1], 0, d_shared_[1].bytes()));
      readers[Field::kDSharedDown] = grad_reader(download(d_shared_[2], 0, d_shared_[2].bytes()));
    }
    return readers;
  }

  std::vector<uint8_t> snapshot(bool with_backward) override {
    std::vector<uint8_t> bytes = *download(out_, 0, out_.bytes());
    if (with_backward) {
      for (const DeviceBuffer* buffer : {&d_x_, &d_topk_}) {
        auto part = download(*buffer, 0, buffer->bytes());
        bytes.insert(bytes.end(), part->begin(), part->end());
      }
    }
    return bytes;
  }

 private:
  template <typename Call>
  double timed(Call&& call) {
    POUNCE_CUDA_TRY(cudaEventRecord(start_, stream_));
    call();
    POUNCE_CUDA_TRY(cudaEventRecord(stop_, stream_));
    POUNCE_CUDA_TRY(cudaEventSynchronize(stop_));
    float ms = 0.0f;
    POUNCE_CUDA_TRY(cudaEventElapsedTime(&ms, start_, stop_));
    return ms;
  }

  // The routed weights in FP8, into device buffers beside the bf16 ones: once, before the runs and outside
  // every timed call, as a trainer quantizes them once per optimizer step; timed on its own (CUDA events on
  // the rank's stream, once every upload has landed).
  void quantize_weights() {
    const std::array<Fp8Extents, kNumFp8Tensors> extents = fp8_weight_extents(shape_);
    void* data[kNumFp8Tensors];
    void* scale[kNumFp8Tensors];
    for (int i = 0; i < kNumFp8Tensors; ++i) {
      fp8_data_[i] = DeviceBuffer(numel_of(extents[i].data));  // e4m3 bytes
      fp8_scale_[i] = DeviceBuffer(numel_of(extents[i].scale) * sizeof(float));
      data[i] = fp8_data_[i].data();
      scale[i] = fp8_scale_[i].data();
    }
    fp8_ = fp8_weight_views(shape_, data, scale, DeviceKind::kCuda, rank_);
    POUNCE_CUDA_TRY(cudaDeviceSynchronize());  // the weights' cudaMemcpy uploads are done
    weight_quantize_ms_ = timed([&] { pounce::quantize_weights_fp8(args_.inputs.routed, fp8_, stream_); });
    args_.inputs.routed_fp8 = &fp8_;
  }

  // Input sets 1.. of RunRequest::num_input_sets: set 0's token rows (x, topk_idx, topk_weights, d_out)
  // shifted by input_set_shift, copied on the device.
  void make_input_sets(int64_t T, int64_t H, int64_t k) {
    const int num_sets = request_.num_input_sets;
    sets_.push_back({x_.data(), topk_idx_.data(), topk_weights_.data(), d_out_.data()});
    for (int set_idx = 1; set_idx < num_sets; ++set_idx) {
      const int64_t shift = input_set_shift(T, set_idx, num_sets);
      InputSet set;
      set.x = rotated_rows(x_, T, H * 2, shift);
      set.topk_idx = rotated_rows(topk_idx_, T, k * 4, shift);
      set.topk_weights = rotated_rows(topk_weights_, T, k * 4, shift);
      set.d_out = rotated_rows(d_out_, T, H * 2, shift);
      input_sets_.push_back(std::move(set));
    }
    for (InputSet& set : input_sets_)
      sets_.push_back({set.x.data(), set.topk_idx.data(), set.topk_weights.data(), set.d_out.data()});
    POUNCE_CUDA_TRY(cudaStreamSynchronize(stream_));
  }

  // A copy of `rows` rows of `row_bytes` whose row t is row (t + shift) % rows of `source`.
  DeviceBuffer rotated_rows(const DeviceBuffer& source, int64_t rows, int64_t row_bytes, int64_t shift) {
    DeviceBuffer copy(source.bytes());
    const auto* from = static_cast<const uint8_t*>(source.data());
    auto* to = static_cast<uint8_t*>(copy.data());
    const size_t head = shift * row_bytes, tail = (rows - shift) * row_bytes;
    if (tail > 0) POUNCE_CUDA_TRY(cudaMemcpyAsync(to, from + head, tail, cudaMemcpyDeviceToDevice, stream_));
    if (head > 0) POUNCE_CUDA_TRY(cudaMemcpyAsync(to + tail, from, head, cudaMemcpyDeviceToDevice, stream_));
    return copy;
  }

  std::shared_ptr<std::vector<uint8_t>> download(const DeviceBuffer& buffer, size_t offset, size_t bytes) {
    auto host = std::make_shared<std::vector<uint8_t>>(bytes);
    if (bytes > 0) {
      POUNCE_CUDA_TRY(cudaMemcpyAsync(host->data(), static_cast<const uint8_t*>(buffer.data()) + offset,
                                      bytes, cudaMemcpyDeviceToHost, stream_));
      POUNCE_CUDA_TRY(cudaStreamSynchronize(stream_));
    }
    return host;
  }

  const RunRequest& request_;
  Shape shape_;
  int rank_;
  Workspace workspace_;
  BackwardArgs args_;
  int64_t wgrad_bytes_ = 4;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  DeviceBuffer x_, topk_idx_, topk_weights_, d_out_, out_, d_x_, d_topk_;
  DeviceBuffer routed_[3], shared_[3], d_routed_[3], d_shared_[3];
  struct InputSet {
    DeviceBuffer x, topk_idx, topk_weights, d_out;
  };
  std::vector<InputSet> input_sets_;  // sets 1.. (set 0 is x_, topk_idx_, topk_weights_, d_out_)
  std::vector<InputSetData> sets_;    // every set, 0 first
  DeviceBuffer fp8_data_[kNumFp8Tensors], fp8_scale_[kNumFp8Tensors];  // FP8 only
  Fp8Weights fp8_;
  std::optional<double> weight_quantize_ms_;
};

}  // namespace

RunOutcome run_on_gpu(const RunRequest& request) {
  const int R = static_cast<int>(request.problem->shape.num_ranks);
  std::vector<Group> groups = Group::create_nccl_local(R);
  RunOutcome outcome = run_ranks(R, request, [&](int rank) -> std::unique_ptr<RankRunner> {
    POUNCE_CUDA_TRY(cudaSetDevice(rank));
    return std::make_unique<GpuRankRunner>(groups[rank], request, rank);
  });
  cudaDeviceProp properties{};
  POUNCE_CUDA_TRY(cudaGetDeviceProperties(&properties, 0));
  outcome.device = std::to_string(R) + " x " + properties.name;
  return outcome;
}

}  // namespace pounce::cli

#else  // !POUNCE_HAS_CUDA

namespace pounce::cli {

RunOutcome run_on_gpu(const RunRequest&) {
  detail::fail("the GPU backend is not in this build (no CUDA device code); rebuild with the CUDA toolkit, ",
               "or use --backend cpu");
}

}  // namespace pounce::cli

#endif
