#include "gpu_fixtures.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <numeric>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

#include "reference/bf16.h"

namespace pounce::gpu_test {

using reference::bf16_bits_to_float;
using reference::float_to_bf16_bits;

// ---- GPUs ----

int visible_gpus() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

std::vector<int> visible_rank_counts(std::initializer_list<int> wanted) {
  std::vector<int> counts;
  for (int R : wanted) {
    if (R <= visible_gpus()) counts.push_back(R);
  }
  return counts;
}

std::string gpu_skip_reason(int needed) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA GPU visible (cudaGetDeviceCount: ") + cudaGetErrorString(status) +
           "): GPU test skipped";
  }
  if (count == 0) return "no CUDA GPU visible (cudaGetDeviceCount found none): GPU test skipped";
  if (count < needed)
    return "needs " + std::to_string(needed) + " GPUs, " + std::to_string(count) + " visible: skipped";
  return "";
}

void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

std::string current_test_name() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return info != nullptr ? info->name() : "";
}

ScopedEnv::ScopedEnv(const char* name, const char* value) : name_(name) {
  if (const char* previous = std::getenv(name)) saved_ = previous;
  setenv(name, value, 1);
}

ScopedEnv::~ScopedEnv() {
  if (saved_) {
    setenv(name_.c_str(), saved_->c_str(), 1);
  } else {
    unsetenv(name_.c_str());
  }
}

// ---- problem description ----

Call random_routing(std::vector<int64_t> num_tokens, uint32_t seed) {
  return {std::move(num_tokens), Routing::kRandom, false, seed};
}

Call all_to_one_expert(std::vector<int64_t> num_tokens, uint32_t seed) {
  return {std::move(num_tokens), Routing::kAllToOneExpert, false, seed};
}

Call few_experts(std::vector<int64_t> num_tokens, uint32_t seed) {
  return {std::move(num_tokens), Routing::kFewExperts, false, seed};
}

Call sparse_routing(std::vector<int64_t> num_tokens, uint32_t seed) {
  return {std::move(num_tokens), Routing::kSparse, false, seed};
}

Call with_int64_idx(Call call) {
  call.idx_int64 = true;
  return call;
}

Shape make_shape(int64_t max_tokens, int64_t H, int64_t I, int64_t E, int64_t k, int64_t Is, int64_t R) {
  Shape s;
  s.max_tokens = max_tokens;
  s.hidden = H;
  s.intermediate = I;
  s.num_experts = E;
  s.num_topk = k;
  s.shared_intermediate = Is;
  s.num_ranks = R;
  return s;
}

Activation clamped(Activation activation, float limit) {
  activation.clamp_limit = limit;
  return activation;
}

std::vector<uint16_t> random_bf16(size_t count, std::mt19937& gen, float scale) {
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<uint16_t> out(count);
  for (auto& v : out) v = float_to_bf16_bits(dist(gen));
  return out;
}

Model make_model(const Shape& shape, Activation activation, uint32_t seed) {
  std::mt19937 gen(seed);
  Model m{shape, activation, {}, {}, {}, {}, {}, {}};
  const int64_t E = shape.num_experts, H = shape.hidden, I = shape.intermediate,
                Is = shape.shared_intermediate;
  m.gate = random_bf16(E * I * H, gen, 2.0f / std::sqrt(static_cast<float>(H)));
  m.up = random_bf16(E * I * H, gen, 2.0f / std::sqrt(static_cast<float>(H)));
  m.down = random_bf16(E * H * I, gen, 2.0f / std::sqrt(static_cast<float>(I)));
  if (Is > 0) {
    m.shared_gate = random_bf16(Is * H, gen, 2.0f / std::sqrt(static_cast<float>(H)));
    m.shared_up = random_bf16(Is * H, gen, 2.0f / std::sqrt(static_cast<float>(H)));
    m.shared_down = random_bf16(H * Is, gen, 2.0f / std::sqrt(static_cast<float>(Is)));
  }
  return m;
}

