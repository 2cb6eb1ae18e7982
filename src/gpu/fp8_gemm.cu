// Host launchers of the FP8 grouped GEMMs: argument checks, tensor maps, persistent grid sizing.
#include "src/gpu/fp8_gemm.h"

#include <algorithm>
#include <array>
#include <mutex>

#include "kernels/gemm/fp8_gemm_kernel.cuh"
#include "pounce/error.h"
#include "src/gpu/gemm_device.h"
#include "src/gpu/tma.h"

namespace pounce::kernels {
namespace {

using gemm::Fp8GemmConfig;
using gemm::Fp8Kind;

#define POUNCE_FP8_CUDA_CHECK(expr)                                                                 \
  do {                                                                                              \
    const cudaError_t err_ = (expr);                                                                \
    POUNCE_CHECK(err_ == cudaSuccess, #expr, " failed: ", cudaGetErrorString(err_), " (FP8 GEMM)"); \
  } while (0)

// The grouped GEMMs' device state (gemm_device.h), and the FP8 kernels' shared-memory limit raised once per
// device.
const GemmDevice& fp8_device() {
  const GemmDevice& device = gemm_device();
  static std::array<std::once_flag, kMaxGemmDevices> limits_raised;
  std::call_once(limits_raised[device.index], [&] {
    POUNCE_CHECK(static_cast<size_t>(device.max_shared_bytes) >= gemm::kFp8SharedBytes, "device ",
                 device.index, " offers ", device.max_shared_bytes,
                 " bytes of shared memory per block, the FP8 GEMM needs ", gemm::kFp8SharedBytes,
                 "; fix: run on a Hopper (sm_90a) GPU");
    for (const void* kernel :
         {reinterpret_cast<const void*>(gemm::fp8_grouped_gemm_kernel<Fp8Kind::kRows>),
          reinterpret_cast<const void*>(gemm::fp8_grouped_gemm_kernel<Fp8Kind::kGateUp>),
          reinterpret_cast<const void*>(gemm::fp8_grouped_gemm_kernel<Fp8Kind::kWeightGrad>)})
      POUNCE_FP8_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(gemm::kFp8SharedBytes)));
  });
  return device;
}

int64_t blocks_of(int64_t extent, int64_t block) {
  return (extent + block - 1) / block;
}

// e4m3 [rows, cols] with row stride ld bytes (rank 2), or num_groups of them back to back (rank 3): boxes of
// 128 K-bytes x 128 rows, 128-byte swizzled.
CUtensorMap e4m3_map(const void* base, int num_groups, int64_t rows, int64_t cols, int64_t ld,
                     uint32_t box_rows = Fp8GemmConfig::BLOCK_M) {
  TensorMapSpec spec;
  spec.base = base;
  spec.rank = num_groups > 0 ? 3 : 2;
  spec.dims[0] = static_cast<uint64_t>(cols);
  spec.dims[1] = static_cast<uint64_t>(rows);
  spec.dims[2] = static_cast<uint64_t>(std::max(num_groups, 1));
  spec.strides_bytes[0] = static_cast<uint64_t>(ld);
  spec.strides_bytes[1] = static_cast<uint64_t>(ld) * static_cast<uint64_t>(rows);
  spec.box[0] = Fp8GemmConfig::BLOCK_K;
  spec.box[1] = box_rows;
  spec.element = TensorMapElement::kUint8;
  return make_tensor_map(spec);
}

// fp32 scale vectors [blocks][ld] with `extent` entries visible per block: boxes of 128 x 1.
CUtensorMap scale_map(const float* base, int64_t blocks, int64_t extent, int64_t ld) {
  TensorMapSpec spec;
  spec.base = base;
  spec.rank = 2;
  spec.dims[0] = static_cast<uint64_t>(extent);
  spec.dims[1] = static_cast<uint64_t>(blocks);
  spec.strides_bytes[0] = static_cast<uint64_t>(ld) * 4;
  spec.box[0] = Fp8GemmConfig::BLOCK_M;
  spec.box[1] = 1;
  spec.element = TensorMapElement::kFloat32;
  spec.swizzle_128b = false;
  return make_tensor_map(spec);
}

void check_rows(const GroupedRows& rows) {
  POUNCE_CHECK(rows.max_rows >= 0 && rows.max_rows % Fp8GemmConfig::BLOCK_M == 0,
               "GroupedRows.max_rows = ", rows.max_rows, " must be a non-negative multiple of ",
               Fp8GemmConfig::BLOCK_M, "; fix: pad the row capacity");
  POUNCE_CHECK(rows.max_rows / Fp8GemmConfig::BLOCK_M < (int64_t{1} << 24),
               "GroupedRows.max_rows = ", rows.max_rows, " too large for 32-bit tile indices");
  POUNCE_CHECK(rows.num_groups >= 1, "GroupedRows.num_groups = ", rows.num_groups, " must be >= 1");
  POUNCE_CHECK(rows.group_row_offset != nullptr, "GroupedRows.group_row_offset is null");
}

void check_extent(int64_t value, int64_t multiple, const char* name) {
  POUNCE_CHECK(value >= multiple && value % multiple == 0 && value < (int64_t{1} << 24), name, " = ", value,
               " must be a positive multiple of ", multiple, "; fix: pad it");
}

void check_pointer(const void* p, const char* name) {
  POUNCE_CHECK(p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0, "'", name,
               "' must be non-null and 16-byte aligned");
}

// Weight scales are read with plain 4-byte loads: a slice of experts [e0, ...) of a [El][nb][kb] grid may
// start at any float.
void check_weight_scale(const float* p, const char* name) {
  POUNCE_CHECK(p != nullptr && reinterpret_cast<uintptr_t>(p) % 4 == 0, "'", name,
               ".scale' must be non-null and 4-byte aligned");
}

void check_fp8_rows(const GroupedRows& rows, const Fp8Rows& a, const char* name) {
  check_pointer(a.data, name);
  check_pointer(a.scale, name);
  POUNCE_CHECK(a.scale_ld >= rows.max_rows && a.scale_ld % 4 == 0, name, ".scale_ld = ", a.scale_ld,
               " must be >= max_rows (", rows.max_rows, ") and a multiple of 4");
}

// The arguments every kind takes from the grouped rows, and n.
gemm::Fp8GemmArgs grouped_args(const GroupedRows& rows, int64_t n) {
  gemm::Fp8GemmArgs args{};
  args.common.group_row_offset = rows.group_row_offset;
  args.common.group_rows = rows.group_rows;
  args.common.num_groups = rows.num_groups;
  args.common.error_flag = rows.error_flag;
  args.common.inject_failure = rows.inject_failure;
  args.common.group_active = rows.group_active;
  args.common.max_m_blocks = static_cast<int32_t>(rows.max_rows / Fp8GemmConfig::BLOCK_M);
  args.common.n = static_cast<int32_t>(n);
  args.common.out_ld = n;
  return args;
}

void launch(Fp8Kind kind, const gemm::Fp8TensorMaps& maps, gemm::Fp8GemmArgs args, int64_t max_tiles,
            int max_ctas, cudaStream_t stream) {
  const GemmDevice& info = fp8_device();
  if (args.common.error_flag == nullptr) args.common.error_flag = info.error_flag;
  const int ctas = max_ctas > 0 ? std::min(max_ctas, info.num_sms) : info.num_sms;
  const int grid = static_cast<int>(std::min<int64_t>(ctas, max_tiles));
  if (grid <= 0) return;
  if (kind == Fp8Kind::kRows) {
    gemm::fp8_grouped_gemm_kernel<Fp8Kind::kRows>
        <<<grid, Fp8GemmConfig::kNumThreads, gemm::kFp8SharedBytes, stream>>>(maps, args);
  } else if (kind == Fp8Kind::kGateUp) {
    gemm::fp8_grouped_gemm_kernel<Fp8Kind::kGateUp>
        <<<grid, Fp8GemmConfig::kNumThreads, gemm::kFp8SharedBytes, stream>>>(maps, args);
  } else {
    gemm::fp8_grouped_gemm_kernel<Fp8Kind::kWeightGrad>
        <<<grid, Fp8GemmConfig::kNumThreads, gemm::kFp8SharedBytes, stream>>>(maps, args);
  }
  POUNCE_FP8_CUDA_CHECK(cudaGetLastError());
}

void launch_rows(const GroupedRows& rows, const Fp8Rows* a, const Fp8Matrices* b, const int64_t* k, int pairs,
                 void* c, int64_t n, cudaStream_t stream) {
  check_rows(rows);
  check_extent(n, 64, "n");
  check_pointer(c, "c");
  gemm::Fp8TensorMaps maps{};
  gemm::Fp8GemmArgs args = grouped_args(rows, n);
  args.common.k = static_cast<int32_t>(k[0]);
  args.common.out0 = static_cast<__nv_bfloat16*>(c);
  if (rows.max_rows == 0) return;
  for (int p = 0; p < pairs; ++p) {
    const char* name = p == 0 ? "a0" : "a1";
    check_fp8_rows(rows, a[p], name);
    check_extent(k[p], 16, p == 0 ? "k0" : "k1");
    check_pointer(b[p].data, p == 0 ? "b0" : "b1");
    check_weight_scale(b[p].scale, p == 0 ? "b0" : "b1");
    const int64_t k_blocks = blocks_of(k[p], Fp8GemmConfig::BLOCK_K);
    maps.a[p] = e4m3_map(a[p].data, 0, rows.max_rows, k[p], k[p]);
    maps.b[p] = e4m3_map(b[p].data, rows.num_groups, n, k[p], k[p]);
    maps.a_scale[p] = scale_map(a[p].scale, k_blocks, rows.max_rows, a[p].scale_ld);
    (p == 0 ? args.k_blocks0 : args.k_blocks1) = static_cast<int32_t>(k_blocks);
    (p == 0 ? args.b_scale0 : args.b_scale1) = b[p].scale;
  }
  if (pairs == 1) {
    maps.a[1] = maps.a[0], maps.b[1] = maps.b[0], maps.a_scale[1] = maps.a_scale[0];
  }
  maps.b_scale = maps.a_scale[0];  // unused by the row kind
  const int64_t tiles = rows.max_rows / Fp8GemmConfig::BLOCK_M * blocks_of(n, Fp8GemmConfig::BLOCK_N);
  launch(Fp8Kind::kRows, maps, args, tiles, rows.max_ctas, stream);
}

}  // namespace

