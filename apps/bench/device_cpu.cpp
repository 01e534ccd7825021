// The host BenchDevice: steady_clock timing, and peak resident-set growth from /proc/self/status
// (VmHWM reset through /proc/self/clear_refs where the kernel allows it, else VmRSS sampled).
#include <Eigen/Core>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "device.h"

namespace chunkloss::bench {
namespace {

// A "Vm...:  123 kB" field of /proc/self/status, in bytes; 0 when absent.
std::size_t status_bytes(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(f, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    std::istringstream is(line.substr(key.size()));
    std::size_t kb = 0;
    is >> kb;
    return kb * 1024;
  }
  return 0;
}

bool reset_high_water_mark() {
  std::ofstream f("/proc/self/clear_refs");
  if (!f) return false;
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const std::size_t colon = line.find(':');
    if (colon != std::string::npos) return line.substr(line.find_first_not_of(' ', colon + 1));
  }
  return "unknown CPU";
}

// The instruction sets Eigen vectorises with. Its own list names AVX2 and FMA only in an AVX-512
// build, so they are added from its macros.
std::string simd_in_use() {
  std::string sets = Eigen::SimdInstructionSetsInUse();
#ifndef EIGEN_VECTORIZE_AVX512
#ifdef EIGEN_VECTORIZE_FMA
  sets = "FMA, " + sets;
#endif
#ifdef EIGEN_VECTORIZE_AVX2
  sets = "AVX2, " + sets;
#endif
#endif
  return sets;
}

class CpuDevice final : public BenchDevice {
 public:
  explicit CpuDevice(int threads) : threads_(threads) {}
  ~CpuDevice() override { stop_sampler(); }

  std::string describe() const override {
    std::ostringstream os;
    os << "cpu: " << cpu_model() << ", " << threads_ << " of "
       << std::thread::hardware_concurrency() << " hardware threads, Eigen " << EIGEN_WORLD_VERSION
       << "." << EIGEN_MAJOR_VERSION << "." << EIGEN_MINOR_VERSION << " SIMD: " << simd_in_use();
    return os.str();
  }

  double time_ms(const std::function<void()>& fn) override {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    const auto t1 = std::chrono::steady_clock::now();
    return std::chrono::duration<double, std::milli>(t1 - t0).count();
  }

  void begin_peak() override {
    stop_sampler();
    use_hwm_ = false;
    if (reset_high_water_mark()) {
      base_ = status_bytes("VmRSS");
      // The reset worked if the high-water mark now sits at the current resident set.
      use_hwm_ = status_bytes("VmHWM") <= base_ + (std::size_t{1} << 20);
    }
    if (!use_hwm_) {
      base_ = status_bytes("VmRSS");
      peak_ = base_;
      running_ = true;
      sampler_ = std::thread([this] {
        while (running_.load()) {
          peak_ = std::max<std::size_t>(peak_, status_bytes("VmRSS"));
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      });
    }
  }

  PeakMemory end_peak() override {
    if (use_hwm_) {
      const std::size_t hwm = status_bytes("VmHWM");
      return {hwm > base_ ? hwm - base_ : 0,
              "peak RSS growth: VmHWM after a clear_refs reset minus VmRSS at the reset"};
    }
    stop_sampler();
    peak_ = std::max<std::size_t>(peak_, status_bytes("VmRSS"));
    return {peak_ > base_ ? peak_ - base_ : 0,
            "peak RSS growth: VmRSS sampled every 1 ms (clear_refs reset unavailable), may miss "
            "short peaks"};
  }

 private:
  void stop_sampler() {
    running_ = false;
    if (sampler_.joinable()) sampler_.join();
  }

  int threads_;
  bool use_hwm_ = false;
  std::size_t base_ = 0;
  std::atomic<std::size_t> peak_{0};
  std::atomic<bool> running_{false};
  std::thread sampler_;
};

}  // namespace

std::unique_ptr<BenchDevice> make_cpu_device(int threads) {
  return std::make_unique<CpuDevice>(threads);
}

double median(std::vector<double> s) {
  if (s.empty()) throw std::runtime_error("median of no samples");
  std::sort(s.begin(), s.end());
  const std::size_t m = s.size() / 2;
  return s.size() % 2 ? s[m] : 0.5 * (s[m - 1] + s[m]);
}

}  // namespace chunkloss::bench
