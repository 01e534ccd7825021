// The GPU suites' skip: a test case without the CUDA devices it needs says so on stderr as a line
// starting "SKIP: ", which ctest reports as skipped (the gpu label's SKIP_REGULAR_EXPRESSION, see
// tests/CMakeLists.txt) and run_gpu_checks.sh gathers into its summary, then returns early.
#pragma once

#include <chunkloss/gpu/context.h>

#include <cstdio>

namespace chunkloss::test {

/// Whether `needed` CUDA devices are visible; prints the "SKIP: " line for `what` when not.
inline bool have_devices(int needed, const char* what) {
  const int visible = gpu::device_count();
  if (visible >= needed) return true;
  std::fprintf(stderr, "SKIP: %s needs %d CUDA device(s), %d visible\n", what, needed, visible);
  return false;
}

/// Whether a CUDA device is visible (one GPU test case).
inline bool have_gpu() { return have_devices(1, "this GPU test case"); }

}  // namespace chunkloss::test
