// FP8 grouped GEMMs (kernels/gemm/fp8_gemm_kernel.cuh) against fp64 sums of the same quantized operands.
//
// Operands are drawn as fp32 with a magnitude that varies by row and column (2^-6..2^6), so block scales
// differ from block to block, and quantized by the CPU quantizer (reference::quantize_fp8_blocks) into the
// GPU layouts of src/gpu/fp8_gemm.h. Reference: c = sum over K blocks ascending of
// (sum_k qa * qb in fp64) * scale_a * scale_b, then bf16 (the weight gradients: fp32, fp32 added, bf16).
// Tolerance: 2 bf16 ulps (none for fp32 outputs) of |c| plus 2^-11 of the sum of |terms| — wgmma's own sum
// inside a 128-deep K block is neither fp64 nor the reference's ascending fp32; its error is what the
// per-block promotion bounds. Outputs are poisoned first (rows outside the groups must stay poisoned), every
// case runs twice and must be bitwise equal. Shapes cover partial K blocks (k % 128 = 64), edge column tiles
// (n % 128 = 64), empty groups, weight-gradient edges (m % 128 = 64), a capped grid, and the K range split
// over two operand pairs (d_x).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gpu_fixtures.h"
#include "kernels/gemm/activation.cuh"
#include "reference/bf16.h"
#include "reference/reference.h"
#include "src/gpu/fp8_gemm.h"
#include "src/gpu/grouped_gemm.h"

namespace {

using pounce::gpu_test::bf16_ulp;
using pounce::gpu_test::bitwise_difference;
using pounce::gpu_test::count_unpoisoned;
using pounce::gpu_test::DeviceBuffer;
using pounce::gpu_test::download;
using pounce::kernels::Fp8Columns;
using pounce::kernels::Fp8Matrices;
using pounce::kernels::Fp8Rows;
using pounce::kernels::GroupedRows;
using pounce::kernels::WeightGradMode;
constexpr auto from_bf16 = pounce::reference::bf16_bits_to_float;
constexpr auto to_bf16 = pounce::reference::float_to_bf16_bits;
constexpr int64_t kBlock = 128;

int64_t blocks_of(int64_t extent) {
  return (extent + kBlock - 1) / kBlock;
}

// [rows, cols] values whose magnitude changes with the row and the column block, never zero.
std::vector<float> random_values(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-6, 6);
  std::vector<float> row_scale(rows), col_scale(blocks_of(cols));
  for (auto& s : row_scale) s = std::ldexp(1.0f, exponent(gen));
  for (auto& s : col_scale) s = std::ldexp(1.0f, exponent(gen));
  std::vector<float> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float v = dist(gen);
      if (std::fabs(v) < 1e-3f) v = 1e-3f;
      out[r * cols + c] = v * row_scale[r] * col_scale[c / kBlock];
    }
  }
  return out;
}

// A [rows, cols] tensor quantized in 1 x 128 blocks along its rows, its scales stored [blocks][scale_ld]
// (the GPU's layout: a row's scale per K block, K-block-major). decoded = e4m3 value, not scaled.
struct RowQuantized {
  int64_t rows, cols, scale_ld;
  std::vector<uint8_t> bits;
  std::vector<float> scale;     // [blocks_of(cols)][scale_ld]
  std::vector<double> decoded;  // [rows, cols]
  double scale_at(int64_t r, int64_t kb) const { return scale[kb * scale_ld + r]; }
};
RowQuantized quantize_rows(const std::vector<float>& v, int64_t rows, int64_t cols, int64_t scale_ld) {
  RowQuantized q{
      rows, cols, scale_ld, std::vector<uint8_t>(rows * cols), {}, std::vector<double>(rows * cols)};
  std::vector<float> row_major_scale(rows * blocks_of(cols));
  pounce::reference::quantize_fp8_blocks(v.data(), rows, cols, 1, kBlock, q.bits.data(),
                                         row_major_scale.data());
  q.scale.assign(blocks_of(cols) * scale_ld, 1.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t kb = 0; kb < blocks_of(cols); ++kb)
      q.scale[kb * scale_ld + r] = row_major_scale[r * blocks_of(cols) + kb];
  for (size_t i = 0; i < q.bits.size(); ++i) q.decoded[i] = pounce::reference::e4m3_to_float(q.bits[i]);
  return q;
}

