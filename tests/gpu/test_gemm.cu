// Grouped GEMMs (kernels/gemm) against a CPU fp32-accumulate reference.
//
// Reference: out[r, c] = bf16( sum_k float(A[r, k]) * float(B[group(r)][c, k]) ), ascending k, fp32.
// Tolerance: 2 bf16 ulps of |ref| plus 1e-6 * sum_k |A B| (accumulation-order noise). Outputs are
// poisoned with 0xFFFF (a bf16 NaN) first; rows at or beyond group_row_offset[num_groups] must stay
// poisoned. Each case runs twice and demands bitwise-equal outputs.
// The backward kinds the same way: activation backward (d_a through the kernel's own host act'), the
// transposed-weight GEMM with its K range split over two tensors, and the weight gradient (a reduction over
// each group's rows) in its three output modes against fp64 sums, with exact expectations where the result
// is exact: zeros for an empty group, bf16 = the fp32 result rounded, accumulate = prefill + the fp32 result.
// As the pipelined staged passes launch them, some cases run over a slice of the groups (group_row_offset
// + first, so offset[0] > 0; rows outside the slice must stay poisoned) and on a capped grid (max_ctas).
// Cases with data rows (GroupedRows::group_rows) zero A past each group's data, as the layer's padding rows
// are: C skips a consumer warpgroup with only padding rows and the weight gradients the K blocks past the
// data (gate/up and the activation backward compute them), and the outputs must still be the reference's
// (zeros on padding rows; a weight gradient bitwise the one computed over every row).
// The skip rule, device buffers, the poison pattern and the bitwise comparison are gpu_fixtures.h's.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gpu_fixtures.h"
#include "kernels/gemm/activation.cuh"
#include "src/gpu/grouped_gemm.h"
#include "reference/bf16.h"

