// Workspace layout and the bounds/alignment checks on the caller's block.
#include "chunkloss/core/workspace.h"

#include <cstdint>

#include "chunkloss/core/error.h"

namespace chunkloss {

WorkspaceSlice WorkspaceLayout::add(std::size_t bytes) {
  WorkspaceSlice s{total_, bytes};
  total_ += (bytes + kWorkspaceAlignment - 1) / kWorkspaceAlignment * kWorkspaceAlignment;
  return s;
}

Workspace::Workspace(void* base, std::size_t bytes, Device device, int device_index)
    : base_(base), bytes_(bytes), device_(device), device_index_(device_index) {
  CHUNKLOSS_CHECK(base != nullptr || bytes == 0, "Workspace: null base for ", bytes, " bytes");
  CHUNKLOSS_CHECK(reinterpret_cast<std::uintptr_t>(base) % kWorkspaceAlignment == 0,
                  "Workspace: base must be ", kWorkspaceAlignment, "-byte aligned");
}

void Workspace::require(const WorkspaceLayout& layout, const char* who) const {
  CHUNKLOSS_CHECK(bytes_ >= layout.total(), who, ": workspace of ", bytes_,
                  " bytes is too small, the plan needs ", layout.total(),
                  " bytes (ask workspace_bytes() with the same inputs, gradients and options)");
}

}  // namespace chunkloss
