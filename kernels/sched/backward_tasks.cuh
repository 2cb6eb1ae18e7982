// The fused backward kernel's task list (docs/design.md §2): every GEMM tile of one backward pass
// in a topological order, handed out by an atomic ticket.
//
// Data gradients walk the forward's two-GEMM unit list (forward_tasks.cuh) with the backward's GEMMs in the
// two places: the first GEMM of a unit is d_a = dy . w_down with the activation backward in its epilogue
// (d_g, d_u), the second is d_x = [d_g, d_u] . [w_gate; w_up]. Then the weight gradients, one reduction tile
// at a time (each over its expert's whole row segment, as the standalone weight-gradient GEMM computes it):
//
//   R(0), R(1), ...          (macrobatch ring only: the forward's gate/up tiles replayed for this
//                             macrobatch's rows, unit by unit, m fastest; none for the resident one)
//   SA(0), SA(1), SX(0), ... (shared expert, no transfer: covers the first pull)
//   A(0), A(1), X(0), A(2), X(1), ..., X(U-1)                       (routed units)
//   W shared down, gate, up; W routed down (every expert), gate, up (weight gradients)
//
// Dependencies (GPU-scope counters, kernels/fused/fused_common.cuh):
//   R of routed unit j      <- replay_rows_ready[j]        (its x rows pulled again, replay only)
//   A of routed unit j      <- rows_ready[j]               (its dy rows pulled by every communication CTA)
//                              replay_done[m] per m-block  (g, u replayed, replay only)
//   X of m-block m          <- first_done[m]               (every d_a tile of m stored)
//   push of routed unit j   <- rows_done[j]                (every d_x tile of j stored; push combine only)
//   W down of expert e      <- rows_ready of e's units     (dy rows; act is the forward's), with a replay
//                              first_done of e's m-blocks  (which waited for the replayed g, u and act)
//   W gate/up of expert e   <- first_done of e's m-blocks  (d_g, d_u)
//   shared W gate/up        <- first_done of the shared m-blocks; shared W down needs nothing
// Every wait is on a smaller ticket or on the communication CTAs, as in the forward: no cycle. The weight
// gradients come last so that they keep every compute SM busy while the last d_x rows travel.
#pragma once

#include <cstdint>

#include "kernels/sched/forward_tasks.cuh"

namespace pounce::kernels::sched {

// The weight-gradient GEMMs, in list order.
enum class WeightGradKind : int32_t { kSharedDown = 0, kSharedGate, kSharedUp, kDown, kGate, kUp };
inline constexpr int kNumWeightGrads = 6;

POUNCE_HOST_DEVICE inline bool is_shared(WeightGradKind kind) {
  return static_cast<int32_t>(kind) < static_cast<int32_t>(WeightGradKind::kDown);
}

enum class BackwardTaskKind : int32_t {
  kEnd = 0,
  kSharedActGrad,   // d_a tile of the shared expert (first GEMM)
  kSharedDataGrad,  // d_x tile of the shared expert (second GEMM)
  kActGrad,         // d_a tile of routed rows
  kDataGrad,        // d_x tile of routed rows
  kWeightGrad,      // one output tile of one expert's weight gradient
  kReplayGateUp,    // the forward's gate/up tile of routed rows, replayed (macrobatch ring)
};

struct BackwardTask {
  BackwardTaskKind kind;
  int32_t m_block;  // data: row block; weight: output row block of the gradient matrix
  int32_t n_block;
  int32_t unit;           // data: unit (routed index for routed tasks)
  int32_t group;          // weight: expert (0 for the shared expert); routed data and replay: set by the
                          // fused scheduler, as upper_half_padding (see sched::Task)
  WeightGradKind weight;  // weight only
  bool upper_half_padding;
  // Weight only, not the list's: the K blocks of the expert's row segment that hold data, found once by the
  // fused scheduler's producer thread (consumers then start the mainloop without a global load).
  int32_t kb_begin;
  int32_t kb_end;
};

// Output tiles of one weight gradient: groups x [m, n] matrices, m_blocks x n_blocks tiles each.
struct WeightGradTiles {
  int32_t groups = 0;  // 0: no such gradient (no shared expert)
  int32_t m_blocks = 0;
  int32_t n_blocks = 0;
  POUNCE_HOST_DEVICE int32_t count() const { return groups * m_blocks * n_blocks; }
};

struct BackwardTaskShape {
  ForwardTaskShape data;  // first GEMM = d_a (gate_up_n: its n-blocks), second = d_x (down_n)
  WeightGradTiles weight[kNumWeightGrads];
  int32_t replay_m_blocks = 0;  // 0, or data.routed_m_blocks when this macrobatch's rows are replayed
  int32_t replay_n = 0;         // n-blocks of the forward's gate/up

