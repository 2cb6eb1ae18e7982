// The GPU workspace of one rank (docs/design.md §2-§4): ONE struct that lists every region, its size
// formula and its offset. Host code sizes and carves the allocation with it; kernels receive the carved
// pointers (WorkspacePointers) by value. Usable from host and device code.
//
// Two allocations per rank:
//   symmetric — NCCL window (ncclMemAlloc + ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC)); every
//               rank has the same layout, so a peer's region is peer_base[p] + the same offset.
//               With one rank it is plain cudaMalloc memory and no NCCL is involved.
//   local     — cudaMalloc, private to the rank: the receive schedule and the forward context that
//               backward consumes (routed g/u/act/y rows, shared-expert rows).
// Sizes use worst cases only (dropless): nothing depends on the routing of a call.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define POUNCE_HOST_DEVICE __host__ __device__
#else
#define POUNCE_HOST_DEVICE
#endif

namespace pounce::kernels::layout {

inline constexpr int64_t kBlockM = 128;           // GEMM tile height; equals pounce::kBlockM
inline constexpr int64_t kRegionAlign = 256;      // every region starts 256-byte aligned
inline constexpr int64_t kSymmetricAlign = 4096;  // NCCL_WIN_REQUIRED_ALIGNMENT
inline constexpr int64_t kScheduleChunk = 256;    // routing entries (token, slot) per schedule warp
inline constexpr int64_t kBf16Bytes = 2;
inline constexpr int64_t kFp8Block = 128;  // FP8 scale blocks; equals pounce::kFp8Block

POUNCE_HOST_DEVICE constexpr int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}
POUNCE_HOST_DEVICE constexpr int64_t ceil_div(int64_t value, int64_t divisor) {
  return (value + divisor - 1) / divisor;
}
POUNCE_HOST_DEVICE constexpr int64_t min_i64(int64_t a, int64_t b) {
  return a < b ? a : b;
}

// One row of the receive schedule (mirrors reference::ScheduleRow); padding rows are all -1.
struct ScheduleEntry {
  int32_t src_rank;
  int32_t src_token;
  int32_t slot;
  int32_t reserved;  // -1; keeps an entry one 16-byte load
};

// Errors found on the device land here (host-mapped pinned memory, outside the workspace formula:
// sizeof(DeviceErrorRecord) bytes). The first error wins through a claim flag in the local region;
// `code` is written last, after a system fence, so the host never reads a half-written record.
enum class DeviceErrorCode : int32_t {
  kNone = 0,
  kWaitTimeout = 1,         // a bounded spin-wait expired: which wait, rank, peer, expected, observed
  kExpertOutOfRange = 2,    // topk_idx value out of range: source rank, token, slot, value
  kScheduleOverflow = 3,    // more rows than rows_capacity (no routing gets there: a defence only)
  kMacrobatchOverflow = 4,  // an expert's rows exceed the ring (duplicate expert ids within a token)
};
enum class WaitId : int32_t {
  kNone = 0,
  kRoutingBarrier = 1,          // forward: routing exchanged
  kCombineBarrier = 2,          // forward: expert outputs pushed
  kBackwardInputsBarrier = 3,   // backward: d_out and topk_weights staged for the owners' pulls
  kBackwardCombineBarrier = 4,  // backward: d_x pairs pushed
  // Inside the fused kernels (one GPU; `peer` is the minibatch or m-block waited on):
  kFusedRowsReady = 5,          // compute CTA: a minibatch's rows pulled by every communication CTA
  kFusedGateUpDone = 6,         // compute CTA: every gate/up tile of an m-block stored, before its down tiles
  kFusedRowsDone = 7,           // communication CTA: every down tile of a minibatch stored, before its push
  kFusedTaskHandoff = 8,        // producer <-> consumer warpgroups of one CTA (task slots, stage ring)
  kFusedBackwardRowsReady = 9,  // backward compute CTA: a minibatch's dy rows pulled
  kFusedActGradDone = 10,       // backward compute CTA: every d_a tile of an m-block stored
  kFusedBackwardRowsDone = 11,  // backward communication CTA: every d_x tile of a minibatch, before its push
  kFusedGridStep = 12,          // fused forward: a grid-wide step (`peer` is the FusedGridStep)
  kFusedReplayRowsReady = 13,   // fused backward, macrobatch ring: a minibatch's x rows pulled again
  kFusedReplayDone = 14,        // fused backward, macrobatch ring: every replayed gate/up tile of an m-block
  kFusedRingFree = 15,          // fused forward, macrobatch ring: the previous macrobatch's ring rows free
  kStagedGemm = 16,             // a staged GEMM's stage ring (`observed` is its gemm::WaitError)
};

