// The device-specific part of chunkloss-bench behind one small interface: timing a call that
// has completed on the device, and measuring the peak memory a stretch of work adds.
// CPU: steady_clock and the process's resident set (VmHWM/VmRSS); a CUDA device would use
// events on its stream and cudaMemGetInfo / the allocator's high-water mark.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace chunkloss::bench {

/// Peak memory growth over a window, and how it was measured.
struct PeakMemory {
  std::size_t bytes = 0;
  std::string method;  ///< e.g. "VmHWM after clear_refs reset, minus VmRSS at the reset"
};

class BenchDevice {
 public:
  virtual ~BenchDevice() = default;
  /// One line about the device: name, threads, instruction sets.
  virtual std::string describe() const = 0;
  /// Wall time in ms of one call of `fn`, finished on the device when this returns.
  virtual double time_ms(const std::function<void()>& fn) = 0;
  /// Starts a peak-memory window.
  virtual void begin_peak() = 0;
  /// Ends the window: peak memory above the level at begin_peak().
  virtual PeakMemory end_peak() = 0;
};

/// The host, with `threads` threads for GEMMs and epilogues.
std::unique_ptr<BenchDevice> make_cpu_device(int threads);

/// Median of the samples (mean of the two middle ones for an even count).
double median(std::vector<double> samples);

}  // namespace chunkloss::bench