RankData make_rank_data(const Shape& shape, const Call& call, int rank) {
  const int64_t T = call.num_tokens[rank], H = shape.hidden, k = shape.num_topk, E = shape.num_experts;
  std::mt19937 gen(call.seed * 7919u + static_cast<uint32_t>(rank) * 104729u + 17u);
  RankData d;
  d.x = random_bf16(T * H, gen, 1.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float origin = 0.25f * static_cast<float>(rank + 1) + 0.001f * static_cast<float>(t % 97);
    for (int64_t h = 0; h < H; h += 16) {
      d.x[t * H + h] = float_to_bf16_bits(bf16_bits_to_float(d.x[t * H + h]) + origin);
    }
  }
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  d.topk_weights.resize(T * k);
  for (auto& w : d.topk_weights) w = weight(gen);
  d.topk_idx.assign(T * k, -1);
  std::vector<int32_t> experts(E);
  for (int64_t t = 0; t < T; ++t) {
    std::iota(experts.begin(), experts.end(), 0);
    std::shuffle(experts.begin(), experts.end(), gen);
    for (int64_t j = 0; j < k; ++j) {
      int32_t e = experts[j % E];
      switch (call.routing) {
        case Routing::kRandom:
          e = gen() % 5 == 0 ? -1 : e;
          break;
        case Routing::kAllToOneExpert:
          e = j == 0 ? 0 : -1;
          break;
        case Routing::kFewExperts:
          e = j < 2 ? (j == 0 ? 1 : static_cast<int32_t>(E - 1)) : -1;
          break;
        case Routing::kSparse:
          e = gen() % 3 == 0 ? e : -1;
          break;
      }
      d.topk_idx[t * k + j] = e;
    }
  }
  if (call.bad_id != 0 && rank == 0 && T > 0) d.topk_idx[0] = call.bad_id;
  std::mt19937 d_out_gen(call.seed * 6271u + static_cast<uint32_t>(rank) * 3571u + 29u);
  d.d_out = random_bf16(T * H, d_out_gen, 1.0f);
  return d;
}

std::vector<std::vector<RankData>> make_call_data(const Shape& shape, const std::vector<Call>& calls) {
  std::vector<std::vector<RankData>> data;
  for (const Call& call : calls) {
    std::vector<RankData> ranks;
    for (int r = 0; r < shape.num_ranks; ++r) ranks.push_back(make_rank_data(shape, call, r));
    data.push_back(std::move(ranks));
  }
  return data;
}

// ---- cases that several test files share ----

std::vector<int64_t> tokens_per_rank(int num_ranks, int64_t rank0, int64_t rank1) {
  return num_ranks == 2 ? std::vector<int64_t>{rank0, rank1} : std::vector<int64_t>{rank0};
}

std::vector<Call> many_rank_calls(int num_ranks, int64_t max_tokens, int64_t few_tokens,
                                  uint32_t first_seed) {
  std::vector<int64_t> uneven(num_ranks);
  for (int r = 0; r < num_ranks; ++r) uneven[r] = (r * 97) % (max_tokens + 1);
  return {random_routing(uneven, first_seed),
          with_int64_idx(all_to_one_expert(std::vector<int64_t>(num_ranks, max_tokens), first_seed + 1)),
          few_experts(std::vector<int64_t>(num_ranks, few_tokens), first_seed + 2)};
}

std::vector<Call> graph_calls(int num_ranks, uint32_t first_seed) {
  const std::vector<int64_t> tokens =
      num_ranks == 2 ? std::vector<int64_t>{256, 190} : std::vector<int64_t>{190};
  return {random_routing(tokens, first_seed), all_to_one_expert(tokens, first_seed + 1),
          sparse_routing(tokens, first_seed + 2)};
}

int64_t smallest_ring(const Shape& shape) {
  return (shape.num_ranks * shape.max_tokens + kBlockM - 1) / kBlockM * kBlockM;
}

void for_each_fused_variant(
    const std::function<void(int num_ranks, const Config& tuning, const std::string& label)>& body) {
  for (int R : visible_rank_counts({1, 2})) {
    for (CombineMode combine : {CombineMode::kPush, CombineMode::kScatter}) {
      for (int64_t minibatch : {int64_t{kBlockM}, int64_t{0}}) {
        Config tuning;
        tuning.combine = combine;
        tuning.minibatch_size = minibatch;
        body(R, tuning,
             " ranks " + std::to_string(R) + " combine " + to_string(combine) + " minibatch " +
                 std::to_string(minibatch));
      }
    }
  }
}

