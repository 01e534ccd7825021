// Throwaway: cublasGemmEx at the shape racecheck fails on in the skip_ignored_rows cases
// (TN m=4096 n=128 k=256, bf16 A/B, fp32 C, ldc 4096), B offset by argv[1] rows of 256 bf16.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>
int main(int argc, char** argv) {
  const int m = 4096, n = 128, k = 256;
  const long off = argc > 1 ? atol(argv[1]) : 0;
  const int reps = argc > 2 ? atoi(argv[2]) : 3;
  __nv_bfloat16 *a, *b;
  float* c;
  cudaMalloc(&a, sizeof(__nv_bfloat16) * m * k);
  cudaMalloc(&b, sizeof(__nv_bfloat16) * (off + n) * k);
  cudaMalloc(&c, sizeof(float) * m * n);
  std::vector<__nv_bfloat16> h(static_cast<size_t>(m) * k);
  for (size_t i = 0; i < h.size(); ++i) h[i] = __float2bfloat16((i % 7) * 0.01f);
  cudaMemcpy(a, h.data(), sizeof(__nv_bfloat16) * m * k, cudaMemcpyHostToDevice);
  cudaMemset(b, 0, sizeof(__nv_bfloat16) * (off + n) * k);
  cublasHandle_t hd;
  cublasCreate(&hd);
  const float alpha = 1, beta = 0;
  for (int r = 0; r < reps; ++r) {
    cublasStatus_t s = cublasGemmEx(hd, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, a, CUDA_R_16BF,
                                    k, b + off * k, CUDA_R_16BF, k, &beta, c, CUDA_R_32F, m,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cudaError_t e = cudaDeviceSynchronize();
    printf("offset %ld rep %d: cublas %d (%s), sync %s\n", off, r, (int)s, cublasGetStatusString(s),
           cudaGetErrorString(e));
    if (s != CUBLAS_STATUS_SUCCESS || e != cudaSuccess) return 1;
  }
  printf("ok\n");
  return 0;
}