void fp8_grouped_gemm(const GroupedRows& rows, const Fp8Rows& a, const Fp8Matrices& b, void* c, int64_t n,
                      int64_t k, cudaStream_t stream) {
  launch_rows(rows, &a, &b, &k, 1, c, n, stream);
}

void fp8_grouped_gemm_pair(const GroupedRows& rows, const Fp8Rows& a0, const Fp8Matrices& b0, int64_t k0,
                           const Fp8Rows& a1, const Fp8Matrices& b1, int64_t k1, void* c, int64_t n,
                           cudaStream_t stream) {
  const Fp8Rows a[2] = {a0, a1};
  const Fp8Matrices b[2] = {b0, b1};
  const int64_t k[2] = {k0, k1};
  launch_rows(rows, a, b, k, 2, c, n, stream);
}

void fp8_grouped_gate_up(const GroupedRows& rows, const Fp8Rows& x, const Fp8Matrices& w_gate,
                         const Fp8Matrices& w_up, void* g, void* u, void* a, const Fp8Activation& a_q,
                         int64_t n, int64_t k, const ActivationParams& activation, cudaStream_t stream) {
  check_rows(rows);
  check_extent(n, 64, "n");
  check_extent(k, 16, "k");
  check_fp8_rows(rows, x, "x");
  check_pointer(g, "g");
  check_pointer(u, "u");
  POUNCE_CHECK(a == nullptr || reinterpret_cast<uintptr_t>(a) % 16 == 0,
               "'a' must be null or 16-byte aligned");
  check_pointer(a_q.data, "a_q.data");
  check_pointer(a_q.scale, "a_q.scale");
  POUNCE_CHECK(a_q.scale_ld >= rows.max_rows && a_q.scale_ld % 4 == 0, "a_q.scale_ld = ", a_q.scale_ld,
               " must be >= max_rows (", rows.max_rows, ") and a multiple of 4");
  for (const auto& [w, name] : {std::pair{&w_gate, "w_gate"}, std::pair{&w_up, "w_up"}}) {
    check_pointer(w->data, name);
    check_weight_scale(w->scale, name);
  }
  gemm::Fp8GemmArgs args = grouped_args(rows, n);
  args.common.k = static_cast<int32_t>(k);
  args.common.out0 = static_cast<__nv_bfloat16*>(g);
  args.common.out1 = static_cast<__nv_bfloat16*>(u);
  args.common.out2 = static_cast<__nv_bfloat16*>(a);
  args.common.activation = activation;
  args.k_blocks0 = static_cast<int32_t>(blocks_of(k, Fp8GemmConfig::BLOCK_K));
  args.b_scale0 = w_gate.scale;
  args.b_scale1 = w_up.scale;
  args.act_q = static_cast<uint8_t*>(a_q.data);
  args.act_scale = a_q.scale;
  args.act_scale_ld = a_q.scale_ld;
  if (rows.max_rows == 0) return;
  gemm::Fp8TensorMaps maps{};
  maps.a[0] = maps.a[1] = e4m3_map(x.data, 0, rows.max_rows, k, k);
  maps.b[0] = e4m3_map(w_gate.data, rows.num_groups, n, k, k, 64);
  maps.b[1] = e4m3_map(w_up.data, rows.num_groups, n, k, k, 64);
  maps.a_scale[0] = maps.a_scale[1] = scale_map(x.scale, args.k_blocks0, rows.max_rows, x.scale_ld);
  maps.b_scale = maps.a_scale[0];  // unused
  const int64_t tiles = rows.max_rows / Fp8GemmConfig::BLOCK_M * blocks_of(n, Fp8GemmConfig::BLOCK_N);
  launch(Fp8Kind::kGateUp, maps, args, tiles, rows.max_ctas, stream);
}

