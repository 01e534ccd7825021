// Row-major GEMMs through cublasGemmEx: a row-major C = op(A) op(B) is the column-major
// C^T = op(B)^T op(A)^T, so the operands swap and keep their transposes.
#include "chunkloss/gpu/gemm.h"

#include "chunkloss/gpu/check.h"

namespace chunkloss::gpu {
namespace {

cudaDataType_t cuda_type(DType t) {
  CHUNKLOSS_CHECK(t == DType::kF32 || t == DType::kBF16, "gpu::gemm: unsupported dtype ",
                  dtype_name(t));
  return t == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
}

// The one cublasGemmEx call; alpha and beta point to host or device memory per `mode`.
void gemm_impl(const Context& ctx, const Matrix& a, bool trans_a, const Matrix& b, bool trans_b,
               void* c, DType c_dtype, std::int64_t ldc, const float* alpha, const float* beta,
               cublasPointerMode_t mode) {
  CHUNKLOSS_CHECK(a.dtype == b.dtype, "gpu::gemm: A is ", dtype_name(a.dtype), ", B is ",
                  dtype_name(b.dtype));
  const std::int64_t m = trans_a ? a.cols : a.rows;  // rows of C
  const std::int64_t k = trans_a ? a.rows : a.cols;
  const std::int64_t n = trans_b ? b.rows : b.cols;  // cols of C
  CHUNKLOSS_CHECK(k == (trans_b ? b.cols : b.rows), "gpu::gemm: inner dimensions ", k, " and ",
                  trans_b ? b.cols : b.rows, " differ");
  auto h = static_cast<cublasHandle_t>(ctx.cublas());
  CHUNKLOSS_GPU_CHECK(cublasSetPointerMode(h, mode));
  // Column-major: C^T [n, m] = op(B)^T [n, k] * op(A)^T [k, m].
  const cublasStatus_t st =
      cublasGemmEx(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                   static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), alpha, b.data,
                   cuda_type(b.dtype), static_cast<int>(b.ld), a.data, cuda_type(a.dtype),
                   static_cast<int>(a.ld), beta, c, cuda_type(c_dtype), static_cast<int>(ldc),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  CHUNKLOSS_GPU_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  CHUNKLOSS_GPU_CHECK(st);
}

}  // namespace

void gemm(const Context& ctx, const Matrix& a, bool trans_a, const Matrix& b, bool trans_b, void* c,
          DType c_dtype, std::int64_t ldc, float beta) {
  const float alpha = 1.0f;
  gemm_impl(ctx, a, trans_a, b, trans_b, c, c_dtype, ldc, &alpha, &beta, CUBLAS_POINTER_MODE_HOST);
}

void gemm_device_scalars(const Context& ctx, const Matrix& a, bool trans_a, const Matrix& b,
                         bool trans_b, void* c, DType c_dtype, std::int64_t ldc, const float* alpha,
                         const float* beta) {
  gemm_impl(ctx, a, trans_a, b, trans_b, c, c_dtype, ldc, alpha, beta, CUBLAS_POINTER_MODE_DEVICE);
}

}  // namespace chunkloss::gpu
