// FP8 quantization on the GPU (kernels/quant/, src/gpu/fp8_quantize.cu) against the CPU quantizer
// (reference/fp8.cpp), bitwise:
//   - the e4m3 conversion (kernels/common/ptx.cuh cvt_e4m3x2) on every finite bf16 value and on random fp32
//     values of every binade, ties included; decoding every code back;
//   - block_scale on every positive bf16 amax, on 448 * 2^e and its neighbours, subnormals and extremes;
//   - quantize_lane_group over 1x128 row blocks, held by groups of 4 lanes in the wgmma accumulator's column
//     order, and by 8, 16 and 32 lanes in order; rows with a partial last block, an all-zero block;
//   - quantize_columns_128x1 over 128-row tiles staged in shared memory (bf16), and from dequantized e4m3 x_q
//     rows (the x_t path), with a partial last row block whose padding rows must come out exactly zero;
//   - pounce::quantize_weights_fp8 on CUDA tensors (every expert, both orientations, N and K not multiples of
//     128, an all-zero block): outputs poisoned first, run twice, both runs bitwise equal to the CPU path.
// Each test skips with a message where no CUDA GPU is visible.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant/fp8_quant.cuh"
#include "pounce/pounce.h"
#include "reference/bf16.h"
#include "reference/reference.h"
#include "tests/gpu/gpu_fixtures.h"

namespace {

namespace quant = pounce::kernels::quant;
using pounce::reference::bf16_bits_to_float;
using pounce::reference::e4m3_to_float;
using pounce::reference::float_to_e4m3;
using pounce::reference::round_bf16;

// ---- harness -------------------------------------------------------------------------------------------

// A device buffer of `count` T, filled from `host` or with 0xFF bytes (poison: NaN for floats).
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  explicit DeviceBuffer(size_t n) : count(n) {
    if (cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) ptr = nullptr;
    if (ptr != nullptr) cudaMemset(ptr, 0xFF, std::max<size_t>(n, 1) * sizeof(T));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) {
    if (ptr != nullptr && !host.empty())
      cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  std::vector<T> download() const {
    std::vector<T> host(count);
    if (count > 0) cudaMemcpy(host.data(), ptr, count * sizeof(T), cudaMemcpyDeviceToHost);
    return host;
  }
};

// Bitwise equality of float tensors (scales) and byte tensors, naming the first difference.
void expect_bytes_equal(const std::vector<uint8_t>& got, const std::vector<uint8_t>& want,
                        const std::string& name) {
  ASSERT_EQ(got.size(), want.size()) << name;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << name << "[" << i << "]: got 0x" << std::hex << int{got[i]} << ", want 0x"
                               << int{want[i]};
  }
}
void expect_floats_equal(const std::vector<float>& got, const std::vector<float>& want,
                         const std::string& name) {
  ASSERT_EQ(got.size(), want.size()) << name;
  for (size_t i = 0; i < got.size(); ++i) {
    uint32_t a, b;
    std::memcpy(&a, &got[i], 4);
    std::memcpy(&b, &want[i], 4);
    ASSERT_EQ(a, b) << name << "[" << i << "]: got " << got[i] << ", want " << want[i];
  }
}

// Random bf16 values with magnitudes spread over 2^lo_exp .. 2^hi_exp (per value).
float random_bf16(std::mt19937& rng, int lo_exp, int hi_exp) {
  std::uniform_real_distribution<float> mantissa(-2.0f, 2.0f);
  std::uniform_int_distribution<int> exponent(lo_exp, hi_exp);
  return round_bf16(std::ldexp(mantissa(rng), exponent(rng)));
}

// ---- test kernels --------------------------------------------------------------------------------------

__global__ void convert_kernel(const float* in, int64_t num_pairs, uint16_t* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < num_pairs;
       i += gridDim.x * int64_t{blockDim.x})
    out[i] = pounce::kernels::ptx::cvt_e4m3x2(in[2 * i], in[2 * i + 1]);
}

__global__ void decode_kernel(float* out) {  // all 65536 pairs of codes
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 65536)
    pounce::kernels::ptx::cvt_e4m3x2_to_f32(static_cast<uint16_t>(i), out[2 * i], out[2 * i + 1]);
}

__global__ void scale_kernel(const float* amax, int n, float* scale, const float* values, float* scaled) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float s = quant::block_scale(amax[i]);
  scale[i] = s;
  scaled[i] = __fmul_rn(values[i], quant::inverse_scale(s));  // values[i] / s
}

