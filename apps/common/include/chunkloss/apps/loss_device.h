// Where the apps run their loss objects: on the CPU, or (--device cuda) on a CUDA device, with
// each call's hidden states, lm_head, targets and gradient buffers mirrored to the device. The
// model layer itself runs on the CPU either way.
#pragma once

#include <chunkloss/core/context.h>
#include <chunkloss/core/tensor.h>
#include <chunkloss/core/workspace.h>

#include <cstddef>
#include <memory>
#include <string>

namespace chunkloss::apps {

/// The loss's device and one call's staging. Between begin() and end(), in() and inout() return
/// views the loss object can take on context(): the host views themselves on the CPU; device
/// copies on CUDA, whose inout() buffers end() copies back into the host views. Buffers (and the
/// workspace) are reused from call to call and only grow; a call that throws leaves its inout()
/// views unspecified. Objects that keep a LossDevice& must not outlive it. Not thread-safe.
class LossDevice {
 public:
  /// `device` is "cpu" (`threads` CPU threads, 0 = all cores) or "cuda" (device 0; its context
  /// measures each GEMM shape's algorithm with `measured_gemms`, gpu::GemmSelection). Throws
  /// chunkloss::Error for "cuda" in a build without the CUDA backend or with no device.
  LossDevice(const std::string& device, int threads, bool measured_gemms = false);
  ~LossDevice();
  LossDevice(const LossDevice&) = delete;
  LossDevice& operator=(const LossDevice&) = delete;

  /// What is wrong with `device` as a --device value in this build ("" when nothing is): not
  /// cpu or cuda, or cuda in a build without the CUDA backend.
  static std::string usage_error(const std::string& device);

  Context& context();

  /// Starts a call: buffers of the previous call may be reused.
  void begin();
  /// An input of the call.
  TensorView in(const TensorView& host);
  /// A buffer the call reads and writes (a gradient, accumulated into or overwritten).
  TensorView inout(const TensorView& host);
  /// The call's workspace of `bytes` on the device.
  Workspace workspace(std::size_t bytes);
  /// Ends the call: copies the inout() buffers back to their host views.
  void end();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace chunkloss::apps
