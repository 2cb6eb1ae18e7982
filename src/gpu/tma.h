// Host-side tensor-map (CUtensorMap) construction for the bulk tensor copy engine.
//
// The driver entry point cuTensorMapEncodeTiled is looked up once through the runtime
// (cudaGetDriverEntryPointByVersion) so the library never links libcuda and loads on machines without a
// driver. Encoding is pure host work: no device memory, no synchronisation, safe during graph capture.
#pragma once

#include <cuda.h>
#include <cstdint>

namespace pounce::kernels {

// A row-major bf16 tensor of `rank` dimensions listed innermost first: dims[0] is contiguous,
// strides_bytes[i] is the byte distance between consecutive indices of dims[i + 1]. The box is
// box[0] x box[1] (x box[2]) elements, 128-byte swizzled (box[0] * 2 bytes must be 128), zero fill for
// out-of-bounds reads.
struct Bf16TensorMapSpec {
  const void* base = nullptr;
  int rank = 2;  // 2 or 3
  uint64_t dims[3] = {0, 0, 0};
  uint64_t strides_bytes[2] = {0, 0};
  uint32_t box[3] = {1, 1, 1};
};

// Throws pounce::Error naming the field and the fix when the spec is invalid or the driver refuses it.
CUtensorMap make_bf16_tensor_map_sw128(const Bf16TensorMapSpec& spec);

// Any element type (make_bf16_tensor_map_sw128 is its bf16 case): e4m3 bytes (kUint8) in 128-byte swizzled
// boxes of 128 elements per row, fp32 scale vectors (kFloat32) unswizzled, ... dims/strides/box as in
// Bf16TensorMapSpec; zero fill for out-of-bounds reads.
enum class TensorMapElement { kUint8, kBfloat16, kFloat32 };
struct TensorMapSpec {
  const void* base = nullptr;
  int rank = 2;  // 1, 2 or 3
  uint64_t dims[3] = {0, 0, 0};
  uint64_t strides_bytes[2] = {0, 0};
  uint32_t box[3] = {1, 1, 1};
  TensorMapElement element = TensorMapElement::kUint8;
  bool swizzle_128b = true;  // box[0] * element size must then be 128 bytes
};
CUtensorMap make_tensor_map(const TensorMapSpec& spec);

}  // namespace pounce::kernels
