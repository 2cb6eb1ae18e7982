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

int64_t TensorView::stride(int64_t dim) const {
  if (!strides.empty()) return strides[dim];
  int64_t dense = 1;
  for (int64_t d = rank() - 1; d > dim; --d) dense *= shape[d];
  return dense;
}

int64_t TensorView::span_bytes() const {
  if (strides.empty() || numel() == 0) return bytes();
  int64_t last = 0;
  for (int64_t d = 0; d < rank(); ++d) last += (shape[d] - 1) * strides[d];
  return (last + 1) * size_of(dtype);
}

int64_t TensorView::offset_of(int64_t flat_index) const {
  if (strides.empty()) return flat_index;
  int64_t offset = 0;
  for (int64_t d = rank() - 1; d >= 0; --d) {
    offset += flat_index % shape[d] * strides[d];
    flat_index /= shape[d];
  }
  return offset;
}

std::string TensorView::describe() const {
  std::ostringstream out;
  auto list = [&](const std::vector<int64_t>& values) {
    out << "[";
    for (size_t i = 0; i < values.size(); ++i) out << (i ? ", " : "") << values[i];
    out << "]";
  };
  out << to_string(dtype);
  list(shape);
  if (!strides.empty()) {
    out << " strides ";
    list(strides);
  }
  out << " on " << (device == DeviceKind::kCpu ? "cpu" : "cuda:" + std::to_string(device_id));
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

// The strides of a row-strided view (StridePolicy::kRowStrided), checked: the last dimension contiguous, the
// others positive and without overlap (each at least the span of the dimensions inside it, in stride order).
// Dimensions of extent 1 are never stepped over; they get the dense stride of what follows them.
static std::vector<int64_t> row_strides(const DLTensor& tensor, const char* name) {
  const int ndim = tensor.ndim;
  std::vector<int64_t> strides(tensor.strides, tensor.strides + ndim);
  POUNCE_CHECK(ndim >= 1 && (tensor.shape[ndim - 1] == 1 || strides[ndim - 1] == 1), "tensor '", name,
               "' has stride ", ndim >= 1 ? strides[ndim - 1] : 0,
               " in its last dimension; Pounce reads weights row by row, so the last dimension must be ",
               "contiguous (a transposed layout such as [E, H, 2I] is not read in place: pass ",
               "w.transpose(-1, -2).contiguous() once)");
  for (int dim = ndim - 1; dim >= 0; --dim)
    if (tensor.shape[dim] == 1) strides[dim] = dim + 1 < ndim ? strides[dim + 1] * tensor.shape[dim + 1] : 1;
  std::vector<int> order(ndim);
  for (int dim = 0; dim < ndim; ++dim) order[dim] = dim;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return strides[a] < strides[b]; });
  int64_t inner_span = 1;  // elements spanned by the dimensions of smaller stride
  for (int dim : order) {
    if (tensor.shape[dim] == 1) continue;
    POUNCE_CHECK(strides[dim] >= inner_span, "tensor '", name, "' has stride ", strides[dim],
                 " in dimension ", dim,
                 ", which makes its elements overlap; pass a view whose rows are disjoint (or call ",
                 ".contiguous())");
    inner_span = strides[dim] * (tensor.shape[dim] - 1) + inner_span;
  }
  return strides;
}

TensorView TensorView::from_dlpack(const DLTensor& tensor, const char* name, StridePolicy policy) {
  TensorView view;
  view.dtype = dtype_from_dlpack(tensor.dtype, name);
  view.shape.assign(tensor.shape, tensor.shape + tensor.ndim);
  // A tensor without elements has no layout to check (numpy and torch give such tensors any strides).
  const bool empty = std::any_of(tensor.shape, tensor.shape + tensor.ndim, [](int64_t e) { return e == 0; });
  if (tensor.strides != nullptr && !empty) {
    int64_t expected = 1;
    int first_difference = -1;
    for (int dim = tensor.ndim - 1; dim >= 0; --dim) {
      if (tensor.shape[dim] != 1 && tensor.strides[dim] != expected && first_difference < 0)
        first_difference = dim;
      if (first_difference == dim && policy == StridePolicy::kDense)
        detail::fail("tensor '", name, "' is not contiguous (dim ", dim, " has stride ", tensor.strides[dim],
                     ", expected ", expected, "); call .contiguous() first");
      expected *= tensor.shape[dim];
    }
    if (first_difference >= 0) view.strides = row_strides(tensor, name);
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