// num_groups matrices [n, k] quantized in 128 x 128 blocks, scales [group][n blocks][k blocks].
struct MatrixQuantized {
  int64_t n, k;
  std::vector<uint8_t> bits;
  std::vector<float> scale;
  std::vector<double> decoded;
  double scale_at(int g, int64_t row, int64_t kb) const {
    return scale[(static_cast<int64_t>(g) * blocks_of(n) + row / kBlock) * blocks_of(k) + kb];
  }
};
MatrixQuantized quantize_matrices(int num_groups, int64_t n, int64_t k, uint32_t seed) {
  MatrixQuantized q{n, k, std::vector<uint8_t>(num_groups * n * k),
                    std::vector<float>(num_groups * blocks_of(n) * blocks_of(k)),
                    std::vector<double>(num_groups * n * k)};
  for (int g = 0; g < num_groups; ++g) {
    const auto v = random_values(n, k, seed + g);
    pounce::reference::quantize_fp8_blocks(v.data(), n, k, kBlock, kBlock, q.bits.data() + g * n * k,
                                           q.scale.data() + g * blocks_of(n) * blocks_of(k));
  }
  for (size_t i = 0; i < q.bits.size(); ++i) q.decoded[i] = pounce::reference::e4m3_to_float(q.bits[i]);
  return q;
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& rows_per_group) {
  std::vector<int32_t> off(rows_per_group.size() + 1, 0);
  for (size_t g = 0; g < rows_per_group.size(); ++g) off[g + 1] = off[g] + rows_per_group[g];
  return off;
}

struct Expected {
  double value;
  double abs_sum;
};

// One (A, B) pair's contribution to c[r, col] of group g.
void add_pair(const RowQuantized& a, const MatrixQuantized& b, int g, int64_t r, int64_t col, Expected& e) {
  for (int64_t kb = 0; kb < blocks_of(a.cols); ++kb) {
    double partial = 0, magnitude = 0;
    for (int64_t k = kb * kBlock; k < std::min(a.cols, (kb + 1) * kBlock); ++k) {
      const double p = a.decoded[r * a.cols + k] * b.decoded[(g * b.n + col) * b.k + k];
      partial += p;
      magnitude += std::fabs(p);
    }
    const double s = a.scale_at(r, kb) * b.scale_at(g, col, kb);
    e.value += partial * s;
    e.abs_sum += magnitude * s;
  }
}

struct RowsCase {
  std::vector<int32_t> rows_per_group;
  int64_t max_rows, n, k0, k1 = 0;  // k1 > 0: a second pair (fp8_grouped_gemm_pair)
  int max_ctas = 0;
};

