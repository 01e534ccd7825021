// Row-major GEMMs through the context's GemmSelector: a row-major C = op(A) op(B) is the
// column-major C^T = op(B)^T op(A)^T, so the operands swap and keep their transposes.
#include "chunkloss/gpu/gemm.h"

#include <cstdint>

#include "chunkloss/gpu/check.h"
#include "gemm_selector.h"

namespace chunkloss::gpu {
namespace {

cudaDataType_t cuda_type(DType t) {
  CHUNKLOSS_CHECK(t == DType::kF32 || t == DType::kBF16, "gpu::gemm: unsupported dtype ",
                  dtype_name(t));
  return t == DType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
}

// The row-major GEMM in its column-major form; alpha and beta point to host or device memory.
void gemm_impl(const Context& ctx, const Matrix& a, bool trans_a, const Matrix& b, bool trans_b,
               void* c, DType c_dtype, std::int64_t ldc, const float* alpha, const float* beta,
               bool device_scalars) {
  CHUNKLOSS_CHECK(a.dtype == b.dtype, "gpu::gemm: A is ", dtype_name(a.dtype), ", B is ",
                  dtype_name(b.dtype));
  const std::int64_t m = trans_a ? a.cols : a.rows;  // rows of C
  const std::int64_t k = trans_a ? a.rows : a.cols;
  const std::int64_t n = trans_b ? b.rows : b.cols;  // cols of C
  CHUNKLOSS_CHECK(k == (trans_b ? b.cols : b.rows), "gpu::gemm: inner dimensions ", k, " and ",
                  trans_b ? b.cols : b.rows, " differ");
  for (const std::int64_t d : {m, n, k, a.ld, b.ld, ldc})  // (cuBLAS takes ints)
    CHUNKLOSS_CHECK(d >= 0 && d <= INT32_MAX, "gpu::gemm: a size or leading dimension of ", d,
                    " exceeds 2^31-1 (m=", m, " n=", n, " k=", k, " lda=", a.ld, " ldb=", b.ld,
                    " ldc=", ldc, ")");
  // Column-major: C^T [n, m] = op(B)^T [n, k] * op(A)^T [k, m].
  ctx.gemm_selector().run({trans_b, trans_a, static_cast<int>(n), static_cast<int>(m),
                           static_cast<int>(k), b.data, static_cast<int>(b.ld), a.data,
                           static_cast<int>(a.ld), cuda_type(a.dtype), c, static_cast<int>(ldc),
                           cuda_type(c_dtype), alpha, beta, device_scalars});
}

}  // namespace

void gemm(const Context& ctx, const Matrix& a, bool trans_a, const Matrix& b, bool trans_b, void* c,
          DType c_dtype, std::int64_t ldc, float beta) {
  const float alpha = 1.0f;
  gemm_impl(ctx, a, trans_a, b, trans_b, c, c_dtype, ldc, &alpha, &beta, false);
}

void gemm_column_major(const Context& ctx, bool trans_a, bool trans_b, int m, int n, int k,
                       const void* a, int lda, const void* b, int ldb, DType ab_dtype, void* c,
                       int ldc, DType c_dtype, float beta) {
  const float alpha = 1.0f;
  ctx.gemm_selector().run({trans_a, trans_b, m, n, k, a, lda, b, ldb, cuda_type(ab_dtype), c, ldc,
                           cuda_type(c_dtype), &alpha, &beta, false});
}

void gemm_device_scalars(const Context& ctx, const Matrix& a, bool trans_a, const Matrix& b,
                         bool trans_b, void* c, DType c_dtype, std::int64_t ldc, const float* alpha,
                         const float* beta) {
  gemm_impl(ctx, a, trans_a, b, trans_b, c, c_dtype, ldc, alpha, beta, true);
}

}  // namespace chunkloss::gpu