// The fused kernels' GPU-scope counters (local region, zeroed before every launch), in uint32
// words: a header, then per-minibatch and per-m-block counts (sched/forward_tasks.cuh).
inline constexpr int64_t kFusedTicket = 0;     // next task of the compute CTAs' list
inline constexpr int64_t kFusedRole = 1;       // CTAs started so far: the first comm_ctas communicate
inline constexpr int64_t kFusedAbort = 2;      // non-zero once any CTA failed: every wait gives up
inline constexpr int64_t kFusedGemmError = 3;  // the GEMM error word (WorkspacePointers::gemm_error)
// The fused forward's grid-wide steps (kernels/fused/grid_steps.cuh): CTAs (or parties) arrived, and the
// step's release word (1 once the last arrival released it; a failure sets kFusedAbort instead).
enum FusedGridStep : int32_t {
  kStepRouting = 0,
  kStepCounted = 1,
  kStepPlaced = 2,
  kStepFinished = 3,
  kNumGridSteps = 4
};
inline constexpr int64_t kFusedGridArrived = 4;                                   // [kNumGridSteps]
inline constexpr int64_t kFusedGridReleased = kFusedGridArrived + kNumGridSteps;  // [kNumGridSteps]
// %globaltimer (ns, uint64 as two words) of the kernel's milestones, read by the host under
// POUNCE_PROFILE_STAGES only.
enum FusedStepTime : int32_t {
  kTimeRoutingReleased = 0,
  kTimeCountedReleased = 1,
  kTimePlacedReleased = 2,
  kTimeLastFinished = 3,    // the last party arrived at kStepFinished
  kTimeCombineBarrier = 4,  // ... and passed the combine barrier
  kTimeKernelStarted = 5,   // CTA 0 entered the kernel
  kTimeRoutingArrived = 6,  // the last CTA arrived at kStepRouting (x staged): the cross-GPU barrier starts
  kTimeLastCtaStarted = 7,  // the latest CTA's start (atomicMax)
  kTimeXStaged = 8,         // the latest CTA's end of stage x (atomicMax)
  kTimeRoutingStored = 9,   // the latest CTA's routing ids issued (atomicMax)
  kTimeRoutingFenced = 10,  // the latest CTA past its system-scope fence before arriving (atomicMax)
  kNumStepTimes = 11
};
inline constexpr int64_t kFusedStepTimes = kFusedGridReleased + kNumGridSteps;  // even: 8-byte aligned
// Where the compute CTAs' time went (uint64 each, summed over consumer warpgroups, written only when
// WorkspacePointers::profile_tiles is set): per task kind k (its enum value) the ns spent on its tasks
// (mainloop, epilogue, count), their number, the ns spent waiting for them to be handed over, and the ns the
// producers spent finding them (ticket, decode, waits for their inputs).
inline constexpr int kMaxProfiledKinds = 8;
inline constexpr int kProfileWaitBins = 8;               // waits by length: under 0.25 us, then doubling
inline constexpr uint64_t kProfileFirstWaitBinNs = 250;  // ... the last bin open
enum FusedTileProfile : int32_t {
  kProfileKindNs = 0,
  kProfileKindTasks = kMaxProfiledKinds,
  kProfileHandoffNs = 2 * kMaxProfiledKinds,
  kProfileSchedulerNs = 3 * kMaxProfiledKinds,  // the producers' ticket + decode + input checks, per kind
  kProfileStartInverted = 4 * kMaxProfiledKinds,
  // The timeline, as ~ns for earliest-of (atomicMax of the complement: the region starts zeroed): the first
  // consumer warpgroup's start and first task, and the earliest and latest time a warpgroup ran out of tasks.
  kProfileFirstTaskInverted = kProfileStartInverted + 1,
  kProfileOutOfTasksInverted,
  kProfileOutOfTasks,
  // Inside the tasks of kind k, in SM clocks (clock64, summed like the ns): the whole task, from the handover
  // until its first stage was full, and until its last wgmma retired (the mainloop); the rest is the epilogue
  // and the count, whose share after the last store is issued is kProfileCountClocks. Clocks over ns is the
  // SM clock the tiles ran at.
  kProfileKindClocks,
  kProfileFirstStageClocks = kProfileKindClocks + kMaxProfiledKinds,
  kProfileMainloopClocks = kProfileFirstStageClocks + kMaxProfiledKinds,
  kProfileCountClocks = kProfileMainloopClocks + kMaxProfiledKinds,  // stores issued -> counted
  // The waits for a task of kind k by length (kProfileWaitBins bins): their number and their ns.
  kProfileWaitBinTasks = kProfileCountClocks + kMaxProfiledKinds,
  kProfileWaitBinNs = kProfileWaitBinTasks + kProfileWaitBins * kMaxProfiledKinds,
  kNumProfileSlots = kProfileWaitBinNs + kProfileWaitBins * kMaxProfiledKinds
};
inline constexpr int64_t kFusedTileProfile = kFusedStepTimes + 2 * kNumStepTimes;  // even
inline constexpr int64_t kFusedHeaderWords = kFusedTileProfile + 2 * kNumProfileSlots;
static_assert(kFusedStepTimes % 2 == 0 && kFusedTileProfile % 2 == 0,
              "the uint64 step times and profile slots must be 8-byte aligned in the uint32 counter region");