// ---- reference ----

reference::testing::Case make_reference_case(const Model& m, const std::vector<RankData>& data,
                                             Precision precision) {
  const Shape& s = m.shape;
  const int64_t R = s.num_ranks, El = s.num_local_experts(), I = s.intermediate, H = s.hidden;
  reference::testing::Case c;
  reference::Problem& p = c.problem;
  p.hidden = H;
  p.intermediate = I;
  p.num_experts = s.num_experts;
  p.num_topk = s.num_topk;
  p.shared_intermediate = s.shared_intermediate;
  p.num_ranks = R;
  p.block_m = kBlockM;
  p.activation = m.activation;
  p.numerics = reference::Numerics::kBf16;
  p.precision = precision;
  c.ranks.resize(R);
  c.routed.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    c.ranks[r].num_tokens = static_cast<int64_t>(data[r].x.size()) / H;
    c.ranks[r].x = reference::bf16_to_double(data[r].x);
    c.ranks[r].topk_idx = data[r].topk_idx;
    c.ranks[r].topk_weights.assign(data[r].topk_weights.begin(), data[r].topk_weights.end());
    c.ranks[r].d_out = reference::bf16_to_double(data[r].d_out);
    auto slice = [&](const std::vector<uint16_t>& w) {
      const int64_t per_expert = I * H;
      return reference::bf16_to_double(
          std::vector<uint16_t>(w.begin() + r * El * per_expert, w.begin() + (r + 1) * El * per_expert));
    };
    c.routed[r] = {slice(m.gate), slice(m.up), slice(m.down)};
  }
  if (s.shared_intermediate > 0)
    c.shared = {reference::bf16_to_double(m.shared_gate), reference::bf16_to_double(m.shared_up),
                reference::bf16_to_double(m.shared_down)};
  return c;
}

// ---- device buffers ----

void poison(void* ptr, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) CUDA_OK(cudaMemsetAsync(ptr, 0xFF, bytes, stream));
}

DeviceInputs::DeviceInputs(const Shape& s)
    : x(s.max_tokens * s.hidden),
      idx(s.max_tokens * s.num_topk),
      weights(s.max_tokens * s.num_topk),
      out(s.max_tokens * s.hidden) {}

// Pageable host memory is staged before cudaMemcpyAsync returns, so the host vectors may go at once.
void DeviceInputs::upload(const Shape& s, const RankData& d, bool idx_int64, cudaStream_t stream) {
  const int64_t T = static_cast<int64_t>(d.x.size()) / s.hidden;
  if (T == 0) return;
  CUDA_OK(cudaMemcpyAsync(x.ptr, d.x.data(), d.x.size() * 2, cudaMemcpyHostToDevice, stream));
  if (idx_int64) {
    const std::vector<int64_t> wide(d.topk_idx.begin(), d.topk_idx.end());
    CUDA_OK(cudaMemcpyAsync(idx.ptr, wide.data(), wide.size() * 8, cudaMemcpyHostToDevice, stream));
  } else {
    CUDA_OK(
        cudaMemcpyAsync(idx.ptr, d.topk_idx.data(), d.topk_idx.size() * 4, cudaMemcpyHostToDevice, stream));
  }
  CUDA_OK(cudaMemcpyAsync(weights.ptr, d.topk_weights.data(), d.topk_weights.size() * 4,
                          cudaMemcpyHostToDevice, stream));
}

ForwardArgs DeviceInputs::args(const Shape& s, int64_t T, bool idx_int64, int device) const {
  ForwardArgs a;
  a.x = TensorView(x.ptr, DType::kBF16, {T, s.hidden}, DeviceKind::kCuda, device);
  a.topk_idx = TensorView(idx.ptr, idx_int64 ? DType::kInt64 : DType::kInt32, {T, s.num_topk},
                          DeviceKind::kCuda, device);
  a.topk_weights = TensorView(weights.ptr, DType::kFP32, {T, s.num_topk}, DeviceKind::kCuda, device);
  a.out = TensorView(out.ptr, DType::kBF16, {T, s.hidden}, DeviceKind::kCuda, device);
  return a;
}