void fp8_grouped_weight_grad(const GroupedRows& rows, const Fp8Columns& a_t, int64_t m, const Fp8Columns& b_t,
                             int64_t n, void* d, WeightGradMode mode, cudaStream_t stream) {
  check_rows(rows);
  check_extent(m, 64, "m");
  check_extent(n, 64, "n");
  check_pointer(d, "d");
  for (const auto& [operand, name] : {std::pair{&a_t, "a_t"}, std::pair{&b_t, "b_t"}}) {
    check_pointer(operand->data, name);
    check_pointer(operand->scale, name);
    POUNCE_CHECK(operand->ld >= rows.max_rows && operand->ld % 16 == 0, name, ".ld = ", operand->ld,
                 " must be >= max_rows (", rows.max_rows, ") and a multiple of 16");
  }
  POUNCE_CHECK(a_t.scale_ld >= m && a_t.scale_ld % 4 == 0, "a_t.scale_ld = ", a_t.scale_ld,
               " must be >= m and a multiple of 4");
  POUNCE_CHECK(b_t.scale_ld >= n && b_t.scale_ld % 4 == 0, "b_t.scale_ld = ", b_t.scale_ld,
               " must be >= n and a multiple of 4");
  gemm::Fp8GemmArgs args = grouped_args(rows, n);
  args.common.m = static_cast<int32_t>(m);
  args.common.weight_grad = d;
  args.common.weight_grad_mode = mode;
  const int64_t tiles =
      rows.num_groups * blocks_of(m, Fp8GemmConfig::BLOCK_M) * blocks_of(n, Fp8GemmConfig::BLOCK_N);
  if (rows.max_rows == 0) {
    // No rows at all: every group gets zeros. The kernel needs real maps; a 128-row dummy is not worth it,
    // so the zeros are written by the stream.
    if (mode != WeightGradMode::kAccumulateF32) {
      const size_t bytes =
          static_cast<size_t>(rows.num_groups) * m * n * (mode == WeightGradMode::kStoreBf16 ? 2 : 4);
      POUNCE_FP8_CUDA_CHECK(cudaMemsetAsync(d, 0, bytes, stream));
    }
    return;
  }
  const int64_t row_blocks = rows.max_rows / Fp8GemmConfig::BLOCK_M;
  gemm::Fp8TensorMaps maps{};
  maps.a[0] = maps.a[1] = e4m3_map(a_t.data, 0, m, rows.max_rows, a_t.ld);
  maps.b[0] = maps.b[1] = e4m3_map(b_t.data, 0, n, rows.max_rows, b_t.ld);
  maps.a_scale[0] = maps.a_scale[1] = scale_map(a_t.scale, row_blocks, m, a_t.scale_ld);
  maps.b_scale = scale_map(b_t.scale, row_blocks, n, b_t.scale_ld);
  launch(Fp8Kind::kWeightGrad, maps, args, tiles, rows.max_ctas, stream);
}

}  // namespace pounce::kernels
