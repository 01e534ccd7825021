// CUDA helpers shared by the CUDA cases of chunkloss-bench: a status check, seeded device inputs,
// dtype conversions, a naive row kernel over materialised logits (statistics, and the softmax
// gradient with a per-row coefficient), relative-norm errors, free memory, CUDA-event timing and
// row-major cuBLAS GEMM helpers for the floor and the naive/float64 computations.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <chunkloss/core/error.h>
#include <chunkloss/gpu/gemm.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench.h"
#include "device.h"

namespace chunkloss::bench {

#define BENCH_CHECK(stmt)                                                     \
  do {                                                                        \
    const auto s_ = (stmt);                                                   \
    CHUNKLOSS_CHECK(static_cast<int>(s_) == 0, #stmt, " failed with status ", \
                    static_cast<int>(s_));                                    \
  } while (0)

/// p[i] = base[i] (0 without base) + scale * a deterministic N(0, 1) value (element i of a
/// counter-based stream; different seeds give independent streams), on stream s.
void fill_random(float* p, std::size_t n, float scale, std::uint64_t seed, cudaStream_t s,
                 const float* base = nullptr);
void fill_random(__nv_bfloat16* p, std::size_t n, float scale, std::uint64_t seed, cudaStream_t s,
                 const __nv_bfloat16* base = nullptr);

/// A case's random operands (the bf16 or fp32 buffers x [nh] and w [vh], H = h): hidden ~ N(0, 1)
/// and weight ~ N(0, s^2/H) with s = c.logit_std, so the logits' standard deviation is about s,
/// from fill_random streams `seed` and seed + 1 (seed = 4 c.seed; seed + 2 and + 3 are free for
/// a case's further tensors), on stream s_.
struct RandomOperands {
  std::uint64_t seed;
  float weight_scale;
  std::string description;  ///< the operands and targets, in words, for CaseResult::inputs
};
RandomOperands fill_operands(const CaseConfig& c, void* x, void* w, std::size_t nh, std::size_t vh,
                             std::int64_t h, bool bf16, cudaStream_t s_);

/// Targets as the i32 the CUDA cases pass.
std::vector<int> int_targets(const std::vector<std::int64_t>& y);

/// dst[i] = double(src[i]) / bf16(src[i]), on stream s.
void widen(const float* src, double* dst, std::size_t n, cudaStream_t s);
void widen(const __nv_bfloat16* src, double* dst, std::size_t n, cudaStream_t s);
void narrow(const float* src, __nv_bfloat16* dst, std::size_t n, cudaStream_t s);

/// Naive rows of materialised logits z [N, V] (one block per row, double accumulation): for
/// rows with y >= 0, lse = log sum exp(z_t) (or lse_in[t] when given) into lse_out and z_t[y_t]
/// into zy_out (0 for ignored rows; either output may be null). With `coef`, the row is then
/// overwritten in place by coef[t] * (softmax(z_t) - onehot(y_t)) (0 for ignored rows).
void dense_rows(float* z, const int* y, std::int64_t n, std::int64_t v, const double* lse_in,
                const double* coef, double* lse_out, double* zy_out, cudaStream_t s);
void dense_rows(double* z, const int* y, std::int64_t n, std::int64_t v, const double* lse_in,
                const double* coef, double* lse_out, double* zy_out, cudaStream_t s);

/// ||a - b|| / ||b|| over n device values (||a - b|| when b is zero); synchronises the device
/// first (a and b may come from any stream).
double rel_err(const float* a, const float* b, std::size_t n);
double rel_err(const __nv_bfloat16* a, const float* b, std::size_t n);
double rel_err(const float* a, const double* b, std::size_t n);
double rel_err(const __nv_bfloat16* a, const double* b, std::size_t n);
/// The median, 99th percentile and largest of the relative-norm errors of the `rows` rows (of
/// `cols`) of a against the float64 b; rows of b that are all zero are left out.
std::array<double, 3> row_err_quantiles(const float* a, const double* b, std::int64_t rows,
                                        std::int64_t cols);
std::array<double, 3> row_err_quantiles(const __nv_bfloat16* a, const double* b, std::int64_t rows,
                                        std::int64_t cols);

/// Free device memory after synchronising the device (cudaMemGetInfo).
std::size_t free_bytes();

/// Device memory taken since free_bytes() returned `before`, less `known` bytes (0 rather than
/// a wrapped value when less was taken).
std::size_t taken_since(std::size_t before, std::size_t known = 0);

/// Times variants in interleaved rounds on stream `s` with CUDA events: one warm-up call of
/// each, then `repeats` rounds that call every variant once in turn, so drift of the clocks or
/// the temperature during the run hits all of them alike. Returns each variant's samples (ms).
inline std::vector<std::vector<double>> interleaved_ms(
    cudaStream_t s, int repeats, const std::vector<std::function<void()>>& variants) {
  cudaEvent_t e0, e1;
  BENCH_CHECK(cudaEventCreate(&e0));
  BENCH_CHECK(cudaEventCreate(&e1));
  for (const auto& fn : variants) fn();
  std::vector<std::vector<double>> t(variants.size());
  for (int r = 0; r < repeats; ++r)
    for (std::size_t i = 0; i < variants.size(); ++i) {
      BENCH_CHECK(cudaEventRecord(e0, s));
      variants[i]();
      BENCH_CHECK(cudaEventRecord(e1, s));
      BENCH_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      t[i].push_back(ms);
    }
  BENCH_CHECK(cudaEventDestroy(e0));
  BENCH_CHECK(cudaEventDestroy(e1));
  return t;
}

/// Median time in ms of `fn` on stream `s` with CUDA events after one warm-up call; the
/// samples go to `samples` when given.
template <typename Fn>
double time_ms(cudaStream_t s, int repeats, Fn&& fn, std::vector<double>* samples = nullptr) {
  const std::vector<double> t = interleaved_ms(s, repeats, {[&fn] { fn(); }})[0];
  if (samples) *samples = t;
  return median(t);
}

/// Row-major cuBLAS GEMMs: Z[N, V] = X W^T; dX[N, H] = G W; dW[V, H] = G^T X (see
/// lib/gpu/src/gemm.cpp); `in` is the dtype of X and W for the logits GEMM. With `ctx`, the
/// fp32-accumulating ones go through its algorithm selection (gpu::gemm_column_major), as the
/// library's GEMMs do.
struct Gemms {
  cublasHandle_t h;
  cudaDataType_t in, out;
  const gpu::Context* ctx = nullptr;
  void logits(const void* x, const void* w, void* z, int n, int hd, int v, cudaDataType_t zt,
              cublasComputeType_t ct) {
    call(CUBLAS_OP_T, CUBLAS_OP_N, v, n, hd, w, in, x, in, z, zt, v, ct);
  }
  // G's rows are `ldg` elements apart (0: v), dX's `ldo` (0: hd); dW += with `accumulate`.
  void dx(const void* g, const void* w, void* dxp, int n, int hd, int v, cudaDataType_t gt,
          cudaDataType_t wt, cudaDataType_t ot, cublasComputeType_t ct, int ldg = 0, int ldo = 0) {
    call(CUBLAS_OP_N, CUBLAS_OP_N, hd, n, v, w, wt, g, gt, dxp, ot, ldo ? ldo : hd, ct, ldg);
  }
  void dw(const void* g, const void* x, void* dwp, int n, int hd, int v, cudaDataType_t gt,
          cudaDataType_t xt, cudaDataType_t ot, cublasComputeType_t ct, int ldg = 0,
          bool accumulate = false) {
    call(CUBLAS_OP_N, CUBLAS_OP_T, hd, v, n, x, xt, g, gt, dwp, ot, hd, ct, ldg, accumulate);
  }

