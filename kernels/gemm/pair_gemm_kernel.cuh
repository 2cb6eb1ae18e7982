// Experiment for the GEMM-bound shapes (issue #4: deepseek-v3 and gpt-oss-120b forward at 540-500 useful
// TFLOP/s against 650-690 for the bare GEMMs and 789 for cuBLAS's dense GEMM): the forward GEMMs (store and
// gate/up) on clusters of two CTAs along M that share each weight tile through TMA multicast. Every stage of
// a CTA then loads 16 KB of A and half of the 32 KB of B (gate/up: rank 0 the gate rows, rank 1 the up rows;
// store: rank 0 all 256 rows), so the L2 -> SM traffic per k-block drops from 48 KB to 32 KB per CTA.
// Selected by POUNCE_GEMM_PAIRS=1 in the standalone launchers only (grouped_gemm.cu); the layer's default
// paths do not use it until it is measured (not run on a GPU yet).
//
// Pairs: cluster c takes pair tiles c, c + clusters, ...; a pair tile is m-blocks 2q, 2q + 1 of one group and
// one n-block, rank r computing m-block 2q + r. When the group has an odd number of m-blocks, rank 1 of its
// last pair computes a copy of rank 0's tile and stores nothing: it must still load its half of B for rank 0.
// Both CTAs walk the same pair tiles with the same K blocks, so their stage rings stay in step.
// Handoffs: full[s] of each CTA completes when its A and both halves of B landed (the peer's multicast
// completes bytes on this CTA's barrier at the same offset); empty[s] counts the consumer warps of BOTH CTAs
// (local arrive + remote arrive), because either producer's multicast overwrites stage s in both CTAs.
// Results are bitwise those of grouped_gemm_kernel: same tiles, same K order, same epilogues.
#pragma once

#include "kernels/gemm/grouped_gemm_kernel.cuh"

namespace pounce::kernels::gemm {

inline constexpr int kPairsPerChunk = GemmConfig::kMChunk / 2;  // pairs sharing a weight n-block in L2

class PairTileScheduler {
 public:
  __device__ PairTileScheduler(const int32_t* group_row_offset, int num_groups, int32_t max_m_blocks,
                               int32_t num_n_blocks)
      : offsets_(group_row_offset),
        num_groups_(num_groups),
        max_m_blocks_(max_m_blocks),
        num_n_blocks_(num_n_blocks),
        tile_idx_(static_cast<int32_t>(blockIdx.x / 2)),
        rank_(static_cast<int32_t>(ptx::cluster_cta_rank())) {
    enter_group(0, 0);
  }

  // The next tile of this CTA; `stored` is false for the copy rank 1 computes past an odd group's end.
  __device__ bool next(Tile& tile, bool& stored) {
    while (true) {
      while (tile_idx_ >= group_end_tile_) {
        if (group_ + 1 >= num_groups_) return false;
        enter_group(group_ + 1, group_end_tile_);
      }
      const int32_t local = tile_idx_ - group_begin_tile_;
      const int32_t chunk_tiles = kPairsPerChunk * num_n_blocks_;
      const int32_t chunk = local / chunk_tiles;
      const int32_t within = local - chunk * chunk_tiles;
      const int32_t chunk_pairs = min(kPairsPerChunk, num_pairs_ - chunk * kPairsPerChunk);
      tile_idx_ += static_cast<int32_t>(gridDim.x / 2);
      const int32_t first = begin_m_ + 2 * (chunk * kPairsPerChunk + within % chunk_pairs);
      if (first >= max_m_blocks_) continue;  // beyond capacity (malformed offsets): both CTAs skip it
      tile.n_block = within / chunk_pairs;
      tile.group = group_;
      tile.m_block = first + rank_;
      stored = tile.m_block < end_m_ && tile.m_block < max_m_blocks_;
      if (!stored) tile.m_block = first;
      return true;
    }
  }

 private:
  __device__ void enter_group(int g, int32_t first_tile) {
    group_ = g;
    begin_m_ = offsets_[g] / GemmConfig::BLOCK_M;
    end_m_ = offsets_[g + 1] / GemmConfig::BLOCK_M;
    num_pairs_ = max(0, (end_m_ - begin_m_ + 1) / 2);
    group_begin_tile_ = first_tile;
    group_end_tile_ = first_tile + num_pairs_ * num_n_blocks_;
  }

