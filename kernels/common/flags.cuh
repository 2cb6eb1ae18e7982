// Named release/acquire operations, bounded spin-waits, the device error record and the cross-GPU
// phase barrier (docs/design.md §2-§4). The only raw asm of the communication stages lives here.
//
// Phase barrier: every rank owns an inbox uint32[R] in its symmetric allocation. Arriving at epoch e,
// rank r stores e into inbox[r] of every peer with st.release.sys (which also publishes every store
// this rank made before, in this kernel or in earlier kernels of the stream); it then waits until its
// own inbox[p] >= e for every peer p with ld.acquire.sys. Epochs live on the device (barrier_epoch), so a
// captured CUDA graph replays with fresh epochs. Comparisons are wrap-safe (signed difference).
#pragma once

#include <cstdint>

#include "kernels/common/ptx.cuh"
#include "kernels/layout/workspace_layout.cuh"

namespace pounce::kernels::flags {

// ---- release / acquire, system scope (peers over NVLink) ----
__device__ __forceinline__ void st_release_sys(uint32_t* ptr, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* ptr) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}
// ---- release / acquire, GPU scope (between SMs of one GPU) ----
__device__ __forceinline__ void st_release_gpu(uint32_t* ptr, uint32_t value) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_gpu(const uint32_t* ptr) {
  uint32_t value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}
// Adds `value` with release semantics: this thread's earlier stores (and those it observed, e.g. its
// warpgroup's after a barrier) are visible to whoever acquires the sum.
__device__ __forceinline__ void red_release_gpu_add(uint32_t* ptr, uint32_t value) {
  asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(value) : "memory");
}
// Adds `value` and returns the previous sum, acquire + release: the caller sees every store released by the
// adds before its own (the last of a grid's arrivals sees them all).
__device__ __forceinline__ uint32_t atom_add_acq_rel_gpu(uint32_t* ptr, uint32_t value) {
  uint32_t previous;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;"
               : "=r"(previous)
               : "l"(ptr), "r"(value)
               : "memory");
  return previous;
}
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* ptr) {
  uint32_t value;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(ptr) : "memory");
  return value;
}
// Orders every earlier memory operation of this thread before every later one, for all observers.
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

using kernels::ptx::global_timer_ns;  // %globaltimer in ns: the clock of every bounded wait

// True when `observed` has reached `expected` (modulo 2^32).
__device__ __forceinline__ bool epoch_reached(uint32_t observed, uint32_t expected) {
  return static_cast<int32_t>(observed - expected) >= 0;
}

// Spins with ld.acquire.sys until *flag reaches `expected` or `timeout_ns` passes. Returns the last
// value read; the caller compares it with epoch_reached.
__device__ __forceinline__ uint32_t wait_epoch_sys(const uint32_t* flag, uint32_t expected,
                                                   uint64_t timeout_ns) {
  uint32_t observed = ld_acquire_sys(flag);
  if (epoch_reached(observed, expected)) return observed;
  const uint64_t start = global_timer_ns();
  while (!epoch_reached(observed, expected)) {
    if (global_timer_ns() - start > timeout_ns) break;
    __nanosleep(64);
    observed = ld_acquire_sys(flag);
  }
  return observed;
}

// Spins with ld.acquire.gpu until the counter *count reaches `expected` (a plain, non-wrapping count), the
// abort word turns non-zero (another CTA failed: give up at once) or `timeout_ns` passes. Returns the last
// value read.
__device__ __forceinline__ uint32_t wait_count_gpu(const uint32_t* count, uint32_t expected,
                                                   const uint32_t* abort, uint64_t timeout_ns) {
  uint32_t observed = ld_acquire_gpu(count);
  if (observed >= expected) return observed;
  const uint64_t start = global_timer_ns();
  while (observed < expected) {
    if (ld_relaxed_gpu(abort) != 0 || global_timer_ns() - start > timeout_ns) break;
    __nanosleep(32);
    observed = ld_acquire_gpu(count);
  }
  return observed;
}

// ---- device error record ----
// Records the first error of a call: claims `claim` (device memory, GPU-wide atomics), fills the
// host-mapped record, then publishes `code` last after a system fence. Later errors are dropped.
__device__ __forceinline__ void record_error(const layout::WorkspacePointers& ws,
                                             layout::DeviceErrorCode code, int32_t wait_id, int32_t peer,
                                             int64_t expected, int64_t observed, int64_t token = -1,
                                             int64_t slot = -1) {
  if (atomicCAS(ws.error_claim, 0, 1) != 0) return;
  volatile layout::DeviceErrorRecord* record = ws.error;
  record->wait_id = wait_id;
  record->rank = ws.rank;
  record->peer = peer;
  record->expected = expected;
  record->observed = observed;
  record->token = token;
  record->slot = slot;
  fence_acq_rel_sys();
  record->code = static_cast<int32_t>(code);
  fence_acq_rel_sys();
}

