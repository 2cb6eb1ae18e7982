// Grouped GEMM (kernels/gemm) against a CPU fp32-accumulate reference.
//
// Reference: out[r, c] = bf16( sum_k float(A[r, k]) * float(B[group(r)][c, k]) ), ascending k, fp32.
// Tolerance: 2 bf16 ulps of |ref| plus 1e-6 * sum_k |A B| (accumulation-order noise). Outputs are
// poisoned with 0xFFFF (a bf16 NaN) first; rows at or beyond group_row_offset[num_groups] must stay
// poisoned. Each case runs twice and demands bitwise-equal outputs.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/gemm/activation.cuh"
#include "kernels/gemm/grouped_gemm.h"

namespace {

using pounce::kernels::ActivationParams;
using pounce::kernels::GroupedRows;

constexpr uint16_t kPoison = 0xFFFF;

#define SKIP_WITHOUT_GPU()                                                                  \
  do {                                                                                      \
    int count_ = 0;                                                                         \
    const cudaError_t err_ = cudaGetDeviceCount(&count_);                                   \
    if (err_ != cudaSuccess || count_ == 0) {                                               \
      GTEST_SKIP() << "no CUDA GPU visible: "                                               \
                   << (err_ != cudaSuccess ? cudaGetErrorString(err_) : "0 devices found"); \
    }                                                                                       \
  } while (0)

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Uniform in [-scale, scale], never zero, rounded to bf16.
std::vector<uint16_t> random_bf16(size_t count, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<uint16_t> out(count);
  for (auto& v : out) {
    float x = dist(gen);
    if (std::fabs(x) < scale * 1e-3f) x = scale * 1e-3f;
    v = to_bf16(x);
  }
  return out;
}

float bf16_ulp(float x) {
  int e = 0;
  std::frexp(std::fabs(x), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0f, e - 8);
}

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  explicit DeviceBuffer(size_t count) {
    if (cudaMalloc(&ptr, count * sizeof(T) + 16) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

struct Problem {
  std::vector<int32_t> rows_per_group;  // multiples of 128, zeros allowed
  int64_t max_rows;
  int64_t n, k;
  int row_stride = 1;  // check every row_stride-th valid row (keeps the CPU side fast)
  std::vector<int32_t> offsets() const {
    std::vector<int32_t> off(rows_per_group.size() + 1, 0);
    for (size_t g = 0; g < rows_per_group.size(); ++g) off[g + 1] = off[g] + rows_per_group[g];
    return off;
  }
};

// One output element of the reference: fp32 sum and the sum of magnitudes for the tolerance.
struct RefValue {
  float sum;
  float abs_sum;
};
RefValue dot_ref(const uint16_t* a_row, const uint16_t* b_row, int64_t k) {
  float sum = 0.f, abs_sum = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    const float p = from_bf16(a_row[i]) * from_bf16(b_row[i]);
    sum += p;
    abs_sum += std::fabs(p);
  }
  return {sum, abs_sum};
}

// Returns an empty string when `got` matches bf16(ref) within tolerance, else a description.
std::string compare(const char* name, int64_t r, int64_t c, uint16_t got, RefValue ref) {
  const float g = from_bf16(got);
  const float want = from_bf16(to_bf16(ref.sum));
  const float tol = 2.f * bf16_ulp(ref.sum) + 1e-6f * ref.abs_sum;
  if (std::isfinite(g) && std::fabs(g - want) <= tol) return {};
  return std::string(name) + "[" + std::to_string(r) + ", " + std::to_string(c) + "] = " + std::to_string(g) +
         ", reference " + std::to_string(want) + " (tolerance " + std::to_string(tol) + ")";
}

std::vector<int64_t> rows_to_check(const Problem& p) {
  std::vector<int64_t> rows;
  const auto off = p.offsets();
  for (int64_t r = 0; r < off.back(); r += p.row_stride) rows.push_back(r);
  if (off.back() > 0) rows.push_back(off.back() - 1);
  return rows;
}

int group_of(const std::vector<int32_t>& off, int64_t row) {
  int g = 0;
  while (off[g + 1] <= row) ++g;
  return g;
}

// Rows [valid, max_rows) of a [max_rows, n] output must still hold the poison pattern.
int64_t count_unpoisoned_tail(const std::vector<uint16_t>& out, int64_t valid_rows, int64_t n) {
  int64_t bad = 0;
  for (size_t i = static_cast<size_t>(valid_rows * n); i < out.size(); ++i) bad += out[i] != kPoison;
  return bad;
}

void run_grouped_gemm(const Problem& p) {
  const auto off = p.offsets();
  const int num_groups = static_cast<int>(p.rows_per_group.size());
  const auto a = random_bf16(static_cast<size_t>(p.max_rows * p.k), 1234, 1.0f);
  const auto b = random_bf16(static_cast<size_t>(num_groups * p.n * p.k), 5678, 0.25f);
  DeviceBuffer<uint16_t> d_a(a.size()), d_b(b.size()), d_c(static_cast<size_t>(p.max_rows * p.n));
  DeviceBuffer<int32_t> d_off(off.size());
  ASSERT_TRUE(d_a.ptr && d_b.ptr && d_c.ptr && d_off.ptr);
  CUDA_OK(cudaMemcpy(d_a.ptr, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_b.ptr, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_off.ptr, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  const GroupedRows rows{p.max_rows, d_off.ptr, num_groups};
  const size_t out_count = static_cast<size_t>(p.max_rows * p.n);

  std::vector<uint16_t> first, second(out_count);
  for (int run = 0; run < 2; ++run) {
    CUDA_OK(cudaMemset(d_c.ptr, 0xFF, out_count * 2));
    pounce::kernels::grouped_gemm(rows, d_a.ptr, d_b.ptr, d_c.ptr, p.n, p.k, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(pounce::kernels::grouped_gemm_error_code(true), 0);
    CUDA_OK(cudaMemcpy(second.data(), d_c.ptr, out_count * 2, cudaMemcpyDeviceToHost));
    if (run == 0) first = second;
  }
  ASSERT_EQ(std::memcmp(first.data(), second.data(), out_count * 2), 0) << "two runs differ (nondeterminism)";
  EXPECT_EQ(count_unpoisoned_tail(first, off.back(), p.n), 0) << "rows beyond the valid range were written";

  int failures = 0;
  for (int64_t r : rows_to_check(p)) {
    const int g = group_of(off, r);
    for (int64_t c = 0; c < p.n; ++c) {
      const RefValue ref = dot_ref(&a[r * p.k], &b[(g * p.n + c) * p.k], p.k);
      const std::string err = compare("C", r, c, first[r * p.n + c], ref);
      if (!err.empty() && failures++ < 5) ADD_FAILURE() << err << " (group " << g << ")";
    }
  }
  EXPECT_EQ(failures, 0);
}

void run_gate_up(const Problem& p, const ActivationParams& act) {
  const auto off = p.offsets();
  const int num_groups = static_cast<int>(p.rows_per_group.size());
  const size_t w_count = static_cast<size_t>(num_groups * p.n * p.k);
  const auto a = random_bf16(static_cast<size_t>(p.max_rows * p.k), 42, 1.0f);
  const auto wg = random_bf16(w_count, 43, 0.25f);
  const auto wu = random_bf16(w_count, 44, 0.25f);
  const size_t out_count = static_cast<size_t>(p.max_rows * p.n);
  DeviceBuffer<uint16_t> d_a(a.size()), d_wg(w_count), d_wu(w_count);
  DeviceBuffer<uint16_t> d_g(out_count), d_u(out_count), d_act(out_count);
  DeviceBuffer<int32_t> d_off(off.size());
  ASSERT_TRUE(d_a.ptr && d_wg.ptr && d_wu.ptr && d_g.ptr && d_u.ptr && d_act.ptr && d_off.ptr);
  CUDA_OK(cudaMemcpy(d_a.ptr, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_wg.ptr, wg.data(), w_count * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_wu.ptr, wu.data(), w_count * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_off.ptr, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  const GroupedRows rows{p.max_rows, d_off.ptr, num_groups};

  std::vector<uint16_t> g[2], u[2], y[2];
  for (int run = 0; run < 2; ++run) {
    for (auto* d : {d_g.ptr, d_u.ptr, d_act.ptr}) CUDA_OK(cudaMemset(d, 0xFF, out_count * 2));
    pounce::kernels::grouped_gate_up(rows, d_a.ptr, d_wg.ptr, d_wu.ptr, d_g.ptr, d_u.ptr, d_act.ptr, p.n, p.k,
                                     act, nullptr);
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(pounce::kernels::grouped_gemm_error_code(true), 0);
    for (auto [host, dev] :
         {std::pair{&g[run], d_g.ptr}, std::pair{&u[run], d_u.ptr}, std::pair{&y[run], d_act.ptr}}) {
      host->resize(out_count);
      CUDA_OK(cudaMemcpy(host->data(), dev, out_count * 2, cudaMemcpyDeviceToHost));
    }
  }
  ASSERT_TRUE(g[0] == g[1] && u[0] == u[1] && y[0] == y[1]) << "two runs differ (nondeterminism)";
  EXPECT_EQ(count_unpoisoned_tail(g[0], off.back(), p.n), 0) << "g: rows beyond the valid range were written";
  EXPECT_EQ(count_unpoisoned_tail(u[0], off.back(), p.n), 0) << "u: rows beyond the valid range were written";
  EXPECT_EQ(count_unpoisoned_tail(y[0], off.back(), p.n), 0)
      << "act: rows beyond the valid range were written";

  int failures = 0;
  int64_t clamped = 0;
  for (int64_t r : rows_to_check(p)) {
    const int grp = group_of(off, r);
    for (int64_t c = 0; c < p.n; ++c) {
      const size_t w_row = static_cast<size_t>((grp * p.n + c) * p.k);
      const size_t o = static_cast<size_t>(r * p.n + c);
      std::string err = compare("g", r, c, g[0][o], dot_ref(&a[r * p.k], &wg[w_row], p.k));
      if (err.empty()) err = compare("u", r, c, u[0][o], dot_ref(&a[r * p.k], &wu[w_row], p.k));
      // act from the GPU's own bf16 g and u, as the layer defines it; only libm differences remain.
      const float gf = from_bf16(g[0][o]), uf = from_bf16(u[0][o]);
      clamped += gf > act.clamp_limit || std::fabs(uf) > act.clamp_limit;
      const float want = pounce::kernels::gemm::apply_activation(gf, uf, act);
      if (err.empty()) err = compare("act", r, c, y[0][o], RefValue{want, 0.f});
      if (!err.empty() && failures++ < 5) ADD_FAILURE() << err << " (group " << grp << ")";
    }
  }
  EXPECT_EQ(failures, 0);
  if (std::isfinite(act.clamp_limit)) EXPECT_GT(clamped, 0) << "test data never reaches the clamp";
}

TEST(GroupedGemm, EmptyGroupsEdgeTileAndPoisonedTail) {
  SKIP_WITHOUT_GPU();
  // n = 192: one 256-wide tile with its last 64 columns masked; first, middle and last groups empty.
  run_grouped_gemm(Problem{{0, 256, 0, 128, 384, 0}, 1024, 192, 320});
}

TEST(GroupedGemm, ManyGroupsMoreTilesThanSms) {
  SKIP_WITHOUT_GPU();
  std::vector<int32_t> sizes;
  for (int g = 0; g < 37; ++g) sizes.push_back(128 * ((g * 5) % 7));  // 0..768 rows, several empty
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  run_grouped_gemm(Problem{sizes, total + 256, 1088, 256, 5});  // 1088 = 4.25 tiles of 256
}

TEST(GroupedGemm, SingleGroupDeepK) {
  SKIP_WITHOUT_GPU();
  run_grouped_gemm(Problem{{1152}, 1280, 512, 2048, 3});
}

TEST(GroupedGemm, AllGroupsEmptyTouchesNothing) {
  SKIP_WITHOUT_GPU();
  run_grouped_gemm(Problem{{0, 0, 0}, 256, 256, 128});
}

TEST(GroupedGemm, RejectsUnsupportedShapes) {
  SKIP_WITHOUT_GPU();
  const GroupedRows rows{128, reinterpret_cast<const int32_t*>(16), 1};
  EXPECT_THROW(pounce::kernels::grouped_gemm(rows, reinterpret_cast<void*>(16), reinterpret_cast<void*>(16),
                                             reinterpret_cast<void*>(16), 100, 128, nullptr),
               std::exception);
  EXPECT_THROW(pounce::kernels::grouped_gemm(rows, reinterpret_cast<void*>(16), reinterpret_cast<void*>(16),
                                             reinterpret_cast<void*>(16), 128, 96, nullptr),
               std::exception);
}

TEST(GroupedGateUp, SwiGLUClampEdgeTileEmptyGroup) {
  SKIP_WITHOUT_GPU();
  // n = 192 with 128-wide gate/up tiles: the second tile is half masked.
  run_gate_up(Problem{{128, 0, 256}, 512, 192, 256},
              ActivationParams{pounce::kernels::kActivationSwiGLU, 0.5f, 1.f});
}

TEST(GroupedGateUp, SwiGLUNoClamp) {
  SKIP_WITHOUT_GPU();
  run_gate_up(
      Problem{{256, 128}, 384, 768, 512, 2},
      ActivationParams{pounce::kernels::kActivationSwiGLU, std::numeric_limits<float>::infinity(), 1.f});
}

TEST(GroupedGateUp, GptOssClampN2880) {
  SKIP_WITHOUT_GPU();
  // gpt-oss-120b widths: n = k = 2880 (22.5 tiles of 128), sampled rows.
  run_gate_up(Problem{{128, 0, 128}, 384, 2880, 2880, 11},
              ActivationParams{pounce::kernels::kActivationGptOss, 0.75f, 1.702f});
}

}  // namespace
