// The fused forward kernel (DESIGN.md §2, issue #4): dispatch, shared expert, gate/up + activation, down and
// the combine push in ONE persistent launch, one CTA per SM, after the routing exchange and the schedule
// and before the combine barrier and the weighted sum (src/gpu/fused_forward.cu runs those around it).
//
// Roles, by arrival (the first `comm_ctas` CTAs to start communicate, so they are resident whenever any
// compute CTA is and a compute CTA never waits on a communication CTA that cannot run):
//   communication CTA: pulls the rows of routed minibatch 0, 1, ... (warps strided over the rows, every
//     communication CTA a share of every minibatch), bumping rows_ready[j] after each.
//   compute CTA: the GEMM mainloop of kernels/gemm with a task source instead of a static tile walk. The
//     producer thread takes a ticket (sched/forward_tasks.cuh), waits for the task's inputs, hands the
//     task to the consumer warpgroups through a two-slot mbarrier ring in shared memory and loads its
//     stages; the consumers multiply, store through the kind's epilogue, and count the tile done.
//   combine, one of two ways (params.push_combine, chosen per shape by src/gpu/fused_forward.cu):
//     - push: the down tile stores y_rows and counts rows_done[j]; between pulls, and after the last one,
//       the communication CTAs push every minibatch whose down tiles are all stored to the token owners'
//       slots. Suits short down mainloops (small I), whose epilogue must not wait on NVLink stores.
//     - scatter: the down tile's epilogue stores each row straight into its token owner's slot (src_rank,
//       src_token, slot) over NVLink: no copy pass, y_rows not written (backward never reads it), and few
//       communication CTAs suffice.
//     Both deliver the same values to the same slots.
// Every handoff is a named release/acquire pair at GPU scope (flags.cuh); TMA reads rows another CTA wrote,
// so the reader also orders its acquire before its async-proxy loads (fence.proxy.async.global). Every wait
// is bounded and aborts when another CTA failed. Tiles are computed exactly as by the standalone GEMMs
// (same tiles, same K order), so the output is bitwise that of the staged path.
#pragma once

#include <cuda.h>

#include "kernels/common/flags.cuh"
#include "kernels/combine/combine.cuh"
#include "kernels/dispatch/dispatch.cuh"
#include "kernels/gemm/grouped_gemm_kernel.cuh"
#include "kernels/layout/workspace_layout.cuh"
#include "kernels/sched/forward_tasks.cuh"

namespace pounce::fused {

using kernels::gemm::GemmConfig;
using kernels::gemm::GroupedGemmArgs;
using sched::Task;
using sched::TaskKind;

inline constexpr kernels::gemm::GemmKind kGateUpGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kForwardGateUp);
inline constexpr kernels::gemm::GemmKind kDownGemm =
    kernels::gemm::gemm_kind(kernels::gemm::KernelKind::kForwardStore);
inline constexpr int kWarps = GemmConfig::kNumThreads / 32;

// Operand maps of the four GEMMs (built on the host, src/gpu/fused_forward.cu).
struct FusedForwardMaps {
  CUtensorMap x_rows;                               // A of routed gate/up  [rows_capacity, H]
  CUtensorMap act_rows;                             // A of routed down     [rows_capacity, I]
  CUtensorMap sym_x;                                // A of shared gate/up  [token_capacity, H]
  CUtensorMap shared_act;                           // A of shared down     [token_capacity, Is]
  CUtensorMap gate, up, down;                       // routed weights [El, ., .]
  CUtensorMap shared_gate, shared_up, shared_down;  // shared weights [1, ., .]
};

struct FusedForwardParams {
  layout::WorkspacePointers ws;
  GroupedGemmArgs gate_up, down, shared_gate_up, shared_down;  // outputs, extents, activation per GEMM
  int32_t comm_ctas;
  int32_t unit_blocks;  // m-blocks per minibatch
  bool push_combine;    // true: communication CTAs push y_rows; false: down epilogues scatter into slots
};

// Counter regions inside ws.fused_counters (layout::kFused*).
struct FusedCounters {
  uint32_t* base;
  int64_t max_m_blocks, token_blocks;
  __device__ uint32_t* ticket() const { return base + layout::kFusedTicket; }
  __device__ uint32_t* role() const { return base + layout::kFusedRole; }
  __device__ uint32_t* abort() const { return base + layout::kFusedAbort; }
  __device__ uint32_t* rows_ready(int32_t j) const { return base + layout::kFusedHeaderWords + j; }
  __device__ uint32_t* rows_done(int32_t j) const {
    return base + layout::kFusedHeaderWords + max_m_blocks + j;
  }
  __device__ uint32_t* gate_up_done(bool shared, int32_t m_block) const {
    return base + layout::kFusedHeaderWords + 2 * max_m_blocks + (shared ? 0 : token_blocks) + m_block;
  }
};

