// The fused forward kernel's task list (docs/design.md §2): every GEMM tile of one forward pass in a
// topological order, handed out by an atomic ticket, so a persistent grid never waits on a tile that has not
// been handed out.
//
// Work is cut into minibatches ("units") of up to `unit_blocks` m-blocks: the shared expert's rows first
// (they need no transfer, so tensor cores start while the first routed rows are in flight), then the
// routed rows in receive-schedule order. Unit u has gate/up tiles GU(u) and down tiles DN(u), each m-block
// fastest (a unit's rows and each weight n-block are shared in L2 by the CTAs running them). The list is
//
//   GU(0), GU(1), DN(0), GU(2), DN(1), ..., GU(U-1), DN(U-2), DN(U-1)
//
// so a down tile is handed out one unit after the gate/up tiles it reads and rarely waits. Dependencies
// (GPU-scope counters, sched user: kernels/fused/fused_forward.cuh):
//   GU of a routed unit  <- rows_ready[unit]  (its rows pulled by every communication CTA)
//   DN of m-block m      <- first_done[m]     (every gate/up tile of m stored, by both consumer warpgroups)
//   push of routed unit  <- rows_done[unit]   (every down tile of the unit stored; push combine only)
// Each waits only on tiles with smaller tickets or on the communication CTAs, which wait on nothing but
// the compute tiles' counters of units they already pulled: no cycle. Progress needs one compute CTA
// resident beside the communication CTAs (the first to start); on a GPU so shared with other kernels that
// only the communication CTAs fit, push mode ends in its bounded wait's error, not a hang.
#pragma once

#include <cstdint>

#include "kernels/layout/workspace_layout.cuh"  // POUNCE_HOST_DEVICE: the list is also checked on the CPU

namespace pounce::kernels::sched {

enum class TaskKind : int32_t { kEnd = 0, kSharedGateUp, kSharedDown, kGateUp, kDown };

struct Task {
  TaskKind kind;
  int32_t m_block;  // in the shared expert's rows (sym_x) or in the routed rows (x_rows)
  int32_t n_block;
  int32_t unit;  // routed unit (minibatch) index for kGateUp / kDown, shared unit otherwise
  // Not the list's: the fused kernel's scheduler sets them for a routed tile: its expert, and whether its
  // rows 64..127 are all padding (the second consumer warpgroup then skips the wgmmas, as
  // GroupedRows::group_rows makes the staged GEMMs do). Zero from the list (aggregate initialisation; no
  // default member initialisers: the task slots live in __shared__ memory, which allows no constructor).
  int32_t group;
  bool upper_half_padding;
};

// Extents of one call's list; m-block counts are read on the device after the schedule.
struct ForwardTaskShape {
  int32_t shared_m_blocks;                  // round_up(T, 128) / 128 with a shared expert, else 0
  int32_t routed_m_blocks;                  // group_row_offset[El] / 128
  int32_t unit_blocks;                      // m-blocks per minibatch
  int32_t shared_gate_up_n, shared_down_n;  // n-blocks per m-block of each GEMM
  int32_t gate_up_n, down_n;

  POUNCE_HOST_DEVICE int32_t shared_units() const {
    return (shared_m_blocks + unit_blocks - 1) / unit_blocks;
  }
  POUNCE_HOST_DEVICE int32_t routed_units() const {
    return (routed_m_blocks + unit_blocks - 1) / unit_blocks;
  }
  POUNCE_HOST_DEVICE int32_t num_units() const { return shared_units() + routed_units(); }
  POUNCE_HOST_DEVICE bool is_shared(int32_t u) const { return u < shared_units(); }
  // Routed unit index of unit u (valid when !is_shared(u)).
  POUNCE_HOST_DEVICE int32_t routed_index(int32_t u) const { return u - shared_units(); }
  POUNCE_HOST_DEVICE int32_t first_block(int32_t u) const {
    return (is_shared(u) ? u : routed_index(u)) * unit_blocks;
  }
  POUNCE_HOST_DEVICE int32_t blocks(int32_t u) const {
    const int32_t total = is_shared(u) ? shared_m_blocks : routed_m_blocks;
    return static_cast<int32_t>(layout::min_i64(unit_blocks, total - first_block(u)));
  }
  // Blocks of routed unit j (the communication CTAs' view).
  POUNCE_HOST_DEVICE int32_t routed_blocks(int32_t j) const {
    return static_cast<int32_t>(layout::min_i64(unit_blocks, routed_m_blocks - j * unit_blocks));
  }
  POUNCE_HOST_DEVICE int32_t gate_up_tiles(int32_t u) const {
    return blocks(u) * (is_shared(u) ? shared_gate_up_n : gate_up_n);
  }
  POUNCE_HOST_DEVICE int32_t down_tiles(int32_t u) const {
    return blocks(u) * (is_shared(u) ? shared_down_n : down_n);
  }
  // Every tile of the list.
  POUNCE_HOST_DEVICE int32_t num_tiles() const {
    return shared_m_blocks * (shared_gate_up_n + shared_down_n) + routed_m_blocks * (gate_up_n + down_n);
  }
};

// Walks the list forward. One cursor per CTA: a CTA's tickets only grow, so the cursor never rewinds.
class ForwardTaskCursor {
 public:
  POUNCE_HOST_DEVICE explicit ForwardTaskCursor(const ForwardTaskShape& shape) : shape_(shape) { enter(0); }

  // The task holding `ticket` (>= every ticket asked before); false past the end of the list.
  POUNCE_HOST_DEVICE bool at(int32_t ticket, Task& task) {
    while (ticket >= segment_begin_ + segment_size_) {
      if (segment_ > 2 * shape_.num_units()) return false;
      segment_begin_ += segment_size_;
      enter(segment_ + 1);
    }
    if (segment_ > 2 * shape_.num_units()) return false;
    const int32_t local = ticket - segment_begin_;
    const int32_t blocks = shape_.blocks(unit_);
    const bool shared = shape_.is_shared(unit_);
    task.m_block = shape_.first_block(unit_) + local % blocks;
    task.n_block = local / blocks;
    task.unit = shared ? unit_ : shape_.routed_index(unit_);
    task.kind = gate_up_ ? (shared ? TaskKind::kSharedGateUp : TaskKind::kGateUp)
                         : (shared ? TaskKind::kSharedDown : TaskKind::kDown);
    return true;
  }

 private:
  // Segment q of the list: 0 -> GU(0); odd q -> GU((q + 1) / 2); even q > 0 -> DN(q / 2 - 1).
  POUNCE_HOST_DEVICE void enter(int32_t q) {
    segment_ = q;
    const int32_t U = shape_.num_units();
    if (q == 0) {
      gate_up_ = true, unit_ = 0;
    } else if (q % 2 == 1) {
      gate_up_ = true, unit_ = (q + 1) / 2;
    } else {
      gate_up_ = false, unit_ = q / 2 - 1;
    }
    if (unit_ >= U) {
      segment_size_ = 0;
    } else {
      segment_size_ = gate_up_ ? shape_.gate_up_tiles(unit_) : shape_.down_tiles(unit_);
    }
  }

  ForwardTaskShape shape_;
  int32_t segment_ = 0;
  int32_t segment_begin_ = 0;
  int32_t segment_size_ = 0;
  int32_t unit_ = 0;
  bool gate_up_ = true;
};

}  // namespace pounce::kernels::sched
