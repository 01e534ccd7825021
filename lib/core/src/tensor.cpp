// TensorView construction, shape validation and printing.
#include "chunkloss/core/tensor.h"

#include <sstream>

#include "chunkloss/core/error.h"

namespace chunkloss {

std::string_view device_name(Device d) { return d == Device::kCpu ? "cpu" : "cuda"; }

TensorView::TensorView(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                       Device device, int device_index)
    : data_(const_cast<void*>(data)), dtype_(dtype), device_(device), device_index_(device_index) {
  CHUNKLOSS_CHECK(shape.size() <= kMaxDims, "TensorView: at most ", kMaxDims, " dimensions, got ",
                  shape.size());
  for (std::int64_t s : shape) {
    CHUNKLOSS_CHECK(s >= 0, "TensorView: negative dimension ", s);
    shape_[static_cast<std::size_t>(ndim_++)] = s;
  }
  CHUNKLOSS_CHECK(data_ != nullptr || numel() == 0, "TensorView: null data for a view of ", numel(),
                  " elements");
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < ndim_; ++d) n *= shape_[static_cast<std::size_t>(d)];
  return n;
}

std::string TensorView::str() const {
  if (!defined()) return "absent";
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < ndim_; ++d) os << (d ? ", " : "") << shape_[static_cast<std::size_t>(d)];
  os << "] " << dtype_name(dtype_) << ' ' << device_name(device_);
  return os.str();
}

}  // namespace chunkloss
