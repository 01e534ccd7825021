// GEMM wrapper over cuBLAS for the engine (internal): row-major operands of f32 or bf16, fp32
// accumulation (never TF32), selectable output dtype, beta for accumulation; each shape's
// algorithm as the context's GemmSelection picks it.
#pragma once

#include <cstdint>

#include "chunkloss/core/dtype.h"
#include "chunkloss/gpu/context.h"

namespace chunkloss::gpu {

/// A row-major matrix operand: `rows` x `cols` with leading dimension `ld` (elements).
struct Matrix {
  const void* data;
  DType dtype;
  std::int64_t rows, cols, ld;
};

/// C = op(A) op(B) + beta C, all row-major; `trans_a`/`trans_b` transpose the operand.
/// C must be f32 or bf16; A and B share one dtype. Enqueued on the context's stream.
void gemm(const Context& ctx, const Matrix& a, bool trans_a, const Matrix& b, bool trans_b, void* c,
          DType c_dtype, std::int64_t ldc, float beta);

/// As gemm(), C = alpha op(A) op(B) + beta C with alpha and beta read from device memory when
/// the GEMM runs (no host synchronisation).
void gemm_device_scalars(const Context& ctx, const Matrix& a, bool trans_a, const Matrix& b,
                         bool trans_b, void* c, DType c_dtype, std::int64_t ldc, const float* alpha,
                         const float* beta);

/// The column-major form gemm() issues (cuBLAS's convention, leading dimensions in elements):
/// C[m, n] = op(A) op(B) + beta C with host scalars, through the same algorithm selection; for
/// benchmarks that time bare GEMMs as the library runs them.
void gemm_column_major(const Context& ctx, bool trans_a, bool trans_b, int m, int n, int k,
                       const void* a, int lda, const void* b, int ldb, DType ab_dtype, void* c,
                       int ldc, DType c_dtype, float beta);

}  // namespace chunkloss::gpu