// Column of value i of a lane in its group: kLanes = 4 follows the wgmma m64nN accumulator (lane q of a
// quad holds columns 8j + 2q and 8j + 2q + 1 of its row); other groups hold consecutive columns.
template <int kLanes, int kValues>
__device__ int lane_value_column(int lane_in_group, int i) {
  if constexpr (kLanes == 4) {
    return 8 * (i / 2) + 2 * lane_in_group + (i % 2);
  } else {
    return lane_in_group * kValues + i;
  }
}

// in [rows, cols] -> bits [rows, cols], scale [rows, ceil(cols / 128)]; one lane group per (row, block).
template <int kLanes>
__global__ void rows_kernel(const float* in, int rows, int cols, uint8_t* bits, float* scale) {
  constexpr int kValues = quant::kBlock / kLanes;
  const int blocks_per_row = (cols + quant::kBlock - 1) / quant::kBlock;
  const int lane = static_cast<int>(threadIdx.x % 32), lane_in_group = lane % kLanes;
  const int group = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / kLanes);
  const bool active = group < rows * blocks_per_row;  // every lane of the warp calls quantize_lane_group
  const int row = active ? group / blocks_per_row : 0,
            col0 = (active ? group % blocks_per_row : 0) * quant::kBlock;
  float values[kValues];
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    const int col = col0 + lane_value_column<kLanes, kValues>(lane_in_group, i);
    values[i] = active && col < cols ? in[static_cast<int64_t>(row) * cols + col] : 0.0f;
  }
  uint32_t packed[kValues / 4];
  const float s = quant::quantize_lane_group<kLanes, kValues>(values, packed);
  if (!active) return;
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    const int col = col0 + lane_value_column<kLanes, kValues>(lane_in_group, i);
    if (col < cols)
      bits[static_cast<int64_t>(row) * cols + col] = static_cast<uint8_t>(packed[i / 4] >> (8 * (i % 4)));
  }
  if (lane_in_group == 0) scale[row * blocks_per_row + col0 / quant::kBlock] = s;
}

constexpr int kTileCols = 64;
constexpr int kColumnThreads = 128;

// bf16 in [rows, cols] -> out_t [cols, rows_padded] (each column's rows contiguous), scale [row_blocks,
// cols]: CTA (row block, column tile) stages its 128 x 64 tile in shared memory, then quantizes its columns.
__global__ void columns_kernel(const uint16_t* in, int rows, int cols, int rows_padded, uint8_t* out_t,
                               float* scale) {
  __shared__ uint16_t tile[quant::kBlock][kTileCols];
  const int row0 = static_cast<int>(blockIdx.x) * quant::kBlock,
            col0 = static_cast<int>(blockIdx.y) * kTileCols;
  const int num_rows = min(quant::kBlock, rows - row0), num_cols = min(kTileCols, cols - col0);
  for (int i = threadIdx.x; i < quant::kBlock * kTileCols; i += blockDim.x) {
    const int r = i / kTileCols, c = i % kTileCols;
    tile[r][c] = r < num_rows && c < num_cols ? in[static_cast<int64_t>(row0 + r) * cols + col0 + c] : 0;
  }
  __syncthreads();
  auto load = [&](int r, int c) { return __uint_as_float(static_cast<uint32_t>(tile[r][c]) << 16); };
  quant::quantize_columns_128x1<kColumnThreads>(load, num_rows, num_cols, static_cast<int>(threadIdx.x),
                                                out_t + static_cast<int64_t>(col0) * rows_padded + row0,
                                                rows_padded,
                                                scale + static_cast<int64_t>(blockIdx.x) * cols + col0, 1);
}

// The x_t path: x_q [rows, cols] e4m3 with 1x128 scales [rows, ceil(cols / 128)] read straight from global
// memory, dequantized, quantized in 128x1 blocks; one CTA per row block.
__global__ void columns_from_e4m3_kernel(const uint8_t* x_q, const float* x_scale, int rows, int cols,
                                         int rows_padded, uint8_t* out_t, float* scale) {
  const int row0 = static_cast<int>(blockIdx.x) * quant::kBlock, num_rows = min(quant::kBlock, rows - row0);
  const int scale_cols = (cols + quant::kBlock - 1) / quant::kBlock;
  auto load = [&](int r, int c) {
    const int64_t index = static_cast<int64_t>(row0 + r) * cols + c;
    float lo, hi;
    pounce::kernels::ptx::cvt_e4m3x2_to_f32(x_q[index], lo, hi);
    return __fmul_rn(lo, x_scale[(row0 + r) * scale_cols + c / quant::kBlock]);
  };
  quant::quantize_columns_128x1<kColumnThreads>(load, num_rows, cols, static_cast<int>(threadIdx.x),
                                                out_t + row0, rows_padded,
                                                scale + static_cast<int64_t>(blockIdx.x) * cols, 1);
}

