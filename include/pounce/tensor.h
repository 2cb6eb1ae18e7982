// Non-owning tensor views built on DLPack, so tensors from any framework (numpy, torch, raw buffers)
// cross the API without copies. Views are dense row-major ("C contiguous"), except that weights and their
// gradients may be row-strided views of a larger tensor (docs/design.md §5 "Weight layouts"): w_gate =
// w_gate_up[:, :I, :] and w_up = w_gate_up[:, I:, :] of transformers' fused [E, 2I, H] tensor, read in place.
#pragma once

#include <dlpack/dlpack.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace pounce {

enum class DType { kBF16, kFP32, kInt32, kInt64, kFP8E4M3, kUInt8 };

const char* to_string(DType dtype);
int64_t size_of(DType dtype);

enum class DeviceKind { kCpu, kCuda };

// Which DLPack layouts TensorView::from_dlpack takes.
enum class StridePolicy {
  kDense,       // row-major, no gaps: every argument but the weights
  kRowStrided,  // the last dimension contiguous, the outer ones any non-overlapping stride: weights and
                // their gradients (rows of a larger tensor, such as the halves of a fused gate_up tensor)
};

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;
  DeviceKind device = DeviceKind::kCpu;
  int device_id = 0;
  // Elements between consecutive indices of each dimension; empty = dense row-major (from_dlpack leaves it
  // empty for a dense tensor). The layer's validation accepts strides for weights and weight gradients only.
  std::vector<int64_t> strides;

  TensorView() = default;
  TensorView(void* data, DType dtype, std::vector<int64_t> shape, DeviceKind device = DeviceKind::kCpu,
             int device_id = 0)
      : data(data), dtype(dtype), shape(std::move(shape)), device(device), device_id(device_id) {}

  // Wraps a DLPack tensor; throws pounce::Error naming `name` if its layout is not one `policy` takes, or it
  // is of a dtype Pounce does not take. A dense tensor gets empty strides whatever DLPack says.
  static TensorView from_dlpack(const DLTensor& tensor, const char* name,
                                StridePolicy policy = StridePolicy::kDense);

  // A default-constructed view stands for "no tensor" (e.g. shared weights when there is no shared expert).
  bool is_none() const { return data == nullptr && shape.empty(); }
  bool is_dense() const { return strides.empty(); }
  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const;
  int64_t bytes() const { return numel() * size_of(dtype); }
  // Elements between consecutive indices of `dim`: the given stride, or the dense one.
  int64_t stride(int64_t dim) const;
  // Bytes from the first element to one past the last (bytes() when dense): the memory the view touches
  // lies in [data, data + span_bytes()).
  int64_t span_bytes() const;
  // Offset in elements of the element at row-major position `flat_index`.
  int64_t offset_of(int64_t flat_index) const;
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  // "bf16[4096, 2048] on cuda:0"; a strided view: "bf16[8, 768, 2048] strides [3145728, 2048, 1] on cpu".
  std::string describe() const;
};

}  // namespace pounce
