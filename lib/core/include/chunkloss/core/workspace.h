// Workspace carving: a layout of aligned slices computed ahead of a call, then carved out of
// one block the caller owns, so nothing is allocated on the hot path.
#pragma once

#include <cstddef>
#include <cstdint>

#include "chunkloss/core/tensor.h"

namespace chunkloss {

/// Alignment of every slice: enough for 16-byte vector accesses and cuBLAS(Lt) operands.
inline constexpr std::size_t kWorkspaceAlignment = 256;

/// One slice of a workspace: byte offset from the block's start and size.
struct WorkspaceSlice {
  std::size_t offset = 0;
  std::size_t bytes = 0;
};

/// Builds a layout by appending aligned slices; `total()` is the block size to ask for.
class WorkspaceLayout {
 public:
  WorkspaceSlice add(std::size_t bytes);
  std::size_t total() const { return total_; }

 private:
  std::size_t total_ = 0;
};

/// A caller-owned block of memory, viewed as bytes on one device.
/// Throws chunkloss::Error when the block is smaller than a layout needs or misaligned.
class Workspace {
 public:
  Workspace() = default;
  Workspace(void* base, std::size_t bytes, Device device = Device::kCpu, int device_index = 0);

  /// Checks the block can hold `layout` (names the call in the message).
  void require(const WorkspaceLayout& layout, const char* who) const;

  template <typename T>
  T* at(const WorkspaceSlice& s) const {
    return reinterpret_cast<T*>(static_cast<unsigned char*>(base_) + s.offset);
  }
  void* base() const { return base_; }
  std::size_t bytes() const { return bytes_; }
  Device device() const { return device_; }
  int device_index() const { return device_index_; }

 private:
  void* base_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_ = Device::kCpu;
  int device_index_ = 0;
};

}  // namespace chunkloss