// The fused kernels' counter arrays after the header, in uint32 words: the one place that places them, for
// the kernels (fused::FusedCounters) and for the workspace's carve (WorkspaceLayout::fused_counter_words)
// alike. max_m_blocks = rows_capacity / 128 bounds the minibatches and the routed m-blocks, token_blocks =
// token_capacity / 128 the shared expert's m-blocks.
struct FusedCounterLayout {
  int64_t max_m_blocks, token_blocks, max_macrobatches;

  // rows_ready [max_m_blocks]: a minibatch's rows pulled, +1 per communication CTA
  POUNCE_HOST_DEVICE constexpr int64_t rows_ready() const { return kFusedHeaderWords; }
  // rows_done [max_m_blocks]: a minibatch's second-GEMM tiles stored (push combine)
  POUNCE_HOST_DEVICE constexpr int64_t rows_done() const { return rows_ready() + max_m_blocks; }
  // first_done [token_blocks + max_m_blocks]: an m-block's first-GEMM tiles stored, shared m-blocks first
  POUNCE_HOST_DEVICE constexpr int64_t first_done() const { return rows_done() + max_m_blocks; }
  // replay_rows_ready [max_m_blocks], replay_done [max_m_blocks]: the backward's replay over a ring
  POUNCE_HOST_DEVICE constexpr int64_t replay_rows_ready() const {
    return first_done() + token_blocks + max_m_blocks;
  }
  POUNCE_HOST_DEVICE constexpr int64_t replay_done() const { return replay_rows_ready() + max_m_blocks; }
  // ring_free [max_macrobatches]: the forward's macrobatch ring rows free again
  POUNCE_HOST_DEVICE constexpr int64_t ring_free() const { return replay_done() + max_m_blocks; }
  // routed_first_done_total [1]: the backward's count of every routed d_a tile
  POUNCE_HOST_DEVICE constexpr int64_t routed_first_done_total() const {
    return ring_free() + max_macrobatches;
  }
  POUNCE_HOST_DEVICE constexpr int64_t words() const { return routed_first_done_total() + 1; }
};

struct DeviceErrorRecord {
  int32_t code;      // DeviceErrorCode
  int32_t wait_id;   // WaitId for kWaitTimeout
  int32_t rank;      // rank that recorded it
  int32_t peer;      // peer waited on / source rank of a bad routing entry
  int64_t expected;  // barrier epoch expected / E (number of experts) / rows_capacity
  int64_t observed;  // barrier epoch observed / bad expert id / rows needed
  int64_t token;     // token of a bad routing entry
  int64_t slot;      // top-k slot of a bad routing entry
};

// Sizes of one rank's workspace. Every member is a byte offset into its allocation or a size; the
// formulas are the contract with Workspace::bytes_required, which reports them.
struct WorkspaceLayout {
  // Shape (per rank).
  int64_t max_tokens = 0, hidden = 0, intermediate = 0, shared_intermediate = 0;
  int64_t num_experts = 0, num_topk = 0, num_ranks = 1, num_local_experts = 0;
  bool fp8 = false;  // Precision::kFP8: the FP8 regions below are sized (0 bytes otherwise)

