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
    {"dpo", "cpu", &run_preference_cpu},
    {"orpo", "cpu", &run_preference_cpu},
    {"simpo", "cpu", &run_preference_cpu},
    {"cpo", "cpu", &run_preference_cpu},
    {"kto", "cpu", &run_preference_cpu},
#if CHUNKLOSS_BENCH_CUDA
    {"ce", "cuda", &run_ce_cuda},
    {"dpo", "cuda", &run_preference_cuda},
    {"orpo", "cuda", &run_preference_cuda},
    {"simpo", "cuda", &run_preference_cuda},
    {"cpo", "cuda", &run_preference_cuda},
    {"kto", "cuda", &run_preference_cuda},
#endif
};

constexpr std::string_view kPreferenceLosses[] = {"dpo", "orpo", "simpo", "cpo", "kto"};

}  // namespace

bool is_preference_loss(std::string_view loss) {
  return std::find(std::begin(kPreferenceLosses), std::end(kPreferenceLosses), loss) !=
         std::end(kPreferenceLosses);
}

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
