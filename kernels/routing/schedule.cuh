// Receive schedule (docs/design.md §2), built on the device from the exchanged routing; mirrors
// reference::build_schedule exactly.
//
// Rank r owns experts [r*El, (r+1)*El). For local expert le, the pairs (src, token, slot) with
// routing_idx[src][token*k + slot] == r*El + le are numbered per source in ascending (token, slot)
// order: pair i of source s. Sources interleave round-robin, so that pair lands at
//   row(le, s, i) = group_row_offset[le] + sum_{s'} min(count[le][s'], i) + #{s' < s : count[le][s'] > i}
// and each segment is padded with {-1,-1,-1} rows up to a multiple of BLOCK_M = 128.
//
// Three steps, no atomics on positions (so the table is identical on every run); each a device function that
// the staged path runs as a kernel and the fused forward inside its launch (kernels/fused/grid_steps.cuh):
//   count : one warp per (source, chunk of kScheduleChunk entries): pairs per local expert in the chunk
//   scan  : one block: exclusive chunk bases per (source, expert), totals, padded segment offsets, padding
//   place : the count warps again: rank of a pair inside its chunk (warp match + running counters in
//           shared memory, in entry order) + chunk base = i; write the row.
// Ids outside [-1, E) are skipped and recorded ("topk_idx value out of range"); rows beyond
// rows_capacity (only possible with duplicate ids in a token) are dropped and recorded: never an
// out-of-bounds write.
#pragma once

#include <cstdint>

#include "kernels/common/flags.cuh"
#include "kernels/layout/workspace_layout.cuh"

namespace pounce::kernels::routing {

inline constexpr int kScheduleWarpsPerBlock = 4;
inline constexpr int kScheduleThreads = kScheduleWarpsPerBlock * 32;
static_assert(layout::kScheduleChunk % 32 == 0, "a schedule chunk is a whole number of warp steps");

struct SourceRouting {
  const int32_t* idx;   // [T_s * k] of source s, in this rank's symmetric allocation
  int64_t num_entries;  // T_s * k
};

__device__ __forceinline__ SourceRouting source_routing(const layout::WorkspacePointers& ws, int src) {
  const int32_t num_tokens = ws.local_sym<const int32_t>(ws.sym_routing_tokens)[src];
  const int64_t tokens = num_tokens < 0 ? 0 : (num_tokens > ws.max_tokens ? ws.max_tokens : num_tokens);
  return {ws.local_sym<const int32_t>(ws.sym_routing_idx) + src * ws.routing_stride, tokens * ws.num_topk};
}

// Walks one chunk of a source's entries in (token, slot) order, 32 at a time. For every entry that
// names a local expert, calls on_pair(entry, local_expert, rank_in_chunk) where rank_in_chunk counts the
// earlier entries of the chunk with the same expert. `counters` ([El], this warp's) ends holding the
// per-expert totals of the chunk. When `report` is set, ids outside [-1, E) are recorded.
template <typename OnPair>
__device__ __forceinline__ void walk_chunk(const layout::WorkspacePointers& ws, const SourceRouting& source,
                                           int src, int64_t chunk, int32_t* counters, bool report,
                                           OnPair on_pair) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int El = ws.num_local_experts;
  const int first_expert = ws.rank * El;
  for (int e = lane; e < El; e += 32) counters[e] = 0;
  __syncwarp();
  const uint32_t lanes_below = (1u << lane) - 1u;
  const int64_t chunk_begin = chunk * layout::kScheduleChunk;
  for (int64_t step = 0; step < layout::kScheduleChunk; step += 32) {
    const int64_t entry = chunk_begin + step + lane;
    int32_t expert = -1;
    if (entry < source.num_entries) {
      expert = source.idx[entry];
      if (expert < -1 || expert >= ws.num_experts) {
        if (report) {
          flags::record_error(ws, layout::DeviceErrorCode::kExpertOutOfRange, 0, src, ws.num_experts, expert,
                              entry / ws.num_topk, entry % ws.num_topk);
        }
        expert = -1;
      }
    }
    const bool mine = expert >= first_expert && expert < first_expert + El;
    const int local = mine ? expert - first_expert : -1;
    const uint32_t same = __match_any_sync(0xffffffffu, local);
    int32_t base = 0;
    if (mine) base = counters[local];
    __syncwarp();
    if (mine) {
      on_pair(entry, local, base + __popc(same & lanes_below));
      if ((same & lanes_below) == 0) counters[local] = base + __popc(same);  // lowest lane of the group
    }
    __syncwarp();
  }
}

