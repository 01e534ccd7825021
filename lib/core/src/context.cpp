// The host execution context.
#include "chunkloss/core/context.h"

#include <thread>

#include "chunkloss/core/error.h"

namespace chunkloss {

CpuContext::CpuContext(int threads) : threads_(threads) {
  CHUNKLOSS_CHECK(threads >= 0, "CpuContext: threads must be >= 0, got ", threads);
  if (threads_ == 0) threads_ = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace chunkloss