// ---- conversions and scales ----------------------------------------------------------------------------

TEST(Fp8Quantize, E4m3ConversionMatchesTheCpu) {
  SKIP_UNLESS_GPUS(1);
  std::vector<float> values;
  for (uint32_t bits = 0; bits < 65536; ++bits) {  // every finite bf16 value, both signs
    const float v = bf16_bits_to_float(static_cast<uint16_t>(bits));
    if (std::isfinite(v)) values.push_back(v);
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> mantissa(0, (1u << 23) - 1);
  std::uniform_int_distribution<int> exponent(-24, 12);  // the subnormals to well past 448
  for (int i = 0; i < (1 << 20); ++i) {
    const float v = std::ldexp(1.0f + static_cast<float>(mantissa(rng)) * 0x1p-23f, exponent(rng));
    values.push_back(i % 2 ? -v : v);
  }
  for (int code = 0; code < 0x7e; ++code) {  // midpoints between neighbouring finite codes (ties to even)
    const float a = e4m3_to_float(static_cast<uint8_t>(code)),
                b = e4m3_to_float(static_cast<uint8_t>(code + 1));
    values.push_back((a + b) / 2), values.push_back(-(a + b) / 2);
  }
  for (float v : {464.0f, 480.0f, 1e30f, std::numeric_limits<float>::infinity(), std::ldexp(1.0f, -10),
                  std::numeric_limits<float>::denorm_min(), 0.0f, -0.0f}) {
    values.push_back(v), values.push_back(-v);
  }
  if (values.size() % 2) values.push_back(1.0f);
  const int64_t num_pairs = static_cast<int64_t>(values.size() / 2);
  DeviceBuffer<float> in(values);
  DeviceBuffer<uint16_t> out(num_pairs);
  convert_kernel<<<1024, 256>>>(in.ptr, num_pairs, out.ptr);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint16_t> got = out.download();
  for (int64_t i = 0; i < num_pairs; ++i) {
    for (int half = 0; half < 2; ++half) {
      const float v = values[2 * i + half];
      const uint8_t gpu = static_cast<uint8_t>(got[i] >> (8 * half)), cpu = float_to_e4m3(v);
      ASSERT_EQ(gpu, cpu) << "e4m3(" << v << " = " << std::hexfloat << v << std::defaultfloat << "): gpu 0x"
                          << std::hex << int{gpu} << ", cpu 0x" << int{cpu};
    }
  }

  DeviceBuffer<float> decoded(2 * 65536);
  decode_kernel<<<256, 256>>>(decoded.ptr);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> pairs = decoded.download();
  for (int i = 0; i < 65536; ++i) {
    for (int half = 0; half < 2; ++half) {
      const uint8_t code = static_cast<uint8_t>(i >> (8 * half));
      if ((code & 0x7f) == 0x7f) continue;  // NaN
      ASSERT_EQ(pairs[2 * i + half], e4m3_to_float(code)) << "decode 0x" << std::hex << int{code};
    }
  }
}

TEST(Fp8Quantize, BlockScaleMatchesTheCpu) {
  SKIP_UNLESS_GPUS(1);
  std::vector<float> amax;
  for (uint32_t bits = 0; bits < 0x7f80; ++bits)
    amax.push_back(bf16_bits_to_float(static_cast<uint16_t>(bits)));
  for (int e = -150; e <= 118; ++e) {  // 448 * 2^118 is the last finite one
    const float edge = std::ldexp(448.0f, e);
    amax.push_back(edge), amax.push_back(std::nextafter(edge, 0.0f)),
        amax.push_back(std::nextafter(edge, 1e38f));
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 100000; ++i) amax.push_back(std::fabs(random_bf16(rng, -140, 120)) * 1.0001f);
  for (float v : {std::numeric_limits<float>::max(), std::numeric_limits<float>::denorm_min(),
                  std::numeric_limits<float>::min(), 0.0f}) {
    amax.push_back(v);
  }
  // The values scaled by 1 / scale: the block's amax itself and a random fraction of it.
  std::vector<float> values(amax.size());
  std::uniform_real_distribution<float> fraction(-1.0f, 1.0f);
  for (size_t i = 0; i < amax.size(); ++i) values[i] = i % 2 ? amax[i] : amax[i] * fraction(rng);
  const int n = static_cast<int>(amax.size());
  DeviceBuffer<float> d_amax(amax), d_values(values), d_scale(n), d_scaled(n);
  scale_kernel<<<(n + 255) / 256, 256>>>(d_amax.ptr, n, d_scale.ptr, d_values.ptr, d_scaled.ptr);
  CUDA_OK(cudaDeviceSynchronize());
  const std::vector<float> scale = d_scale.download(), scaled = d_scaled.download();
  for (int i = 0; i < n; ++i) {
    float cpu_scale = 0.0f;
    uint8_t q = 0;
    pounce::reference::quantize_fp8_blocks(&amax[i], 1, 1, 1, 128, &q, &cpu_scale);
    ASSERT_EQ(scale[i], cpu_scale) << "block_scale(" << std::hexfloat << amax[i] << ")";
    ASSERT_EQ(scaled[i], values[i] / cpu_scale) << std::hexfloat << values[i] << " / " << cpu_scale;
  }
}

// ---- activation quantizers -----------------------------------------------------------------------------

// Rows of bf16 values whose magnitudes vary per row (2^-20 .. 2^10), with an all-zero block, a block with one
// non-zero value and a block whose amax is exactly 448 * 2^-3.
std::vector<float> activation_rows(int rows, int cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<float> in(static_cast<size_t>(rows) * cols);
  for (int r = 0; r < rows; ++r) {
    const int e = -20 + (r * 30) / std::max(1, rows - 1);
    for (int c = 0; c < cols; ++c) in[static_cast<size_t>(r) * cols + c] = random_bf16(rng, e - 3, e);
  }
  for (int c = 0; c < std::min(cols, 128); ++c) in[c] = 0.0f;
  if (rows > 1) {
    for (int c = 0; c < std::min(cols, 128); ++c) in[cols + c] = c == 5 ? -3.0f : 0.0f;
  }
  if (rows > 2) {
    for (int c = 0; c < std::min(cols, 128); ++c) in[2 * cols + c] = round_bf16(in[2 * cols + c] * 1e-3f);
    in[2 * cols + 7] = 56.0f;  // 448 * 2^-3
  }
  return in;
}

template <int kLanes>
void check_rows(int rows, int cols, uint32_t seed) {
  SCOPED_TRACE(::testing::Message() << kLanes << " lanes per block, " << rows << " x " << cols);
  const std::vector<float> in = activation_rows(rows, cols, seed);
  const int blocks_per_row = (cols + 127) / 128;
  std::vector<uint8_t> want_bits(in.size());
  std::vector<float> want_scale(static_cast<size_t>(rows) * blocks_per_row);
  pounce::reference::quantize_fp8_blocks(in.data(), rows, cols, 1, 128, want_bits.data(), want_scale.data());
  DeviceBuffer<float> d_in(in), d_scale(want_scale.size());
  DeviceBuffer<uint8_t> d_bits(in.size());
  const int threads = 128, groups = rows * blocks_per_row;
  std::vector<uint8_t> first;
  for (int run = 0; run < 2; ++run) {
    CUDA_OK(cudaMemset(d_bits.ptr, 0xFF, in.size()));
    rows_kernel<kLanes><<<(groups * kLanes + threads - 1) / threads, threads>>>(d_in.ptr, rows, cols,
                                                                                d_bits.ptr, d_scale.ptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> bits = d_bits.download();
    expect_bytes_equal(bits, want_bits, "bits");
    expect_floats_equal(d_scale.download(), want_scale, "scale");
    if (run == 1) expect_bytes_equal(bits, first, "second run");
    first = bits;
  }
}

TEST(Fp8Quantize, LaneGroupRowsMatchTheCpu) {
  SKIP_UNLESS_GPUS(1);
  check_rows<4>(37, 320, 21);  // the wgmma quad: 32 values per lane, columns interleaved
  check_rows<8>(37, 320, 22);
  check_rows<16>(64, 2880, 23);  // gpt-oss's hidden: 22.5 blocks
  check_rows<32>(5, 200, 24);
}

// Compares out_t [cols, rows_padded] and scale [row_blocks, cols] with the CPU's 128x1 quantization of in.
void expect_token_axis(const std::vector<float>& in, int rows, int cols, const std::vector<uint8_t>& out_t,
                       const std::vector<float>& scale) {
  const int row_blocks = (rows + 127) / 128, rows_padded = row_blocks * 128;
  std::vector<uint8_t> bits(in.size());
  std::vector<float> want_scale(static_cast<size_t>(row_blocks) * cols);
  pounce::reference::quantize_fp8_blocks(in.data(), rows, cols, 128, 1, bits.data(), want_scale.data());
  for (int c = 0; c < cols; ++c) {
    for (int r = 0; r < rows_padded; ++r) {
      const uint8_t want = r < rows ? bits[static_cast<size_t>(r) * cols + c] : 0;  // padding rows exactly 0
      ASSERT_EQ(out_t[static_cast<size_t>(c) * rows_padded + r], want) << "row " << r << ", column " << c;
    }
  }
  expect_floats_equal(scale, want_scale, "token-axis scale");
}

TEST(Fp8Quantize, TokenAxisColumnsMatchTheCpu) {
  SKIP_UNLESS_GPUS(1);
  const int rows = 300, cols = 200;  // 3 row blocks (the last 44 rows), 4 column tiles (the last 8 columns)
  const int row_blocks = (rows + 127) / 128, rows_padded = row_blocks * 128;
  std::vector<float> in = activation_rows(cols, rows, 31);  // magnitudes vary along the columns here
  std::vector<float> transposed(in.size());
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c)
      transposed[static_cast<size_t>(r) * cols + c] = in[static_cast<size_t>(c) * rows + r];
  std::vector<uint16_t> bf16(transposed.size());
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = pounce::reference::float_to_bf16_bits(transposed[i]);
  DeviceBuffer<uint16_t> d_in(bf16);
  DeviceBuffer<uint8_t> d_out(static_cast<size_t>(cols) * rows_padded);
  DeviceBuffer<float> d_scale(static_cast<size_t>(row_blocks) * cols);
  std::vector<uint8_t> first;
  for (int run = 0; run < 2; ++run) {
    CUDA_OK(cudaMemset(d_out.ptr, 0xFF, d_out.count));
    columns_kernel<<<dim3(row_blocks, (cols + kTileCols - 1) / kTileCols), kColumnThreads>>>(
        d_in.ptr, rows, cols, rows_padded, d_out.ptr, d_scale.ptr);
    CUDA_OK(cudaDeviceSynchronize());
    const std::vector<uint8_t> out = d_out.download();
    expect_token_axis(transposed, rows, cols, out, d_scale.download());
    if (run == 1) expect_bytes_equal(out, first, "second run");
    first = out;
  }
}

TEST(Fp8Quantize, TokenAxisFromE4m3RowsMatchesTheCpu) {
  SKIP_UNLESS_GPUS(1);
  const int rows = 200, cols = 192;  // x rows of an expert segment: 1x128 quantized, partial blocks both ways
  const int row_blocks = (rows + 127) / 128, rows_padded = row_blocks * 128, scale_cols = (cols + 127) / 128;
  const std::vector<float> x = activation_rows(rows, cols, 41);
  std::vector<uint8_t> x_q(x.size());
  std::vector<float> x_scale(static_cast<size_t>(rows) * scale_cols), x_deq(x.size());
  pounce::reference::quantize_fp8_blocks(x.data(), rows, cols, 1, 128, x_q.data(), x_scale.data());
  pounce::reference::dequantize_fp8_blocks(x_q.data(), x_scale.data(), rows, cols, 1, 128, x_deq.data());
  DeviceBuffer<uint8_t> d_x_q(x_q), d_out(static_cast<size_t>(cols) * rows_padded);
  DeviceBuffer<float> d_x_scale(x_scale), d_scale(static_cast<size_t>(row_blocks) * cols);
  columns_from_e4m3_kernel<<<row_blocks, kColumnThreads>>>(d_x_q.ptr, d_x_scale.ptr, rows, cols, rows_padded,
                                                           d_out.ptr, d_scale.ptr);
  CUDA_OK(cudaDeviceSynchronize());
  expect_token_axis(x_deq, rows, cols, d_out.download(), d_scale.download());
}

// ---- weights through the public API -----------------------------------------------------------------

struct WeightShape {
  int64_t experts, intermediate, hidden;
};

// bf16 routed weights [El, I, H] x2, [El, H, I]: per-block magnitudes from 2^-12 to 2^4, an all-zero block in
// gate[min(1, El - 1)], a block of down whose amax is exactly 448 * 2^-6.
std::vector<std::vector<uint16_t>> random_weights(const WeightShape& s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> block_exponent(-12, 4);
  std::vector<std::vector<uint16_t>> w;
  for (int t = 0; t < 3; ++t) {
    const int64_t n = t < 2 ? s.intermediate : s.hidden, k = t < 2 ? s.hidden : s.intermediate;
    std::vector<uint16_t> bits(s.experts * n * k);
    for (int64_t e = 0; e < s.experts; ++e) {
      for (int64_t bn = 0; bn < n; bn += 128) {
        for (int64_t bk = 0; bk < k; bk += 128) {
          const int exp = block_exponent(rng);
          for (int64_t r = bn; r < std::min(n, bn + 128); ++r) {
            for (int64_t c = bk; c < std::min(k, bk + 128); ++c) {
              bits[(e * n + r) * k + c] =
                  pounce::reference::float_to_bf16_bits(random_bf16(rng, exp - 4, exp));
            }
          }
        }
      }
    }
    w.push_back(bits);
  }
  const int64_t zero_expert = std::min<int64_t>(1, s.experts - 1);
  for (int64_t r = 0; r < std::min<int64_t>(128, s.intermediate); ++r) {
    for (int64_t c = 0; c < std::min<int64_t>(128, s.hidden); ++c)
      w[0][(zero_expert * s.intermediate + r) * s.hidden + c] = 0;
  }
  w[2][0] = pounce::reference::float_to_bf16_bits(7.0f);  // amax of its block at least 7 = 448 * 2^-6
  for (int64_t r = 0; r < std::min<int64_t>(128, s.hidden); ++r) {
    for (int64_t c = 0; c < std::min<int64_t>(128, s.intermediate); ++c) {
      uint16_t& b = w[2][r * s.intermediate + c];
      if (r + c > 0) b = pounce::reference::float_to_bf16_bits(round_bf16(bf16_bits_to_float(b) * 0x1p-12f));
    }
  }
  return w;
}

// The views of one quantization's outputs over `bytes` (data) and `scales` buffers, on `device`.
struct Fp8Outputs {
  std::vector<std::vector<uint8_t>> bytes;  // [6] host copies (gate, up, down, gate_t, up_t, down_t)
  std::vector<std::vector<float>> scales;   // [6]
};

std::vector<std::vector<int64_t>> output_shapes(const WeightShape& s, bool scale) {
  const int64_t I = s.intermediate, H = s.hidden, bi = (I + 127) / 128, bh = (H + 127) / 128;
  if (scale)
    return {{s.experts, bi, bh}, {s.experts, bi, bh}, {s.experts, bh, bi},
            {s.experts, bh, bi}, {s.experts, bh, bi}, {s.experts, bi, bh}};
  return {{s.experts, I, H}, {s.experts, I, H}, {s.experts, H, I},
          {s.experts, H, I}, {s.experts, H, I}, {s.experts, I, H}};
}

pounce::Fp8Weights fp8_views(const std::vector<void*>& data, const std::vector<void*>& scale,
                             const WeightShape& s, pounce::DeviceKind device) {
  const auto data_shapes = output_shapes(s, false), scale_shapes = output_shapes(s, true);
  auto tensor = [&](int i) {
    return pounce::Fp8Tensor{pounce::TensorView(data[i], pounce::DType::kUInt8, data_shapes[i], device),
                             pounce::TensorView(scale[i], pounce::DType::kFP32, scale_shapes[i], device)};
  };
  return {tensor(0), tensor(1), tensor(2), tensor(3), tensor(4), tensor(5)};
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t e : shape) n *= e;
  return n;
}

