// The types the grouped GEMMs share between their device code (gemm_config.cuh, grouped_gemm_kernel.cuh) and
// their host launchers (src/gpu/grouped_gemm.h): expert-grouped rows, the activation, the tile schedules and
// the weight-gradient store modes.
#pragma once

#include <cstdint>
#include <limits>

namespace pounce::kernels {

// Expert-grouped activation rows, device memory.
struct GroupedRows {
  int64_t max_rows = 0;  // capacity in rows (multiple of 128); tensor maps are built over it
  // Device [num_groups + 1]: non-decreasing multiples of 128 ([0] > 0 for a slice of a larger grouping).
  // Read only on the device.
  const int32_t* group_row_offset = nullptr;
  int num_groups = 0;
  int max_ctas = 0;  // persistent grid cap (leave SMs to concurrent communication kernels); 0 = every SM
  // Weight gradients only: device [num_groups], 0 where the group's output is left untouched (a macrobatch
  // writes only the experts it holds); null = every group.
  const int32_t* group_active = nullptr;
  // Optional device [num_groups]: rows of each segment that hold data; the rest, up to the next offset, are
  // padding whose A rows are zero. The GEMMs then skip work on padding (a consumer warpgroup whose 64 rows
  // are all padding, weight-gradient K blocks past the data) and store what zero rows give: zeros. null =
  // none.
  const int32_t* group_rows = nullptr;
  // Device int32 where a bounded wait that ran out records its gemm::WaitError (first one wins); null = the
  // device's global word (grouped_gemm_error_code). The layer passes its workspace's word.
  int32_t* error_flag = nullptr;
  // Tests' fault injection (gpu::inject_wait_failure): non-zero makes every stage-ring wait of the GEMM fail
  // at once, as a ring whose bound ran out would (the error flag then holds that WaitError).
  int32_t inject_failure = 0;
};

struct ActivationParams {
  int kind = 0;  // 0 SwiGLU silu(g) * u, 1 GPT-OSS (u + 1) * g * sigmoid(alpha * g)
  // g = min(g, L), u = clamp(u, -L, L); +inf means no clamp.
  float clamp_limit = std::numeric_limits<float>::infinity();
  float alpha = 1.702f;  // GPT-OSS only
};
inline constexpr int kActivationSwiGLU = 0;
inline constexpr int kActivationGptOss = 1;

// How the two consumer warpgroups of a GEMM kernel share the work (weight gradients and the activation
// backward offer both; the values are the same bit for bit):
//   kCooperative: both multiply halves of one 128 x 256 tile (as the fused kernels do), then both store.
//   kPingPong: each owns whole 128 x 128 tiles, every other one, so one stores while the other multiplies
//     (weight_grad_pingpong.cuh, activation_backward_pingpong.cuh); it loads a third more per FLOP.
enum class TileSchedule { kPingPong, kCooperative };

enum class WeightGradMode : int32_t { kStoreF32 = 0, kAccumulateF32 = 1, kStoreBf16 = 2 };

}  // namespace pounce::kernels
