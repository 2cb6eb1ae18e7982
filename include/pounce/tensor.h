// Non-owning tensor views built on DLPack, so tensors from any framework (numpy, torch, raw buffers)
// cross the API without copies. Views must be dense row-major ("C contiguous").
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

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;
  DeviceKind device = DeviceKind::kCpu;
  int device_id = 0;

  TensorView() = default;
  TensorView(void* data, DType dtype, std::vector<int64_t> shape, DeviceKind device = DeviceKind::kCpu,
             int device_id = 0)
      : data(data), dtype(dtype), shape(std::move(shape)), device(device), device_id(device_id) {}

  // Wraps a DLPack tensor; throws pounce::Error naming `name` if it is strided, offset-misaligned or of
  // a dtype Pounce does not take.
  static TensorView from_dlpack(const DLTensor& tensor, const char* name);

  // A default-constructed view stands for "no tensor" (e.g. shared weights when there is no shared expert).
  bool is_none() const { return data == nullptr && shape.empty(); }
  int64_t rank() const { return static_cast<int64_t>(shape.size()); }
  int64_t numel() const;
  int64_t bytes() const { return numel() * size_of(dtype); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data);
  }
  std::string describe() const;  // "bf16[4096, 2048] on cuda:0"
};

}  // namespace pounce