  // Derived extents.
  int64_t rows_capacity = 0;   // round_up(R * max_tokens * k + El * (BLOCK_M - 1), BLOCK_M)
  int64_t token_capacity = 0;  // round_up(max_tokens, BLOCK_M): shared-expert rows, T padded
  int64_t routing_stride = 0;  // round_up(max_tokens * k, 4) int32 entries per source rank
  int64_t max_chunks = 0;      // ceil(max_tokens * k / kScheduleChunk), at least 1
  // The routed activation ring (docs/design.md, "Macrobatch ring"): rows of the eight routed row buffers.
  // rows_capacity without a ring; Config::macrobatch_size when below it (at least round_up(R * max_tokens,
  // 128), one expert's largest segment with distinct ids per token: src/config.cpp), and the routed rows then
  // run in macrobatches of whole experts, at most max_macrobatches of them (greedy packing: two neighbours
  // hold more than the ring, so B <= 2 * floor(rows / ring) + 1).
  int64_t ring_rows = 0;
  int64_t max_macrobatches = 1;

  // ---- symmetric allocation (same offsets on every rank) ----
  int64_t sym_barrier_inbox = 0;   // uint32 [R]: epoch each peer last arrived with
  int64_t sym_routing_tokens = 0;  // int32 [R]: T of each source rank
  int64_t sym_routing_idx = 0;     // int32 [R][routing_stride]: topk_idx of each source rank
  int64_t sym_x = 0;               // bf16 [token_capacity][H]: this rank's x, rows >= T zeroed
  int64_t sym_y_slots = 0;         // bf16 [max_tokens][k][H]: expert output per (token, slot)
  int64_t sym_d_out = 0;           // bf16 [token_capacity][H]: this rank's d_out, rows >= T zeroed
  int64_t sym_topk_weights = 0;    // fp32 [routing_stride]: this rank's topk_weights (backward pulls them)
  int64_t sym_dx_slots = 0;        // bf16 [max_tokens][k][H]: d_x of each (token, slot) pushed by its owner
  // FP8 only (0 bytes in BF16): x quantized at its source, the rows peers pull (FP8 on the wire)
  int64_t sym_x_q = 0;          // e4m3 [token_capacity][H]: q1x128_H(x), rows >= T zero
  int64_t sym_x_scale = 0;      // fp32 [token_capacity][H / 128]: each row's block scales, contiguous
  int64_t symmetric_bytes = 0;  // rounded up to 4096