// Per-CTA handoff state beside the GEMM's stage ring.
struct TaskSlots {
  Task task[2];
  uint64_t full[2];   // producer -> consumers: task[s] written (1 arrival)
  uint64_t empty[2];  // consumers -> producer: task[s] read by all 8 consumer warps
  int32_t role;
  int32_t go;  // communication CTAs: thread 0's decision, broadcast
};

__device__ __forceinline__ FusedCounters counters_of(const FusedForwardParams& p) {
  return {p.ws.fused_counters, p.ws.rows_capacity / GemmConfig::BLOCK_M,
          p.ws.token_capacity / GemmConfig::BLOCK_M};
}

__device__ __forceinline__ sched::ForwardTaskShape task_shape_of(const FusedForwardParams& p) {
  sched::ForwardTaskShape shape;
  const int32_t max_m_blocks = static_cast<int32_t>(p.ws.rows_capacity / GemmConfig::BLOCK_M);
  const int32_t token_blocks = static_cast<int32_t>(p.ws.token_capacity / GemmConfig::BLOCK_M);
  shape.shared_m_blocks =
      p.ws.shared_intermediate > 0 ? min(p.ws.shared_row_offset[1] / GemmConfig::BLOCK_M, token_blocks) : 0;
  // Beyond the capacity only with an overflowing schedule (already reported); never touch those rows.
  shape.routed_m_blocks =
      min(p.ws.group_row_offset[p.ws.num_local_experts] / GemmConfig::BLOCK_M, max_m_blocks);
  shape.unit_blocks = p.unit_blocks;
  constexpr int kGateUpN = kernels::gemm::kOutBlockN<kGateUpGemm.epilogue>;
  constexpr int kDownN = kernels::gemm::kOutBlockN<kDownGemm.epilogue>;
  shape.shared_gate_up_n = (p.shared_gate_up.n + kGateUpN - 1) / kGateUpN;
  shape.shared_down_n = (p.shared_down.n + kDownN - 1) / kDownN;
  shape.gate_up_n = (p.gate_up.n + kGateUpN - 1) / kGateUpN;
  shape.down_n = (p.down.n + kDownN - 1) / kDownN;
  return shape;
}

// Any failure: record it (first one wins) and make every other wait of the kernel give up at once.
__device__ __forceinline__ void fail(const FusedForwardParams& p, layout::WaitId which, int64_t index,
                                     int64_t expected, int64_t observed) {
  flags::record_error(p.ws, layout::DeviceErrorCode::kWaitTimeout, static_cast<int32_t>(which),
                      static_cast<int32_t>(index), expected, observed);
  atomicExch(counters_of(p).abort(), 1u);
}

__device__ __forceinline__ bool wait_count(const FusedForwardParams& p, const uint32_t* count,
                                           uint32_t expected, layout::WaitId which, int64_t index) {
  const uint32_t observed = flags::wait_count_gpu(count, expected, counters_of(p).abort(), p.ws.timeout_ns);
  if (observed >= expected) return true;
  if (flags::ld_relaxed_gpu(counters_of(p).abort()) == 0) fail(p, which, index, expected, observed);
  return false;
}

// Thread 0's `decision` (only thread 0's argument counts), known to every thread of the CTA afterwards: a
// communication CTA branches as one, so no thread is left behind at a later __syncthreads.
__device__ __forceinline__ bool cta_broadcast(TaskSlots& slots, bool decision) {
  if (threadIdx.x == 0) slots.go = decision ? 1 : 0;
  __syncthreads();
  const bool value = slots.go == 1;
  __syncthreads();  // slots.go is written again by the next decision
  return value;
}

