// The host execution context.
#include "chunkloss/core/context.h"

#include <thread>

#include "chunkloss/core/error.h"

namespace chunkloss {

CpuContext::CpuContext(int threads) : threads_(threads) {
  CHUNKLOSS_CHECK(threads >= 0 && threads <= kMaxThreads, "CpuContext: threads must be in [0, ",
                  kMaxThreads, "], got ", threads);
  if (threads_ == 0) threads_ = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace chunkloss