namespace {

using pounce::gpu_test::bf16_ulp;
using pounce::gpu_test::bitwise_difference;
using pounce::gpu_test::count_unpoisoned;
using pounce::gpu_test::DeviceBuffer;
using pounce::gpu_test::kPoison;
using pounce::gpu_test::same_bits;
using pounce::kernels::ActivationParams;
using pounce::kernels::GroupedRows;
constexpr auto from_bf16 = pounce::reference::bf16_bits_to_float;  // exact
constexpr auto to_bf16 = pounce::reference::float_to_bf16_bits;    // round to nearest even

// Uniform in [-scale, scale], never zero, rounded to bf16.
std::vector<uint16_t> nonzero_random_bf16(size_t count, uint32_t seed, float scale) {
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

struct Problem {
  std::vector<int32_t> rows_per_group;  // multiples of 128, zeros allowed
  int64_t max_rows;
  int64_t n, k;
  int row_stride = 1;  // check every row_stride-th valid row (keeps the CPU side fast)
  // Rows of each group's segment holding data (GroupedRows::group_rows); A rows past them are zero. Empty:
  // every row holds data (group_rows null).
  std::vector<int32_t> data_rows = {};
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

// Returns an empty string when `got` is within `tol` of bf16(ref), else a description.
std::string compare_within(const char* name, int64_t r, int64_t c, uint16_t got, float ref, float tol) {
  const float g = from_bf16(got);
  const float want = from_bf16(to_bf16(ref));
  // + an absolute floor: the GPU's sigmoid gives 0 where the exact one is a denormal (activation.cuh)
  if (std::isfinite(g) && std::fabs(g - want) <= tol + 1e-30f) return {};
  return std::string(name) + "[" + std::to_string(r) + ", " + std::to_string(c) + "] = " + std::to_string(g) +
         ", reference " + std::to_string(want) + " (tolerance " + std::to_string(tol) + ")";
}

// Returns an empty string when `got` matches bf16(ref) within tolerance, else a description.
std::string compare(const char* name, int64_t r, int64_t c, uint16_t got, RefValue ref) {
  return compare_within(name, r, c, got, ref.sum, 2.f * bf16_ulp(ref.sum) + 1e-6f * ref.abs_sum);
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

// A [max_rows, ld] bf16 operand with the rows past each group's data zeroed (Problem::data_rows).
void zero_padding_rows(const Problem& p, std::vector<uint16_t>& a, int64_t ld) {
  const auto off = p.offsets();
  for (size_t g = 0; g < p.data_rows.size(); ++g)
    std::fill(a.begin() + (off[g] + p.data_rows[g]) * ld, a.begin() + off[g + 1] * ld, uint16_t{0});
}

// GroupedRows of a problem's groups [first_group, ..): offsets, data rows where the problem has them.
GroupedRows grouped_rows(const Problem& p, const int32_t* d_off, const int32_t* d_data_rows,
                         int first_group = 0, int max_ctas = 0) {
  GroupedRows rows{p.max_rows, d_off + first_group, static_cast<int>(p.rows_per_group.size()) - first_group,
                   max_ctas};
  if (!p.data_rows.empty()) rows.group_rows = d_data_rows + first_group;
  return rows;
}

// Rows [valid, max_rows) of a [max_rows, n] output must still hold the poison pattern.
int64_t count_unpoisoned_tail(const std::vector<uint16_t>& out, int64_t valid_rows, int64_t n) {
  return count_unpoisoned(out.data() + valid_rows * n, out.data() + out.size());
}

// Rows [0, first_row) of a [max_rows, n] output must still hold the poison pattern (a launch over a slice).
int64_t count_unpoisoned_head(const std::vector<uint16_t>& out, int64_t first_row, int64_t n) {
  return count_unpoisoned(out.data(), out.data() + first_row * n);
}

// `max_ctas` caps the grid (CTAs loop over tiles). With data rows, the A rows of a tile's upper half that
// holds no data keep zeros only in their first 16 columns and hold NaNs past them on the device (the
// reference sees zeros): C skips that half, whose accumulators come from one k16 wgmma over those first
// columns, so its output rows are zeros only if the skip happened.
void run_grouped_gemm(const Problem& p, int max_ctas = 0) {
  const auto off = p.offsets();
  const int num_groups = static_cast<int>(p.rows_per_group.size());
  auto a = nonzero_random_bf16(static_cast<size_t>(p.max_rows * p.k), 1234, 1.0f);
  zero_padding_rows(p, a, p.k);
  auto a_device = a;
  int64_t skipped_halves = 0;
  for (size_t g = 0; g < p.data_rows.size(); ++g) {
    const int64_t data_end = off[g] + p.data_rows[g];
    for (int64_t half = off[g] + 64; half < off[g + 1]; half += 128) {
      if (half < data_end) continue;
      ++skipped_halves;
      for (int64_t r = half; r < half + 64; ++r)
        std::fill(a_device.begin() + r * p.k + 16, a_device.begin() + (r + 1) * p.k, kPoison);
    }
  }
  if (!p.data_rows.empty()) ASSERT_GT(skipped_halves, 0) << "the case has no upper half without data";
  const auto b = nonzero_random_bf16(static_cast<size_t>(num_groups * p.n * p.k), 5678, 0.25f);
  DeviceBuffer<uint16_t> d_a(a.size()), d_b(b.size()), d_c(static_cast<size_t>(p.max_rows * p.n));
  DeviceBuffer<int32_t> d_off(off.size()), d_data_rows(p.data_rows);
  ASSERT_TRUE(d_a.ptr && d_b.ptr && d_c.ptr && d_off.ptr && d_data_rows.ptr);
  CUDA_OK(cudaMemcpy(d_a.ptr, a_device.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_b.ptr, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_off.ptr, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  const GroupedRows rows = grouped_rows(p, d_off.ptr, d_data_rows.ptr, 0, max_ctas);
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
  ASSERT_EQ(bitwise_difference("C", first, second), "") << "two runs differ (nondeterminism)";
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
  auto a = nonzero_random_bf16(static_cast<size_t>(p.max_rows * p.k), 42, 1.0f);
  zero_padding_rows(p, a, p.k);
  const auto wg = nonzero_random_bf16(w_count, 43, 0.25f);
  const auto wu = nonzero_random_bf16(w_count, 44, 0.25f);
  const size_t out_count = static_cast<size_t>(p.max_rows * p.n);
  DeviceBuffer<uint16_t> d_a(a.size()), d_wg(w_count), d_wu(w_count);
  DeviceBuffer<uint16_t> d_g(out_count), d_u(out_count), d_act(out_count);
  DeviceBuffer<int32_t> d_off(off.size()), d_data_rows(p.data_rows);
  ASSERT_TRUE(d_a.ptr && d_wg.ptr && d_wu.ptr && d_g.ptr && d_u.ptr && d_act.ptr && d_off.ptr &&
              d_data_rows.ptr);
  CUDA_OK(cudaMemcpy(d_a.ptr, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_wg.ptr, wg.data(), w_count * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_wu.ptr, wu.data(), w_count * 2, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_off.ptr, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  const GroupedRows rows = grouped_rows(p, d_off.ptr, d_data_rows.ptr);

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
  ASSERT_EQ(bitwise_difference("g", g[0], g[1]) + bitwise_difference("u", u[0], u[1]) +
                bitwise_difference("act", y[0], y[1]),
            "")
      << "two runs differ (nondeterminism)";
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

// ---- backward kinds ----

// Twice: `out` poisoned (or set to `start`), `launch`, GEMM error flag checked, `count` elements read back;
// the two runs must be bitwise equal. Call through ASSERT_NO_FATAL_FAILURE.
template <typename T>
void run_twice(const std::function<void()>& launch, const DeviceBuffer<T>& out, size_t count,
               std::vector<T>& result, const std::vector<T>* start = nullptr) {
  std::vector<T> runs[2];
  for (int run = 0; run < 2; ++run) {
    if (start != nullptr) {
      out.upload(*start);
    } else {
      CUDA_OK(cudaMemset(out.ptr, 0xFF, count * sizeof(T)));
    }
    launch();
    CUDA_OK(cudaDeviceSynchronize());
    ASSERT_EQ(pounce::kernels::grouped_gemm_error_code(true), 0);
    runs[run].resize(count);
    CUDA_OK(cudaMemcpy(runs[run].data(), out.ptr, count * sizeof(T), cudaMemcpyDeviceToHost));
  }
  ASSERT_EQ(bitwise_difference("output", runs[0], runs[1]), "") << "two runs differ (nondeterminism)";
  result = std::move(runs[0]);
}

// a_row[0:k] . b[k, n] (b row-major, n contiguous) for every column, fp32 ascending k, continuing from
// `start` (empty: from zero).
std::vector<RefValue> row_times_matrix(const uint16_t* a_row, const uint16_t* b, int64_t k, int64_t n,
                                       std::vector<RefValue> start = {}) {
  start.resize(n, RefValue{0.f, 0.f});
  for (int64_t i = 0; i < k; ++i) {
    const float a_i = from_bf16(a_row[i]);
    for (int64_t c = 0; c < n; ++c) {
      const float prod = a_i * from_bf16(b[i * n + c]);
      start[c].sum += prod;
      start[c].abs_sum += std::fabs(prod);
    }
  }
  return start;
}

// run_activation_backward's checks of one schedule's output.
void check_activation_backward(const Problem& p, const ActivationParams& act, int first_group,
                               const std::vector<uint16_t>& a, const std::vector<uint16_t>& w,
                               const std::vector<uint16_t>& g, const std::vector<uint16_t>& u,
                               const std::vector<uint16_t>& out) {
  const auto off = p.offsets();
  const int64_t n = p.n, k = p.k, d_ld = 2 * n;
  EXPECT_EQ(count_unpoisoned_tail(out, off.back(), d_ld), 0) << "rows beyond the valid range were written";
  EXPECT_EQ(count_unpoisoned_head(out, off[first_group], d_ld), 0) << "rows before the slice were written";

  int failures = 0;
  int64_t clamped = 0;
  for (int64_t r : rows_to_check(p)) {
    if (r < off[first_group]) continue;
    const int grp = group_of(off, r);
    const std::vector<RefValue> d_a_row = row_times_matrix(&a[r * k], &w[grp * k * n], k, n);
    for (int64_t c = 0; c < n; ++c) {
      const float d_a_ref = from_bf16(to_bf16(d_a_row[c].sum));
      const float gf = from_bf16(g[r * n + c]), uf = from_bf16(u[r * n + c]);
      clamped += gf > act.clamp_limit || std::fabs(uf) > act.clamp_limit;
      float d_g = 0.f, d_u = 0.f, slope_g = 0.f, slope_u = 0.f;
      pounce::kernels::gemm::apply_activation_backward(gf, uf, d_a_ref, act, d_g, d_u);
      pounce::kernels::gemm::apply_activation_backward(gf, uf, 1.0f, act, slope_g, slope_u);
      const float d_a_slack = bf16_ulp(d_a_ref) + 1e-6f * d_a_row[c].abs_sum;
      std::string err = compare_within("d_g", r, c, out[r * d_ld + c], d_g,
                                       2.f * bf16_ulp(d_g) + std::fabs(slope_g) * d_a_slack);
      if (err.empty())
        err = compare_within("d_u", r, c, out[r * d_ld + n + c], d_u,
                             2.f * bf16_ulp(d_u) + std::fabs(slope_u) * d_a_slack);
      if (!err.empty() && failures++ < 5) ADD_FAILURE() << err << " (group " << grp << ")";
    }
  }
  EXPECT_EQ(failures, 0);
  if (std::isfinite(act.clamp_limit)) EXPECT_GT(clamped, 0) << "test data never reaches the clamp";
}

const char* schedule_name(pounce::kernels::TileSchedule schedule) {
  return schedule == pounce::kernels::TileSchedule::kPingPong ? "ping-pong" : "cooperative";
}

// d_a = bf16(A . W[group]) with W [groups, k, n] (w_down read transposed), then d_g, d_u = bf16(act'(g, u)
// d_a), stored as the layer does: one [rows, 2n] buffer, d_g in columns [0, n), d_u in [n, 2n) (d_ld = 2n).
// Reference: fp32 d_a rounded to bf16, then the kernel's own host act' (activation.cuh). Where the GPU's d_a
// rounds to the neighbouring bf16 value (other accumulation order), d_g and d_u move by one d_a ulp times
// the derivative: the tolerance allows that on top of 2 ulps of the result.
// `first_group` > 0 launches over a slice of the groups (offsets from group_row_offset + first_group, weights
// from the first group's matrix, as the pipelined backward does); `max_ctas` caps the persistent grid. Both
// tile schedules run, each checked against the reference, and must agree bit for bit.
void run_activation_backward(const Problem& p, const ActivationParams& act, int first_group = 0,
                             int max_ctas = 0) {
  const auto off = p.offsets();
  const int num_groups = static_cast<int>(p.rows_per_group.size());
  const int64_t n = p.n, k = p.k, d_ld = 2 * n;
  auto a = nonzero_random_bf16(static_cast<size_t>(p.max_rows * k), 71, 1.0f);
  zero_padding_rows(p, a, k);
  const auto w = nonzero_random_bf16(static_cast<size_t>(num_groups * k * n), 72, 0.25f);
  const auto g = nonzero_random_bf16(static_cast<size_t>(p.max_rows * n), 73, 2.0f);  // reaches a clamp at 1
  const auto u = nonzero_random_bf16(static_cast<size_t>(p.max_rows * n), 74, 2.0f);
  const size_t out_count = static_cast<size_t>(p.max_rows * d_ld);
  DeviceBuffer<uint16_t> d_a(a), d_w(w), d_g_in(g), d_u_in(u), d_out(out_count);
  DeviceBuffer<int32_t> d_off(off), d_data_rows(p.data_rows);
  ASSERT_TRUE(d_a.ptr && d_w.ptr && d_g_in.ptr && d_u_in.ptr && d_out.ptr && d_off.ptr && d_data_rows.ptr);
  const GroupedRows rows = grouped_rows(p, d_off.ptr, d_data_rows.ptr, first_group, max_ctas);
  const uint16_t* w_slice = d_w.ptr + first_group * k * n;
  using pounce::kernels::TileSchedule;
  const TileSchedule schedules[] = {TileSchedule::kPingPong, TileSchedule::kCooperative};
  std::vector<uint16_t> outs[2];
  for (int s = 0; s < 2; ++s) {
    SCOPED_TRACE(schedule_name(schedules[s]));
    ASSERT_NO_FATAL_FAILURE(run_twice(
        [&] {
          pounce::kernels::grouped_activation_backward(rows, d_a.ptr, w_slice, d_g_in.ptr, d_u_in.ptr,
                                                       d_out.ptr, d_out.ptr + n, d_ld, n, k, act, nullptr,
                                                       schedules[s]);
        },
        d_out, out_count, outs[s]));
    check_activation_backward(p, act, first_group, a, w, g, u, outs[s]);
  }
  EXPECT_EQ(bitwise_difference("[d_g, d_u]", outs[0], outs[1]), "")
      << "the ping-pong and cooperative tiles differ";
}

// C[rows, n] = A[rows, k] . [B0; B1][group]: K rows [0, k_split) from b0 [groups, k_split, n], the rest from
// b1 [groups, k - k_split, n] (d_x = [d_g, d_u] . [w_gate; w_up]); b1 is null when k_split == k.
// `first_group` and `max_ctas` as for run_activation_backward.
void run_gemm_transposed(const Problem& p, int64_t k_split, int first_group = 0, int max_ctas = 0) {
  const auto off = p.offsets();
  const int num_groups = static_cast<int>(p.rows_per_group.size());
  const int64_t n = p.n, k = p.k, k1 = k - k_split;
  auto a = nonzero_random_bf16(static_cast<size_t>(p.max_rows * k), 75, 1.0f);
  zero_padding_rows(p, a, k);
  const auto b0 = nonzero_random_bf16(static_cast<size_t>(num_groups * k_split * n), 76, 0.25f);
  const auto b1 = nonzero_random_bf16(static_cast<size_t>(num_groups * k1 * n), 77, 0.25f);
  const size_t out_count = static_cast<size_t>(p.max_rows * n);
  DeviceBuffer<uint16_t> d_a(a), d_b0(b0), d_b1(b1), d_c(out_count);
  DeviceBuffer<int32_t> d_off(off), d_data_rows(p.data_rows);
  ASSERT_TRUE(d_a.ptr && d_b0.ptr && d_b1.ptr && d_c.ptr && d_off.ptr && d_data_rows.ptr);
  const GroupedRows rows = grouped_rows(p, d_off.ptr, d_data_rows.ptr, first_group, max_ctas);
  const uint16_t* b0_slice = d_b0.ptr + first_group * k_split * n;
  const uint16_t* b1_slice = k1 > 0 ? d_b1.ptr + first_group * k1 * n : nullptr;
  std::vector<uint16_t> out;
  ASSERT_NO_FATAL_FAILURE(run_twice(
      [&] {
        pounce::kernels::grouped_gemm_transposed(rows, d_a.ptr, b0_slice, b1_slice, k_split, d_c.ptr, n, k,
                                                 nullptr);
      },
      d_c, out_count, out));
  EXPECT_EQ(count_unpoisoned_tail(out, off.back(), n), 0) << "rows beyond the valid range were written";
  EXPECT_EQ(count_unpoisoned_head(out, off[first_group], n), 0) << "rows before the slice were written";

  int failures = 0;
  for (int64_t r : rows_to_check(p)) {
    if (r < off[first_group]) continue;
    const int grp = group_of(off, r);
    // Both K ranges into one fp32 accumulator per column, ascending k.
    std::vector<RefValue> ref = row_times_matrix(&a[r * k], &b0[grp * k_split * n], k_split, n);
    if (k1 > 0) ref = row_times_matrix(&a[r * k + k_split], &b1[grp * k1 * n], k1, n, std::move(ref));
    for (int64_t c = 0; c < n; ++c) {
      const std::string err = compare("C", r, c, out[r * n + c], ref[c]);
      if (!err.empty() && failures++ < 5) ADD_FAILURE() << err << " (group " << grp << ")";
    }
  }
  EXPECT_EQ(failures, 0);
}

// grouped_weight_grad in its three output modes, each run twice: fp32 store, bf16 store, and fp32 accumulate
// into `prefill` ([num_groups, m, n]).
struct WeightGradRuns {
  std::vector<float> store32, accumulated;
  std::vector<uint16_t> store16;
};
// "" when every mode's result of `x` and `y` is bitwise the same.
std::string runs_difference(const WeightGradRuns& x, const WeightGradRuns& y) {
  return bitwise_difference("fp32 store", x.store32, y.store32) +
         bitwise_difference("bf16 store", x.store16, y.store16) +
         bitwise_difference("accumulate", x.accumulated, y.accumulated);
}
void run_weight_grad_modes(const GroupedRows& rows, const uint16_t* a, int64_t a_ld, int64_t m,
                           const uint16_t* b, int64_t b_ld, int64_t n, const std::vector<float>& prefill,
                           WeightGradRuns& runs,
                           pounce::kernels::TileSchedule tiles = pounce::kernels::TileSchedule::kPingPong) {
  using pounce::kernels::WeightGradMode;
  DeviceBuffer<uint16_t> d16(prefill.size());
  DeviceBuffer<float> d32(prefill.size());
  ASSERT_TRUE(d16.ptr && d32.ptr);
  auto launch = [&](void* d, WeightGradMode mode) {
    return [&, d, mode] {
      pounce::kernels::grouped_weight_grad(rows, a, a_ld, m, b, b_ld, n, d, mode, nullptr, tiles);
    };
  };
  ASSERT_NO_FATAL_FAILURE(
      run_twice(launch(d32.ptr, WeightGradMode::kStoreF32), d32, prefill.size(), runs.store32));
  ASSERT_NO_FATAL_FAILURE(
      run_twice(launch(d16.ptr, WeightGradMode::kStoreBf16), d16, prefill.size(), runs.store16));
  ASSERT_NO_FATAL_FAILURE(run_twice(launch(d32.ptr, WeightGradMode::kAccumulateF32), d32, prefill.size(),
                                    runs.accumulated, &prefill));
}

// D[g][i, j] = sum over the rows r of group g of A[r, i] B[r, j], in the three output modes. A is the second
// half of [rows, 2m] rows (a = base + m, a_ld = 2m, as d_u inside [d_g, d_u]); its first half, and every row
// of A and B past the last group, hold NaNs, so reading them shows. B rows are b_ld = n + 64 apart.
// fp32: within 1e-5 * sum |A B| of the fp64 sum; an empty group exactly zero. bf16: exactly the fp32 result
// rounded. Accumulate into random fp32 values: exactly prefill + the fp32 result (one fp32 addition), so an
// empty group leaves its prefill untouched.
// With `data_rows`, A rows past each group's data are zero and the launch names them (group_rows): the
// results must be bitwise those of a launch over every row. Every case also runs the cooperative tiles (what
// the fused backward computes): bitwise the same as the ping-pong tiles of the standalone launch.
void run_weight_grad(const std::vector<int32_t>& rows_per_group, int64_t max_rows, int64_t m, int64_t n,
                     int max_ctas = 0, const std::vector<int32_t>& data_rows = {}) {
  const Problem problem{rows_per_group, max_rows, n, m, 1, data_rows};
  const auto off = problem.offsets();
  const int num_groups = static_cast<int>(rows_per_group.size());
  const int64_t a_ld = 2 * m, b_ld = n + 64;
  auto a = nonzero_random_bf16(static_cast<size_t>(max_rows * a_ld), 81, 1.0f);
  auto b = nonzero_random_bf16(static_cast<size_t>(max_rows * b_ld), 82, 1.0f);
  for (int64_t r = 0; r < max_rows; ++r) {
    std::fill_n(a.begin() + r * a_ld, r < off.back() ? m : a_ld, kPoison);
    if (r >= off.back()) std::fill_n(b.begin() + r * b_ld, b_ld, kPoison);
  }
  for (size_t g = 0; g < data_rows.size(); ++g) {
    for (int64_t r = off[g] + data_rows[g]; r < off[g + 1]; ++r)
      std::fill_n(a.begin() + r * a_ld + m, m, uint16_t{0});
  }
  const size_t d_count = static_cast<size_t>(num_groups * m * n);
  std::vector<float> prefill(d_count);
  std::mt19937 gen(83);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (float& v : prefill) v = dist(gen);
  DeviceBuffer<uint16_t> d_a(a), d_b(b);
  DeviceBuffer<int32_t> d_off(off), d_data_rows(data_rows);
  ASSERT_TRUE(d_a.ptr && d_b.ptr && d_off.ptr && d_data_rows.ptr);
  WeightGradRuns runs;
  ASSERT_NO_FATAL_FAILURE(
      run_weight_grad_modes(grouped_rows(problem, d_off.ptr, d_data_rows.ptr, 0, max_ctas), d_a.ptr + m, a_ld,
                            m, d_b.ptr, b_ld, n, prefill, runs));
  {
    WeightGradRuns cooperative;
    ASSERT_NO_FATAL_FAILURE(run_weight_grad_modes(
        grouped_rows(problem, d_off.ptr, d_data_rows.ptr, 0, max_ctas), d_a.ptr + m, a_ld, m, d_b.ptr, b_ld,
        n, prefill, cooperative, pounce::kernels::TileSchedule::kCooperative));
    EXPECT_EQ(runs_difference(runs, cooperative), "") << "ping-pong and cooperative tiles summed differently";
  }
  if (!data_rows.empty()) {
    using pounce::kernels::TileSchedule;
    const TileSchedule schedules[] = {TileSchedule::kPingPong, TileSchedule::kCooperative};
    for (const TileSchedule schedule : schedules) {
      WeightGradRuns every_row;
      ASSERT_NO_FATAL_FAILURE(run_weight_grad_modes({max_rows, d_off.ptr, num_groups, max_ctas}, d_a.ptr + m,
                                                    a_ld, m, d_b.ptr, b_ld, n, prefill, every_row, schedule));
      EXPECT_EQ(runs_difference(runs, every_row), "")
          << schedule_name(schedule) << ": skipping the K blocks past the data changed a weight gradient";
    }
    // B rows of the K blocks wholly past the data set to NaN: the sums stay finite (bitwise the same) only if
    // those K blocks are skipped (zero A times NaN is NaN).
    auto b_nan = b;
    int64_t nan_rows = 0;
    for (size_t g = 0; g < data_rows.size(); ++g) {
      const int64_t first_skipped = off[g] + (data_rows[g] + 63) / 64 * 64;
      for (int64_t r = first_skipped; r < off[g + 1]; ++r, ++nan_rows)
        std::fill_n(b_nan.begin() + r * b_ld, n, kPoison);
    }
    ASSERT_GT(nan_rows, 0) << "the case has no K block past its data";
    d_b.upload(b_nan);
    for (const TileSchedule schedule : schedules) {
      WeightGradRuns skipped_nan;
      ASSERT_NO_FATAL_FAILURE(
          run_weight_grad_modes(grouped_rows(problem, d_off.ptr, d_data_rows.ptr, 0, max_ctas), d_a.ptr + m,
                                a_ld, m, d_b.ptr, b_ld, n, prefill, skipped_nan, schedule));
      EXPECT_EQ(runs_difference(runs, skipped_nan), "")
          << schedule_name(schedule) << ": a K block past the data was read";
    }
  }
  const std::vector<float>& store32 = runs.store32;
  const std::vector<float>& accumulated = runs.accumulated;
  const std::vector<uint16_t>& store16 = runs.store16;

  int failures = 0;
  auto fail = [&](const std::string& what, int g, int64_t i, int64_t j) {
    if (failures++ < 5) ADD_FAILURE() << what << " at D[" << g << "][" << i << ", " << j << "]";
  };
  std::vector<double> sum(m * n), abs_sum(m * n);  // one group's fp64 sums, ascending rows
  for (int g = 0; g < num_groups; ++g) {
    std::fill(sum.begin(), sum.end(), 0.0);
    std::fill(abs_sum.begin(), abs_sum.end(), 0.0);
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      for (int64_t i = 0; i < m; ++i) {
        const double a_ri = from_bf16(a[r * a_ld + m + i]);
        for (int64_t j = 0; j < n; ++j) {
          const double prod = a_ri * from_bf16(b[r * b_ld + j]);
          sum[i * n + j] += prod;
          abs_sum[i * n + j] += std::fabs(prod);
        }
      }
    }
    const bool empty = off[g] == off[g + 1];
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        const size_t at = static_cast<size_t>((g * m + i) * n + j);
        const float got = store32[at];
        if (empty ? got != 0.f : !(std::fabs(got - sum[i * n + j]) <= 1e-5 * abs_sum[i * n + j])) {
          fail("fp32 " + std::to_string(got) + " vs fp64 reference " + std::to_string(sum[i * n + j]) +
                   (empty ? " (empty group: must be 0)" : ""),
               g, i, j);
        }
        if (store16[at] != to_bf16(got))
          fail("bf16 " + std::to_string(from_bf16(store16[at])) + " is not the fp32 result rounded", g, i, j);
        const float want = prefill[at] + got;
        if (!same_bits(accumulated[at], want))
          fail("accumulated " + std::to_string(accumulated[at]) + " is not prefill + fp32 result " +
                   std::to_string(want),
               g, i, j);
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(GroupedGemm, EmptyGroupsEdgeTileAndPoisonedTail) {
  SKIP_UNLESS_GPUS(1);
  // n = 192: one 256-wide tile with its last 64 columns masked; first, middle and last groups empty.
  run_grouped_gemm(Problem{{0, 256, 0, 128, 384, 0}, 1024, 192, 320});
}

TEST(GroupedGemm, LastTileOfTwoChunks) {
  SKIP_UNLESS_GPUS(1);
  // n = 384: the second 256-wide tile holds 128 columns, two of its four 64-column store chunks.
  run_grouped_gemm(Problem{{128, 0, 256}, 512, 384, 192});
}

TEST(GroupedGemm, ManyGroupsMoreTilesThanSms) {
  SKIP_UNLESS_GPUS(1);
  std::vector<int32_t> sizes;
  for (int g = 0; g < 37; ++g) sizes.push_back(128 * ((g * 5) % 7));  // 0..768 rows, several empty
  const int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  run_grouped_gemm(Problem{sizes, total + 256, 1088, 256, 5});  // 1088 = 4.25 tiles of 256
}

TEST(GroupedGemm, SingleGroupDeepK) {
  SKIP_UNLESS_GPUS(1);
  run_grouped_gemm(Problem{{1152}, 1280, 512, 2048, 3});
}

TEST(GroupedGemm, AllGroupsEmptyTouchesNothing) {
  SKIP_UNLESS_GPUS(1);
  run_grouped_gemm(Problem{{0, 0, 0}, 256, 256, 128});
}

TEST(GroupedGemm, RejectsUnsupportedShapes) {
  SKIP_UNLESS_GPUS(1);
  const GroupedRows rows{128, reinterpret_cast<const int32_t*>(16), 1};
  EXPECT_THROW(pounce::kernels::grouped_gemm(rows, reinterpret_cast<void*>(16), reinterpret_cast<void*>(16),
                                             reinterpret_cast<void*>(16), 100, 128, nullptr),
               std::exception);
  EXPECT_THROW(pounce::kernels::grouped_gemm(rows, reinterpret_cast<void*>(16), reinterpret_cast<void*>(16),
                                             reinterpret_cast<void*>(16), 128, 96, nullptr),
               std::exception);
}

TEST(GroupedGateUp, SwiGLUClampEdgeTileEmptyGroup) {
  SKIP_UNLESS_GPUS(1);
  // n = 192 with 128-wide gate/up tiles: the second tile is half masked.
  run_gate_up(Problem{{128, 0, 256}, 512, 192, 256},
              ActivationParams{pounce::kernels::kActivationSwiGLU, 0.5f, 1.f});
}

TEST(GroupedGateUp, SwiGLUNoClamp) {
  SKIP_UNLESS_GPUS(1);
  run_gate_up(
      Problem{{256, 128}, 384, 768, 512, 2},
      ActivationParams{pounce::kernels::kActivationSwiGLU, std::numeric_limits<float>::infinity(), 1.f});
}

TEST(GroupedGateUp, GptOssClampN2880) {
  SKIP_UNLESS_GPUS(1);
  // gpt-oss-120b widths: n = k = 2880 (22.5 tiles of 128), sampled rows.
  run_gate_up(Problem{{128, 0, 128}, 384, 2880, 2880, 11},
              ActivationParams{pounce::kernels::kActivationGptOss, 0.75f, 1.702f});
}

TEST(GroupedActivationBackward, SwiGLUPartialTileEmptyGroup) {
  SKIP_UNLESS_GPUS(1);
  // n = 192: the 256-wide tile has its last 64 columns masked; k = 320: five K blocks; spare capacity.
  run_activation_backward(
      Problem{{128, 0, 384}, 640, 192, 320},
      ActivationParams{pounce::kernels::kActivationSwiGLU, std::numeric_limits<float>::infinity(), 1.f});
}

// A pipeline chunk: groups 1..3 of 4 (its first group empty), rows of group 0 untouched; 3 CTAs loop over
// the tiles.
TEST(GroupedActivationBackward, GptOssClampSliceOfGroupsCappedGrid) {
  SKIP_UNLESS_GPUS(1);
  run_activation_backward(Problem{{256, 0, 128, 256}, 768, 320, 256},
                          ActivationParams{pounce::kernels::kActivationGptOss, 1.0f, 1.702f}, 1, 3);
}

TEST(GroupedGemmTransposed, KSplitOverTwoTensorsPartialTile) {
  SKIP_UNLESS_GPUS(1);
  // d_x shape: n = H = 320 (256 + a 64-column tile), k = 2I = 384 split at I = 192.
  run_gemm_transposed(Problem{{256, 0, 128, 384}, 896, 320, 384}, 192);
}

TEST(GroupedGemmTransposed, OneTensorWhenKSplitIsKSliceOfGroupsCappedGrid) {
  SKIP_UNLESS_GPUS(1);
  run_gemm_transposed(Problem{{128, 256, 0, 128}, 640, 192, 256}, 256, 1, 2);
}

TEST(GroupedWeightGrad, ThreeModesEmptyGroupPartialTiles) {
  SKIP_UNLESS_GPUS(1);
  // m = 192 and n = 320: partial tiles in both output dimensions; groups of 128, 0, 384 and 256 rows.
  run_weight_grad({128, 0, 384, 256}, 1024, 192, 320);
}

// 4 groups x 2 m-blocks x 2 n-blocks on a grid capped at 5 CTAs: each CTA loops over several tiles.
TEST(GroupedWeightGrad, FiveCtasLoopOverSixteenTiles) {
  SKIP_UNLESS_GPUS(1);
  run_weight_grad({256, 0, 128, 128}, 640, 192, 320, 5);
}

// One CTA: its two warpgroups alternate over all 24 ping-pong tiles (6 per group: whole, half-height and
// 64-column edge tiles) with 1, 0, 6 and 13 K blocks holding data. Tiles of 13 K blocks lap the 6-stage ring
// inside one tile (a stage handed back before its wgmmas finished would be overwritten while read), and the
// uneven counts start tiles at different stages.
TEST(GroupedWeightGrad, OneCtaTakesTurnsOverUnevenTiles) {
  SKIP_UNLESS_GPUS(1);
  run_weight_grad({128, 0, 384, 896}, 1536, 192, 320, 1, {40, 0, 384, 830});
}

// Data rows (GroupedRows::group_rows): 40 of 128 rows and 320 of 384 leave a tile's upper 64 rows without
// data (its second consumer warpgroup skips), 200 of 256 does not; n = 1088 ends in a 64-column tile; 3 CTAs
// loop over the 30 tiles, so a warpgroup that skipped runs into its next tile ahead of the other.
TEST(GroupedGemm, PaddingRowsSkippedNarrowEdgeTile) {
  SKIP_UNLESS_GPUS(1);
  run_grouped_gemm(Problem{{256, 128, 0, 384}, 896, 1088, 256, 1, {200, 40, 0, 320}}, 3);
}

TEST(GroupedGateUp, GptOssDataRowsComputedWhole) {
  SKIP_UNLESS_GPUS(1);
  // Gate/up computes its padding rows (mma_columns): zero rows of A still give zeros there.
  run_gate_up(Problem{{128, 0, 256}, 512, 192, 256, 1, {60, 0, 250}},
              ActivationParams{pounce::kernels::kActivationGptOss, 1.0f, 1.702f});
}

TEST(GroupedActivationBackward, DataRowsComputedWholeSliceOfGroups) {
  SKIP_UNLESS_GPUS(1);
  run_activation_backward(Problem{{256, 128, 128, 256}, 768, 320, 256, 1, {256, 10, 64, 129}},
                          ActivationParams{pounce::kernels::kActivationGptOss, 1.0f, 1.702f}, 1, 3);
}

TEST(GroupedGemmTransposed, PaddingRowsSkippedSliceOfGroups) {
  SKIP_UNLESS_GPUS(1);
  run_gemm_transposed(Problem{{128, 256, 0, 128}, 640, 320, 384, 1, {1, 190, 0, 65}}, 192, 1, 2);
}

// K blocks past the data skipped: 130 of 256 rows (3 of 4 K blocks), 60 of 128, 300 of 384, an empty group;
// the sums must stay bitwise the same with NaN in the skipped K blocks of B.
TEST(GroupedWeightGrad, PaddingRowsSkippedBitwise) {
  SKIP_UNLESS_GPUS(1);
  run_weight_grad({256, 128, 0, 384}, 1024, 192, 320, 5, {130, 60, 0, 300});  // 5 CTAs, 16 tiles
}

TEST(GroupedWeightGrad, ZeroCapacityStillOwesZeros) {
  SKIP_UNLESS_GPUS(1);
  const int64_t m = 64, n = 128, count = 2 * m * n;
  DeviceBuffer<uint16_t> d_rows(64);
  DeviceBuffer<int32_t> d_off(std::vector<int32_t>(3, 0));
  ASSERT_TRUE(d_rows.ptr && d_off.ptr);
  const std::vector<float> prefill(count, 0.5f);
  WeightGradRuns runs;
  ASSERT_NO_FATAL_FAILURE(
      run_weight_grad_modes({0, d_off.ptr, 2}, d_rows.ptr, m, m, d_rows.ptr, n, n, prefill, runs));
  EXPECT_TRUE(runs.store32 == std::vector<float>(count, 0.f)) << "fp32 store must write zeros";
  EXPECT_TRUE(runs.store16 == std::vector<uint16_t>(count, 0)) << "bf16 store must write zeros";
  EXPECT_TRUE(runs.accumulated == prefill) << "accumulate must leave main_grad untouched";
}

}  // namespace
