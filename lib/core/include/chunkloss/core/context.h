// Execution contexts: which device a call runs on and the resources it may use there.
// Contexts are explicit values owned by the caller; the library keeps no hidden globals.
#pragma once

#include "chunkloss/core/tensor.h"

namespace chunkloss {

/// Base of every execution context. A loss call checks that all its views live on the
/// context's device.
class Context {
 public:
  virtual ~Context() = default;
  virtual Device device() const = 0;
  virtual int device_index() const { return 0; }

 protected:
  Context() = default;
  Context(const Context&) = default;
  Context& operator=(const Context&) = default;
};

/// Runs on the host. `threads` bounds the threads used by GEMMs and epilogues (0: all cores).
/// The GEMMs are Eigen's, which take it from the calling thread's OpenMP setting during a call;
/// a process that calls Eigen::setNbThreads overrides that for every call.
class CpuContext final : public Context {
 public:
  explicit CpuContext(int threads = 0);
  Device device() const override { return Device::kCpu; }
  int threads() const { return threads_; }

 private:
  int threads_;
};

}  // namespace chunkloss