void run_rows_case(const RowsCase& p) {
  const auto off = offsets_of(p.rows_per_group);
  const int num_groups = static_cast<int>(p.rows_per_group.size());
  const int pairs = p.k1 > 0 ? 2 : 1;
  const int64_t k[2] = {p.k0, p.k1};
  std::vector<RowQuantized> a;
  std::vector<MatrixQuantized> b;
  for (int i = 0; i < pairs; ++i) {
    a.push_back(quantize_rows(random_values(p.max_rows, k[i], 100 + i), p.max_rows, k[i], p.max_rows + 4));
    b.push_back(quantize_matrices(num_groups, p.n, k[i], 200 + 10 * i));
  }
  std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> bits;
  std::vector<std::unique_ptr<DeviceBuffer<float>>> scales;
  Fp8Rows a_dev[2];
  Fp8Matrices b_dev[2];
  for (int i = 0; i < pairs; ++i) {
    bits.push_back(std::make_unique<DeviceBuffer<uint8_t>>(a[i].bits));
    scales.push_back(std::make_unique<DeviceBuffer<float>>(a[i].scale));
    a_dev[i] = {bits.back()->ptr, scales.back()->ptr, a[i].scale_ld};
    bits.push_back(std::make_unique<DeviceBuffer<uint8_t>>(b[i].bits));
    scales.push_back(std::make_unique<DeviceBuffer<float>>(b[i].scale));
    b_dev[i] = {bits.back()->ptr, scales.back()->ptr};
  }
  DeviceBuffer<int32_t> d_off(off);
  const size_t out_count = static_cast<size_t>(p.max_rows * p.n);
  DeviceBuffer<uint16_t> d_c(out_count);
  const GroupedRows rows{p.max_rows, d_off.ptr, num_groups, p.max_ctas};

  std::vector<uint16_t> first, second(out_count);
  for (int run = 0; run < 2; ++run) {
    CUDA_OK(cudaMemset(d_c.ptr, 0xFF, out_count * 2));
    if (pairs == 1) {
      pounce::kernels::fp8_grouped_gemm(rows, a_dev[0], b_dev[0], d_c.ptr, p.n, p.k0, nullptr);
    } else {
      pounce::kernels::fp8_grouped_gemm_pair(rows, a_dev[0], b_dev[0], p.k0, a_dev[1], b_dev[1], p.k1,
                                             d_c.ptr, p.n, nullptr);
    }
    ASSERT_EQ(pounce::kernels::grouped_gemm_error_code(true), 0);
    CUDA_OK(cudaMemcpy(second.data(), d_c.ptr, out_count * 2, cudaMemcpyDeviceToHost));
    if (run == 0) first = second;
  }
  ASSERT_EQ(bitwise_difference("C", first, second), "") << "two runs differ (nondeterminism)";
  EXPECT_EQ(count_unpoisoned(first.data() + off.back() * p.n, first.data() + first.size()), 0)
      << "rows beyond the groups were written";
  int failures = 0;
  double worst = 0;
  for (int g = 0; g < num_groups; ++g) {
    for (int64_t r = off[g]; r < off[g + 1]; ++r) {
      for (int64_t col = 0; col < p.n; ++col) {
        Expected e{0, 0};
        for (int i = 0; i < pairs; ++i) add_pair(a[i], b[i], g, r, col, e);
        const float want = from_bf16(to_bf16(static_cast<float>(e.value)));
        const float got = from_bf16(first[r * p.n + col]);
        const double tol = 2.0 * bf16_ulp(want) + std::ldexp(e.abs_sum, -11);
        const double err = std::fabs(static_cast<double>(got) - want);
        worst = std::max(worst, err / (tol + 1e-30));
        if (!(err <= tol) && ++failures <= 5)
          ADD_FAILURE() << "C[" << r << ", " << col << "] = " << got << ", expected " << want
                        << " (tolerance " << tol << ")";
      }
    }
  }
  EXPECT_EQ(failures, 0);
  std::printf("  worst error / tolerance: %.3f\n", worst);
}

TEST(Fp8GroupedGemm, RowsAgainstFp64OfTheQuantizedOperands) {
  SKIP_UNLESS_GPUS(1);
  run_rows_case({{128, 0, 384, 256}, 1024, 320, 448});  // partial K block, edge column tile, empty group
}

TEST(Fp8GroupedGemm, RowsOnACappedGridWithManyGroups) {
  SKIP_UNLESS_GPUS(1);
  run_rows_case({{256, 128, 0, 128, 384, 128, 0, 256}, 1536, 256, 1024, 0, 3});
}

TEST(Fp8GroupedGemm, PairSumsBothKRanges) {
  SKIP_UNLESS_GPUS(1);
  run_rows_case({{256, 0, 128}, 512, 192, 320, 192});  // d_x: K split over gate and up, both partial
}

// ---- gate/up with the activation and a's quantization ----