// ---- count: chunk_counts[s][chunk][le] = pairs of source s, chunk `chunk`, for local expert le ----
// One warp per (source, chunk); `counters` is this warp's [El] int32 in shared memory.
__device__ __forceinline__ void schedule_count_chunk(const layout::WorkspacePointers& ws, int src,
                                                     int64_t chunk, int32_t* counters) {
  const SourceRouting source = source_routing(ws, src);
  walk_chunk(ws, source, src, chunk, counters, /*report=*/true, [](int64_t, int, int32_t) {});
  int32_t* out = ws.chunk_counts + (src * ws.max_chunks + chunk) * ws.num_local_experts;
  for (int e = static_cast<int>(threadIdx.x % 32); e < ws.num_local_experts; e += 32) out[e] = counters[e];
}

// ---- scan (one block): chunk bases, counts per (expert, source), segment offsets, padding rows ----
// The scan's shared memory. The standalone kernel declares it; the fused kernel lends it from its stage ring,
// whose static shared memory must stay small (above ~196 KB in all the SM gives up most of its L1).
struct ScanScratch {
  static constexpr int kMaxThreads = 1024;
  int64_t warp_rows[32];
  int32_t
      per_thread[kMaxThreads];    // a run's chunk total in the chunk scan, then a segment's first padding row
  uint8_t pad_rows[kMaxThreads];  // padding rows of a segment: fewer than BLOCK_M
};

