// What the fused kernels (fused_forward.cuh, fused_backward.cuh) share: the GPU-scope counters and their
// bounded waits, the per-CTA task handoff, the communication CTAs' pull/push loop and the scatter epilogue.
//
// Both kernels run the same shape of work (docs/design.md §2): per minibatch ("unit") of routed m-blocks, the
// communication CTAs pull rows from the token owners (forward: x; backward: w * d_out), a first GEMM
// (gate/up; d_a with the activation backward) and a second GEMM that reads the first one's output of the
// same m-block (down; d_x), then the second GEMM's rows go back to the owners' (token, slot) slots, pushed
// by the communication CTAs or scattered by the second GEMM's epilogue.
//
// Counters (ws.fused_counters, zeroed before every launch; layout::kFused* header):
//   rows_ready[j]           routed unit j's rows pulled: +1 per communication CTA
//   rows_done[j]            unit j's second-GEMM tiles stored: +1 per consumer warpgroup (push combine only)
//   first_done(shared, m)   m-block m's first-GEMM tiles stored: +1 per consumer warpgroup
// Writers release at GPU scope after their stores (and fence.proxy.async, since TMA reads the rows); readers
// acquire, then fence.proxy.async before their TMA loads. Every wait is bounded, gives up at once when
// another CTA failed (the abort word), and names itself in the error record.
#pragma once

#include <cuda.h>

#include <new>
#include <type_traits>

#include "kernels/combine/combine.cuh"
#include "kernels/common/flags.cuh"
#include "kernels/common/named_barriers.cuh"
#include "kernels/common/warp.cuh"
#include "kernels/fused/profile.cuh"
#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "kernels/layout/workspace_layout.cuh"
#include "kernels/sched/forward_tasks.cuh"

