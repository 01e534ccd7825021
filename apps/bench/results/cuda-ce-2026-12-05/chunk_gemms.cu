// Throwaway probe: the cost of chunking in each of the three GEMMs (cuBLAS default algorithm).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>
#define CK(x)                                                \
  do {                                                       \
    auto e = (x);                                            \
    if ((int)e) {                                            \
      printf("fail %s line %d: %d\n", #x, __LINE__, (int)e); \
      exit(1);                                               \
    }                                                        \
  } while (0)
cublasHandle_t h;
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* A, int lda,
          const void* B, int ldb, void* C, int ldc, cudaDataType ct, float beta) {
  float alpha = 1.0f;
  CK(cublasGemmEx(h, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &beta, C,
                  ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
__global__ void fill(__nv_bfloat16* p, size_t n, unsigned s) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned x = (unsigned)(i * 2654435761u) ^ s;
    x ^= x >> 13;
    x *= 0x5bd1e995;
    x ^= x >> 15;
    p[i] = __float2bfloat16(((x & 0xffff) / 65536.0f - 0.5f) * 0.05f);
  }
}
float time_ms(const std::function<void()>& f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a);
  f();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms;
  cudaEventElapsedTime(&ms, a, b);
  return ms;
}
int main(int argc, char** argv) {
  long N = atol(argv[1]), H = atol(argv[2]), V = atol(argv[3]), C = atol(argv[4]);
  int reps = argc > 5 ? atoi(argv[5]) : 7;
  CK(cublasCreate(&h));
  void* ws;
  CK(cudaMalloc(&ws, 100 << 20));
  CK(cublasSetWorkspace(h, ws, 100 << 20));
  __nv_bfloat16 *X, *W, *G, *dX, *dW;
  float* L;
  CK(cudaMalloc(&X, N * H * 2));
  CK(cudaMalloc(&W, V * H * 2));
  CK(cudaMalloc(&G, N * V * 2));
  CK(cudaMalloc(&dX, N * H * 2));
  CK(cudaMalloc(&dW, V * H * 4));
  CK(cudaMalloc(&L, C * V * 4));
  fill<<<1024, 256>>>(X, N * H, 1);
  fill<<<1024, 256>>>(W, V * H, 2);
  fill<<<1024, 256>>>(G, N * V, 3);
  __nv_bfloat16* Lfull = G;  // full-size bf16 logits output reuses G's storage
  auto T = CUBLAS_OP_T, Nn = CUBLAS_OP_N;
  long nc = N / C;
  struct Case {
    const char* name;
    std::function<void()> f;
  };
  std::vector<Case> cases = {
      {"full logits bf16", [&] { gemm(T, Nn, V, N, H, W, H, X, H, Lfull, V, CUDA_R_16BF, 0); }},
      {"full dX", [&] { gemm(Nn, Nn, H, N, V, W, H, G, V, dX, H, CUDA_R_16BF, 0); }},
      {"full dW", [&] { gemm(Nn, T, H, V, N, X, H, G, V, dW, H, CUDA_R_16BF, 0); }},
      {"chunk logits f32",
       [&] {
         for (long c = 0; c < nc; ++c)
           gemm(T, Nn, V, C, H, W, H, X + c * C * H, H, L, V, CUDA_R_32F, 0);
       }},
      {"chunk logits bf16",
       [&] {
         for (long c = 0; c < nc; ++c)
           gemm(T, Nn, V, C, H, W, H, X + c * C * H, H, G, V, CUDA_R_16BF, 0);
       }},
      {"chunk dX",
       [&] {
         for (long c = 0; c < nc; ++c)
           gemm(Nn, Nn, H, C, V, W, H, G + c * C * V, V, dX + c * C * H, H, CUDA_R_16BF, 0);
       }},
      {"chunk dW beta1 bf16",
       [&] {
         for (long c = 0; c < nc; ++c)
           gemm(Nn, T, H, V, C, X + c * C * H, H, G + c * C * V, V, dW, H, CUDA_R_16BF,
                c ? 1.f : 0.f);
       }},
      {"chunk dW beta0 bf16",
       [&] {
         for (long c = 0; c < nc; ++c)
           gemm(Nn, T, H, V, C, X + c * C * H, H, G + c * C * V, V, dW, H, CUDA_R_16BF, 0.f);
       }},
      {"chunk dW beta1 f32",
       [&] {
         for (long c = 0; c < nc; ++c)
           gemm(Nn, T, H, V, C, X + c * C * H, H, G + c * C * V, V, dW, H, CUDA_R_32F,
                c ? 1.f : 0.f);
       }},
      {"2x chunk dW beta1 bf16",
       [&] {
         for (long c = 0; c < nc / 2; ++c)
           gemm(Nn, T, H, V, 2 * C, X + c * 2 * C * H, H, G + c * 2 * C * V, V, dW, H, CUDA_R_16BF,
                c ? 1.f : 0.f);
       }},
  };
  for (auto& c : cases) c.f();
  cudaDeviceSynchronize();
  std::vector<std::vector<float>> t(cases.size());
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < cases.size(); ++i) t[i].push_back(time_ms(cases[i].f));
  printf("N=%ld H=%ld V=%ld C=%ld chunks=%ld reps=%d\n", N, H, V, C, nc, reps);
  for (size_t i = 0; i < cases.size(); ++i) {
    auto v = t[i];
    std::sort(v.begin(), v.end());
    printf("  %-24s %8.3f ms\n", cases[i].name, v[v.size() / 2]);
  }
  CK(cudaGetLastError());
}