__device__ __forceinline__ void schedule_scan(const layout::WorkspacePointers& ws, ScanScratch& scratch) {
  constexpr int kScanBatch = 16;  // chunk counts per batch: all its loads are in flight before any store
  const int El = ws.num_local_experts, R = ws.num_ranks, num_pairs = El * R;
  const int thread = static_cast<int>(threadIdx.x), num_threads = static_cast<int>(blockDim.x);
  const int lane = thread % 32, warp = thread / 32, num_warps = num_threads / 32;
  int32_t* per_thread = scratch.per_thread;
  uint8_t* pad_rows = scratch.pad_rows;
  int64_t* warp_rows = scratch.warp_rows;

  // Exclusive scan over chunks, in place, per (source, expert); totals into expert_src_count. Consecutive
  // threads take consecutive experts of one source, so every chunk's loads coalesce. When the block has
  // room, a column's chunks are split into `parts` runs of whole batches, one thread each: each run is
  // summed first, the runs' bases come from shared memory, then the run is scanned from its base (int32
  // additions wrap, so the bases match the serial sums bit for bit).
  auto scan_run = [&](int32_t* column, int64_t first, int64_t end, int32_t running) {
    for (; first < end; first += kScanBatch) {
      int32_t* batch = column + first * El;
      const int64_t num_valid = end - first;  // the batch's first num_valid chunks exist
      int32_t count[kScanBatch];
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) count[i] = i < num_valid ? batch[i * El] : 0;
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) {
        if (i < num_valid) batch[i * El] = running;
        running += count[i];
      }
    }
    return running;
  };
  const int64_t num_batches = (ws.max_chunks + kScanBatch - 1) / kScanBatch;
  const int parts = static_cast<int>(min(static_cast<int64_t>(max(1, num_threads / num_pairs)), num_batches));
  if (parts == 1) {
    for (int pair = thread; pair < num_pairs; pair += num_threads) {
      const int src = pair / El, expert = pair % El;
      int32_t* column = ws.chunk_counts + src * ws.max_chunks * El + expert;  // chunk c at column[c * El]
      ws.expert_src_count[expert * R + src] = scan_run(column, 0, ws.max_chunks, 0);
    }
  } else {
    const int64_t span = (num_batches + parts - 1) / parts * kScanBatch;  // chunks per run
    const int pair = thread % num_pairs, part = thread / num_pairs;       // part >= parts: idle
    const int src = pair / El, expert = pair % El;
    int32_t* column = ws.chunk_counts + src * ws.max_chunks * El + expert;
    const int64_t first = part * span, end = part < parts ? min(first + span, ws.max_chunks) : first;
    int32_t count[kScanBatch] = {};  // a one-batch run keeps its counts here for the second pass
    int32_t sum = 0;
    for (int64_t batch = first; batch < end; batch += kScanBatch) {
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) count[i] = i < end - batch ? column[(batch + i) * El] : 0;
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) sum += count[i];
    }
    per_thread[thread] = sum;
    __syncthreads();
    if (part < parts) {
      int32_t running = 0;
      for (int earlier = 0; earlier < part; ++earlier) running += per_thread[earlier * num_pairs + pair];
      if (span == kScanBatch) {
#pragma unroll
        for (int i = 0; i < kScanBatch; ++i) {
          if (i < end - first) column[(first + i) * El] = running;
          running += count[i];
        }
      } else {
        running = scan_run(column, first, end, running);
      }
      if (part == parts - 1) ws.expert_src_count[expert * R + src] = running;
    }
  }
  __syncthreads();

  // Segment offsets: a block prefix sum of the padded segment sizes, blockDim.x experts per tile, clamped
  // to the capacity. The running sums only grow, so the first expert whose sum passes rows_capacity is the
  // one whose exclusive sum does not: the error is recorded once, with the unclamped sum it reached.
  // Padding rows of every segment: the tile's segments handed round the warps through shared memory.
  if (thread == 0) ws.group_row_offset[0] = 0;
  int64_t carry = 0;  // padded rows of the earlier tiles
  for (int tile = 0; tile < El; tile += num_threads) {
    const int expert = tile + thread;
    int64_t rows = 0;
    if (expert < El) {
      for (int src = 0; src < R; ++src) rows += ws.expert_src_count[expert * R + src];
    }
    const int64_t padded = layout::round_up(rows, layout::kBlockM);
    int64_t inclusive = padded;  // within the warp
#pragma unroll
    for (int delta = 1; delta < 32; delta *= 2) {
      const int64_t below = __shfl_up_sync(0xffffffffu, inclusive, delta);
      if (lane >= delta) inclusive += below;
    }
    if (lane == 31) warp_rows[warp] = inclusive;
    __syncthreads();
    int64_t end = carry + inclusive;
    for (int w = 0; w < num_warps; ++w) {
      const int64_t warp_total = warp_rows[w];
      if (w < warp) end += warp_total;
      carry += warp_total;
    }
    const int64_t begin = end - padded;
    const int64_t clamped_begin = min(begin, ws.rows_capacity), clamped_end = min(end, ws.rows_capacity);
    if (expert < El) {
      if (end > ws.rows_capacity && begin <= ws.rows_capacity) {
        flags::record_error(ws, layout::DeviceErrorCode::kScheduleOverflow, 0, -1, ws.rows_capacity, end);
      }
      ws.group_row_offset[expert + 1] = static_cast<int32_t>(clamped_end);
      ws.group_rows[expert] = static_cast<int32_t>(min(clamped_begin + rows, clamped_end) - clamped_begin);
    }
    const int64_t pad_begin = clamped_begin + rows;  // padding rows: [pad_begin, clamped_end)
    const bool padding = pad_begin < clamped_end;
    per_thread[thread] = padding ? static_cast<int32_t>(pad_begin) : 0;
    pad_rows[thread] = padding ? static_cast<uint8_t>(clamped_end - pad_begin) : 0;
    __syncthreads();  // also: every thread has read warp_rows before the next tile rewrites it
    const int tile_experts = min(num_threads, El - tile);
    for (int local = warp; local < tile_experts; local += num_warps) {
      const int64_t first = per_thread[local];
      for (int row = lane; row < pad_rows[local]; row += 32) {
        ws.schedule[first + row] = layout::ScheduleEntry{-1, -1, -1, -1};
      }
    }
  }
}

