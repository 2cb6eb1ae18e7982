// Host launchers of the grouped GEMMs: argument checks, tensor maps, persistent grid sizing.
#include "kernels/gemm/grouped_gemm.h"

#include <array>
#include <atomic>

#include "kernels/common/tma.h"
#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "pounce/error.h"

namespace pounce::kernels {
namespace {

using gemm::Epilogue;
using gemm::GemmConfig;

__device__ int32_t g_grouped_gemm_error = 0;

constexpr int kMaxDevices = 64;

#define POUNCE_GEMM_CUDA_CHECK(expr)                                                                    \
  do {                                                                                                  \
    const cudaError_t err_ = (expr);                                                                    \
    POUNCE_CHECK(err_ == cudaSuccess, #expr, " failed: ", cudaGetErrorString(err_), " (grouped GEMM)"); \
  } while (0)

struct DeviceInfo {
  int num_sms = 0;
  int32_t* error_flag = nullptr;
};

// SM count, error flag address and the opt-in shared-memory limit, set up once per device.
const DeviceInfo& device_info() {
  static std::array<DeviceInfo, kMaxDevices> infos{};
  static std::array<std::atomic<bool>, kMaxDevices> ready{};
  int device = 0;
  POUNCE_GEMM_CUDA_CHECK(cudaGetDevice(&device));
  POUNCE_CHECK(device >= 0 && device < kMaxDevices, "device index ", device, " beyond ", kMaxDevices);
  if (!ready[device].load(std::memory_order_acquire)) {
    DeviceInfo info;
    POUNCE_GEMM_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device));
    int max_smem = 0;
    POUNCE_GEMM_CUDA_CHECK(
        cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    POUNCE_CHECK(static_cast<size_t>(max_smem) >= gemm::kSharedBytes, "device ", device, " offers ", max_smem,
                 " bytes of shared memory per block, the grouped GEMM needs ", gemm::kSharedBytes,
                 "; fix: run on a Hopper (sm_90a) GPU");
    void* flag = nullptr;
    POUNCE_GEMM_CUDA_CHECK(cudaGetSymbolAddress(&flag, g_grouped_gemm_error));
    info.error_flag = static_cast<int32_t*>(flag);
    POUNCE_GEMM_CUDA_CHECK(cudaFuncSetAttribute(gemm::grouped_gemm_kernel<Epilogue::kStore>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(gemm::kSharedBytes)));
    POUNCE_GEMM_CUDA_CHECK(cudaFuncSetAttribute(gemm::grouped_gemm_kernel<Epilogue::kGateUpActivation>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                static_cast<int>(gemm::kSharedBytes)));
    infos[device] = info;
    ready[device].store(true, std::memory_order_release);
  }
  return infos[device];
}

void check_common(const GroupedRows& rows, const void* a, int64_t n, int64_t k) {
  POUNCE_CHECK(rows.max_rows >= 0 && rows.max_rows % GemmConfig::BLOCK_M == 0,
               "GroupedRows.max_rows = ", rows.max_rows, " must be a non-negative multiple of ",
               GemmConfig::BLOCK_M, "; fix: pad the row capacity");
  POUNCE_CHECK(rows.max_rows / GemmConfig::BLOCK_M < (int64_t{1} << 24),
               "GroupedRows.max_rows = ", rows.max_rows, " too large for 32-bit tile indices");
  POUNCE_CHECK(rows.num_groups >= 1, "GroupedRows.num_groups = ", rows.num_groups, " must be >= 1");
  POUNCE_CHECK(rows.group_row_offset != nullptr, "GroupedRows.group_row_offset is null");
  POUNCE_CHECK(n >= 64 && n % 64 == 0 && n < (int64_t{1} << 24), "n = ", n,
               " must be a positive multiple of 64; fix: pad the weight rows");
  POUNCE_CHECK(k >= 64 && k % 64 == 0 && k < (int64_t{1} << 24), "k = ", k,
               " must be a positive multiple of 64; fix: pad the reduction dimension");
  POUNCE_CHECK(a != nullptr && reinterpret_cast<uintptr_t>(a) % 16 == 0,
               "A must be non-null and 16-byte aligned");
}

void check_output(const void* p, const char* name) {
  POUNCE_CHECK(p != nullptr && reinterpret_cast<uintptr_t>(p) % 16 == 0, "output '", name,
               "' must be non-null and 16-byte aligned");
}

CUtensorMap activation_map(const GroupedRows& rows, const void* a, int64_t k) {
  Bf16TensorMapSpec spec;
  spec.base = a;
  spec.rank = 2;
  spec.dims[0] = static_cast<uint64_t>(k);
  spec.dims[1] = static_cast<uint64_t>(rows.max_rows);
  spec.strides_bytes[0] = static_cast<uint64_t>(k) * 2;
  spec.box[0] = GemmConfig::BLOCK_K;
  spec.box[1] = GemmConfig::BLOCK_M;
  return make_bf16_tensor_map_sw128(spec);
}

// Weights [num_groups, n, k] as a 3-D map so a tile past n reads zeros instead of the next expert.
CUtensorMap weight_map(const void* w, int num_groups, int64_t n, int64_t k, uint32_t box_rows) {
  Bf16TensorMapSpec spec;
  spec.base = w;
  spec.rank = 3;
  spec.dims[0] = static_cast<uint64_t>(k);
  spec.dims[1] = static_cast<uint64_t>(n);
  spec.dims[2] = static_cast<uint64_t>(num_groups);
  spec.strides_bytes[0] = static_cast<uint64_t>(k) * 2;
  spec.strides_bytes[1] = static_cast<uint64_t>(n) * static_cast<uint64_t>(k) * 2;
  spec.box[0] = GemmConfig::BLOCK_K;
  spec.box[1] = box_rows;
  spec.box[2] = 1;
  return make_bf16_tensor_map_sw128(spec);
}

template <Epilogue kEpilogue>
void launch(const CUtensorMap& tmap_a, const CUtensorMap& tmap_b0, const CUtensorMap& tmap_b1,
            gemm::GroupedGemmArgs args, int64_t max_rows, cudaStream_t stream) {
  const DeviceInfo& info = device_info();
  args.error_flag = info.error_flag;
  const int64_t num_n_blocks = (args.n + gemm::kOutBlockN<kEpilogue> - 1) / gemm::kOutBlockN<kEpilogue>;
  const int64_t max_tiles = max_rows / GemmConfig::BLOCK_M * num_n_blocks;
  const int grid = static_cast<int>(std::min<int64_t>(info.num_sms, max_tiles));
  gemm::grouped_gemm_kernel<kEpilogue>
      <<<grid, GemmConfig::kNumThreads, gemm::kSharedBytes, stream>>>(tmap_a, tmap_b0, tmap_b1, args);
  POUNCE_GEMM_CUDA_CHECK(cudaGetLastError());
}

// The fields every launch shares: which rows, how many groups, the problem extents.
gemm::GroupedGemmArgs base_args(const GroupedRows& rows, int64_t n, int64_t k) {
  gemm::GroupedGemmArgs args{};
  args.group_row_offset = rows.group_row_offset;
  args.num_groups = rows.num_groups;
  args.max_m_blocks = static_cast<int32_t>(rows.max_rows / GemmConfig::BLOCK_M);
  args.n = static_cast<int32_t>(n);
  args.k = static_cast<int32_t>(k);
  return args;
}

}  // namespace

void grouped_gemm(const GroupedRows& rows, const void* a, const void* b, void* c, int64_t n, int64_t k,
                  cudaStream_t stream) {
  check_common(rows, a, n, k);
  check_output(b, "b");
  check_output(c, "c");
  if (rows.max_rows == 0) return;
  const CUtensorMap tmap_a = activation_map(rows, a, k);
  const CUtensorMap tmap_b = weight_map(b, rows.num_groups, n, k, GemmConfig::BLOCK_N);
  gemm::GroupedGemmArgs args = base_args(rows, n, k);
  args.out0 = static_cast<__nv_bfloat16*>(c);
  launch<Epilogue::kStore>(tmap_a, tmap_b, tmap_b, args, rows.max_rows, stream);
}

void grouped_gate_up(const GroupedRows& rows, const void* a, const void* w_gate, const void* w_up, void* g,
                     void* u, void* act, int64_t n, int64_t k, const ActivationParams& activation,
                     cudaStream_t stream) {
  check_common(rows, a, n, k);
  check_output(w_gate, "w_gate");
  check_output(w_up, "w_up");
  check_output(g, "g");
  check_output(u, "u");
  check_output(act, "act");
  POUNCE_CHECK(activation.kind == kActivationSwiGLU || activation.kind == kActivationGptOss,
               "ActivationParams.kind = ", activation.kind, " unknown; fix: 0 (SwiGLU) or 1 (GPT-OSS)");
  POUNCE_CHECK(activation.clamp_limit > 0.f, "ActivationParams.clamp_limit = ", activation.clamp_limit,
               " must be positive; fix: +inf for no clamp");
  if (rows.max_rows == 0) return;
  const CUtensorMap tmap_a = activation_map(rows, a, k);
  const CUtensorMap tmap_gate = weight_map(w_gate, rows.num_groups, n, k, GemmConfig::BLOCK_N / 2);
  const CUtensorMap tmap_up = weight_map(w_up, rows.num_groups, n, k, GemmConfig::BLOCK_N / 2);
  gemm::GroupedGemmArgs args = base_args(rows, n, k);
  args.out0 = static_cast<__nv_bfloat16*>(g);
  args.out1 = static_cast<__nv_bfloat16*>(u);
  args.out2 = static_cast<__nv_bfloat16*>(act);
  args.activation = activation;
  launch<Epilogue::kGateUpActivation>(tmap_a, tmap_gate, tmap_up, args, rows.max_rows, stream);
}

int32_t grouped_gemm_error_code(bool reset) {
  const DeviceInfo& info = device_info();
  POUNCE_GEMM_CUDA_CHECK(cudaDeviceSynchronize());
  int32_t code = 0;
  POUNCE_GEMM_CUDA_CHECK(cudaMemcpy(&code, info.error_flag, sizeof(code), cudaMemcpyDeviceToHost));
  if (reset) POUNCE_GEMM_CUDA_CHECK(cudaMemset(info.error_flag, 0, sizeof(code)));
  return code;
}

}  // namespace pounce::kernels
