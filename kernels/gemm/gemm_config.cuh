// The grouped GEMM's vocabulary, shared by the mainloop (grouped_gemm_kernel.cuh) and its epilogues: the
// kinds of GEMM, tile and pipeline sizes, the kernel arguments and the shared-memory layout.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cstddef>
#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/gemm_types.h"

namespace pounce::kernels::gemm {
// ---------------------------------------------------------------------------------------------------
// Config
// ---------------------------------------------------------------------------------------------------
enum class Epilogue {
  kStore,               // bf16 C
  kGateUpActivation,    // g, u, act = act(g, u)
  kActivationBackward,  // d_a = bf16(acc); d_g, d_u = bf16(act'(g, u) d_a), g and u read from in0 / in1
  kWeightGrad,          // fp32 store, fp32 accumulate or bf16 store (args.weight_grad_mode), rows < m only
};
enum class Major { kK, kMN };  // which extent of an operand is contiguous in memory
enum class Grouping {
  kRows,       // groups own row segments of A and C; B has one matrix per group
  kReduction,  // groups own segments of the reduction rows; C has one matrix per group
};

// What one kernel instantiation computes (a structural template parameter).
struct GemmKind {
  Epilogue epilogue;
  Major a;
  Major b;
  Grouping grouping;
};
// The kinds the layer uses. Kernels are instantiated on this enum (nvcc's host stubs cannot spell a
// class-type template argument); device code works with the GemmKind it names.
enum class KernelKind { kForwardStore, kForwardGateUp, kDataGrad, kDataGradActivation, kWeightGrad };
constexpr GemmKind gemm_kind(KernelKind kind) {
  switch (kind) {
    case KernelKind::kForwardStore:
      return {Epilogue::kStore, Major::kK, Major::kK, Grouping::kRows};
    case KernelKind::kForwardGateUp:
      return {Epilogue::kGateUpActivation, Major::kK, Major::kK, Grouping::kRows};
    case KernelKind::kDataGrad:
      return {Epilogue::kStore, Major::kK, Major::kMN, Grouping::kRows};
    case KernelKind::kDataGradActivation:
      return {Epilogue::kActivationBackward, Major::kK, Major::kMN, Grouping::kRows};
    case KernelKind::kWeightGrad:
      break;
  }
  return {Epilogue::kWeightGrad, Major::kMN, Major::kMN, Grouping::kReduction};
}

enum class WaitError : int32_t { kNone = 0, kFullStage = 1, kEmptyStage = 2, kRowsExceedCapacity = 3 };

struct GemmConfig {
  static constexpr int BLOCK_M = 128;
  static constexpr int BLOCK_N = 256;  // B rows per stage (gate/up: 128 gate + 128 up)
  static constexpr int BLOCK_K = 64;
  static constexpr int kBoxMN = 64;  // MN-major operands arrive in boxes of 64 contiguous elements x BLOCK_K
  static constexpr uint32_t kBoxBytes = kBoxMN * BLOCK_K * 2;
  static constexpr int kNumStages = 4;
  static constexpr int kNumConsumerWarpgroups = 2;
  static constexpr int kNumThreads = 128 * (1 + kNumConsumerWarpgroups);
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kMChunk = 8;  // scheduler: m-blocks that share weights in L2
  static constexpr uint32_t kStageBytesA = BLOCK_M * BLOCK_K * 2;
  static constexpr uint32_t kStageBytesB = BLOCK_N * BLOCK_K * 2;
  static constexpr uint64_t kWaitTimeoutNs = 4'000'000'000ull;  // far above any legitimate stall
  // Epilogue through shared memory (tma_store.cuh): chunks of 64 rows x 64 columns of bf16, one TMA box.
  static constexpr int kStoreChunkCols = 64;
  static constexpr uint32_t kStoreChunkBytes = 64 * kStoreChunkCols * 2;

  static_assert(BLOCK_K * 2 == 128, "a K block must be one 128-byte swizzle row; fix: BLOCK_K = 64 for bf16");
  static_assert(BLOCK_M == 64 * kNumConsumerWarpgroups,
                "each consumer warpgroup owns 64 rows (wgmma m64); fix: BLOCK_M = 64 * consumer warpgroups");
  static_assert(BLOCK_M % kBoxMN == 0 && BLOCK_N % kBoxMN == 0 && kBoxMN * 2 == 128,
                "MN-major tiles are whole 128-byte boxes; fix: BLOCK_M, BLOCK_N multiples of 64");
  static_assert(BLOCK_N == 256, "the mainloop issues wgmma m64n256k16; fix: add a wgmma wrapper for other N");
  static_assert(
      BLOCK_M % BLOCK_K == 0,
      "weight gradients split K at group offsets (multiples of BLOCK_M); fix: BLOCK_M % BLOCK_K == 0");
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kNumConsumerWarpgroups <= 65536,
                "register file overcommitted; fix: lower kConsumerRegs or kProducerRegs");
};

// Output column block width: the full B tile, or half of it for gate/up (gate and up share columns).
template <Epilogue kEpilogue>
inline constexpr int kOutBlockN =
    kEpilogue == Epilogue::kGateUpActivation ? GemmConfig::BLOCK_N / 2 : GemmConfig::BLOCK_N;