namespace pounce::kernels::fused {

using kernels::gemm::GemmConfig;
using kernels::gemm::GroupedGemmArgs;
inline constexpr int kWarps = GemmConfig::kNumThreads / 32;
// 16-byte loads in flight per lane when a communication warp pulls a row (warp::copy_16b): 16 take a
// gpt-oss row (5760 B) in one NVLink round trip and a deepseek row (14336 B) in two, where 8 took two and
// four; each round trip also waits for the row's schedule entry first, so the rounds are most of a pull.
inline constexpr int kPullDepth = 16;

// A GEMM kind as a type, for generic lambdas that pick the mainloop's instantiation.
template <kernels::gemm::GemmKind kKind>
struct GemmTag {
  static constexpr kernels::gemm::GemmKind value = kKind;
};

// The counters of one launch, at the places layout::FusedCounterLayout gives them.
struct FusedCounters {
  uint32_t* base;
  layout::FusedCounterLayout at;
  __device__ uint32_t* ticket() const { return base + layout::kFusedTicket; }
  __device__ uint32_t* role() const { return base + layout::kFusedRole; }
  __device__ uint32_t* abort() const { return base + layout::kFusedAbort; }
  __device__ uint32_t* rows_ready(int32_t j) const { return base + at.rows_ready() + j; }
  __device__ uint32_t* rows_done(int32_t j) const { return base + at.rows_done() + j; }
  __device__ uint32_t* first_done(bool shared, int32_t m_block) const {
    return base + at.first_done() + (shared ? 0 : at.token_blocks) + m_block;
  }
  // The fused backward's replay of a macrobatch's forward rows: x rows of unit j pulled, gate/up of an
  // m-block.
  __device__ uint32_t* replay_rows_ready(int32_t j) const { return base + at.replay_rows_ready() + j; }
  __device__ uint32_t* replay_done(int32_t m_block) const { return base + at.replay_done() + m_block; }
  // The fused forward over a macrobatch ring: macrobatch b's ring rows may be overwritten (every down tile
  // stored and, with the push combine, every row pushed).
  __device__ uint32_t* ring_free(int32_t b) const { return base + at.ring_free() + b; }
  // The fused backward: every routed d_a tile stored, +1 per consumer warpgroup (one check for all of them
  // once the weight-gradient tiles start, where the per-m-block counts take a round trip each).
  __device__ uint32_t* routed_first_done_total() const { return base + at.routed_first_done_total(); }
};

__device__ __forceinline__ FusedCounters counters_of(const layout::WorkspacePointers& ws) {
  return {
      ws.fused_counters,
      {ws.rows_capacity / GemmConfig::BLOCK_M, ws.token_capacity / GemmConfig::BLOCK_M, ws.max_macrobatches}};
}

// Per-CTA handoff state beside the GEMM's stage ring: the producer thread takes a ticket, waits for the
// task's inputs and hands it to the consumer warpgroups through a ring of kTaskSlots in shared memory, then
// loads its stages. Tickets are taken just in time (when the previous tile's loads are issued): a deeper
// lookahead (a separate scheduler thread kTaskSlots = 4 tasks ahead) claimed tiles long before they could
// run and cost 25-45 % on every preset (docs/design.md).
inline constexpr int kTaskSlots = 2;
template <typename TaskT>
struct TaskSlots {
  TaskT task[kTaskSlots];
  uint64_t full[kTaskSlots];   // producer -> consumers: task[s] written (1 arrival)
  uint64_t empty[kTaskSlots];  // task[s] read by all 8 consumer warps
  int32_t role;
  int32_t go;                   // communication CTAs: thread 0's decision, broadcast
  uint64_t scheduler_start_ns;  // under ws.profile_tiles: when the producer asked for its next task
  uint64_t task_marks[GemmConfig::kNumConsumerWarpgroups][3];  // ... and TileProfile's marks per warpgroup
};
inline constexpr uint32_t kTaskReaders = 4 * GemmConfig::kNumConsumerWarpgroups;

// Any failure: record it (first one wins) and make every other wait of the kernel give up at once.
__device__ __forceinline__ void fail(const layout::WorkspacePointers& ws, layout::WaitId which, int64_t index,
                                     int64_t expected, int64_t observed) {
  flags::record_error(ws, layout::DeviceErrorCode::kWaitTimeout, static_cast<int32_t>(which),
                      static_cast<int32_t>(index), expected, observed);
  atomicExch(counters_of(ws).abort(), 1u);
}

// `timeout_ns` defaults to the call's; a task with several waits passes what is left of one deadline, so the
// producer never waits longer than the consumers' handoff bound (twice the call's) allows.
__device__ __forceinline__ bool wait_count(const layout::WorkspacePointers& ws, const uint32_t* count,
                                           uint32_t expected, layout::WaitId which, int64_t index,
                                           uint64_t timeout_ns = 0) {
  const uint32_t* abort = counters_of(ws).abort();
  if (ws.injects(which)) {  // tests: as if the bound ran out at once
    if (flags::ld_relaxed_gpu(abort) == 0) fail(ws, which, index, expected, flags::ld_relaxed_gpu(count));
    return false;
  }
  const uint32_t observed =
      flags::wait_count_gpu(count, expected, abort, timeout_ns > 0 ? timeout_ns : ws.timeout_ns);
  if (observed >= expected) return true;
  if (flags::ld_relaxed_gpu(abort) == 0) fail(ws, which, index, expected, observed);
  return false;
}

__device__ __forceinline__ bool aborted(const layout::WorkspacePointers& ws) {
  return flags::ld_relaxed_gpu(counters_of(ws).abort()) != 0;
}

// Thread 0's `decision` (only thread 0's argument counts), known to every thread of the CTA afterwards: a
// communication CTA branches as one, so no thread is left behind at a later __syncthreads.
__device__ __forceinline__ bool cta_broadcast(int32_t& go, bool decision) {
  if (threadIdx.x == 0) go = decision ? 1 : 0;
  __syncthreads();
  const bool value = go == 1;
  __syncthreads();  // go is written again by the next decision
  return value;
}

// K blocks of every tile of a row-grouped GEMM (the whole reduction).
__device__ __forceinline__ int32_t k_blocks(const GroupedGemmArgs& args) {
  return args.k / GemmConfig::BLOCK_K;
}

// The expert owning routed m-block `m_block`: the first e with group_row_offset[e + 1] > its first row.
__device__ __forceinline__ int32_t expert_of_block(const layout::WorkspacePointers& ws, int32_t m_block) {
  const int32_t row = m_block * GemmConfig::BLOCK_M;
  int32_t lo = 0, hi = ws.num_local_experts - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (ws.group_row_offset[mid + 1] <= row)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// A routed m-block's expert and whether its rows 64..127 are all padding, from the scan's offsets and
// group_rows (visible to every compute CTA from its first ticket on). Only the upper half can be: a
// segment pads to fewer than BLOCK_M rows.
template <typename TaskT>
__device__ __forceinline__ void find_routed_block(const layout::WorkspacePointers& ws, int32_t m_block,
                                                  TaskT& task) {
  task.group = expert_of_block(ws, m_block);
  task.upper_half_padding =
      m_block * GemmConfig::BLOCK_M + 64 >= ws.group_row_offset[task.group] + ws.group_rows[task.group];
}

// The routed units of one call, as the communication CTAs see them.
struct CommunicationPlan {
  sched::ForwardTaskShape shape;  // routed_m_blocks, unit_blocks
  bool replay = false;            // the pulls count replay_rows_ready instead of rows_ready
  int32_t comm_ctas;
  bool push_combine;
  uint32_t second_tiles_per_block;  // rows_done[j] reaches this times the unit's m-blocks
  layout::WaitId rows_done_wait;
};

// kRing: the workspace's routed rows are a macrobatch ring (WorkspacePointers::has_ring); its plan (B and the
// bounds) was written in the fused forward's scan step.
__device__ __forceinline__ int32_t ring_macrobatches(const layout::WorkspacePointers& ws) {
  return ws.macrobatch_plan[0];
}
__device__ __forceinline__ const int32_t* ring_bounds(const layout::WorkspacePointers& ws) {
  return ws.macrobatch_plan + 1;
}

// Communication CTA `comm_idx`, the one loop of both kernels, with and without a ring: walks the macrobatches
// in order (without a ring, one spanning every routed row) and each one's units of unit_blocks m-blocks,
// units numbered across macrobatches (j). For each unit it pulls its share of the rows (one warp per row,
// every communication warp a strided share of every unit) and bumps rows_ready[j] (replay_rows_ready in the
// backward's replay); with the push combine it also pushes every unit whose second-GEMM tiles are all stored,
// between pulls and after the last one. Rows live at `row - ring_first` (ring_first = the macrobatch's first
// schedule row over a ring, 0 otherwise).
//   pull_row(row, second, ring_first): kPullPairs: the warp's rows two at a time (`second` negative past the
//     unit's end); otherwise one (`second` is -1).      push_row(row, ring_first): one row to its owner.
// Over a ring, before pulling macrobatch b >= 1 the CTA pushes every unit of b - 2 (push combine; what b -
// 1's tiles wait for) and waits until every gate/up tile of b - 1 is stored (b - 1's x rows are read); after
// its share of a macrobatch's last unit is pushed it counts ring_free[b] (push combine; the down tiles count
// it otherwise).
template <bool kRing, bool kPullPairs, typename PullRow, typename PushRow>
__device__ __forceinline__ void run_communication(const layout::WorkspacePointers& ws, int32_t& go,
                                                  const CommunicationPlan& plan, int32_t comm_idx,
                                                  PullRow&& pull_row, PushRow&& push_row) {
  static_assert(!(kRing && kPullPairs), "the ring pulls one row per warp and round trip");
  const FusedCounters counters = counters_of(ws);
  const sched::ForwardTaskShape& shape = plan.shape;
  const int64_t unit_rows = static_cast<int64_t>(shape.unit_blocks) * GemmConfig::BLOCK_M;
  const int64_t warp = static_cast<int64_t>(comm_idx) * kWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(plan.comm_ctas) * kWarps;
  // Macrobatch b's schedule rows [begin_of(b), end_of(b)).
  auto begin_of = [&](int32_t b) -> int64_t {
    if constexpr (kRing) return ring_bounds(ws)[b];
    return 0;
  };
  auto end_of = [&](int32_t b) -> int64_t {
    if constexpr (kRing) return ring_bounds(ws)[b + 1];
    return static_cast<int64_t>(shape.routed_m_blocks) * GemmConfig::BLOCK_M;
  };
  auto units_of = [&](int32_t b) {
    return static_cast<int32_t>((end_of(b) - begin_of(b) + unit_rows - 1) / unit_rows);
  };
  int32_t num_macrobatches = 1;
  if constexpr (kRing) {
    num_macrobatches = ring_macrobatches(ws);
    if (num_macrobatches ==
        0) {  // overflow (recorded in the scan step) or no rows: poison what was routed here
      const int32_t* row_offset = ws.group_row_offset;
      for (int64_t row = row_offset[0] + warp; row < row_offset[ws.num_local_experts]; row += num_warps)
        combine::poison_row(ws, ws.sym_y_slots, row);
      return;
    }
  }
  // Unit u of macrobatch b: [first, end) and this CTA's rows of it.
  auto unit_first = [&](int32_t b, int32_t u) { return begin_of(b) + u * unit_rows; };
  auto unit_end = [&](int32_t b, int32_t u) { return min(unit_first(b, u) + unit_rows, end_of(b)); };
  auto push_unit = [&](int32_t b, int32_t u) {
    for (int64_t row = unit_first(b, u) + warp; row < unit_end(b, u); row += num_warps)
      push_row(row, begin_of(b));
  };

  // Pushes, in unit order: the next one is unit push_u of macrobatch push_b, global unit next_push.
  int32_t push_b = 0, push_u = 0, next_push = 0;
  auto push_next = [&](bool block) {
    bool ready = false;
    if (threadIdx.x == 0) {
      const int64_t blocks = (unit_end(push_b, push_u) - unit_first(push_b, push_u)) / GemmConfig::BLOCK_M;
      const uint32_t expected = plan.second_tiles_per_block * static_cast<uint32_t>(blocks);
      const uint32_t* done = counters.rows_done(next_push);
      // A poll between pulls is the same wait, unblocked: an injected failure (tests) fails it too.
      ready = block || ws.injects(plan.rows_done_wait)
                  ? wait_count(ws, done, expected, plan.rows_done_wait, next_push)
                  : flags::ld_acquire_gpu(done) >= expected;
    }
    if (!cta_broadcast(go, ready)) return false;
    push_unit(push_b, push_u);
    ++next_push;
    if (++push_u == units_of(push_b)) {
      if constexpr (kRing) {
        __syncthreads();  // every warp's copies out of b's y rows are done
        if (threadIdx.x == 0) flags::red_release_gpu_add(counters.ring_free(push_b), 1u);
      }
      push_u = 0;
      ++push_b;
    }
    return true;
  };

  int32_t j = 0;  // global unit
  for (int32_t b = 0; b < num_macrobatches; ++b) {
    if constexpr (kRing) {
      if (b >= 1) {
        if (plan.push_combine) {
          while (push_b < b - 1) {
            if (!push_next(/*block=*/true)) return;
          }
        }
        bool free = true;
        if (threadIdx.x == 0) {
          const uint32_t expected = 2u * shape.gate_up_n;
          for (int32_t m = ring_bounds(ws)[b - 1] / GemmConfig::BLOCK_M;
               free && m < ring_bounds(ws)[b] / GemmConfig::BLOCK_M; ++m)
            free =
                wait_count(ws, counters.first_done(false, m), expected, layout::WaitId::kFusedGateUpDone, m);
        }
        if (!cta_broadcast(go, free)) return;
      }
    }
    for (int32_t u = 0; u < units_of(b); ++u, ++j) {
      const int64_t end = unit_end(b, u);
      if constexpr (kPullPairs) {
        for (int64_t row = unit_first(b, u) + warp; row < end; row += 2 * num_warps)
          pull_row(row, row + num_warps < end ? row + num_warps : int64_t{-1}, begin_of(b));
      } else {
        for (int64_t row = unit_first(b, u) + warp; row < end; row += num_warps)
          pull_row(row, int64_t{-1}, begin_of(b));
      }
      __syncthreads();  // this CTA's share of unit j has landed
      if (threadIdx.x == 0) {
        kernels::ptx::fence_proxy_async_global();
        flags::red_release_gpu_add(plan.replay ? counters.replay_rows_ready(j) : counters.rows_ready(j), 1u);
      }
      if (plan.push_combine) {
        // Push what is finished already; pulling the next unit comes first otherwise.
        while (next_push <= j && push_next(/*block=*/false)) {
        }
      } else if constexpr (!kRing) {
        continue;
      }
      if (cta_broadcast(go, threadIdx.x == 0 && aborted(ws))) return;
    }
  }
  if (!plan.push_combine) return;
  while (next_push < j) {
    if (!push_next(/*block=*/true)) return;
  }
}

// Scatter epilogue of a second-GEMM tile: row r of the tile belongs to schedule[r] = (src_rank, src_token,
// slot); its bf16 values go straight to peer(src_rank)'s slot region `sym_slots` at (src_token, slot)
// (padding rows nowhere), packed as every bf16 epilogue packs.
__device__ __forceinline__ void store_tile_to_slots(const float (&acc)[128],
                                                    const layout::WorkspacePointers& ws, int64_t sym_slots,
                                                    int32_t n, int32_t m_block, int32_t n_block,
                                                    int consumer_idx) {
  const int64_t row = kernels::gemm::tile_row(m_block, consumer_idx);
  __nv_bfloat16* row_base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const layout::ScheduleEntry entry = ws.schedule[row + 8 * h];
    row_base[h] = entry.src_rank < 0 ? nullptr : combine::slot_row<__nv_bfloat16>(ws, sym_slots, entry);
  }
  kernels::gemm::store_rows_bf16(acc, row_base, n, n_block * GemmConfig::BLOCK_N,
                                 static_cast<int>(threadIdx.x % 32));
}

// Every store of this consumer warpgroup's 64 rows of a tile, then one release of `count` (and of `total`,
// a count over many tiles, when set).
__device__ __forceinline__ void count_tile_stored(uint32_t* count, uint32_t* total, int consumer_idx) {
  warpgroup_sync(NamedBarrier::kTileStored, consumer_idx);
  if (threadIdx.x % 128 == 0) {
    kernels::ptx::fence_proxy_async_global();
    flags::red_release_gpu_add(count, 1u);
    if (total != nullptr) flags::red_release_gpu_add(total, 1u);
  }
}

// Thread 0 of a compute CTA: the stage ring's and the task slots' mbarriers.
template <typename TaskT>
__device__ __forceinline__ void init_compute_barriers(kernels::gemm::SharedStorage& ss,
                                                      TaskSlots<TaskT>& slots) {
  kernels::gemm::init_stage_ring(ss, kernels::gemm::kConsumerWarps);
  for (int s = 0; s < kTaskSlots; ++s) {
    kernels::ptx::mbarrier_init(&slots.full[s], 1);
    kernels::ptx::mbarrier_init(&slots.empty[s], kTaskReaders);
  }
  kernels::ptx::fence_mbarrier_init();
}

// Kernel start: thread 0 takes this CTA's role by arrival; a compute CTA (role >= comm_ctas) initialises
// the stage ring and the task slots. Returns the role, known to every thread.
template <typename TaskT>
__device__ __forceinline__ int32_t start_cta(const layout::WorkspacePointers& ws, int32_t comm_ctas,
                                             kernels::gemm::SharedStorage& ss, TaskSlots<TaskT>& slots) {
  if (threadIdx.x == 0) {
    slots.role = static_cast<int32_t>(atomicAdd(counters_of(ws).role(), 1u));
    if (slots.role >= comm_ctas) init_compute_barriers(ss, slots);
  }
  __syncthreads();
  return slots.role;
}

// A communication CTA whose transfers are all done joins the compute CTAs: it takes tickets from wherever
// the list is (the backward's weight-gradient tail, typically). Its waits are on tiles handed out before or
// on the other communication CTAs, which started first and are resident: no new cycle.
template <typename TaskT>
__device__ __forceinline__ void turn_to_compute(kernels::gemm::SharedStorage& ss, TaskSlots<TaskT>& slots) {
  __syncthreads();  // every warp is out of the communication loop
  if (threadIdx.x == 0) init_compute_barriers(ss, slots);
  __syncthreads();
}

// Producer side of the handoff: waits until slot i % kTaskSlots is free, writes the task, arrives. False
// (recorded) when the consumers never freed it: writing it would flip a phase they have not seen.
template <typename TaskT>
__device__ __forceinline__ bool hand_over(const layout::WorkspacePointers& ws, TaskSlots<TaskT>& slots,
                                          uint32_t i, const TaskT& task) {
  const uint32_t s = i % kTaskSlots;
  const uint32_t phase = (i / kTaskSlots) & 1;
  if (ws.injects(layout::WaitId::kFusedTaskHandoff) ||  // tests: as if the consumers never freed it
      !kernels::ptx::mbarrier_wait_parity_bounded(&slots.empty[s], phase ^ 1, ws.timeout_ns)) {
    fail(ws, layout::WaitId::kFusedTaskHandoff, s, 1, 0);
    return false;
  }
  slots.task[s] = task;
  kernels::ptx::mbarrier_arrive(&slots.full[s]);
  return true;
}

// Consumer side: waits for task i, copies it, frees the slot (one arrival per warp).
template <typename TaskT>
__device__ __forceinline__ bool take_over(const layout::WorkspacePointers& ws, TaskSlots<TaskT>& slots,
                                          uint32_t i, TaskT& task) {
  const uint32_t s = i % kTaskSlots;
  const uint64_t handoff_timeout = 2 * ws.timeout_ns;  // the producer may wait out one timeout first
  if (!kernels::ptx::mbarrier_wait_parity_bounded(&slots.full[s], (i / kTaskSlots) & 1, handoff_timeout)) {
    fail(ws, layout::WaitId::kFusedTaskHandoff, s, 1, 0);
    return false;
  }
  task = slots.task[s];
  __syncwarp();
  if (threadIdx.x % 32 == 0) kernels::ptx::mbarrier_arrive(&slots.empty[s]);
  return true;
}

// Shared-memory home of a scheduler's state (cursor, shape, caches): the producer warpgroup runs on
// kProducerRegs registers, too few to hold it, and one thread reading shared memory costs nothing next to
// its ticket and counter round trips.
template <typename Scheduler>
struct SchedulerStorage {
  alignas(16) unsigned char bytes[sizeof(Scheduler)];
  template <typename... Args>
  __device__ Scheduler& construct(const Args&... args) {
    return *new (bytes) Scheduler(args...);
  }
};

// One task's mainloop (kernels::gemm::multiply_tile) between the profile's marks.
template <kernels::gemm::GemmKind kKind>
__device__ __forceinline__ bool multiply_task(kernels::gemm::SharedStorage& ss,
                                              kernels::gemm::RingPosition& ring, const GroupedGemmArgs& args,
                                              int32_t kb_begin, int32_t kb_end, int consumer_idx,
                                              int32_t mma_cols, float (&acc)[128],
                                              const TileProfile& profile) {
  if (kb_end > kb_begin) profile.mark_first_stage(&ss.full[ring.stage], ring.phase);
  if (!kernels::gemm::multiply_tile<kKind>(ss, ring, args, kb_begin, kb_end, consumer_idx, mma_cols, acc))
    return false;
  profile.mark_multiplied();
  return true;
}

// The producer thread: `next(task)` takes a ticket and waits for the task's inputs (task.kind == kEnd at the
// end of the list, after a failure, or once any CTA aborted); the task goes to the consumers, the end too;
// `produce(task, ring)` loads its stages (false: recorded by the stage ring, the CTA's work ends).
template <typename TaskT, typename NextTask, typename Produce>
__device__ __forceinline__ void run_producer(const layout::WorkspacePointers& ws, TaskSlots<TaskT>& slots,
                                             NextTask&& next, Produce&& produce) {
  kernels::gemm::RingPosition ring;
  for (uint32_t i = 0;; ++i) {
    TaskT task;
    // The profile's state lives in shared memory and ws: the producer's 40 registers hold nothing more.
    if (ws.profile_tiles != 0) slots.scheduler_start_ns = flags::global_timer_ns();
    next(task);
    if (ws.profile_tiles != 0) {
      TileProfile(ws).scheduled(static_cast<int>(task.kind), slots.scheduler_start_ns,
                                flags::global_timer_ns());
    }
    kernels::ptx::fence_proxy_async_global();  // rows other CTAs stored (acquired by next), read by TMA
    if (!hand_over(ws, slots, i, task) || task.kind == decltype(task.kind)::kEnd) return;
    if (!produce(task, ring)) {
      fail(ws, layout::WaitId::kFusedTaskHandoff, task.m_block, 0, 1);
      return;
    }
  }
}

// A consumer warpgroup: `consume(task, ring, acc, done, done_total, profile)` multiplies this warpgroup's
// rows of one task and stores them (false: a stage never filled, recorded); `done`, when set, is the counter
// to bump once the warpgroup's stores are all issued, `done_total`, when set too, a second one (over all
// tiles of a kind); `profile` takes the task's marks.
template <typename TaskT, typename Consume>
__device__ __forceinline__ void run_consumer(const layout::WorkspacePointers& ws, TaskSlots<TaskT>& slots,
                                             int consumer_idx, Consume&& consume) {
  kernels::gemm::RingPosition ring;
  float acc[128];
  TileProfile profile(ws, slots.task_marks[consumer_idx]);
  profile.started(profile.now());
  for (uint32_t i = 0;; ++i) {
    TaskT task;
    const uint64_t waited_from = profile.now();
    if (!take_over(ws, slots, i, task) || task.kind == decltype(task.kind)::kEnd) {
      profile.out_of_tasks(profile.now());  // taken right after the last task: when it ended
      return;
    }
    const uint64_t handed_over = profile.now();
    const uint64_t handed_over_clock = profile.clock();
    profile.handoff(static_cast<int>(task.kind), waited_from, handed_over);
    if (i == 0) profile.first_task(handed_over);
    profile.begin_task();
    uint32_t* done = nullptr;
    uint32_t* done_total = nullptr;
    if (!consume(task, ring, acc, done, done_total, profile)) {
      fail(ws, layout::WaitId::kFusedTaskHandoff, task.m_block, 1, 0);
      return;
    }
    profile.mark_stored();
    if (done != nullptr) count_tile_stored(done, done_total, consumer_idx);
    profile.task(static_cast<int>(task.kind), handed_over, profile.now(), handed_over_clock);
  }
}

// The dynamic shared memory of a fused kernel: the GEMM's stage ring, 1024-byte aligned (128B swizzle).
__device__ __forceinline__ kernels::gemm::SharedStorage& stage_storage() {
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
  return *reinterpret_cast<kernels::gemm::SharedStorage*>(base);
}

// A compute CTA: the producer warpgroup gives registers to the consumers; its thread 0 runs the producer
// loop with the scheduler built from `params` in shared memory, the two consumer warpgroups run `consume`,
// then `finish()`. `finish` runs here, inside the consumers'
// branch: code after the branches join is compiled for the producer's kProducerRegs registers (ptxas takes
// the smaller budget at the join) and spills.
template <typename TaskT, typename Scheduler, typename Params, typename Produce, typename Consume,
          typename Finish>
__device__ __forceinline__ void run_compute_cta(const layout::WorkspacePointers& ws, TaskSlots<TaskT>& slots,
                                                SchedulerStorage<Scheduler>& scheduler, const Params& params,
                                                Produce&& produce, Consume&& consume, Finish&& finish) {
  const int warpgroup_idx = threadIdx.x / 128;
  if (warpgroup_idx == 0) {
    kernels::ptx::setmaxnreg_dec<GemmConfig::kProducerRegs>();
    if (threadIdx.x == 0) run_producer(ws, slots, scheduler.construct(params), produce);
  } else {
    kernels::ptx::setmaxnreg_inc<GemmConfig::kConsumerRegs>();
    run_consumer(ws, slots, warpgroup_idx - 1, consume);
    finish();
  }
}

}  // namespace pounce::kernels::fused
