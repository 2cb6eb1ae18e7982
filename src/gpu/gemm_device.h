// What every grouped GEMM launcher (bf16: grouped_gemm.cu, FP8: fp8_gemm.cu) needs of the current device,
// set up once per device by grouped_gemm.cu: its SM count (the persistent grid), its opt-in shared-memory
// limit, and its timeout flag, which every GEMM kernel records into and grouped_gemm_error_code reads.
// The bf16 kernels' shared-memory limits are raised there too; other launchers raise their own kernels'.
#pragma once

#include <cstdint>

namespace pounce::kernels {

inline constexpr int kMaxGemmDevices = 64;

struct GemmDevice {
  int index = 0;
  int num_sms = 0;
  int max_shared_bytes = 0;
  int32_t* error_flag = nullptr;
};

// The current device's; throws pounce::Error on a device that cannot run the grouped GEMMs.
const GemmDevice& gemm_device();

}  // namespace pounce::kernels