// ---- place: every pair of one (source, chunk) to its interleaved row (one warp, as count) ----
__device__ __forceinline__ void schedule_place_chunk(const layout::WorkspacePointers& ws, int src,
                                                     int64_t chunk, int32_t* counters) {
  const int El = ws.num_local_experts, R = ws.num_ranks;
  const SourceRouting source = source_routing(ws, src);
  const int32_t* chunk_base = ws.chunk_counts + (src * ws.max_chunks + chunk) * El;
  walk_chunk(ws, source, src, chunk, counters, /*report=*/false, [&](int64_t entry, int local, int32_t rank) {
    const int32_t i = chunk_base[local] + rank;
    const int32_t* count = ws.expert_src_count + local * R;
    int64_t row = ws.group_row_offset[local];
    for (int s = 0; s < R; ++s) row += min(count[s], i) + (s < src && count[s] > i ? 1 : 0);
    if (row < ws.group_row_offset[local + 1]) {
      ws.schedule[row] = layout::ScheduleEntry{src, static_cast<int32_t>(entry / ws.num_topk),
                                               static_cast<int32_t>(entry % ws.num_topk), -1};
    }
  });
}

// The (source, chunk) work items of count and place, R * max_chunks of them, one per warp. `warp` and
// `num_warps` number the warps taking part (a grid of the standalone kernels, or every warp of the fused
// kernel); `counters` is the calling warp's [El] int32 in shared memory.
template <typename PerChunk>
__device__ __forceinline__ void for_each_schedule_chunk(const layout::WorkspacePointers& ws, int64_t warp,
                                                        int64_t num_warps, int32_t* counters,
                                                        PerChunk&& per_chunk) {
  const int64_t num_items = ws.num_ranks * ws.max_chunks;
  for (int64_t item = warp; item < num_items; item += num_warps) {
    per_chunk(ws, static_cast<int>(item / ws.max_chunks), item % ws.max_chunks, counters);
  }
}

// ---- standalone kernels of the staged path ----
__device__ __forceinline__ int32_t* warp_counters(int32_t* smem_counters, int num_local_experts) {
  return smem_counters + static_cast<int>(threadIdx.x / 32) * num_local_experts;
}
// count and place: grid (ceil(max_chunks / 4), R), kScheduleThreads threads, 4 * El int32 of dynamic smem.
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads) schedule_count_kernel(layout::WorkspacePointers ws) {
  static_assert(kNumThreads == kScheduleThreads, "the schedule kernels run kScheduleWarpsPerBlock warps");
  extern __shared__ int32_t smem_counters[];
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kScheduleWarpsPerBlock + threadIdx.x / 32;
  if (chunk >= ws.max_chunks) return;
  schedule_count_chunk(ws, static_cast<int>(blockIdx.y), chunk,
                       warp_counters(smem_counters, ws.num_local_experts));
}
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads) schedule_scan_kernel(layout::WorkspacePointers ws) {
  static_assert(kNumThreads <= ScanScratch::kMaxThreads, "the scan keeps one int32 per thread");
  __shared__ ScanScratch scratch;
  schedule_scan(ws, scratch);
}
template <int kNumThreads>
__global__ void __launch_bounds__(kNumThreads) schedule_place_kernel(layout::WorkspacePointers ws) {
  static_assert(kNumThreads == kScheduleThreads, "the schedule kernels run kScheduleWarpsPerBlock warps");
  extern __shared__ int32_t smem_counters[];
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kScheduleWarpsPerBlock + threadIdx.x / 32;
  if (chunk >= ws.max_chunks) return;
  schedule_place_chunk(ws, static_cast<int>(blockIdx.y), chunk,
                       warp_counters(smem_counters, ws.num_local_experts));
}

}  // namespace pounce::kernels::routing