 private:
  // Column-major C[m, n] = op(A) op(B) (+ C with `accumulate`) with leading dimensions m-or-k
  // as the shapes require (B's is `ldb` when nonzero); alpha = 1 in the compute type.
  void call(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* a,
            cudaDataType_t at, const void* b, cudaDataType_t bt, void* c, cudaDataType_t ctype,
            int ldc, cublasComputeType_t ct, int ldb = 0, bool accumulate = false) {
    const double one = 1, zero = 0;
    const float onef = 1, zerof = 0;
    const bool f64 = ct == CUBLAS_COMPUTE_64F;
    const int lda = ta == CUBLAS_OP_T ? k : m;
    if (ldb == 0) ldb = tb == CUBLAS_OP_T ? n : k;
    if (ctx && ct == CUBLAS_COMPUTE_32F && at == bt) {
      const auto dtype = [](cudaDataType_t t) {
        return t == CUDA_R_32F ? DType::kF32 : DType::kBF16;
      };
      gpu::gemm_column_major(*ctx, ta == CUBLAS_OP_T, tb == CUBLAS_OP_T, m, n, k, a, lda, b, ldb,
                             dtype(at), c, ldc, dtype(ctype), accumulate ? 1.0f : 0.0f);
      return;
    }
    const void* beta = f64 ? (accumulate ? static_cast<const void*>(&one) : &zero)
                           : (accumulate ? static_cast<const void*>(&onef) : &zerof);
    BENCH_CHECK(cublasGemmEx(h, ta, tb, m, n, k, f64 ? static_cast<const void*>(&one) : &onef, a,
                             at, lda, b, bt, ldb, beta, c, ctype, ldc, ct, CUBLAS_GEMM_DEFAULT));
  }
};

}  // namespace chunkloss::bench
