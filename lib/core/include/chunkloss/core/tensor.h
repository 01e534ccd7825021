// Non-owning tensor views: a pointer, a dtype, a device and a row-major contiguous shape.
// Loss objects take their inputs, outputs and gradients as views; an empty view means "absent".
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "chunkloss/core/dtype.h"

namespace chunkloss {

/// Where a view's memory lives.
enum class Device : std::uint8_t { kCpu, kCuda };

std::string_view device_name(Device d);

/// A non-owning, contiguous, row-major view of up to 4 dimensions. The library never frees
/// or reallocates the memory; inputs are only read, outputs and gradients only written.
class TensorView {
 public:
  static constexpr int kMaxDims = 4;

  /// The empty view: absent optional argument.
  TensorView() = default;
  TensorView(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
             Device device = Device::kCpu, int device_index = 0);

  /// Typed convenience constructors for host memory.
  static TensorView of(const float* p, std::initializer_list<std::int64_t> shape,
                       Device device = Device::kCpu) {
    return {p, DType::kF32, shape, device};
  }
  static TensorView of(const BFloat16* p, std::initializer_list<std::int64_t> shape,
                       Device device = Device::kCpu) {
    return {p, DType::kBF16, shape, device};
  }
  static TensorView of(const std::int32_t* p, std::initializer_list<std::int64_t> shape,
                       Device device = Device::kCpu) {
    return {p, DType::kI32, shape, device};
  }
  static TensorView of(const std::int64_t* p, std::initializer_list<std::int64_t> shape,
                       Device device = Device::kCpu) {
    return {p, DType::kI64, shape, device};
  }

  bool defined() const { return data_ != nullptr || ndim_ > 0; }
  void* data() const { return data_; }
  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  int device_index() const { return device_index_; }
  int ndim() const { return ndim_; }
  std::int64_t size(int d) const { return shape_[static_cast<std::size_t>(d)]; }
  std::int64_t numel() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }

  /// The same shape and dtype over other memory (e.g. a device copy of a host view).
  TensorView rebound(const void* data, Device device, int device_index = 0) const {
    TensorView v = *this;
    v.data_ = const_cast<void*>(data);
    v.device_ = device;
    v.device_index_ = device_index;
    return v;
  }

  /// "[4, 7] bf16 cpu", or "absent".
  std::string str() const;

 private:
  void* data_ = nullptr;
  std::array<std::int64_t, kMaxDims> shape_{};
  int ndim_ = 0;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
  int device_index_ = 0;
};

}  // namespace chunkloss