DeviceWeights::DeviceWeights(const Model& m, int rank, int device, Precision precision) {
  const Shape& s = m.shape;
  const int64_t El = s.num_local_experts(), I = s.intermediate, H = s.hidden, Is = s.shared_intermediate;
  auto upload = [&](const std::vector<uint16_t>& w, int64_t begin, int64_t count,
                    std::vector<int64_t> shape) {
    buffers.push_back(std::make_unique<DeviceBuffer<uint16_t>>(
        std::vector<uint16_t>(w.begin() + begin, w.begin() + begin + count)));
    return TensorView(buffers.back()->ptr, DType::kBF16, std::move(shape), DeviceKind::kCuda, device);
  };
  routed.gate = upload(m.gate, rank * El * I * H, El * I * H, {El, I, H});
  routed.up = upload(m.up, rank * El * I * H, El * I * H, {El, I, H});
  routed.down = upload(m.down, rank * El * H * I, El * H * I, {El, H, I});
  if (Is > 0) {
    shared.gate = upload(m.shared_gate, 0, Is * H, {Is, H});
    shared.up = upload(m.shared_up, 0, Is * H, {Is, H});
    shared.down = upload(m.shared_down, 0, H * Is, {H, Is});
  }
  if (precision != Precision::kFP8) return;
  // include/pounce/fp8.h: data [El, N, K] and scales [El, ceil(N / 128), ceil(K / 128)], forward orientation
  // as the bf16 weights, backward orientation transposed.
  const std::pair<Fp8Tensor*, std::vector<int64_t>> tensors[] = {
      {&fp8.gate, {El, I, H}},   {&fp8.up, {El, I, H}},   {&fp8.down, {El, H, I}},
      {&fp8.gate_t, {El, H, I}}, {&fp8.up_t, {El, H, I}}, {&fp8.down_t, {El, I, H}}};
  auto blocks = [](int64_t extent) { return (extent + kFp8Block - 1) / kFp8Block; };
  for (const auto& [tensor, dims] : tensors) {
    const std::vector<int64_t> scale_dims = {El, blocks(dims[1]), blocks(dims[2])};
    fp8_buffers.push_back(std::make_unique<DeviceBuffer<uint8_t>>(El * dims[1] * dims[2]));
    tensor->data = TensorView(fp8_buffers.back()->ptr, DType::kFP8E4M3, dims, DeviceKind::kCuda, device);
    fp8_buffers.back()->poison();
    fp8_buffers.push_back(std::make_unique<DeviceBuffer<uint8_t>>(El * scale_dims[1] * scale_dims[2] * 4));
    tensor->scale = TensorView(fp8_buffers.back()->ptr, DType::kFP32, scale_dims, DeviceKind::kCuda, device);
    fp8_buffers.back()->poison();
  }
  // On the legacy stream, after the poison; synchronised like DeviceBuffer::upload, so every pass sees it.
  quantize_weights_fp8(routed, fp8, nullptr);
  CUDA_OK(cudaStreamSynchronize(nullptr));
  routed_fp8 = &fp8;
}

// ---- rank threads ----

void run_ranks(int num_ranks, const std::function<void(const Group& group, int rank)>& body) {
  std::vector<Group> groups = Group::create_nccl_local(num_ranks);
  std::vector<std::string> thread_errors(num_ranks);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < num_ranks; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        CUDA_OK(cudaSetDevice(rank));
        body(groups[rank], rank);
      } catch (const std::exception& error) {
        thread_errors[rank] = error.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < num_ranks; ++rank) {
    if (!thread_errors[rank].empty())
      throw std::runtime_error("rank " + std::to_string(rank) + ": " + thread_errors[rank]);
  }
}

// ---- checks ----

namespace {

std::string hex_bits(const uint8_t* element, size_t element_bytes) {
  std::string out = "0x";
  char digits[3];
  for (size_t i = element_bytes; i-- > 0;) {  // little-endian: the most significant byte last
    std::snprintf(digits, sizeof(digits), "%02x", element[i]);
    out += digits;
  }
  return out;
}

}  // namespace