  // ---- local allocation ----
  int64_t loc_peer_base = 0;          // uint64 [R]: symmetric base of every peer in this address space
  int64_t loc_barrier_epoch = 0;      // uint32 [1]: epochs completed by this rank's phase barrier
  int64_t loc_error_claim = 0;        // int32 [1]: first error claims the host record
  int64_t loc_chunk_counts = 0;       // int32 [R][max_chunks][El]: pairs per (source, chunk, expert)
  int64_t loc_expert_src_count = 0;   // int32 [El][R]: pairs per (local expert, source)
  int64_t loc_group_row_offset = 0;   // int32 [El + 1]: padded segment offsets (multiples of 128)
  int64_t loc_group_rows = 0;         // int32 [El]: rows of each segment holding data (the rest is padding)
  int64_t loc_shared_row_offset = 0;  // int32 [2]: {0, round_up(T, 128)} for the shared expert
  int64_t loc_schedule = 0;           // ScheduleEntry [rows_capacity]
  // ring only (0 bytes without): the macrobatch plan, built on the device after the schedule
  // (kernels/sched/macrobatch_plan.cuh); macrobatch b's kernels see the workspace through macrobatch(b)
  int64_t loc_macrobatch_plan = 0;      // int32 [1 + max_macrobatches + 1]: count B, bounds[0 .. maxB]
  int64_t loc_macrobatch_offsets = 0;   // int32 [maxB][3][El + 1]: MacrobatchRows
  int64_t loc_macrobatch_owned = 0;     // int32 [maxB][El]: 1 where b writes the expert's weight gradient
  int64_t loc_macrobatch_schedule = 0;  // ScheduleEntry [maxB][ring_rows]: b's schedule rows, ring-relative
  // the routed row buffers: ring_rows rows each (rows_capacity without a ring)
  int64_t loc_x_rows = 0;      // bf16 [ring_rows][H]: dispatched token rows, padding = 0
  int64_t loc_g_rows = 0;      // bf16 [ring_rows][I]
  int64_t loc_u_rows = 0;      // bf16 [ring_rows][I]
  int64_t loc_act_rows = 0;    // bf16 [ring_rows][I]
  int64_t loc_y_rows = 0;      // bf16 [ring_rows][H]: routed expert outputs
  int64_t loc_shared_g = 0;    // bf16 [token_capacity][Is]   (0 bytes when Is = 0)
  int64_t loc_shared_u = 0;    // bf16 [token_capacity][Is]
  int64_t loc_shared_act = 0;  // bf16 [token_capacity][Is]
  int64_t loc_shared_y = 0;    // bf16 [token_capacity][H]    (0 bytes when Is = 0)
  // fused kernels only: uint32 [FusedCounterLayout::words()], kFusedHeaderWords + 5 * max_m_blocks +
  // token_blocks + max_macrobatches + 1 (FusedCounterLayout places each array)
  int64_t loc_fused_counters = 0;
  int64_t fused_counter_words = 0;
  // backward only (nothing here is forward context)
  int64_t loc_dy_rows = 0;      // bf16 [ring_rows][H]: w * d_out pulled per row, padding = 0
  int64_t loc_d_gu_rows = 0;    // bf16 [ring_rows][2I]: d_g in columns [0, I), d_u in [I, 2I)
  int64_t loc_dx_rows = 0;      // bf16 [ring_rows][H]: d_x of each row before the push
  int64_t loc_shared_d_gu = 0;  // bf16 [token_capacity][2Is]
  int64_t loc_shared_dx = 0;    // bf16 [token_capacity][H]    (0 bytes when Is = 0)
  // FP8 only (0 bytes in BF16; docs/design.md §1 "FP8 mode"): the routed rows in the operand layouts of the
  // FP8 GEMMs (src/gpu/fp8_gemm.h). Rows in 1x128 blocks: e4m3 [ring_rows][cols] and fp32 scales
  // [cols / 128][ring_rows] (K-block-major). Token-axis copies in 128x1 blocks: e4m3 [cols][ring_rows] and
  // fp32 scales [ring_rows / 128][round_up(cols, 4)]. Block counts round up (a partial last block).
  int64_t loc_fp8_x_rows = 0, loc_fp8_x_scale = 0;      // x_q pulled, [M][H]      (forward context)
  int64_t loc_fp8_act_rows = 0, loc_fp8_act_scale = 0;  // a_q, [M][I]             (forward context)
  int64_t loc_fp8_dy_rows = 0, loc_fp8_dy_scale = 0;    // d_y_q, [M][H]           (backward)
  int64_t loc_fp8_d_a = 0;                              // bf16 [M][I]: d_a before the activation backward
  int64_t loc_fp8_dg_rows = 0, loc_fp8_dg_scale = 0;    // d_g_q, [M][I]
  int64_t loc_fp8_du_rows = 0, loc_fp8_du_scale = 0;    // d_u_q, [M][I]
  int64_t loc_fp8_x_t = 0, loc_fp8_x_t_scale = 0;       // x_t, [H][M]  (from the dequantized x_q rows)
  int64_t loc_fp8_act_t = 0, loc_fp8_act_t_scale = 0;   // a_t, [I][M]
  int64_t loc_fp8_dy_t = 0, loc_fp8_dy_t_scale = 0;     // d_y_t, [H][M]
  int64_t loc_fp8_dgu_t = 0, loc_fp8_dgu_t_scale = 0;   // [d_g | d_u]_t, [2I][M]: d_g_t then d_u_t
  int64_t local_bytes = 0;

