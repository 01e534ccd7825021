// A throwaway probe beside the 2026-12-04 results (not built): are cuBLAS's bf16-output GEMMs
// the round-to-nearest of its fp32-output GEMMs, at the bench's logits, dX and dW shapes, with
// host and device alpha, with and without CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION?
//   nvcc -O2 -arch=sm_90 -o probe cublas-bf16-output-rounding.cu -lcublas && ./probe
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>
#define CK(x)                               \
  do {                                      \
    auto e_ = (x);                          \
    if ((int)e_) {                          \
      printf("fail %s: %d\n", #x, (int)e_); \
      return 1;                             \
    }                                       \
  } while (0)
__global__ void fill(__nv_bfloat16* p, size_t n, float sc, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t s = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    float a = 0;
    for (int k = 0; k < 4; ++k) {
      s ^= s >> 31;
      s *= 0xBF58476D1CE4E5B9ull;
      s ^= s >> 29;
      a += (s >> 40) * (1.0f / 16777216.0f) - 0.5f;
    }
    p[i] = __float2bfloat16_rn(a * sc * 1.7320508f);
  }
}
// compares bf16 c with RN(fp32 r): count differing, sum sq diff, sum sq ref
__global__ void cmp(const __nv_bfloat16* c, const float* r, size_t n, unsigned long long* cnt,
                    double* acc) {
  double d2 = 0, r2 = 0;
  unsigned long long k = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float a = __bfloat162float(c[i]), b = __bfloat162float(__float2bfloat16_rn(r[i]));
    k += a != b;
    d2 += (double)(a - r[i]) * (a - r[i]);
    r2 += (double)r[i] * r[i];
    (void)b;
  }
  atomicAdd(cnt, k);
  atomicAdd(acc, d2);
  atomicAdd(acc + 1, r2);
}
__global__ void rnerr(const float* r, size_t n, double* acc) {
  double d2 = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    float b = __bfloat162float(__float2bfloat16_rn(r[i]));
    d2 += (double)(b - r[i]) * (b - r[i]);
  }
  atomicAdd(acc, d2);
}
int test(cublasHandle_t h, const char* name, int m, int n, int k, bool ta, bool tb,
         const __nv_bfloat16* A, int lda, const __nv_bfloat16* B, int ldb, float* R,
         __nv_bfloat16* C, unsigned long long* cnt, double* acc, bool device_alpha, float* dscal) {
  // column-major C[m,n] = op(A)[m,k] * B[k,n]
  float zero = 0, alpha = 0.5833f;
  CK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  CK(cublasGemmEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k,
                  &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &zero, R, CUDA_R_32F, m,
                  CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  if (device_alpha) {
    CK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_DEVICE));
    CK(cublasGemmEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k,
                    dscal, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, dscal + 1, C, CUDA_R_16BF, m,
                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    CK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
  } else {
    CK(cublasGemmEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k,
                    &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &zero, C, CUDA_R_16BF, m,
                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  }
  CK(cudaMemset(cnt, 0, 8));
  CK(cudaMemset(acc, 0, 24));
  size_t e = (size_t)m * n;
  cmp<<<1024, 256>>>(C, R, e, cnt, acc);
  rnerr<<<1024, 256>>>(R, e, acc + 2);
  unsigned long long hc;
  double ha[3];
  CK(cudaMemcpy(&hc, cnt, 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(ha, acc, 24, cudaMemcpyDeviceToHost));
  printf("%-40s m=%d n=%d k=%d: %.4f%% differ from RN(fp32); rel err %.3e (RN alone %.3e)\n", name,
         m, n, k, 100.0 * hc / e, sqrt(ha[0] / ha[1]), sqrt(ha[2] / ha[1]));
  return 0;
}
int main() {
  const int N = 4096, H = 4096, V = 128256;
  __nv_bfloat16 *x, *w, *g, *C;
  float* R;
  unsigned long long* cnt;
  double* acc;
  float* dscal;
  CK(cudaMalloc(&x, (size_t)N * H * 2));
  CK(cudaMalloc(&w, (size_t)V * H * 2));
  CK(cudaMalloc(&g, (size_t)N * V * 2));
  CK(cudaMalloc(&C, (size_t)N * V * 2));
  CK(cudaMalloc(&R, (size_t)N * V * 4));
  CK(cudaMalloc(&cnt, 8));
  CK(cudaMalloc(&acc, 24));
  CK(cudaMalloc(&dscal, 8));
  float hs[2] = {0.5833f, 0.0f};
  CK(cudaMemcpy(dscal, hs, 8, cudaMemcpyHostToDevice));
  fill<<<1024, 256>>>(x, (size_t)N * H, 1.0f, 1);
  fill<<<1024, 256>>>(w, (size_t)V * H, sqrtf(4.0f / H), 2);
  fill<<<1024, 256>>>(g, (size_t)N * V, 1e-3f, 3);
  cublasHandle_t h;
  CK(cublasCreate(&h));
  void* ws;
  CK(cudaMalloc(&ws, 100 << 20));
  CK(cublasSetWorkspace(h, ws, 100 << 20));
  for (int mode = 0; mode < 2; ++mode) {
    CK(cublasSetMathMode(h, mode ? (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                                  CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)
                                 : CUBLAS_DEFAULT_MATH));
    printf("== math mode %s\n", mode ? "DISALLOW_REDUCED_PRECISION_REDUCTION" : "default");
    for (int da = 0; da < 2; ++da) {
      const char* s = da ? " device alpha" : " host alpha";
      char nm[64];
      // logits^T [V, N] = W [V,H] * X^T: column-major m=V, n=N, k=H, A = w^T (T), B = x^T
      snprintf(nm, 64, "logits%s", s);
      test(h, nm, V, N, H, true, false, w, H, x, H, R, C, cnt, acc, da, dscal);
      // dX^T [H, N] = W^T [H,V] G^T [V,N]: m=H, n=N, k=V, A = w (col-major H x V, lda H), B = g^T
      // (ld V)
      snprintf(nm, 64, "dX%s", s);
      test(h, nm, H, N, V, false, false, w, H, g, V, R, C, cnt, acc, da, dscal);
      // dW^T [H, V] = X^T [H,N] G [N,V]: m=H, n=V, k=N, A = x (col-major H x N), B = g
      // (col-major... ld V, trans)
      snprintf(nm, 64, "dW k=4096%s", s);
      test(h, nm, H, V, N, false, true, x, H, g, V, R, C, cnt, acc, da, dscal);
    }
  }
  return 0;
}