// g and u against fp64 sums of the quantized operands; a against the host activation of the GPU's own g and
// u (the device sigmoid is approximate: activation.cuh); a_q and its scales bitwise the CPU quantizer's of
// the GPU's a (the quantizer is exact, so the epilogue must be too).
void run_gate_up_case(const std::vector<int32_t>& rows_per_group, int64_t max_rows, int64_t n, int64_t k,
                      const pounce::kernels::ActivationParams& activation) {
  const auto off = offsets_of(rows_per_group);
  const int num_groups = static_cast<int>(rows_per_group.size());
  const RowQuantized x = quantize_rows(random_values(max_rows, k, 500), max_rows, k, max_rows);
  const MatrixQuantized w_gate = quantize_matrices(num_groups, n, k, 600);
  const MatrixQuantized w_up = quantize_matrices(num_groups, n, k, 700);
  DeviceBuffer<uint8_t> x_bits(x.bits), wg_bits(w_gate.bits), wu_bits(w_up.bits);
  DeviceBuffer<float> x_scale(x.scale), wg_scale(w_gate.scale), wu_scale(w_up.scale);
  DeviceBuffer<int32_t> d_off(off);
  const size_t count = static_cast<size_t>(max_rows * n);
  const int64_t scale_ld = max_rows + 8;
  const size_t scale_count = static_cast<size_t>(blocks_of(n) * scale_ld);
  DeviceBuffer<uint16_t> g(count), u(count), a(count);
  DeviceBuffer<uint8_t> a_q(count);
  DeviceBuffer<float> a_scale(scale_count);
  const GroupedRows rows{max_rows, d_off.ptr, num_groups, 0};
  struct Outputs {
    std::vector<uint16_t> g, u, a;
    std::vector<uint8_t> a_q;
    std::vector<float> a_scale;
  } out[2];
  for (int run = 0; run < 2; ++run) {
    for (void* p : {static_cast<void*>(g.ptr), static_cast<void*>(u.ptr), static_cast<void*>(a.ptr)})
      CUDA_OK(cudaMemset(p, 0xFF, count * 2));
    CUDA_OK(cudaMemset(a_q.ptr, 0xFF, count));
    CUDA_OK(cudaMemset(a_scale.ptr, 0xFF, scale_count * 4));
    pounce::kernels::fp8_grouped_gate_up(rows, Fp8Rows{x_bits.ptr, x_scale.ptr, x.scale_ld},
                                         Fp8Matrices{wg_bits.ptr, wg_scale.ptr},
                                         Fp8Matrices{wu_bits.ptr, wu_scale.ptr}, g.ptr, u.ptr, a.ptr,
                                         {a_q.ptr, a_scale.ptr, scale_ld}, n, k, activation, nullptr);
    ASSERT_EQ(pounce::kernels::grouped_gemm_error_code(true), 0);
    out[run] = {download<uint16_t>(g.ptr, count), download<uint16_t>(u.ptr, count),
                download<uint16_t>(a.ptr, count), download<uint8_t>(a_q.ptr, count),
                download<float>(a_scale.ptr, scale_count)};
  }
  ASSERT_EQ(bitwise_difference("g", out[0].g, out[1].g), "");
  ASSERT_EQ(bitwise_difference("a_q", out[0].a_q, out[1].a_q), "");
  ASSERT_EQ(bitwise_difference("a_scale", out[0].a_scale, out[1].a_scale), "");
  const Outputs& o = out[0];
  const int64_t valid = off.back();
  EXPECT_EQ(count_unpoisoned(o.a_q.data() + valid * n, o.a_q.data() + o.a_q.size()), 0);
  int failures = 0;
  for (int grp = 0; grp < num_groups; ++grp) {
    for (int64_t r = off[grp]; r < off[grp + 1]; ++r) {
      for (int64_t col = 0; col < n; ++col) {
        for (int which = 0; which < 2; ++which) {
          Expected e{0, 0};
          add_pair(x, which == 0 ? w_gate : w_up, grp, r, col, e);
          const float want = from_bf16(to_bf16(static_cast<float>(e.value)));
          const float got = from_bf16((which == 0 ? o.g : o.u)[r * n + col]);
          const double tol = 2.0 * bf16_ulp(want) + std::ldexp(e.abs_sum, -11);
          if (!(std::fabs(got - want) <= tol) && ++failures <= 5)
            ADD_FAILURE() << (which == 0 ? "g[" : "u[") << r << ", " << col << "] = " << got << ", expected "
                          << want;
        }
        const float act = pounce::kernels::gemm::apply_activation(from_bf16(o.g[r * n + col]),
                                                                  from_bf16(o.u[r * n + col]), activation);
        const float got_a = from_bf16(o.a[r * n + col]);
        if (!(std::fabs(got_a - act) <= 2.0f * bf16_ulp(act) + 1e-30f) && ++failures <= 5)
          ADD_FAILURE() << "a[" << r << ", " << col << "] = " << got_a << ", activation of the GPU's g, u "
                        << act;
      }
    }
  }
  // a_q: the CPU quantizer of the GPU's a over the valid rows.
  std::vector<float> a_values(valid * n);
  for (int64_t i = 0; i < valid * n; ++i) a_values[i] = from_bf16(o.a[i]);
  const RowQuantized want = quantize_rows(a_values, valid, n, scale_ld);
  for (int64_t i = 0; i < valid * n; ++i) {
    if (want.bits[i] != o.a_q[i] && ++failures <= 5)
      ADD_FAILURE() << "a_q[" << i / n << ", " << i % n << "] = " << int(o.a_q[i]) << ", CPU quantizer "
                    << int(want.bits[i]);
  }
  for (int64_t b = 0; b < blocks_of(n); ++b)
    for (int64_t r = 0; r < valid; ++r)
      if (want.scale[b * scale_ld + r] != o.a_scale[b * scale_ld + r] && ++failures <= 5)
        ADD_FAILURE() << "a_scale[" << b << "][" << r << "] = " << o.a_scale[b * scale_ld + r] << ", CPU "
                      << want.scale[b * scale_ld + r];
  EXPECT_EQ(failures, 0);
}