struct GroupedGemmArgs {
  const int32_t* group_row_offset;  // [num_groups + 1] rows, multiples of BLOCK_M
  const int32_t* group_rows;        // [num_groups] rows holding data (the rest of a segment is zero padding);
                                    // null = every row of a segment
  int num_groups;
  int32_t max_m_blocks;  // capacity / BLOCK_M (kRows)
  int32_t m;             // output rows per group (kReduction)
  int32_t n;
  int32_t k;
  int32_t k_split;           // MN-major B of kRows: K rows [0, k_split) from tmap_b0, the rest from tmap_b1
  int64_t out_ld;            // row stride of out0 / out1 in elements
  __nv_bfloat16* out0;       // C, g, or d_g
  __nv_bfloat16* out1;       // u, or d_u
  __nv_bfloat16* out2;       // act (gate/up only)
  const __nv_bfloat16* in0;  // g (activation backward), row stride n
  const __nv_bfloat16* in1;  // u (activation backward)
  void* weight_grad;         // [num_groups][m][n] fp32 or bf16
  const int32_t* group_active;  // kReduction: [num_groups], 0 = leave that group's output alone; null = all
  WeightGradMode weight_grad_mode;
  ActivationParams activation;
  int32_t* error_flag;     // first WaitError recorded by any CTA
  int32_t inject_failure;  // tests: non-zero, every stage-ring wait fails at once (GroupedRows)
};

// The outputs of one GEMM as TMA store targets, boxes of 64 rows x 64 columns (128-byte swizzled): C
// (kStore), or g, u, act (gate/up).
struct OutputMaps {
  CUtensorMap out[3];
};

// How a kind's standalone kernel uses its shared memory: `stages` of the ring, then `chunks` store chunks per
// consumer warpgroup (tma_store.cuh; 0 = per-lane global stores), laid out right after those stages (in the
// ring's unused last stage, or past the end of SharedStorage). Chosen per kind on H200 from
// docs/experiments/010-epilogues-through-shared-memory.md (see docs/design.md "Epilogues"). The fused kernels
// keep every stage and store per lane: other CTAs of the same launch read their outputs.
struct EpilogueLayout {
  int stages;
  int chunks;
};
constexpr EpilogueLayout epilogue_layout(Epilogue epilogue) {
  switch (epilogue) {
    case Epilogue::kStore:
    case Epilogue::kGateUpActivation:
      return {GemmConfig::kNumStages - 1, 3};
    case Epilogue::kActivationBackward:
    case Epilogue::kWeightGrad:
      break;
  }
  return {GemmConfig::kNumStages, 0};
}

// ---------------------------------------------------------------------------------------------------
// Shared storage
// ---------------------------------------------------------------------------------------------------
struct SharedStorage {
  struct alignas(1024) Stage {
    __nv_bfloat16 a[GemmConfig::BLOCK_M * GemmConfig::BLOCK_K];  // 16 KB, 128B-swizzled rows of 64
    __nv_bfloat16 b[GemmConfig::BLOCK_N * GemmConfig::BLOCK_K];  // 32 KB
  };
  // The barriers come first, so that a standalone kernel's store chunks can run on past the last stage its
  // ring uses (epilogue_layout below).
  alignas(1024) uint64_t full[GemmConfig::kNumStages];  // producer -> consumers: stage bytes landed
  uint64_t empty[GemmConfig::kNumStages];               // consumers -> producer: stage may be overwritten
  Stage stages[GemmConfig::kNumStages];
};
inline constexpr size_t kSharedBytes = sizeof(SharedStorage) + 1024;  // + slack to align the base
static_assert(kSharedBytes <= 227 * 1024, "shared storage exceeds 227 KB per block; fix: fewer stages");

// Byte offset of the store chunks in SharedStorage, and a standalone kernel's dynamic shared memory.
constexpr size_t store_chunks_offset(EpilogueLayout layout) {
  return offsetof(SharedStorage, stages) + static_cast<size_t>(layout.stages) * sizeof(SharedStorage::Stage);
}
constexpr size_t shared_bytes_for(Epilogue epilogue) {
  const EpilogueLayout layout = epilogue_layout(epilogue);
  const size_t chunks_end = store_chunks_offset(layout) + static_cast<size_t>(layout.chunks) *
                                                              GemmConfig::kNumConsumerWarpgroups *
                                                              GemmConfig::kStoreChunkBytes;
  return (chunks_end > sizeof(SharedStorage) ? chunks_end : sizeof(SharedStorage)) + 1024;
}
static_assert(shared_bytes_for(Epilogue::kStore) <= 227 * 1024 &&
                  shared_bytes_for(Epilogue::kGateUpActivation) <= 227 * 1024 &&
                  shared_bytes_for(Epilogue::kActivationBackward) <= 227 * 1024 &&
                  shared_bytes_for(Epilogue::kWeightGrad) <= 227 * 1024,
              "a kind's stages and store chunks exceed 227 KB per block; fix: epilogue_layout");

// ---------------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------------
__device__ __forceinline__ void record_error(int32_t* flag, WaitError code) {
  atomicCAS(flag, 0, static_cast<int32_t>(code));
}

template <int N>
__device__ __forceinline__ void fence_accumulators(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) ptx::fence_operand(acc[i]);
}

}  // namespace pounce::kernels::gemm
