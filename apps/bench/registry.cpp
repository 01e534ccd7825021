// The (loss, device) -> runner table of chunkloss-bench. A new loss or device adds one row.
#include <algorithm>

#include "bench.h"

namespace chunkloss::bench {
namespace {

struct Entry {
  std::string_view loss, device;
  CaseRunner run;
};

constexpr Entry kRunners[] = {
    {"ce", "cpu", &run_ce_cpu},
#if CHUNKLOSS_BENCH_CUDA
    {"ce", "cuda", &run_ce_cuda},
#endif
};

}  // namespace

CaseRunner find_runner(std::string_view loss, std::string_view device) {
  for (const Entry& e : kRunners)
    if (e.loss == loss && e.device == device) return e.run;
  return nullptr;
}

std::vector<std::string> known_losses() {
  std::vector<std::string> out;
  for (const Entry& e : kRunners)
    if (std::find(out.begin(), out.end(), e.loss) == out.end()) out.emplace_back(e.loss);
  return out;
}

std::vector<std::string> known_devices() {
  std::vector<std::string> out;
  for (const Entry& e : kRunners)
    if (std::find(out.begin(), out.end(), e.device) == out.end()) out.emplace_back(e.device);
  return out;
}

}  // namespace chunkloss::bench
