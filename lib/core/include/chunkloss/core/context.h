// Execution contexts: which device a call runs on and the resources it may use there.
// Contexts are explicit values owned by the caller; the library keeps no hidden globals.
#pragma once

#include "chunkloss/core/tensor.h"

namespace chunkloss {

namespace gpu {
class Context;
}  // namespace gpu

/// Base of the execution contexts, CpuContext and gpu::Context (the only two: the backends rely
/// on a context of each device being that class, so no other may derive). A loss call checks
/// that all its views live on the context's device.
class Context {
 public:
  virtual ~Context() = default;
  virtual Device device() const = 0;
  virtual int device_index() const { return 0; }

 private:
  friend class CpuContext;
  friend class gpu::Context;
  Context() = default;
  Context(const Context&) = default;
  Context& operator=(const Context&) = default;
};

/// Runs on the host. `threads` bounds the threads used by GEMMs and epilogues (0: all cores; at
/// most kMaxThreads, beyond which OpenMP runtimes fail to start their threads).
/// The GEMMs are Eigen's, which take it from the calling thread's OpenMP setting during a call;
/// a process that calls Eigen::setNbThreads overrides that for every call.
class CpuContext final : public Context {
 public:
  static constexpr int kMaxThreads = 4096;
  explicit CpuContext(int threads = 0);
  Device device() const override { return Device::kCpu; }
  int threads() const { return threads_; }

 private:
  int threads_;
};

}  // namespace chunkloss
