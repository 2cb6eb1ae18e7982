// Persistent tile scheduler over expert-grouped rows: CTA b visits tiles b, b + grid, b + 2 grid, ...
//
// Tiles are numbered group by group (group g owns m-blocks [offset[g] / BLOCK_M, offset[g + 1] / BLOCK_M)).
// Inside a group, m-blocks are visited in chunks of kMChunk: all n-blocks of one chunk, m fastest, before
// the next chunk. Concurrent CTAs then share both the chunk's A rows and each weight n-block in L2, even for
// a single huge group (the shared expert). The valid row count is read on the device, never on the host.
#pragma once

#include <cstdint>

namespace pounce::kernels::gemm {

struct Tile {
  int32_t m_block;  // global row block: rows [m_block * BLOCK_M, +BLOCK_M)
  int32_t n_block;  // output column block
  int32_t group;    // expert (weight) index
};

template <int BLOCK_M, int kMChunk>
class TileScheduler {
 public:
  // group_row_offset[0] may exceed 0 (a slice of the groups). It is read with plain loads: it was written by
  // an earlier kernel in stream order.
  __device__ TileScheduler(const int32_t* group_row_offset, int num_groups, int32_t max_m_blocks,
                           int32_t num_n_blocks)
      : offsets_(group_row_offset),
        num_groups_(num_groups),
        max_m_blocks_(max_m_blocks),
        num_n_blocks_(num_n_blocks),
        tile_idx_(static_cast<int32_t>(blockIdx.x)) {
    // Tiles are numbered from global row block 0, so a launch over a slice of the groups (a pipeline
    // chunk whose offsets start above 0) starts counting at its first row block.
    num_tiles_ = (offsets_[num_groups_] / BLOCK_M) * num_n_blocks_;
    begin_m_ = offsets_[0] / BLOCK_M;
    end_m_ = offsets_[1] / BLOCK_M;
    tile_idx_ += begin_m_ * num_n_blocks_;
  }

  __device__ bool next(Tile& tile) {
    while (tile_idx_ < num_tiles_) {
      while (group_ + 1 < num_groups_ && tile_idx_ >= end_m_ * num_n_blocks_) {
        ++group_;
        begin_m_ = offsets_[group_] / BLOCK_M;
        end_m_ = offsets_[group_ + 1] / BLOCK_M;
      }
      const int32_t local = tile_idx_ - begin_m_ * num_n_blocks_;
      const int32_t chunk_tiles = kMChunk * num_n_blocks_;
      const int32_t chunk = local / chunk_tiles;
      const int32_t within = local - chunk * chunk_tiles;
      const int32_t group_m_blocks = end_m_ - begin_m_;
      const int32_t chunk_m_blocks = min(kMChunk, group_m_blocks - chunk * kMChunk);
      tile_idx_ += static_cast<int32_t>(gridDim.x);
      if (chunk_m_blocks <= 0) continue;  // only with malformed (decreasing) offsets
      tile.m_block = begin_m_ + chunk * kMChunk + within % chunk_m_blocks;
      tile.n_block = within / chunk_m_blocks;
      tile.group = group_;
      if (tile.m_block >= max_m_blocks_) continue;  // beyond capacity: never touch those rows
      return true;
    }
    return false;
  }

 private:
  const int32_t* offsets_;
  int num_groups_;
  int32_t max_m_blocks_;
  int32_t num_n_blocks_;
  int32_t tile_idx_;
  int32_t num_tiles_ = 0;
  int group_ = 0;
  int32_t begin_m_ = 0;
  int32_t end_m_ = 0;
};

// Weight-gradient scheduler: every group (expert) owns the same [m, n] output; the group splits the
// reduction instead, over its rows [offset[g], offset[g + 1]). Tiles are numbered group by group, n-block
// major and m fastest inside a group, so concurrent CTAs read the same rows of the same expert.
template <int BLOCK_M, int BLOCK_N>
class ReductionTileScheduler {
 public:
  // `active` (device [num_groups], may be null): groups whose entry is 0 are skipped, their output untouched.
  __device__ ReductionTileScheduler(int num_groups, int32_t m, int32_t n, const int32_t* active = nullptr)
      : num_m_blocks_((m + BLOCK_M - 1) / BLOCK_M),
        tiles_per_group_(num_m_blocks_ * ((n + BLOCK_N - 1) / BLOCK_N)),
        num_tiles_(tiles_per_group_ * num_groups),
        tile_idx_(static_cast<int32_t>(blockIdx.x)),
        active_(active) {}

  __device__ bool next(Tile& tile) {
    while (tile_idx_ < num_tiles_) {
      tile.group = tile_idx_ / tiles_per_group_;
      const int32_t within = tile_idx_ - tile.group * tiles_per_group_;
      tile.m_block = within % num_m_blocks_;
      tile.n_block = within / num_m_blocks_;
      tile_idx_ += static_cast<int32_t>(gridDim.x);
      if (active_ != nullptr && active_[tile.group] == 0) continue;
      return true;
    }
    return false;
  }

 private:
  int32_t num_m_blocks_;
  int32_t tiles_per_group_;
  int32_t num_tiles_;
  int32_t tile_idx_;
  const int32_t* active_;
};

}  // namespace pounce::kernels::gemm