  static WorkspaceLayout make(int64_t max_tokens, int64_t hidden, int64_t intermediate,
                              int64_t shared_intermediate, int64_t num_experts, int64_t num_topk,
                              int64_t num_ranks, int64_t macrobatch_size = 0, bool fp8 = false) {
    WorkspaceLayout l;
    l.max_tokens = max_tokens;
    l.hidden = hidden;
    l.intermediate = intermediate;
    l.shared_intermediate = shared_intermediate;
    l.num_experts = num_experts;
    l.num_topk = num_topk;
    l.num_ranks = num_ranks;
    l.num_local_experts = num_experts / num_ranks;
    l.fp8 = fp8;
    const int64_t R = num_ranks, El = l.num_local_experts, k = num_topk, H = hidden, I = intermediate;
    const int64_t Is = shared_intermediate;

    // k rows per token, even where El < k: a token naming one expert in several slots is computed as the CPU
    // backend computes it, never dropped (min(k, El), enough for distinct ids, saved memory only there).
    l.rows_capacity = round_up(R * max_tokens * k + El * (kBlockM - 1), kBlockM);
    l.token_capacity = round_up(max_tokens, kBlockM);
    l.routing_stride = round_up(max_tokens * k, 4);
    l.max_chunks =
        ceil_div(max_tokens * k, kScheduleChunk) > 0 ? ceil_div(max_tokens * k, kScheduleChunk) : 1;
    const bool ring = macrobatch_size > 0 && macrobatch_size < l.rows_capacity;
    l.ring_rows = ring ? macrobatch_size : l.rows_capacity;
    l.max_macrobatches = ring ? 2 * (l.rows_capacity / l.ring_rows) + 1 : 1;
    const int64_t maxB = ring ? l.max_macrobatches : 0, M = l.ring_rows;

    int64_t at = 0;
    auto carve = [&at](int64_t bytes) {
      const int64_t offset = at;
      at = round_up(at + bytes, kRegionAlign);
      return offset;
    };
    l.sym_barrier_inbox = carve(R * 4);
    l.sym_routing_tokens = carve(R * 4);
    l.sym_routing_idx = carve(R * l.routing_stride * 4);
    l.sym_x = carve(l.token_capacity * H * kBf16Bytes);
    l.sym_y_slots = carve(max_tokens * k * H * kBf16Bytes);
    l.sym_d_out = carve(l.token_capacity * H * kBf16Bytes);
    l.sym_topk_weights = carve(l.routing_stride * 4);
    l.sym_dx_slots = carve(max_tokens * k * H * kBf16Bytes);
    const int64_t q = fp8 ? 1 : 0;  // FP8 regions: sized only in FP8 mode
    const int64_t h_blocks = ceil_div(H, kFp8Block), i_blocks = ceil_div(I, kFp8Block);
    l.sym_x_q = carve(q * l.token_capacity * H);
    l.sym_x_scale = carve(q * l.token_capacity * h_blocks * 4);
    l.symmetric_bytes = round_up(at, kSymmetricAlign);

    at = 0;
    l.loc_peer_base = carve(R * 8);
    l.loc_barrier_epoch = carve(4);
    l.loc_error_claim = carve(4);
    l.loc_chunk_counts = carve(R * l.max_chunks * El * 4);
    l.loc_expert_src_count = carve(El * R * 4);
    l.loc_group_row_offset = carve((El + 1) * 4);
    l.loc_group_rows = carve(El * 4);
    l.loc_shared_row_offset = carve(2 * 4);
    l.loc_schedule = carve(l.rows_capacity * static_cast<int64_t>(sizeof(ScheduleEntry)));
    l.loc_macrobatch_plan = carve(ring ? (maxB + 2) * 4 : 0);
    l.loc_macrobatch_offsets = carve(maxB * 3 * (El + 1) * 4);
    l.loc_macrobatch_owned = carve(maxB * El * 4);
    l.loc_macrobatch_schedule = carve(maxB * M * static_cast<int64_t>(sizeof(ScheduleEntry)));
    l.loc_x_rows = carve(M * H * kBf16Bytes);
    l.loc_g_rows = carve(M * I * kBf16Bytes);
    l.loc_u_rows = carve(M * I * kBf16Bytes);
    l.loc_act_rows = carve(M * I * kBf16Bytes);
    l.loc_y_rows = carve(M * H * kBf16Bytes);
    l.loc_shared_g = carve(l.token_capacity * Is * kBf16Bytes);
    l.loc_shared_u = carve(l.token_capacity * Is * kBf16Bytes);
    l.loc_shared_act = carve(l.token_capacity * Is * kBf16Bytes);
    l.loc_shared_y = carve(Is > 0 ? l.token_capacity * H * kBf16Bytes : 0);
    l.fused_counter_words =
        FusedCounterLayout{l.rows_capacity / kBlockM, l.token_capacity / kBlockM, l.max_macrobatches}.words();
    l.loc_fused_counters = carve(l.fused_counter_words * 4);
    l.loc_dy_rows = carve(M * H * kBf16Bytes);
    l.loc_d_gu_rows = carve(M * 2 * I * kBf16Bytes);
    l.loc_dx_rows = carve(M * H * kBf16Bytes);
    l.loc_shared_d_gu = carve(l.token_capacity * 2 * Is * kBf16Bytes);
    l.loc_shared_dx = carve(Is > 0 ? l.token_capacity * H * kBf16Bytes : 0);
    const int64_t m_blocks = M / kFp8Block;
    l.loc_fp8_x_rows = carve(q * M * H);
    l.loc_fp8_x_scale = carve(q * h_blocks * M * 4);
    l.loc_fp8_act_rows = carve(q * M * I);
    l.loc_fp8_act_scale = carve(q * i_blocks * M * 4);
    l.loc_fp8_dy_rows = carve(q * M * H);
    l.loc_fp8_dy_scale = carve(q * h_blocks * M * 4);
    l.loc_fp8_d_a = carve(q * M * I * kBf16Bytes);
    l.loc_fp8_dg_rows = carve(q * M * I);
    l.loc_fp8_dg_scale = carve(q * i_blocks * M * 4);
    l.loc_fp8_du_rows = carve(q * M * I);
    l.loc_fp8_du_scale = carve(q * i_blocks * M * 4);
    l.loc_fp8_x_t = carve(q * H * M);
    l.loc_fp8_x_t_scale = carve(q * m_blocks * round_up(H, 4) * 4);
    l.loc_fp8_act_t = carve(q * I * M);
    l.loc_fp8_act_t_scale = carve(q * m_blocks * round_up(I, 4) * 4);
    l.loc_fp8_dy_t = carve(q * H * M);
    l.loc_fp8_dy_t_scale = carve(q * m_blocks * round_up(H, 4) * 4);
    l.loc_fp8_dgu_t = carve(q * 2 * I * M);
    l.loc_fp8_dgu_t_scale = carve(q * m_blocks * round_up(2 * I, 4) * 4);
    l.local_bytes = at;
    return l;
  }
};