TEST(Fp8GroupedGateUp, SwiGluWithAPartialScaleBlock) {
  SKIP_UNLESS_GPUS(1);
  // n = 320: two whole 128-column blocks and one of 64 (its second pass skipped); k partial too.
  run_gate_up_case({256, 0, 128}, 512, 320, 448, {pounce::kernels::kActivationSwiGLU});
}

TEST(Fp8GroupedGateUp, GptOssWithClamp) {
  SKIP_UNLESS_GPUS(1);
  run_gate_up_case({128, 384}, 640, 256, 256, {pounce::kernels::kActivationGptOss, 2.0f, 1.702f});
}

// ---- weight gradients ----

// [cols, ld] token-axis copy of a [rows, cols] row tensor: column c's rows contiguous, quantized per
// 128-row block, scales [row blocks][scale_ld].
struct ColumnQuantized {
  int64_t cols, ld, scale_ld;
  std::vector<uint8_t> bits;    // [cols, ld]
  std::vector<float> scale;     // [ld / 128][scale_ld]
  std::vector<double> decoded;  // [cols, ld]
};
ColumnQuantized quantize_columns(int64_t rows, int64_t cols, const std::vector<int32_t>& off, uint32_t seed) {
  // Values [cols, rows]: each column's rows are a row of the transposed tensor, quantized 1 x 128.
  auto v = random_values(cols, rows, seed);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = off.back(); r < rows; ++r) v[c * rows + r] = 0.0f;  // rows past the groups: unused
  const RowQuantized q = quantize_rows(v, cols, rows, cols + 4);
  return {cols, rows, cols + 4, q.bits, q.scale, q.decoded};
}

