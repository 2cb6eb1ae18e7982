// Macrobatches of the receive schedule (docs/design.md, "Macrobatch ring"): the routed rows cut into runs
// that fit a ring of `ring_rows` rows, so that routed activations need the ring, not the worst case.
//
// Macrobatch b covers schedule rows [bounds[b], bounds[b + 1]). Runs of whole experts are packed greedily
// in schedule order; an expert with more rows than the ring is split into pieces of `ring_rows` rows
// (the last piece shorter), each piece a macrobatch of its own. So an expert's weight-gradient tile
// reduces over one macrobatch unless the expert is split, and every split is at a multiple of ring_rows
// from the expert's first row. Experts without rows add nothing. Computed by one thread, on the device
// after the schedule (the host never reads a row count) and on the CPU in tests.
#pragma once

#include <cstdint>

#include "kernels/layout/workspace_layout.cuh"  // POUNCE_HOST_DEVICE, min_i64

namespace pounce::kernels::sched {

// An upper bound of the macrobatch count: every expert may close one, and the rows beyond fill at most
// ceil(rows / ring_rows) more.
POUNCE_HOST_DEVICE inline int32_t max_macrobatches(int32_t num_groups, int64_t rows_capacity,
                                                   int64_t ring_rows) {
  return static_cast<int32_t>(num_groups + (rows_capacity + ring_rows - 1) / ring_rows);
}

// Writes bounds[0 .. B] (B + 1 entries, bounds[0] = group_row_offset[0], bounds[B] = the last expert's end)
// and returns B, the number of macrobatches (0 without rows). `group_row_offset` has num_groups + 1
// non-decreasing entries (multiples of 128 in the schedule); `ring_rows` > 0 (a multiple of 128 keeps the
// cuts on m-block boundaries); `bounds` holds max_macrobatches(...) + 1 entries.
POUNCE_HOST_DEVICE inline int32_t plan_macrobatches(const int32_t* group_row_offset, int32_t num_groups,
                                                    int32_t ring_rows, int32_t* bounds) {
  int32_t count = 0;
  int32_t open = group_row_offset[0];  // first row of the macrobatch being packed (empty while == begin)
  bounds[0] = open;
  for (int32_t g = 0; g < num_groups; ++g) {
    const int32_t begin = group_row_offset[g], end = group_row_offset[g + 1];
    if (end <= begin) continue;
    if (end - begin > ring_rows) {  // split: close what is open, then whole pieces, the last one closed too
      if (begin > open) bounds[++count] = begin;
      for (int32_t at = begin + ring_rows; at < end; at += ring_rows) bounds[++count] = at;
      bounds[++count] = end;
      open = end;
    } else if (end - open > ring_rows) {  // does not fit beside what is open (which is not empty then)
      bounds[++count] = begin;
      open = begin;
    }
  }
  const int32_t last = group_row_offset[num_groups];
  if (last > open) bounds[++count] = last;
  return count;
}

}  // namespace pounce::kernels::sched
