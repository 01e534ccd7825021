// Status checks for CUDA and cuBLAS calls (internal: includes CUDA headers). One generic macro
// throws chunkloss::Error naming the failing statement, file, line and device.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "chunkloss/core/error.h"

namespace chunkloss::gpu::detail {

inline const char* status_string(cudaError_t e) { return cudaGetErrorString(e); }
inline const char* status_string(cublasStatus_t s) { return cublasGetStatusString(s); }
inline bool status_ok(cudaError_t e) { return e == cudaSuccess; }
inline bool status_ok(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }
inline int current_device() {
  int d = -1;
  (void)cudaGetDevice(&d);
  return d;
}

}  // namespace chunkloss::gpu::detail

/// Evaluates a CUDA runtime or cuBLAS call (or a kernel launcher returning a cudaError_t as int)
/// and throws chunkloss::Error on failure.
#define CHUNKLOSS_GPU_CHECK(stmt) CHUNKLOSS_GPU_CHECK_AS((stmt), #stmt)

/// As CHUNKLOSS_GPU_CHECK for a status already in hand; the message names what failed by the
/// remaining arguments (a GEMM and its shape, say) rather than by the statement.
#define CHUNKLOSS_GPU_CHECK_AS(status, ...)                            \
  do {                                                                 \
    const auto chunkloss_status_ = (status);                           \
    if (!::chunkloss::gpu::detail::status_ok(chunkloss_status_)) {     \
      ::chunkloss::detail::throw_error(                                \
          __FILE__, __LINE__, __VA_ARGS__, " failed on cuda device ",  \
          ::chunkloss::gpu::detail::current_device(), ": ",            \
          ::chunkloss::gpu::detail::status_string(chunkloss_status_)); \
    }                                                                  \
  } while (0)

/// Checks a kernel launcher's returned status (a cudaError_t as int).
#define CHUNKLOSS_LAUNCH_CHECK(call) CHUNKLOSS_GPU_CHECK(static_cast<cudaError_t>(call))