// Which rows of macrobatch b a view shows (WorkspacePointers::macrobatch; the plan's offset sets, in order).
enum class MacrobatchRows : int32_t {
  kForward = 0,  // b's rows (none past the plan's count)
  kReplay = 1,   // b's rows where the backward replays them: every macrobatch but the resident last
  kRestore = 2,  // the last macrobatch's rows when there are several (the backward replays it at its end, so
                 // the forward context is what the forward left and backward may run again)
};

// The carved pointers of one rank, passed to kernels by value. `peer_base[p]` (device array) is the
// symmetric base of rank p as this GPU addresses it: the one "peer map" every transfer goes through,
// so that another transport only changes how it is filled.
struct WorkspacePointers {
  int32_t rank;
  int32_t num_ranks;
  int32_t num_local_experts;
  int32_t num_experts;
  int32_t num_topk;
  int64_t hidden, intermediate, shared_intermediate, max_tokens;
  int64_t rows_capacity, token_capacity, routing_stride, max_chunks;
  int64_t ring_rows;         // == rows_capacity without a ring
  int32_t max_macrobatches;  // 1 without a ring
  uint64_t timeout_ns;       // bound of every spin-wait
  int32_t profile_tiles;     // 1: the fused kernels fill kFusedTileProfile (POUNCE_PROFILE_STAGES)
  // Tests' fault injection (gpu::inject_wait_failure): the WaitId that fails at once wherever this call
  // uses it, as if its bound had run out; 0 = none.
  int32_t injected_wait;

  char* symmetric;            // this rank's symmetric base
  const uint64_t* peer_base;  // [R]
  int64_t sym_barrier_inbox, sym_routing_tokens, sym_routing_idx, sym_x, sym_y_slots;  // offsets
  int64_t sym_d_out, sym_topk_weights, sym_dx_slots;