Fp8Outputs quantize_on_cpu(const WeightShape& s, std::vector<std::vector<uint16_t>>& w) {
  Fp8Outputs out;
  std::vector<void*> data, scale;
  for (const auto& shape : output_shapes(s, false)) out.bytes.emplace_back(numel(shape), 0);
  for (const auto& shape : output_shapes(s, true)) out.scales.emplace_back(numel(shape), 0.0f);
  for (int i = 0; i < 6; ++i) data.push_back(out.bytes[i].data()), scale.push_back(out.scales[i].data());
  const pounce::ExpertWeights routed{
      pounce::TensorView(w[0].data(), pounce::DType::kBF16, {s.experts, s.intermediate, s.hidden}),
      pounce::TensorView(w[1].data(), pounce::DType::kBF16, {s.experts, s.intermediate, s.hidden}),
      pounce::TensorView(w[2].data(), pounce::DType::kBF16, {s.experts, s.hidden, s.intermediate})};
  pounce::quantize_weights_fp8(routed, fp8_views(data, scale, s, pounce::DeviceKind::kCpu));
  return out;
}

TEST(Fp8Quantize, WeightsMatchTheCpuBitwise) {
  SKIP_UNLESS_GPUS(1);
  for (const WeightShape& s :
       {WeightShape{3, 320, 192}, WeightShape{2, 64, 128}, WeightShape{1, 2880, 2880}}) {
    SCOPED_TRACE(::testing::Message()
                 << "El " << s.experts << ", I " << s.intermediate << ", H " << s.hidden);
    std::vector<std::vector<uint16_t>> w =
        random_weights(s, static_cast<uint32_t>(s.intermediate + s.experts));
    const Fp8Outputs want = quantize_on_cpu(s, w);

    DeviceBuffer<uint16_t> gate(w[0]), up(w[1]), down(w[2]);
    std::vector<std::unique_ptr<DeviceBuffer<uint8_t>>> data;
    std::vector<std::unique_ptr<DeviceBuffer<float>>> scale;
    std::vector<void*> data_ptrs, scale_ptrs;
    for (int i = 0; i < 6; ++i) {
      data.push_back(std::make_unique<DeviceBuffer<uint8_t>>(want.bytes[i].size()));
      scale.push_back(std::make_unique<DeviceBuffer<float>>(want.scales[i].size()));
      data_ptrs.push_back(data.back()->ptr), scale_ptrs.push_back(scale.back()->ptr);
    }
    const auto cuda = pounce::DeviceKind::kCuda;
    const pounce::ExpertWeights routed{
        pounce::TensorView(gate.ptr, pounce::DType::kBF16, {s.experts, s.intermediate, s.hidden}, cuda),
        pounce::TensorView(up.ptr, pounce::DType::kBF16, {s.experts, s.intermediate, s.hidden}, cuda),
        pounce::TensorView(down.ptr, pounce::DType::kBF16, {s.experts, s.hidden, s.intermediate}, cuda)};
    cudaStream_t stream;
    CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::vector<std::vector<uint8_t>> first;
    for (int run = 0; run < 2; ++run) {
      for (int i = 0; i < 6; ++i) {  // poison: 0xFF bytes are e4m3 NaNs, 0xFFFFFFFF scales fp32 NaNs
        CUDA_OK(cudaMemsetAsync(data[i]->ptr, 0xFF, data[i]->count, stream));
        CUDA_OK(cudaMemsetAsync(scale[i]->ptr, 0xFF, scale[i]->count * sizeof(float), stream));
      }
      pounce::quantize_weights_fp8(routed, fp8_views(data_ptrs, scale_ptrs, s, cuda), stream);
      CUDA_OK(cudaStreamSynchronize(stream));
      const char* names[] = {"gate", "up", "down", "gate_t", "up_t", "down_t"};
      for (int i = 0; i < 6; ++i) {
        const std::vector<uint8_t> bytes = data[i]->download();
        expect_bytes_equal(bytes, want.bytes[i], std::string(names[i]) + ".data, run " + std::to_string(run));
        expect_floats_equal(scale[i]->download(), want.scales[i], std::string(names[i]) + ".scale");
        if (run == 1) expect_bytes_equal(bytes, first[i], std::string(names[i]) + ": second run");
        if (run == 0) first.push_back(bytes);
      }
    }
    CUDA_OK(cudaStreamDestroy(stream));
    EXPECT_EQ(want.scales[0][(std::min<int64_t>(1, s.experts - 1)) * ((s.intermediate + 127) / 128) *
                             ((s.hidden + 127) / 128)],
              1.0f)
        << "the all-zero block's scale";
  }
}

}  // namespace
