// DLPack views: the only way tensors enter Pounce.
#include "pounce/tensor.h"

#include <algorithm>
#include <sstream>

#include "pounce/error.h"

namespace pounce {

const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP32:
      return "fp32";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kFP8E4M3:
      return "fp8e4m3";
    case DType::kUInt8:
      return "uint8";
  }
  return "?";
}

int64_t size_of(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return 2;
    case DType::kFP32:
      return 4;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kFP8E4M3:
      return 1;
    case DType::kUInt8:
      return 1;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t count = 1;
  for (int64_t extent : shape) count *= extent;
  return count;
}

std::string TensorView::describe() const {
  std::ostringstream out;
  out << to_string(dtype) << "[";
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << "] on " << (device == DeviceKind::kCpu ? "cpu" : "cuda:" + std::to_string(device_id));
  return out.str();
}

static DType dtype_from_dlpack(const DLDataType& type, const char* name) {
  POUNCE_CHECK(type.lanes == 1, "tensor '", name, "' has ", int(type.lanes), " lanes; pass a plain tensor");
  if (type.code == kDLBfloat && type.bits == 16) return DType::kBF16;
  if (type.code == kDLFloat && type.bits == 32) return DType::kFP32;
  if (type.code == kDLInt && type.bits == 32) return DType::kInt32;
  if (type.code == kDLInt && type.bits == 64) return DType::kInt64;
  if (type.code == kDLUInt && type.bits == 8) return DType::kUInt8;
  // DLPack 1.0 numbers float8_e4m3fn as code 10 (kDLFloat8_e4m3fn); older headers lack the enum.
  if (type.code == 10 && type.bits == 8) return DType::kFP8E4M3;
  detail::fail("tensor '", name, "' has DLPack dtype (code ", int(type.code), ", bits ", int(type.bits),
               "); Pounce takes bf16, fp32, int32, int64 and fp8e4m3 tensors");
}

TensorView TensorView::from_dlpack(const DLTensor& tensor, const char* name) {
  TensorView view;
  view.dtype = dtype_from_dlpack(tensor.dtype, name);
  view.shape.assign(tensor.shape, tensor.shape + tensor.ndim);
  // A tensor without elements has no layout to check (numpy and torch give such tensors any strides).
  const bool empty = std::any_of(tensor.shape, tensor.shape + tensor.ndim, [](int64_t e) { return e == 0; });
  if (tensor.strides != nullptr && !empty) {
    int64_t expected = 1;
    for (int dim = tensor.ndim - 1; dim >= 0; --dim) {
      POUNCE_CHECK(tensor.shape[dim] == 1 || tensor.strides[dim] == expected, "tensor '", name,
                   "' is not contiguous (dim ", dim, " has stride ", tensor.strides[dim], ", expected ",
                   expected, "); call .contiguous() first");
      expected *= tensor.shape[dim];
    }
  }
  view.data = static_cast<char*>(tensor.data) + tensor.byte_offset;
  switch (tensor.device.device_type) {
    case kDLCPU:
      view.device = DeviceKind::kCpu;
      break;
    case kDLCUDA:
      view.device = DeviceKind::kCuda;
      break;
    default:
      detail::fail("tensor '", name, "' lives on DLPack device type ", int(tensor.device.device_type),
                   "; Pounce takes CPU or CUDA tensors");
  }
  view.device_id = tensor.device.device_id;
  return view;
}

}  // namespace pounce
