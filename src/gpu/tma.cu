// Tensor-map encoding through the driver entry point obtained from the runtime (no libcuda link).
#include "src/gpu/tma.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <mutex>

#include "pounce/error.h"

namespace pounce::kernels {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled_entry_point() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult query = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t err =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &query);
    if (err == cudaSuccess && query == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  POUNCE_CHECK(fn != nullptr,
               "cuTensorMapEncodeTiled is not available from the CUDA driver; fix: install an NVIDIA driver "
               "for CUDA 12.0 or newer");
  return fn;
}

}  // namespace

CUtensorMap make_bf16_tensor_map_sw128(const Bf16TensorMapSpec& spec) {
  TensorMapSpec generic;
  generic.base = spec.base;
  generic.rank = spec.rank;
  for (int i = 0; i < 3; ++i) generic.dims[i] = spec.dims[i], generic.box[i] = spec.box[i];
  for (int i = 0; i < 2; ++i) generic.strides_bytes[i] = spec.strides_bytes[i];
  generic.element = TensorMapElement::kBfloat16;
  generic.swizzle_128b = true;
  return make_tensor_map(generic);
}

CUtensorMap make_tensor_map(const TensorMapSpec& spec) {
  const uint32_t element_bytes = spec.element == TensorMapElement::kUint8      ? 1
                                 : spec.element == TensorMapElement::kBfloat16 ? 2
                                                                               : 4;
  const CUtensorMapDataType data_type =
      spec.element == TensorMapElement::kUint8      ? CU_TENSOR_MAP_DATA_TYPE_UINT8
      : spec.element == TensorMapElement::kBfloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                    : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  POUNCE_CHECK(spec.rank >= 1 && spec.rank <= 3, "tensor map rank ", spec.rank,
               " unsupported; fix: use 1, 2 or 3");
  POUNCE_CHECK(spec.base != nullptr && reinterpret_cast<uintptr_t>(spec.base) % 16 == 0, "tensor base ",
               spec.base, " must be non-null and 16-byte aligned; fix: allocate with cudaMalloc");
  POUNCE_CHECK(!spec.swizzle_128b || spec.box[0] * element_bytes == 128, "tensor map box inner extent ",
               spec.box[0], " elements of ", element_bytes,
               " bytes; fix: the 128-byte swizzle needs exactly 128 bytes per row");
  for (int i = 0; i + 1 < spec.rank; ++i) {
    POUNCE_CHECK(spec.strides_bytes[i] % 16 == 0, "tensor map stride ", spec.strides_bytes[i],
                 " bytes is not a multiple of 16; fix: pad the inner dimension to 16 bytes");
  }
  for (int i = 0; i < spec.rank; ++i) {
    POUNCE_CHECK(spec.dims[i] >= 1, "tensor map dimension ", i, " is empty; fix: skip the launch");
    POUNCE_CHECK(spec.box[i] >= 1 && spec.box[i] <= 256, "tensor map box extent ", spec.box[i],
                 " out of 1..256");
  }
  CUtensorMap map{};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult res = encode_tiled_entry_point()(
      &map, data_type, static_cast<cuuint32_t>(spec.rank), const_cast<void*>(spec.base), spec.dims,
      spec.strides_bytes, spec.box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      spec.swizzle_128b ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  POUNCE_CHECK(res == CUDA_SUCCESS, "cuTensorMapEncodeTiled failed with CUresult ", static_cast<int>(res),
               " (rank ", spec.rank, ", dims ", spec.dims[0], "x", spec.dims[1], "x", spec.dims[2],
               "); fix: check shapes, alignment and box sizes");
  return map;
}

}  // namespace pounce::kernels