std::string bitwise_difference(const std::string& name, const void* a, size_t a_count, const void* b,
                               size_t b_count, size_t element_bytes) {
  if (a_count != b_count)
    return name + ": " + std::to_string(a_count) + " vs " + std::to_string(b_count) + " elements";
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  if (a_count == 0 || std::memcmp(x, y, a_count * element_bytes) == 0) return "";
  size_t i = 0;
  while (std::memcmp(x + i * element_bytes, y + i * element_bytes, element_bytes) == 0) ++i;
  return name + ": element " + std::to_string(i) + " differs bitwise (" +
         hex_bits(x + i * element_bytes, element_bytes) + " vs " +
         hex_bits(y + i * element_bytes, element_bytes) + ")";
}

std::string fp8_budget_difference(const std::string& name, const std::vector<double>& gpu,
                                  const std::vector<double>& bf16, bool gradient,
                                  const std::vector<bool>* mask) {
  if (gpu.size() != bf16.size())
    return name + ": size " + std::to_string(gpu.size()) + " vs the BF16 reference's " +
           std::to_string(bf16.size());
  double diff2 = 0, dot = 0, gpu2 = 0, bf16_2 = 0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    if (mask && !(*mask)[i]) continue;
    diff2 += (gpu[i] - bf16[i]) * (gpu[i] - bf16[i]);
    dot += gpu[i] * bf16[i];
    gpu2 += gpu[i] * gpu[i];
    bf16_2 += bf16[i] * bf16[i];
  }
  std::ostringstream out;
  if (bf16_2 == 0) {
    if (gpu2 == 0) return "";
    out << name << ": norm " << std::sqrt(gpu2) << " where the BF16 layer is exactly zero";
    return out.str();
  }
  const double relative = std::sqrt(diff2 / bf16_2), cosine = dot / std::sqrt(gpu2 * bf16_2);
  if (relative <= kFp8MaxRelativeError && (!gradient || cosine >= kFp8MinCosine)) return "";
  out << name << ": relative error " << relative << " (budget " << kFp8MaxRelativeError << ")";
  if (gradient) out << ", cosine similarity " << cosine << " (budget >= " << kFp8MinCosine << ")";
  out << " against the BF16 layer";
  return out.str();
}

std::string coordinate(const std::vector<int64_t>& dims, int64_t index) {
  std::vector<int64_t> at(dims.size());
  for (size_t d = dims.size(); d-- > 0;) {
    at[d] = index % dims[d];
    index /= dims[d];
  }
  std::string out = "[";
  for (size_t d = 0; d < at.size(); ++d) out += (d ? ", " : "") + std::to_string(at[d]);
  return out + "]";
}

std::string compare_close(const std::string& name, const std::vector<int64_t>& dims,
                          const std::vector<double>& gpu, const std::vector<double>& ref,
                          const std::vector<double>& ref64, const std::vector<bool>* mask, double extra_atol,
                          double noise_factor) {
  if (gpu.size() != ref.size() || ref.size() != ref64.size())
    return name + ": size " + std::to_string(gpu.size()) + " vs reference " + std::to_string(ref.size()) +
           " / " + std::to_string(ref64.size());
  double noise = 0, max_ref = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (mask && !(*mask)[i]) continue;
    noise = std::max(noise, std::fabs(ref[i] - ref64[i]));
    max_ref = std::max(max_ref, std::fabs(ref64[i]));
  }
  const double bound = noise_factor * noise + 1e-6 * max_ref + extra_atol + 1e-30;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (mask && !(*mask)[i]) continue;
    if (!(std::fabs(gpu[i] - ref64[i]) <= bound)) {
      std::ostringstream out;
      out << name << coordinate(dims, static_cast<int64_t>(i)) << ": gpu " << gpu[i] << " vs reference bf16 "
          << ref[i] << " / fp64 " << ref64[i] << " (bound " << bound << " = " << noise_factor
          << " x bf16 noise " << noise << " + atol)";
      return out.str();
    }
  }
  return "";
}

}  // namespace pounce::gpu_test
