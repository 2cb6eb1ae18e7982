// The fused forward's task list over macrobatches (docs/design.md, "Macrobatch ring"; kernels/fused/
// fused_forward.cuh walks it with a ring). Macrobatch b holds schedule rows [bounds[b], bounds[b + 1])
// (sched/macrobatches.cuh), which live in ring rows [0, bounds[b + 1] - bounds[b]) while it runs. Each
// macrobatch's list is forward_tasks.cuh's list over its rows (the shared expert's units in macrobatch 0
// only, before its routed ones), and the lists follow each other in macrobatch order:
//
//   [shared units, GU(0,0) GU(0,1) DN(0,0) ... DN(0,U0-1)] [GU(1,0) GU(1,1) DN(1,0) ... DN(1,U1-1)] ...
//
// A routed task names its m-block twice: in the ring (the rows its TMA loads and epilogue stores address) and
// in the schedule (its expert, the schedule entries the combine reads, the counters rows_ready / first_done /
// rows_done, which stay indexed by schedule blocks and by routed units numbered across all macrobatches).
// Ring reuse adds waits, each on tiles with smaller tickets or on communication CTAs (kernels/fused/
// fused_forward.cuh): a routed tile of macrobatch b >= 1 waits until b - 1's ring rows are free (its down
// tiles stored and, with the push combine, its rows pushed); the pulls of b wait for every gate/up tile of
// b - 1 (its x rows).
#pragma once

#include <cstdint>

#include "kernels/sched/forward_tasks.cuh"

namespace pounce::kernels::sched {

struct MacrobatchTask : Task {  // m_block: the ring block (routed) or the shared block; unit: see below
  int32_t macrobatch;           // 0 for the shared expert's tiles
  int32_t schedule_block;       // routed: ring block + bounds[macrobatch] / BLOCK_M; shared: = m_block
};
// unit of a routed tile counts routed units across macrobatches (a unit never spans two of them).

struct MacrobatchTaskShape {
  ForwardTaskShape base;     // shared_m_blocks, unit_blocks and the n-blocks; routed_m_blocks is ignored
  const int32_t* bounds;     // [num_macrobatches + 1] schedule rows, multiples of layout::kBlockM
  int32_t num_macrobatches;  // 0: no routed rows (the shared expert's list alone, if any)

  POUNCE_HOST_DEVICE int32_t num_lists() const { return num_macrobatches > 0 ? num_macrobatches : 1; }
  // Macrobatch b's own list.
  POUNCE_HOST_DEVICE ForwardTaskShape list(int32_t b) const {
    ForwardTaskShape shape = base;
    if (b > 0) shape.shared_m_blocks = 0;
    shape.routed_m_blocks =
        num_macrobatches > 0 ? static_cast<int32_t>((bounds[b + 1] - bounds[b]) / layout::kBlockM) : 0;
    return shape;
  }
};

// Walks the concatenated lists forward; like ForwardTaskCursor, one per CTA, tickets never decrease.
class MacrobatchTaskCursor {
 public:
  POUNCE_HOST_DEVICE explicit MacrobatchTaskCursor(const MacrobatchTaskShape& shape)
      : shape_(shape), cursor_(shape.list(0)) {
    enter(0);
  }

  // The task holding `ticket` (>= every ticket asked before); false past the end of the last list.
  POUNCE_HOST_DEVICE bool at(int32_t ticket, MacrobatchTask& out) {
    while (ticket >= list_begin_ + list_size_) {
      if (macrobatch_ + 1 >= shape_.num_lists()) return false;
      list_begin_ += list_size_;
      unit_base_ += shape_.list(macrobatch_).routed_units();
      enter(macrobatch_ + 1);
    }
    Task& task = out;
    if (!cursor_.at(ticket - list_begin_, task)) return false;
    out.macrobatch = macrobatch_;
    const bool routed = task.kind == TaskKind::kGateUp || task.kind == TaskKind::kDown;
    out.schedule_block = routed ? block_base_ + task.m_block : task.m_block;
    if (routed) task.unit += unit_base_;
    return true;
  }

 private:
  POUNCE_HOST_DEVICE void enter(int32_t b) {
    macrobatch_ = b;
    const ForwardTaskShape list = shape_.list(b);
    cursor_ = ForwardTaskCursor(list);
    list_size_ = list.num_tiles();
    block_base_ = shape_.num_macrobatches > 0 ? static_cast<int32_t>(shape_.bounds[b] / layout::kBlockM) : 0;
  }

  MacrobatchTaskShape shape_;
  ForwardTaskCursor cursor_;
  int32_t macrobatch_ = 0;
  int32_t list_begin_ = 0;
  int32_t list_size_ = 0;
  int32_t unit_base_ = 0;   // routed units of the macrobatches before this one
  int32_t block_base_ = 0;  // this macrobatch's first schedule block
};

}  // namespace pounce::kernels::sched