  const int32_t* offsets_;
  int num_groups_;
  int32_t max_m_blocks_;
  int32_t num_n_blocks_;
  int32_t tile_idx_;
  int32_t rank_;
  int group_ = 0;
  int32_t begin_m_ = 0, end_m_ = 0, num_pairs_ = 0;
  int32_t group_begin_tile_ = 0, group_end_tile_ = 0;
};

// Loads every K block of one pair tile: this CTA's A, its share of B multicast into both CTAs. False when a
// stage never became free in both CTAs (recorded).
template <GemmKind kKind>
__device__ __forceinline__ bool produce_pair_tile(SharedStorage& ss, RingPosition& ring,
                                                  const CUtensorMap& tmap_a, const CUtensorMap& tmap_b0,
                                                  const CUtensorMap& tmap_b1, const GroupedGemmArgs& args,
                                                  const Tile& tile, uint32_t rank) {
  using C = GemmConfig;
  constexpr uint16_t kBothCtas = 0b11;
  const int32_t row0 = tile.m_block * C::BLOCK_M;
  const int32_t col0 = tile.n_block * kOutBlockN<kKind.epilogue>;
  for (int32_t kb = 0; kb < args.k / C::BLOCK_K; ++kb) {
    if (!ptx::mbarrier_wait_parity_bounded<ptx::WaitScope::kCluster>(&ss.empty[ring.stage], ring.phase ^ 1,
                                                                     C::kWaitTimeoutNs)) {
      record_error(args.error_flag, WaitError::kEmptyStage);
      return false;
    }
    SharedStorage::Stage& st = ss.stages[ring.stage];
    uint64_t* full = &ss.full[ring.stage];
    ptx::mbarrier_arrive_expect_tx(full, C::kStageBytesA + C::kStageBytesB);
    const int32_t k0 = kb * C::BLOCK_K;
    ptx::tma_load_2d(st.a, &tmap_a, full, k0, row0);
    if constexpr (kKind.epilogue == Epilogue::kGateUpActivation) {
      ptx::tma_load_3d_multicast(st.b + rank * (C::BLOCK_N / 2) * C::BLOCK_K, rank == 0 ? &tmap_b0 : &tmap_b1,
                                 full, k0, col0, tile.group, kBothCtas);
    } else if (rank == 0) {
      ptx::tma_load_3d_multicast(st.b, &tmap_b0, full, k0, col0, tile.group, kBothCtas);
    }
    ring.advance();
  }
  return true;
}

// Hands a stage back to BOTH CTAs' producers: either one's multicast overwrites it in both.
struct ReleaseToPair {
  SharedStorage& ss;
  uint32_t peer;
  __device__ void operator()(uint32_t s) const {
    if (threadIdx.x % 32 == 0) {
      ptx::mbarrier_arrive(&ss.empty[s]);
      ptx::mbarrier_arrive_cluster(&ss.empty[s], peer);
    }
  }
};

template <KernelKind kKernelKind>
__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    grouped_gemm_pair_kernel(const __grid_constant__ CUtensorMap tmap_a,
                             const __grid_constant__ CUtensorMap tmap_b0,
                             const __grid_constant__ CUtensorMap tmap_b1, const GroupedGemmArgs args) {
  using C = GemmConfig;
  constexpr GemmKind kKind = gemm_kind(kKernelKind);
  static_assert(kKind.grouping == Grouping::kRows && kKind.a == Major::kK && kKind.b == Major::kK,
                "pairs share a K-major weight tile of one group: the forward kinds only");
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t smem_base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_base);
  const int warpgroup_idx = threadIdx.x / 128;
  const uint32_t rank = ptx::cluster_cta_rank(), peer = rank ^ 1u;

  if (threadIdx.x == 0) {
    ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b0);
    ptx::prefetch_tensor_map(&tmap_b1);
    init_stage_ring(ss, 2 * kConsumerWarps);  // both CTAs' consumer warps
    ptx::fence_mbarrier_init();
  }
  ptx::cluster_sync();  // the peer's barriers exist before anyone multicasts into them or arrives on them

  const int32_t n_blocks = (args.n + kOutBlockN<kKind.epilogue> - 1) / kOutBlockN<kKind.epilogue>;
  if (warpgroup_idx == 0) {
    ptx::setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) {
      PairTileScheduler scheduler(args.group_row_offset, args.num_groups, args.max_m_blocks, n_blocks);
      RingPosition ring;
      Tile tile;
      bool stored = false;
      while (scheduler.next(tile, stored)) {
        if (!produce_pair_tile<kKind>(ss, ring, tmap_a, tmap_b0, tmap_b1, args, tile, rank)) break;
      }
    }
  } else {
    ptx::setmaxnreg_inc<C::kConsumerRegs>();
    const int consumer_idx = warpgroup_idx - 1;
    PairTileScheduler scheduler(args.group_row_offset, args.num_groups, args.max_m_blocks, n_blocks);
    RingPosition ring;
    float acc[128];
    Tile tile;
    bool stored = false;
    while (scheduler.next(tile, stored)) {
      if (!multiply_tile<kKind>(ss, ring, args, 0, args.k / C::BLOCK_K, consumer_idx, acc,
                                ReleaseToPair{ss, peer}))
        break;
      if (stored) store_tile<kKind>(acc, args, tile, true, consumer_idx);
    }
  }
  // No CTA leaves while its peer may still multicast into it or arrive on its barriers. Every wait above is
  // bounded, so both CTAs get here even after a failure.
  ptx::cluster_sync();
}

}  // namespace pounce::kernels::gemm