__device__ __forceinline__ bool cta_aborted(const FusedForwardParams& p, TaskSlots& slots) {
  return cta_broadcast(slots, threadIdx.x == 0 && flags::ld_relaxed_gpu(counters_of(p).abort()) != 0);
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

// ---------------------------------------------------------------------------------------------------
// Communication CTA
// ---------------------------------------------------------------------------------------------------
// Thread 0 decides whether routed minibatch j's down tiles are all stored (waiting for it when `block`);
// every thread learns the answer.
__device__ __forceinline__ bool cta_rows_done(const FusedForwardParams& p, TaskSlots& slots,
                                              const sched::ForwardTaskShape& shape, int32_t j, bool block) {
  bool ready = false;
  if (threadIdx.x == 0) {
    const uint32_t expected = 2u * shape.routed_blocks(j) * shape.down_n;
    const uint32_t* done = counters_of(p).rows_done(j);
    ready = block ? wait_count(p, done, expected, layout::WaitId::kFusedRowsDone, j)
                  : flags::ld_acquire_gpu(done) >= expected;
  }
  return cta_broadcast(slots, ready);
}

__device__ __forceinline__ void run_communication(const FusedForwardParams& p, TaskSlots& slots,
                                                  int32_t comm_idx) {
  const layout::WorkspacePointers& ws = p.ws;
  const FusedCounters counters = counters_of(p);
  const sched::ForwardTaskShape shape = task_shape_of(p);
  const int32_t num_units = shape.routed_units();
  const int64_t warp = static_cast<int64_t>(comm_idx) * kWarps + threadIdx.x / 32;
  const int64_t num_warps = static_cast<int64_t>(p.comm_ctas) * kWarps;
  // This warp's rows of routed minibatch j (every communication warp a strided share).
  auto for_my_rows = [&](int32_t j, auto&& body) {
    const int64_t first = static_cast<int64_t>(j) * shape.unit_blocks * GemmConfig::BLOCK_M;
    const int64_t end = first + static_cast<int64_t>(shape.routed_blocks(j)) * GemmConfig::BLOCK_M;
    for (int64_t row = first + warp; row < end; row += num_warps) body(row);
  };
  auto push_unit = [&](int32_t j) {
    for_my_rows(j, [&](int64_t row) { combine::push_row<8>(ws, ws.y_rows, ws.sym_y_slots, row); });
  };

  int32_t next_push = 0;
  for (int32_t j = 0; j < num_units; ++j) {
    for_my_rows(j, [&](int64_t row) { dispatch::pull_row<8>(ws, row); });
    __syncthreads();  // this CTA's share of minibatch j has landed
    if (threadIdx.x == 0) {
      kernels::ptx::fence_proxy_async_global();
      flags::red_release_gpu_add(counters.rows_ready(j), 1u);
    }
    if (!p.push_combine) continue;
    // Push what is finished already; pulling the next minibatch comes first otherwise.
    while (next_push <= j && cta_rows_done(p, slots, shape, next_push, /*block=*/false))
      push_unit(next_push++);
    if (cta_aborted(p, slots)) return;
  }
  if (!p.push_combine) return;
  while (next_push < num_units) {
    if (!cta_rows_done(p, slots, shape, next_push, /*block=*/true)) return;
    push_unit(next_push++);
  }
}

// ---------------------------------------------------------------------------------------------------
// Combine epilogue of a down tile
// ---------------------------------------------------------------------------------------------------
// Row r of the tile is y of schedule[r] = (src_rank, src_token, slot): its bf16 values go straight to
// peer(src_rank).y_slots[src_token][slot] (padding rows nowhere), packed as every bf16 epilogue packs.
__device__ __forceinline__ void store_tile_to_slots(const float (&acc)[128],
                                                    const layout::WorkspacePointers& ws, int32_t n,
                                                    int32_t m_block, int32_t n_block, int consumer_idx) {
  const int64_t row = kernels::gemm::tile_row(m_block, consumer_idx);
  __nv_bfloat16* row_base[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const layout::ScheduleEntry entry = ws.schedule[row + 8 * h];
    row_base[h] = entry.src_rank < 0 ? nullptr : combine::slot_row<__nv_bfloat16>(ws, ws.sym_y_slots, entry);
  }
  kernels::gemm::store_rows_bf16(acc, row_base, n, n_block * GemmConfig::BLOCK_N,
                                 static_cast<int>(threadIdx.x % 32));
}

// ---------------------------------------------------------------------------------------------------
// Compute CTA
// ---------------------------------------------------------------------------------------------------
// Producer thread: ticket -> task -> inputs ready -> hand to the consumers -> load its stages.
__device__ __forceinline__ void run_task_producer(kernels::gemm::SharedStorage& ss, TaskSlots& slots,
                                                  const FusedForwardMaps& maps, const FusedForwardParams& p) {
  const FusedCounters counters = counters_of(p);
  const sched::ForwardTaskShape shape = task_shape_of(p);
  sched::ForwardTaskCursor cursor(shape);
  kernels::gemm::RingPosition ring;
  for (uint32_t i = 0;; ++i) {
    Task task{TaskKind::kEnd, 0, 0, 0};
    // After a failure anywhere, no new tile (tiles without inputs to wait on would never notice).
    const bool aborted = flags::ld_relaxed_gpu(counters.abort()) != 0;
    const int32_t ticket = aborted ? 0 : static_cast<int32_t>(atomicAdd(counters.ticket(), 1u));
    if (!aborted && cursor.at(ticket, task)) {
      bool ready = true;
      if (task.kind == TaskKind::kGateUp) {
        ready = wait_count(p, counters.rows_ready(task.unit), static_cast<uint32_t>(p.comm_ctas),
                           layout::WaitId::kFusedRowsReady, task.unit);
      } else if (task.kind == TaskKind::kDown || task.kind == TaskKind::kSharedDown) {
        const bool shared = task.kind == TaskKind::kSharedDown;
        const uint32_t expected = 2u * (shared ? shape.shared_gate_up_n : shape.gate_up_n);
        ready = wait_count(p, counters.gate_up_done(shared, task.m_block), expected,
                           layout::WaitId::kFusedGateUpDone, task.m_block);
      }
      if (!ready) task.kind = TaskKind::kEnd;
      kernels::ptx::fence_proxy_async_global();  // rows other CTAs stored, read by TMA below
    }
    const uint32_t s = i % 2;
    if (!kernels::ptx::mbarrier_wait_parity_bounded(&slots.empty[s], ((i / 2) & 1) ^ 1, p.ws.timeout_ns)) {
      // Consumers still hold the slot: writing it would flip a phase they have not seen. They time out.
      fail(p, layout::WaitId::kFusedTaskHandoff, s, 1, 0);
      return;
    }
    slots.task[s] = task;
    kernels::ptx::mbarrier_arrive(&slots.full[s]);
    if (task.kind == TaskKind::kEnd) return;

    const bool routed = task.kind == TaskKind::kGateUp || task.kind == TaskKind::kDown;
    const kernels::gemm::Tile tile{task.m_block, task.n_block,
                                   routed ? expert_of_block(p.ws, task.m_block) : 0};
    bool ok = true;
    switch (task.kind) {
      case TaskKind::kSharedGateUp:
        ok = kernels::gemm::produce_tile<kGateUpGemm>(ss, ring, maps.sym_x, maps.shared_gate, maps.shared_up,
                                                      p.shared_gate_up, tile, 0, k_blocks(p.shared_gate_up));
        break;
      case TaskKind::kSharedDown:
        ok = kernels::gemm::produce_tile<kDownGemm>(ss, ring, maps.shared_act, maps.shared_down,
                                                    maps.shared_down, p.shared_down, tile, 0,
                                                    k_blocks(p.shared_down));
        break;
      case TaskKind::kGateUp:
        ok = kernels::gemm::produce_tile<kGateUpGemm>(ss, ring, maps.x_rows, maps.gate, maps.up, p.gate_up,
                                                      tile, 0, k_blocks(p.gate_up));
        break;
      case TaskKind::kDown:
        ok = kernels::gemm::produce_tile<kDownGemm>(ss, ring, maps.act_rows, maps.down, maps.down, p.down,
                                                    tile, 0, k_blocks(p.down));
        break;
      case TaskKind::kEnd:
        break;
    }
    if (!ok) {
      fail(p, layout::WaitId::kFusedTaskHandoff, task.m_block, 0, 1);
      return;
    }
  }
}

// Consumer warpgroup: task -> mainloop + epilogue -> count the tile done (one count per warpgroup).
__device__ __forceinline__ void run_task_consumer(kernels::gemm::SharedStorage& ss, TaskSlots& slots,
                                                  const FusedForwardParams& p, int consumer_idx) {
  const FusedCounters counters = counters_of(p);
  kernels::gemm::RingPosition ring;
  float acc[128];
  const uint64_t handoff_timeout = 2 * p.ws.timeout_ns;  // the producer may wait out one timeout first
  for (uint32_t i = 0;; ++i) {
    const uint32_t s = i % 2;
    if (!kernels::ptx::mbarrier_wait_parity_bounded(&slots.full[s], (i / 2) & 1, handoff_timeout)) {
      fail(p, layout::WaitId::kFusedTaskHandoff, s, 1, 0);
      return;
    }
    const Task task = slots.task[s];
    __syncwarp();
    if (threadIdx.x % 32 == 0) kernels::ptx::mbarrier_arrive(&slots.empty[s]);
    if (task.kind == TaskKind::kEnd) return;

    const kernels::gemm::Tile tile{task.m_block, task.n_block, 0};
    bool ok = true;
    uint32_t* done = nullptr;
    switch (task.kind) {
      case TaskKind::kSharedGateUp:
        ok = kernels::gemm::consume_tile<kGateUpGemm>(ss, ring, p.shared_gate_up, tile, 0,
                                                      k_blocks(p.shared_gate_up), consumer_idx, acc);
        done = counters.gate_up_done(true, task.m_block);
        break;
      case TaskKind::kSharedDown:
        ok = kernels::gemm::consume_tile<kDownGemm>(ss, ring, p.shared_down, tile, 0, k_blocks(p.shared_down),
                                                    consumer_idx, acc);
        break;
      case TaskKind::kGateUp:
        ok = kernels::gemm::consume_tile<kGateUpGemm>(ss, ring, p.gate_up, tile, 0, k_blocks(p.gate_up),
                                                      consumer_idx, acc);
        done = counters.gate_up_done(false, task.m_block);
        break;
      case TaskKind::kDown:
        ok =
            kernels::gemm::multiply_tile<kDownGemm>(ss, ring, p.down, 0, k_blocks(p.down), consumer_idx, acc);
        if (!ok) break;
        if (p.push_combine) {
          kernels::gemm::store_tile<kDownGemm>(acc, p.down, tile, true, consumer_idx);
          done = counters.rows_done(task.unit);
        } else {
          store_tile_to_slots(acc, p.ws, p.down.n, task.m_block, task.n_block, consumer_idx);
        }
        break;
      case TaskKind::kEnd:
        break;
    }
    if (!ok) {
      fail(p, layout::WaitId::kFusedTaskHandoff, task.m_block, 1, 0);
      return;
    }
    if (done != nullptr) {
      // Every store of this warpgroup's 64 rows, then one release: readers acquire the count.
      kernels::ptx::named_barrier_sync(1 + consumer_idx, 128);
      if (threadIdx.x % 128 == 0) {
        kernels::ptx::fence_proxy_async_global();
        flags::red_release_gpu_add(done, 1u);
      }
    }
  }
}

__global__ void __launch_bounds__(GemmConfig::kNumThreads, 1)
    fused_forward_kernel(const __grid_constant__ FusedForwardMaps maps, const FusedForwardParams params) {
  extern __shared__ uint8_t smem_raw[];
  const uintptr_t smem_base = (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023);
  kernels::gemm::SharedStorage& ss = *reinterpret_cast<kernels::gemm::SharedStorage*>(smem_base);
  __shared__ TaskSlots slots;

  if (threadIdx.x == 0) {
    slots.role = static_cast<int32_t>(atomicAdd(counters_of(params).role(), 1u));
    if (slots.role >= params.comm_ctas) {
      for (const CUtensorMap* map : {&maps.x_rows, &maps.act_rows, &maps.gate, &maps.up, &maps.down})
        kernels::ptx::prefetch_tensor_map(map);
#pragma unroll
      for (int s = 0; s < GemmConfig::kNumStages; ++s) {
        kernels::ptx::mbarrier_init(&ss.full[s], 1);
        kernels::ptx::mbarrier_init(&ss.empty[s], 4 * GemmConfig::kNumConsumerWarpgroups);
      }
      for (int s = 0; s < 2; ++s) {
        kernels::ptx::mbarrier_init(&slots.full[s], 1);
        kernels::ptx::mbarrier_init(&slots.empty[s], 4 * GemmConfig::kNumConsumerWarpgroups);
      }
      kernels::ptx::fence_mbarrier_init();
    }
  }
  __syncthreads();
  const int32_t role = slots.role;
  if (role < params.comm_ctas) {
    run_communication(params, slots, role);
    return;
  }
  const int warpgroup_idx = threadIdx.x / 128;
  if (warpgroup_idx == 0) {
    kernels::ptx::setmaxnreg_dec<GemmConfig::kProducerRegs>();
    if (threadIdx.x == 0) run_task_producer(ss, slots, maps, params);
  } else {
    kernels::ptx::setmaxnreg_inc<GemmConfig::kConsumerRegs>();
    run_task_consumer(ss, slots, params, warpgroup_idx - 1);
  }
}

}  // namespace pounce::fused
