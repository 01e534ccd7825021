// The apps' loss device (see loss_device.h).
#include "chunkloss/apps/loss_device.h"

#include <chunkloss/core/error.h>

#include <utility>
#include <vector>

#if CHUNKLOSS_APPS_CUDA
#include <chunkloss/gpu/context.h>
#endif

namespace chunkloss::apps {
namespace {

// A host block for loss workspaces, aligned to kWorkspaceAlignment, grown on demand and reused.
class HostWorkspace {
 public:
  Workspace get(std::size_t bytes) {
    if (bytes > capacity_ || !storage_) {
      storage_ = std::make_unique<std::byte[]>(bytes + kWorkspaceAlignment);
      capacity_ = bytes;
    }
    void* p = storage_.get();
    std::size_t space = capacity_ + kWorkspaceAlignment;
    return Workspace(std::align(kWorkspaceAlignment, capacity_, p, space), bytes);
  }

 private:
  std::unique_ptr<std::byte[]> storage_;
  std::size_t capacity_ = 0;
};

}  // namespace

struct LossDevice::Impl {
  std::unique_ptr<CpuContext> cpu;
  HostWorkspace host_ws;
#if CHUNKLOSS_APPS_CUDA
  std::unique_ptr<gpu::Context> gpu;
  std::vector<gpu::DeviceBuffer> buffers;  // one per in()/inout() of a call, reused
  std::size_t next = 0;
  gpu::DeviceBuffer ws;
  std::vector<std::pair<TensorView, void*>> copy_back;  // host view, its device copy
#endif

  TensorView mirror(const TensorView& host, [[maybe_unused]] bool back) {
#if CHUNKLOSS_APPS_CUDA
    if (gpu && host.defined()) {
      CHUNKLOSS_CHECK(host.device() == Device::kCpu, "LossDevice: ", host.str(),
                      " is not a host view");
      if (next == buffers.size()) buffers.emplace_back();
      gpu::DeviceBuffer& b = buffers[next++];
      if (b.bytes() < host.nbytes()) b = gpu::DeviceBuffer(host.nbytes());
      gpu::copy_to_device(b.data(), host.data(), host.nbytes());
      if (back) copy_back.emplace_back(host, b.data());
      return host.rebound(b.data(), Device::kCuda, gpu->device_index());
    }
#endif
    return host;
  }
};

LossDevice::LossDevice(const std::string& device, int threads, [[maybe_unused]] bool measured_gemms)
    : impl_(std::make_unique<Impl>()) {
  const std::string bad = usage_error(device);
  CHUNKLOSS_CHECK(bad.empty(), bad);
#if CHUNKLOSS_APPS_CUDA
  if (device == "cuda") {
    CHUNKLOSS_CHECK(gpu::device_count() > 0, "--device cuda: no CUDA device is visible");
    impl_->gpu = std::make_unique<gpu::Context>(
        0, nullptr, measured_gemms ? gpu::GemmSelection::kMeasured : gpu::GemmSelection::kDefault);
    return;
  }
#endif
  impl_->cpu = std::make_unique<CpuContext>(threads);
}

LossDevice::~LossDevice() = default;

std::string LossDevice::usage_error(const std::string& device) {
  if (device != "cpu" && device != "cuda") return "--device: '" + device + "' is not cpu or cuda";
  if (device == "cuda" && !CHUNKLOSS_APPS_CUDA)
    return "--device cuda: this build has no CUDA backend (configure with "
           "-DCHUNKLOSS_WITH_CUDA=ON where the CUDA toolkit is installed)";
  return "";
}

Context& LossDevice::context() {
#if CHUNKLOSS_APPS_CUDA
  if (impl_->gpu) return *impl_->gpu;
#endif
  return *impl_->cpu;
}

void LossDevice::begin() {
#if CHUNKLOSS_APPS_CUDA
  impl_->next = 0;
  impl_->copy_back.clear();
#endif
}

TensorView LossDevice::in(const TensorView& host) { return impl_->mirror(host, false); }

TensorView LossDevice::inout(const TensorView& host) { return impl_->mirror(host, true); }

Workspace LossDevice::workspace(std::size_t bytes) {
#if CHUNKLOSS_APPS_CUDA
  if (impl_->gpu) {
    if (impl_->ws.bytes() < bytes) impl_->ws = gpu::DeviceBuffer(bytes);
    return Workspace(impl_->ws.data(), bytes, Device::kCuda, impl_->gpu->device_index());
  }
#endif
  return impl_->host_ws.get(bytes);
}

void LossDevice::end() {
#if CHUNKLOSS_APPS_CUDA
  for (const auto& [host, dev] : impl_->copy_back)
    gpu::copy_to_host(host.data(), dev, host.nbytes());
  impl_->copy_back.clear();
#endif
}

}  // namespace chunkloss::apps