// ---- phase barrier across the ranks of the group ----
// This rank's arrival at `epoch` in peer `peer`'s inbox. Release: this rank's earlier stores (all blocks, all
// earlier kernels) before the arrival flag.
__device__ __forceinline__ void arrive_at_peer(const layout::WorkspacePointers& ws, int peer,
                                               uint32_t epoch) {
  fence_acq_rel_sys();
  st_release_sys(ws.peer<uint32_t>(peer, ws.sym_barrier_inbox) + ws.rank, epoch);
}

// Acquire: the peer's stores before its arrival at `epoch` are visible after this returns true. False
// (recorded) when the peer did not arrive in time.
__device__ __forceinline__ bool wait_for_peer(const layout::WorkspacePointers& ws, int peer, uint32_t epoch,
                                              layout::WaitId which) {
  const uint32_t* inbox = ws.local_sym<uint32_t>(ws.sym_barrier_inbox) + peer;
  const uint32_t observed = wait_epoch_sys(inbox, epoch, ws.timeout_ns);
  if (epoch_reached(observed, epoch)) return true;
  record_error(ws, layout::DeviceErrorCode::kWaitTimeout, static_cast<int32_t>(which), peer, epoch, observed);
  return false;
}

// Tests' fault injection (WorkspacePointers::injected_wait): the barrier `which` fails as a peer that never
// arrived would make it fail (the next rank, or this one when alone; one rank has no peer to wait for, so
// its callers run the barrier only when injected). The arrivals still go out: peers see this rank.
__device__ __forceinline__ bool injected_barrier_failure(const layout::WorkspacePointers& ws,
                                                         layout::WaitId which, uint32_t epoch) {
  if (!ws.injects(which)) return false;
  record_error(ws, layout::DeviceErrorCode::kWaitTimeout, static_cast<int32_t>(which),
               (ws.rank + 1) % ws.num_ranks, epoch, epoch - 1);
  return true;
}

// Called by one whole block; threads [0, R) handle one peer each. Every store the calling rank made
// before the call (earlier kernels in stream order included) is visible to every peer after its own
// call returns, and vice versa. Returns false (and records the error) when a peer did not arrive.
__device__ __forceinline__ bool phase_barrier_block(const layout::WorkspacePointers& ws,
                                                    layout::WaitId which) {
  __shared__ int timed_out;
  const uint32_t epoch = *ws.barrier_epoch + 1;
  if (threadIdx.x == 0) timed_out = injected_barrier_failure(ws, which, epoch) ? 1 : 0;
  __syncthreads();
  const int peer = static_cast<int>(threadIdx.x);
  if (peer < ws.num_ranks && peer != ws.rank) {
    arrive_at_peer(ws, peer, epoch);
    if (!wait_for_peer(ws, peer, epoch, which)) timed_out = 1;
  }
  __syncthreads();
  if (threadIdx.x == 0) *ws.barrier_epoch = epoch;
  return timed_out == 0;
}

// The same barrier run by one whole warp at a given `epoch` (inside the fused kernel, which reserves its
// epochs itself): lane i arrives at peers i, i + 32, ... first, then waits for them, so no arrival waits on
// another peer's. The caller has ordered every store of this GPU that must travel before the warp (the
// grid's arrivals, then __syncwarp or bar.sync), so the lanes' system-scope releases carry them.
__device__ __forceinline__ bool phase_barrier_warp(const layout::WorkspacePointers& ws, layout::WaitId which,
                                                   uint32_t epoch) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int peer = lane; peer < ws.num_ranks; peer += 32) {
    if (peer != ws.rank) arrive_at_peer(ws, peer, epoch);
  }
  bool arrived = !(lane == 0 && injected_barrier_failure(ws, which, epoch));
  for (int peer = lane; peer < ws.num_ranks; peer += 32) {
    if (peer != ws.rank) arrived = wait_for_peer(ws, peer, epoch, which) && arrived;
  }
  return __all_sync(0xffffffffu, arrived);
}

}  // namespace pounce::kernels::flags