  // Replay tiles of routed unit j: its m-blocks times the gate/up n-blocks; units are data.unit_blocks long.
  POUNCE_HOST_DEVICE int32_t replay_tiles() const { return replay_m_blocks * replay_n; }
  POUNCE_HOST_DEVICE int32_t data_tiles() const {
    return data.shared_m_blocks * (data.shared_gate_up_n + data.shared_down_n) +
           data.routed_m_blocks * (data.gate_up_n + data.down_n);
  }
  POUNCE_HOST_DEVICE int32_t num_tiles() const {
    int32_t total = replay_tiles() + data_tiles();
    for (int w = 0; w < kNumWeightGrads; ++w) total += weight[w].count();
    return total;
  }
};

// Walks the list forward; one cursor per CTA, tickets only grow.
class BackwardTaskCursor {
 public:
  POUNCE_HOST_DEVICE explicit BackwardTaskCursor(const BackwardTaskShape& shape)
      : shape_(shape),
        data_(shape.data),
        replay_tiles_(shape.replay_tiles()),
        data_tiles_(shape.data_tiles()) {}

  // The task holding `ticket`; false past the end of the list.
  POUNCE_HOST_DEVICE bool at(int32_t ticket, BackwardTask& task) {
    task.group = 0;
    task.weight = WeightGradKind::kSharedDown;
    if (ticket < replay_tiles_) {  // unit-major, m fastest inside a unit (only the last unit may be short)
      const int32_t unit_tiles = shape_.data.unit_blocks * shape_.replay_n;
      task.kind = BackwardTaskKind::kReplayGateUp;
      task.unit = ticket / unit_tiles;
      const int32_t within = ticket - task.unit * unit_tiles;
      const int32_t first = task.unit * shape_.data.unit_blocks;
      const int32_t blocks =
          static_cast<int32_t>(layout::min_i64(shape_.data.unit_blocks, shape_.replay_m_blocks - first));
      task.m_block = first + within % blocks;
      task.n_block = within / blocks;
      return true;
    }
    ticket -= replay_tiles_;
    if (ticket < data_tiles_) {
      Task t;
      if (!data_.at(ticket, t)) return false;  // unreachable: data_tiles_ counts exactly these
      task.m_block = t.m_block;
      task.n_block = t.n_block;
      task.unit = t.unit;
      switch (t.kind) {
        case TaskKind::kSharedGateUp:
          task.kind = BackwardTaskKind::kSharedActGrad;
          break;
        case TaskKind::kSharedDown:
          task.kind = BackwardTaskKind::kSharedDataGrad;
          break;
        case TaskKind::kGateUp:
          task.kind = BackwardTaskKind::kActGrad;
          break;
        case TaskKind::kDown:
          task.kind = BackwardTaskKind::kDataGrad;
          break;
        case TaskKind::kEnd:
          return false;
      }
      return true;
    }
    int32_t local = ticket - data_tiles_;
    for (int w = 0; w < kNumWeightGrads; ++w) {
      const WeightGradTiles& tiles = shape_.weight[w];
      if (local >= tiles.count()) {
        local -= tiles.count();
        continue;
      }
      // Group-major, then n-block, m fastest (the standalone weight-gradient GEMM's order).
      const int32_t per_group = tiles.m_blocks * tiles.n_blocks;
      task.kind = BackwardTaskKind::kWeightGrad;
      task.weight = static_cast<WeightGradKind>(w);
      task.group = local / per_group;
      const int32_t within = local - task.group * per_group;
      task.m_block = within % tiles.m_blocks;
      task.n_block = within / tiles.m_blocks;
      task.unit = 0;
      return true;
    }
    return false;
  }

 private:
  BackwardTaskShape shape_;
  ForwardTaskCursor data_;
  int32_t replay_tiles_;
  int32_t data_tiles_;
};

}  // namespace pounce::kernels::sched
