// Host launchers of the grouped GEMMs: argument checks, tensor maps, persistent grid sizing.
#include "src/gpu/grouped_gemm.h"

#include <algorithm>
#include <array>
#include <atomic>

#include "src/gpu/gemm_device.h"
#include "src/gpu/tma.h"
#include "src/gpu/gemm_operands.h"
#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "kernels/gemm/activation_backward_pingpong.cuh"
#include "kernels/gemm/weight_grad_pingpong.cuh"
#include "pounce/error.h"

namespace pounce::kernels {
namespace {

using gemm::GemmConfig;
using gemm::KernelKind;

__device__ int32_t g_grouped_gemm_error = 0;

#define POUNCE_GEMM_CUDA_CHECK(expr)                                                                    \
  do {                                                                                                  \
    const cudaError_t err_ = (expr);                                                                    \
    POUNCE_CHECK(err_ == cudaSuccess, #expr, " failed: ", cudaGetErrorString(err_), " (grouped GEMM)"); \
  } while (0)

template <KernelKind kKind>
constexpr size_t shared_bytes_of() {
  return gemm::shared_bytes_for(gemm::gemm_kind(kKind).epilogue);
}

template <KernelKind kKind>
void set_shared_limit() {
  POUNCE_GEMM_CUDA_CHECK(cudaFuncSetAttribute(gemm::grouped_gemm_kernel<kKind>,
                                              cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(shared_bytes_of<kKind>())));
}

}  // namespace

const GemmDevice& gemm_device() {
  static std::array<GemmDevice, kMaxGemmDevices> infos{};
  static std::array<std::atomic<bool>, kMaxGemmDevices> ready{};
  int device = 0;
  POUNCE_GEMM_CUDA_CHECK(cudaGetDevice(&device));
  POUNCE_CHECK(device >= 0 && device < kMaxGemmDevices, "device index ", device, " beyond ", kMaxGemmDevices);
  if (!ready[device].load(std::memory_order_acquire)) {
    GemmDevice info;
    info.index = device;
    POUNCE_GEMM_CUDA_CHECK(cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, device));
    int& max_smem = info.max_shared_bytes;
    POUNCE_GEMM_CUDA_CHECK(
        cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    constexpr size_t kMostBytes = std::max(
        {shared_bytes_of<KernelKind::kForwardStore>(), shared_bytes_of<KernelKind::kForwardGateUp>(),
         shared_bytes_of<KernelKind::kDataGradActivation>(), shared_bytes_of<KernelKind::kWeightGrad>(),
         gemm::kSharedBytes, gemm::kPingPongSharedBytes});
    POUNCE_CHECK(static_cast<size_t>(max_smem) >= kMostBytes, "device ", device, " offers ", max_smem,
                 " bytes of shared memory per block, the grouped GEMM needs ", kMostBytes,
                 "; fix: run on a Hopper (sm_90a) GPU");
    void* flag = nullptr;
    POUNCE_GEMM_CUDA_CHECK(cudaGetSymbolAddress(&flag, g_grouped_gemm_error));
    info.error_flag = static_cast<int32_t*>(flag);
    set_shared_limit<KernelKind::kForwardStore>();
    set_shared_limit<KernelKind::kForwardGateUp>();
    set_shared_limit<KernelKind::kDataGrad>();
    set_shared_limit<KernelKind::kDataGradActivation>();
    set_shared_limit<KernelKind::kWeightGrad>();
    for (const void* pingpong : {reinterpret_cast<const void*>(gemm::weight_grad_pingpong_kernel),
                                 reinterpret_cast<const void*>(gemm::activation_backward_pingpong_kernel)})
      POUNCE_GEMM_CUDA_CHECK(cudaFuncSetAttribute(pingpong, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(gemm::kPingPongSharedBytes)));
    infos[device] = info;
    ready[device].store(true, std::memory_order_release);
  }
  return infos[device];
}

namespace {

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

// A row-major bf16 matrix [rows, ld] with columns [0, cols) visible, loaded in boxes of box_cols x box_rows.
CUtensorMap matrix_map(const void* base, int64_t rows, int64_t cols, int64_t ld, uint32_t box_cols,
                       uint32_t box_rows) {
  Bf16TensorMapSpec spec;
  spec.base = base;
  spec.rank = 2;
  spec.dims[0] = static_cast<uint64_t>(cols);
  spec.dims[1] = static_cast<uint64_t>(rows);
  spec.strides_bytes[0] = static_cast<uint64_t>(ld) * 2;
  spec.box[0] = box_cols;
  spec.box[1] = box_rows;
  return make_bf16_tensor_map_sw128(spec);
}

// num_groups [rows, cols] matrices (dense, or at w's strides), as a 3-D map so a box past the edge reads
// zeros instead of the next group's values (or whatever lies between a view's rows).
CUtensorMap grouped_matrix_map(WeightRows w, int num_groups, int64_t rows, int64_t cols, uint32_t box_cols,
                               uint32_t box_rows) {
  const int64_t row_stride = w.row_stride > 0 ? w.row_stride : cols;
  const int64_t group_stride = w.group_stride > 0 ? w.group_stride : rows * cols;
  POUNCE_CHECK(row_stride >= cols && group_stride > 0, "weight strides (group ", group_stride, ", row ",
               row_stride, ") do not hold ", rows, " x ", cols,
               " matrices; fix: pass the view's own strides");
  Bf16TensorMapSpec spec;
  spec.base = w.data;
  spec.rank = 3;
  spec.dims[0] = static_cast<uint64_t>(cols);
  spec.dims[1] = static_cast<uint64_t>(rows);
  spec.dims[2] = static_cast<uint64_t>(num_groups);
  spec.strides_bytes[0] = static_cast<uint64_t>(row_stride) * 2;
  spec.strides_bytes[1] = static_cast<uint64_t>(group_stride) * 2;
  spec.box[0] = box_cols;
  spec.box[1] = box_rows;
  spec.box[2] = 1;
  return make_bf16_tensor_map_sw128(spec);
}

// Activation rows [max_rows, k], K-major tiles of BLOCK_M rows x BLOCK_K.
CUtensorMap activation_map(const GroupedRows& rows, const void* a, int64_t k) {
  return matrix_map(a, rows.max_rows, k, k, GemmConfig::BLOCK_K, GemmConfig::BLOCK_M);
}

// Activation rows [max_rows, ld] read MN-major: columns [0, cols) in boxes of 64 x BLOCK_K rows.
CUtensorMap transposed_activation_map(const GroupedRows& rows, const void* a, int64_t ld, int64_t cols) {
  return matrix_map(a, rows.max_rows, cols, ld, GemmConfig::kBoxMN, GemmConfig::BLOCK_K);
}

// Weights [num_groups, n, k], K-major tiles of box_rows x BLOCK_K.
CUtensorMap weight_map(WeightRows w, int num_groups, int64_t n, int64_t k, uint32_t box_rows) {
  return grouped_matrix_map(w, num_groups, n, k, GemmConfig::BLOCK_K, box_rows);
}

// Weights [num_groups, rows, cols] read transposed: boxes of 64 contiguous columns x BLOCK_K rows.
CUtensorMap transposed_weight_map(WeightRows w, int num_groups, int64_t rows, int64_t cols) {
  return grouped_matrix_map(w, num_groups, rows, cols, GemmConfig::kBoxMN, GemmConfig::BLOCK_K);
}

// The bf16 outputs of a kind whose epilogue goes through the store chunks (tma_store.cuh), as TMA store
// targets: [capacity rows, n] with the arguments' row stride, boxes of 64 x 64. C, or g, u and act.
template <KernelKind kKind>
gemm::OutputMaps output_maps(const gemm::GroupedGemmArgs& args) {
  gemm::OutputMaps maps{};
  if constexpr (gemm::epilogue_layout(gemm::gemm_kind(kKind).epilogue).chunks > 0) {
    const int64_t rows = static_cast<int64_t>(args.max_m_blocks) * GemmConfig::BLOCK_M;
    const bool gate_up = gemm::gemm_kind(kKind).epilogue == gemm::Epilogue::kGateUpActivation;
    int i = 0;
    for (const void* out : {static_cast<const void*>(args.out0), static_cast<const void*>(args.out1),
                            static_cast<const void*>(args.out2)}) {
      if (i == 0 || gate_up)
        maps.out[i] = matrix_map(out, rows, args.n, args.out_ld, GemmConfig::kStoreChunkCols, 64);
      ++i;
    }
  }
  return maps;
}

template <KernelKind kKind>
void launch(GemmOperands operands, int64_t max_tiles, int max_ctas, cudaStream_t stream) {
  const GemmDevice& info = gemm_device();
  if (operands.args.error_flag == nullptr) operands.args.error_flag = info.error_flag;
  const int ctas = max_ctas > 0 ? std::min(max_ctas, info.num_sms) : info.num_sms;
  const int grid = static_cast<int>(std::min<int64_t>(ctas, max_tiles));
  gemm::grouped_gemm_kernel<kKind><<<grid, GemmConfig::kNumThreads, shared_bytes_of<kKind>(), stream>>>(
      operands.a, operands.b0, operands.b1, output_maps<kKind>(operands.args), operands.args);
  POUNCE_GEMM_CUDA_CHECK(cudaGetLastError());
}

// A ping-pong kernel (weight_grad_pingpong.cuh, activation_backward_pingpong.cuh): A and B maps, the args.
using PingPongKernel = void (*)(CUtensorMap, CUtensorMap, gemm::GroupedGemmArgs);
void launch_pingpong(PingPongKernel kernel, GemmOperands operands, int64_t max_tiles, int max_ctas,
                     cudaStream_t stream) {
  const GemmDevice& info = gemm_device();
  if (operands.args.error_flag == nullptr) operands.args.error_flag = info.error_flag;
  const int ctas = max_ctas > 0 ? std::min(max_ctas, info.num_sms) : info.num_sms;
  const int grid = static_cast<int>(std::min<int64_t>(ctas, max_tiles));
  kernel<<<grid, GemmConfig::kNumThreads, gemm::kPingPongSharedBytes, stream>>>(operands.a, operands.b0,
                                                                                operands.args);
  POUNCE_GEMM_CUDA_CHECK(cudaGetLastError());
}

// Upper bound of the tiles of a row-grouped GEMM: every row block of the capacity times the column blocks.
int64_t row_tiles(const GroupedRows& rows, int64_t n, int out_block_n) {
  return rows.max_rows / GemmConfig::BLOCK_M * ((n + out_block_n - 1) / out_block_n);
}

// The fields every GEMM shares: which rows, how many groups, the problem extents.
gemm::GroupedGemmArgs base_args(const GroupedRows& rows, int64_t n, int64_t k) {
  gemm::GroupedGemmArgs args{};
  args.group_row_offset = rows.group_row_offset;
  args.group_rows = rows.group_rows;
  args.group_active = rows.group_active;
  args.num_groups = rows.num_groups;
  args.error_flag = rows.error_flag;
  args.inject_failure = rows.inject_failure;
  args.max_m_blocks = static_cast<int32_t>(rows.max_rows / GemmConfig::BLOCK_M);
  args.n = static_cast<int32_t>(n);
  args.k = static_cast<int32_t>(k);
  args.k_split = static_cast<int32_t>(k);
  args.out_ld = n;
  return args;
}

}  // namespace

CUtensorMap activation_rows_map(const void* a, int64_t rows, int64_t k) {
  return matrix_map(a, rows, k, k, GemmConfig::BLOCK_K, GemmConfig::BLOCK_M);
}

CUtensorMap weight_rows_map(WeightRows w, int num_groups, int64_t n, int64_t k, uint32_t box_rows) {
  return weight_map(w, num_groups, n, k, box_rows);
}

GemmOperands store_operands(const GroupedRows& rows, const void* a, WeightRows b, void* c, int64_t n,
                            int64_t k) {
  check_common(rows, a, n, k);
  check_output(b.data, "b");
  check_output(c, "c");
  GemmOperands o{};
  o.args = base_args(rows, n, k);
  o.args.out0 = static_cast<__nv_bfloat16*>(c);
  if (rows.max_rows == 0) return o;  // no rows to map: the launchers stop here
  o.a = activation_map(rows, a, k);
  o.b0 = o.b1 = weight_map(b, rows.num_groups, n, k, GemmConfig::BLOCK_N);
  return o;
}

GemmOperands gate_up_operands(const GroupedRows& rows, const void* a, WeightRows w_gate, WeightRows w_up,
                              void* g, void* u, void* act, int64_t n, int64_t k,
                              const ActivationParams& activation) {
  check_common(rows, a, n, k);
  check_output(w_gate.data, "w_gate");
  check_output(w_up.data, "w_up");
  check_output(g, "g");
  check_output(u, "u");
  check_output(act, "act");
  POUNCE_CHECK(activation.kind == kActivationSwiGLU || activation.kind == kActivationGptOss,
               "ActivationParams.kind = ", activation.kind, " unknown; fix: 0 (SwiGLU) or 1 (GPT-OSS)");
  POUNCE_CHECK(activation.clamp_limit > 0.f, "ActivationParams.clamp_limit = ", activation.clamp_limit,
               " must be positive; fix: +inf for no clamp");
  GemmOperands o{};
  o.args = base_args(rows, n, k);
  o.args.out0 = static_cast<__nv_bfloat16*>(g);
  o.args.out1 = static_cast<__nv_bfloat16*>(u);
  o.args.out2 = static_cast<__nv_bfloat16*>(act);
  o.args.activation = activation;
  if (rows.max_rows == 0) return o;  // no rows to map: the launchers stop here
  o.a = activation_map(rows, a, k);
  o.b0 = weight_map(w_gate, rows.num_groups, n, k, GemmConfig::BLOCK_N / 2);
  o.b1 = weight_map(w_up, rows.num_groups, n, k, GemmConfig::BLOCK_N / 2);
  return o;
}

GemmOperands activation_backward_operands(const GroupedRows& rows, const void* a, WeightRows w, const void* g,
                                          const void* u, void* d_g, void* d_u, int64_t d_ld, int64_t n,
                                          int64_t k, const ActivationParams& activation) {
  check_common(rows, a, n, k);
  check_output(w.data, "w");
  check_output(g, "g");
  check_output(u, "u");
  check_output(d_g, "d_g");
  check_output(d_u, "d_u");
  POUNCE_CHECK(d_ld >= n && d_ld % 8 == 0, "d_ld = ", d_ld, " must be >= n = ", n, " and a multiple of 8");
  GemmOperands o{};
  o.args = base_args(rows, n, k);
  o.args.out0 = static_cast<__nv_bfloat16*>(d_g);
  o.args.out1 = static_cast<__nv_bfloat16*>(d_u);
  o.args.out_ld = d_ld;
  o.args.in0 = static_cast<const __nv_bfloat16*>(g);
  o.args.in1 = static_cast<const __nv_bfloat16*>(u);
  o.args.activation = activation;
  if (rows.max_rows == 0) return o;  // no rows to map: the launchers stop here
  o.a = activation_map(rows, a, k);
  o.b0 = o.b1 = transposed_weight_map(w, rows.num_groups, k, n);
  return o;
}

GemmOperands transposed_operands(const GroupedRows& rows, const void* a, WeightRows b0, WeightRows b1,
                                 int64_t k_split, void* c, int64_t n, int64_t k) {
  check_common(rows, a, n, k);
  check_output(b0.data, "b0");
  check_output(c, "c");
  POUNCE_CHECK(k_split > 0 && k_split <= k && k_split % GemmConfig::BLOCK_K == 0, "k_split = ", k_split,
               " must be a positive multiple of ", GemmConfig::BLOCK_K, " and <= k = ", k);
  POUNCE_CHECK(k_split == k || b1.data != nullptr, "b1 is null but k_split = ", k_split, " < k = ", k);
  GemmOperands o{};
  o.args = base_args(rows, n, k);
  o.args.k_split = static_cast<int32_t>(k_split);
  o.args.out0 = static_cast<__nv_bfloat16*>(c);
  if (rows.max_rows == 0) return o;  // no rows to map: the launchers stop here
  o.a = activation_map(rows, a, k);
  o.b0 = transposed_weight_map(b0, rows.num_groups, k_split, n);
  o.b1 = k_split == k ? o.b0 : transposed_weight_map(b1, rows.num_groups, k - k_split, n);
  return o;
}

GemmOperands weight_grad_operands(const GroupedRows& rows, const void* a, int64_t a_ld, int64_t m,
                                  const void* b, int64_t b_ld, int64_t n, void* d, WeightGradMode mode) {
  check_common(rows, a, n, /*k=*/64);
  POUNCE_CHECK(m >= 64 && m % 64 == 0 && m < (int64_t{1} << 24), "m = ", m,
               " must be a positive multiple of 64; fix: pad the weight rows");
  POUNCE_CHECK(a_ld >= m && a_ld % 8 == 0 && b_ld >= n && b_ld % 8 == 0, "row strides a_ld = ", a_ld,
               ", b_ld = ", b_ld, " must cover m = ", m, ", n = ", n, " and be multiples of 8");
  check_output(b, "b");
  check_output(d, "d");
  POUNCE_CHECK(mode == WeightGradMode::kStoreF32 || mode == WeightGradMode::kAccumulateF32 ||
                   mode == WeightGradMode::kStoreBf16,
               "WeightGradMode ", static_cast<int>(mode), " unknown");
  GemmOperands o{};
  o.args = base_args(rows, n, /*k=*/0);
  o.args.m = static_cast<int32_t>(m);
  o.args.weight_grad = d;
  o.args.weight_grad_mode = mode;
  if (rows.max_rows == 0) return o;  // no rows to map: the launchers stop here
  o.a = transposed_activation_map(rows, a, a_ld, m);
  o.b0 = o.b1 = transposed_activation_map(rows, b, b_ld, n);
  return o;
}

void grouped_gemm(const GroupedRows& rows, const void* a, WeightRows b, void* c, int64_t n, int64_t k,
                  cudaStream_t stream) {
  const GemmOperands operands = store_operands(rows, a, b, c, n, k);
  if (rows.max_rows == 0) return;
  launch<KernelKind::kForwardStore>(operands, row_tiles(rows, n, GemmConfig::BLOCK_N), rows.max_ctas, stream);
}

void grouped_gate_up(const GroupedRows& rows, const void* a, WeightRows w_gate, WeightRows w_up, void* g,
                     void* u, void* act, int64_t n, int64_t k, const ActivationParams& activation,
                     cudaStream_t stream) {
  const GemmOperands operands = gate_up_operands(rows, a, w_gate, w_up, g, u, act, n, k, activation);
  if (rows.max_rows == 0) return;
  launch<KernelKind::kForwardGateUp>(operands, row_tiles(rows, n, GemmConfig::BLOCK_N / 2), rows.max_ctas,
                                     stream);
}

void grouped_activation_backward(const GroupedRows& rows, const void* a, WeightRows w, const void* g,
                                 const void* u, void* d_g, void* d_u, int64_t d_ld, int64_t n, int64_t k,
                                 const ActivationParams& activation, cudaStream_t stream,
                                 TileSchedule schedule) {
  const GemmOperands operands =
      activation_backward_operands(rows, a, w, g, u, d_g, d_u, d_ld, n, k, activation);
  if (rows.max_rows == 0) return;
  if (schedule == TileSchedule::kCooperative) {
    launch<KernelKind::kDataGradActivation>(operands, row_tiles(rows, n, GemmConfig::BLOCK_N), rows.max_ctas,
                                            stream);
    return;
  }
  POUNCE_CHECK(schedule == TileSchedule::kPingPong, "TileSchedule ", static_cast<int>(schedule),
               " unknown; fix: kPingPong or kCooperative");
  launch_pingpong(gemm::activation_backward_pingpong_kernel, operands,
                  row_tiles(rows, n, gemm::PingPongConfig::TILE_N), rows.max_ctas, stream);
}

void grouped_gemm_transposed(const GroupedRows& rows, const void* a, WeightRows b0, WeightRows b1,
                             int64_t k_split, void* c, int64_t n, int64_t k, cudaStream_t stream) {
  const GemmOperands operands = transposed_operands(rows, a, b0, b1, k_split, c, n, k);
  if (rows.max_rows == 0) return;
  launch<KernelKind::kDataGrad>(operands, row_tiles(rows, n, GemmConfig::BLOCK_N), rows.max_ctas, stream);
}

void grouped_weight_grad(const GroupedRows& rows, const void* a, int64_t a_ld, int64_t m, const void* b,
                         int64_t b_ld, int64_t n, void* d, WeightGradMode mode, cudaStream_t stream,
                         TileSchedule schedule) {
  const GemmOperands operands = weight_grad_operands(rows, a, a_ld, m, b, b_ld, n, d, mode);
  // Capacity zero still owes zero gradients to every group: write them without a GEMM.
  if (rows.max_rows == 0) {
    const size_t element = mode == WeightGradMode::kStoreBf16 ? 2 : 4;
    if (mode != WeightGradMode::kAccumulateF32)
      POUNCE_GEMM_CUDA_CHECK(cudaMemsetAsync(d, 0, element * rows.num_groups * m * n, stream));
    return;
  }
  if (schedule == TileSchedule::kCooperative) {
    const int64_t count = rows.num_groups * ((m + GemmConfig::BLOCK_M - 1) / GemmConfig::BLOCK_M) *
                          ((n + GemmConfig::BLOCK_N - 1) / GemmConfig::BLOCK_N);
    launch<KernelKind::kWeightGrad>(operands, count, rows.max_ctas, stream);
    return;
  }
  POUNCE_CHECK(schedule == TileSchedule::kPingPong, "TileSchedule ", static_cast<int>(schedule),
               " unknown; fix: kPingPong or kCooperative");
  using gemm::PingPongConfig;
  const int64_t count = rows.num_groups * ((m + PingPongConfig::TILE_M - 1) / PingPongConfig::TILE_M) *
                        ((n + PingPongConfig::TILE_N - 1) / PingPongConfig::TILE_N);
  launch_pingpong(gemm::weight_grad_pingpong_kernel, operands, count, rows.max_ctas, stream);
}

int32_t grouped_gemm_error_code(bool reset) {
  const GemmDevice& info = gemm_device();
  POUNCE_GEMM_CUDA_CHECK(cudaDeviceSynchronize());
  int32_t code = 0;
  POUNCE_GEMM_CUDA_CHECK(cudaMemcpy(&code, info.error_flag, sizeof(code), cudaMemcpyDeviceToHost));
  if (reset) POUNCE_GEMM_CUDA_CHECK(cudaMemset(info.error_flag, 0, sizeof(code)));
  return code;
}

}  // namespace pounce::kernels