void run_weight_grad_case(const std::vector<int32_t>& rows_per_group, int64_t max_rows, int64_t m, int64_t n,
                          WeightGradMode mode) {
  const auto off = offsets_of(rows_per_group);
  const int num_groups = static_cast<int>(rows_per_group.size());
  const ColumnQuantized a = quantize_columns(max_rows, m, off, 300);
  const ColumnQuantized b = quantize_columns(max_rows, n, off, 400);
  DeviceBuffer<uint8_t> a_bits(a.bits), b_bits(b.bits);
  DeviceBuffer<float> a_scale(a.scale), b_scale(b.scale);
  DeviceBuffer<int32_t> d_off(off);
  const size_t out_count = static_cast<size_t>(num_groups * m * n);
  const bool bf16 = mode == WeightGradMode::kStoreBf16;
  const bool accumulate = mode == WeightGradMode::kAccumulateF32;
  DeviceBuffer<float> d_out(out_count);
  std::vector<float> prefill(out_count);
  {
    std::mt19937 gen(7);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (auto& v : prefill) v = dist(gen);
  }
  const GroupedRows rows{max_rows, d_off.ptr, num_groups, 0};
  const Fp8Columns a_dev{a_bits.ptr, a.ld, a_scale.ptr, a.scale_ld};
  const Fp8Columns b_dev{b_bits.ptr, b.ld, b_scale.ptr, b.scale_ld};
  const size_t bytes = out_count * (bf16 ? 2 : 4);
  std::vector<uint8_t> first(bytes), second(bytes);
  for (int run = 0; run < 2; ++run) {
    if (accumulate) {
      d_out.upload(prefill);
    } else {
      CUDA_OK(cudaMemset(d_out.ptr, 0xFF, bytes));
    }
    pounce::kernels::fp8_grouped_weight_grad(rows, a_dev, m, b_dev, n, d_out.ptr, mode, nullptr);
    ASSERT_EQ(pounce::kernels::grouped_gemm_error_code(true), 0);
    CUDA_OK(cudaMemcpy(second.data(), d_out.ptr, bytes, cudaMemcpyDeviceToHost));
    if (run == 0) first = second;
  }
  ASSERT_EQ(bitwise_difference("D", first, second), "") << "two runs differ (nondeterminism)";
  int failures = 0;
  for (int g = 0; g < num_groups; ++g) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double value = 0, abs_sum = 0;
        for (int64_t kb = off[g] / kBlock; kb < off[g + 1] / kBlock; ++kb) {
          double partial = 0, magnitude = 0;
          for (int64_t r = kb * kBlock; r < (kb + 1) * kBlock; ++r) {
            const double p = a.decoded[i * a.ld + r] * b.decoded[j * b.ld + r];
            partial += p;
            magnitude += std::fabs(p);
          }
          const double s = static_cast<double>(a.scale[kb * a.scale_ld + i]) * b.scale[kb * b.scale_ld + j];
          value += partial * s;
          abs_sum += magnitude * s;
        }
        const size_t at = (static_cast<size_t>(g) * m + i) * n + j;
        double want = value, got = 0, tol = std::ldexp(abs_sum, -11);
        if (bf16) {
          want = from_bf16(to_bf16(static_cast<float>(value)));
          got = from_bf16(reinterpret_cast<const uint16_t*>(first.data())[at]);
          tol += 2.0 * bf16_ulp(static_cast<float>(want));
        } else {
          got = reinterpret_cast<const float*>(first.data())[at];
          if (accumulate) want += prefill[at], tol += std::ldexp(std::fabs(want), -23);
        }
        if (rows_per_group[g] == 0 && !accumulate && got != 0.0) {
          if (++failures <= 5) ADD_FAILURE() << "D[" << g << "] of an empty group is " << got << ", not 0";
          continue;
        }
        if (!(std::fabs(got - want) <= tol) && ++failures <= 5)
          ADD_FAILURE() << "D[" << g << "][" << i << ", " << j << "] = " << got << ", expected " << want
                        << " (tolerance " << tol << ")";
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(Fp8GroupedWeightGrad, StoreF32) {
  SKIP_UNLESS_GPUS(1);
  run_weight_grad_case({256, 0, 128, 384}, 1024, 192, 320, WeightGradMode::kStoreF32);
}

TEST(Fp8GroupedWeightGrad, AccumulateF32) {
  SKIP_UNLESS_GPUS(1);
  run_weight_grad_case({128, 256, 0}, 512, 256, 192, WeightGradMode::kAccumulateF32);
}

TEST(Fp8GroupedWeightGrad, StoreBf16) {
  SKIP_UNLESS_GPUS(1);
  run_weight_grad_case({384, 128}, 640, 320, 128, WeightGradMode::kStoreBf16);
}

}  // namespace
