// A discrete-event simulation of one pass of the hierarchical expert-parallel schedule across nodes
// (docs/internode.md §3-§5), on a whole group's routing, in one process. No tensor is touched: every row is
// placed, timed and counted, so that a test can check what the device code will have to guarantee and what
// the cost model (cli/plan.h) assumes about overlap.
//
// What it runs, per pass (forward; backward is the mirror with its own tile costs and the weight-gradient
// tiles last):
//   1. counts   every rank's receive schedule from build_schedule() (the device schedule's rows), and per
//               (source, node) the number of distinct tokens the source will put there;
//   2. NIC      each source puts every token at most once per remote node, to the GPU of that node with its
//               own local index (the relay), in the order the node will need the tokens (their earliest
//               schedule row there); each put bumps the relay's signal for that source;
//   3. pulls    each rank's communication CTAs pull its schedule rows in order: from its own x, a node
//               peer's x (NVLink), its own landing buffer, or a node peer's landing buffer once that peer
//               has seen its signal reach the token's put (NVLink); minibatches of rows hand over to tiles;
//   4. tiles    a ticket per tile in the fused kernels' order (shared expert, GU(0), GU(1), DN(0), ...), each
//               taken by the first free compute SM, which then waits for its inputs;
//   5. combine  each down tile's rows go to their owner (same node) or to the token's relay (another node),
//               which sums a token's pairs of that node into one partial once all have arrived and puts it
//               to the owner over its NIC; the owner sums once every partial is in.
// Resources are FIFO calendars: each rank's NIC (out, in), its communication CTAs, its NVLink out-link, a
// reducer; a transfer over the NIC needs a common gap in the sender's out and the receiver's in calendar.
// Simplifications, said once: two GPUs' NVLink transfers do not contend in the switch; pulls are capped by
// min(CTAs x per-CTA rate, NVLink); the relay's reductions have their own calendar at the CTAs' local rate.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reference/reference.h"

namespace pounce::reference {

struct SimConfig {
  int64_t gpus_per_node = 8;
  // Tiles: per 128-row m-block, `in_tiles` of the first GEMM (gate/up; backward: d_a) and `out_tiles` of
  // the second (down; backward: d_x), each its us on one SM; the shared expert's tiles first, without
  // inputs; backward's weight-gradient tiles last, after every first-GEMM tile.
  int compute_sms = 128;
  int64_t in_tiles = 8;
  double in_tile_us = 10;
  int64_t out_tiles = 8;
  double out_tile_us = 10;
  int64_t shared_tiles = 0;
  double shared_tile_us = 0;
  int64_t tail_tiles = 0;
  double tail_tile_us = 0;
  int64_t minibatch_m_blocks = 8;
  // Transfers.
  int comm_sms = 4;
  bool push_combine = false;  // the combine by the communication CTAs; else by the tiles' epilogues
  double nvlink_gbps = 370;
  double nvlink_per_comm_sm_gbps = 19;
  double local_per_comm_sm_gbps = 50;
  double nic_gbps = 45;  // effective, per direction
  double nic_latency_us = 10;
  double nvlink_latency_us = 1;
  double in_row_bytes = 0;        // a pulled row (x or d_out)
  double out_row_bytes = 0;       // a returned pair row (y or d_x)
  double nic_in_row_bytes = 0;    // a token put to a relay (row + metadata)
  double nic_out_row_bytes = 0;   // a per-node partial put to the owner
  double partial_row_bytes = 0;   // a partial as the relay writes it
  double prologue_us = 0;         // before the first transfer (staging, counts, schedule, barrier)
  double combine_barrier_us = 0;  // after the last row is in
  double epilogue_us = 0;         // after the combine barrier (the weighted sum)
  // An ablation: puts in token order instead of the order the node needs them (docs/internode.md §3).
  bool puts_in_token_order = false;
  // For the tests: one deliberate fault, to show that the check meant for it fires.
  enum class Fault { kNone, kDropPut, kDuplicatePut, kSkipPull, kDropPartial };
  Fault fault = Fault::kNone;
};

struct SimRankStats {
  int64_t schedule_rows = 0, pulled_rows = 0;
  int64_t nvlink_rows = 0, local_rows = 0, relayed_rows = 0;
  int64_t nic_puts_sent = 0, nic_puts_received = 0, partials_sent = 0, partials_received = 0;
  double first_tile_us = 0, last_tile_us = 0, compute_busy_us = 0, done_us = 0;
};

struct SimResult {
  bool ok = true;
  std::vector<std::string> errors;      // the first few violations, each naming rank, token and slot
  double pass_us = 0;                   // the slowest rank's end, prologue and epilogue included
  double max_compute_busy_us = 0;       // SM-us / compute SMs, the slowest rank
  int64_t pairs = 0;                    // routed (token, slot) pairs in the group
  int64_t nic_puts = 0;                 // token rows over the NIC (dispatch)
  int64_t nic_pairs_without_dedup = 0;  // pairs whose expert is on another node
  int64_t partials = 0;                 // per-node partial rows over the NIC (combine)
  std::vector<SimRankStats> ranks;
};

// Simulates one pass of `problem` (its block_m pads the schedule) over `inputs` (num_tokens and topk_idx of
// every rank; -1 slots and repeated experts allowed). Throws pounce::Error on bad routing or config.
SimResult simulate_pass(const Problem& problem, const std::vector<RankInputs>& inputs,
                        const SimConfig& config);

}  // namespace pounce::reference