  uint32_t* barrier_epoch;
  int32_t* error_claim;
  DeviceErrorRecord* error;  // host-mapped
  int32_t* chunk_counts;
  int32_t* expert_src_count;
  int32_t* group_row_offset;
  int32_t* group_rows;  // [El]: a segment's rows holding data, the same in every macrobatch view
  int32_t* shared_row_offset;
  ScheduleEntry* schedule;
  int32_t* macrobatch_plan;  // ring only (null without), see WorkspaceLayout
  int32_t* macrobatch_offsets;
  int32_t* macrobatch_owned;
  ScheduleEntry* macrobatch_schedule;
  void* x_rows;
  void* g_rows;
  void* u_rows;
  void* act_rows;
  void* y_rows;
  void* shared_g;
  void* shared_u;
  void* shared_act;
  void* shared_y;
  uint32_t* fused_counters;
  void* dy_rows;
  void* d_gu_rows;
  void* dx_rows;
  void* shared_d_gu;
  void* shared_dx;
  // FP8 mode only (null in BF16): sym_x_q/sym_x_scale are symmetric offsets, the rest the regions of
  // WorkspaceLayout (rows ring-relative like the bf16 row buffers; their scale ld is ring_rows).
  int64_t sym_x_q, sym_x_scale;
  uint8_t* fp8_x_rows;
  float* fp8_x_scale;
  uint8_t* fp8_act_rows;
  float* fp8_act_scale;
  uint8_t* fp8_dy_rows;
  float* fp8_dy_scale;
  void* fp8_d_a;
  uint8_t* fp8_dg_rows;
  float* fp8_dg_scale;
  uint8_t* fp8_du_rows;
  float* fp8_du_scale;
  uint8_t* fp8_x_t;
  float* fp8_x_t_scale;
  uint8_t* fp8_act_t;
  float* fp8_act_t_scale;
  uint8_t* fp8_dy_t;
  float* fp8_dy_t_scale;
  uint8_t* fp8_dgu_t;
  float* fp8_dgu_t_scale;

  // Address of `offset` inside rank `peer`'s symmetric allocation.
  template <typename T>
  POUNCE_HOST_DEVICE T* peer(int peer_rank, int64_t offset) const {
    return reinterpret_cast<T*>(reinterpret_cast<char*>(peer_base[peer_rank]) + offset);
  }
  template <typename T>
  POUNCE_HOST_DEVICE T* local_sym(int64_t offset) const {
    return reinterpret_cast<T*>(symmetric + offset);
  }

  POUNCE_HOST_DEVICE bool has_ring() const { return macrobatch_plan != nullptr; }
  // The workspace as macrobatch b's kernels see it: every routed kernel runs unchanged on it, because the
  // expert offsets and the schedule are the macrobatch's own, ring-relative (and empty past the last
  // macrobatch, so kernels launched for every possible b do nothing there; the host never reads B).
  // `rows` picks the backward's replay views (MacrobatchRows). Without a ring, the workspace itself.
  POUNCE_HOST_DEVICE WorkspacePointers macrobatch(int32_t b,
                                                  MacrobatchRows rows = MacrobatchRows::kForward) const {
    if (!has_ring()) return *this;
    WorkspacePointers view = *this;
    view.rows_capacity = ring_rows;
    view.group_row_offset =
        macrobatch_offsets + (3 * b + static_cast<int32_t>(rows)) * (num_local_experts + 1);
    view.schedule = macrobatch_schedule + b * ring_rows;
    return view;
  }
  // Device [El]: 1 where macrobatch b writes expert e's weight gradient (null without a ring: every expert).
  POUNCE_HOST_DEVICE const int32_t* owned_experts(int32_t b) const {
    return has_ring() ? macrobatch_owned + b * num_local_experts : nullptr;
  }
  // The workspace's GEMM error word (a gemm::WaitError): the fused kernels' stage ring and every staged GEMM
  // record a bounded wait that ran out here; the call's last launch (common/finish_call.cuh) turns a staged
  // one into the error record.
  POUNCE_HOST_DEVICE int32_t* gemm_error() const {
    return reinterpret_cast<int32_t*>(fused_counters + kFusedGemmError);
  }
  POUNCE_HOST_DEVICE bool injects(WaitId which) const { return injected_wait == static_cast<int32_t>(which); }
  // GroupedRows::inject_failure of this call's staged GEMMs.
  POUNCE_HOST_DEVICE int32_t gemm_failure_injected() const { return injects(WaitId::kStagedGemm) ? 1 : 0; }
};

}  // namespace pounce::kernels::layout
