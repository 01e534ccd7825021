// Throwaway probe: do the floor's dX and dW GEMMs take the same time on the true gradient
// (softmax - onehot, times the mean's power of two, ignored rows zero) as on the logits, which
// the bench's floor feeds them?
// A throwaway probe beside the 2026-12-04 evening results (not built; floor-on-true-gradient.txt):
//   nvcc -O3 -arch=sm_90 -o floor-on-true-gradient floor-on-true-gradient.cu -lcublas
//   ./floor-on-true-gradient N H V
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#define CK(x)                                                 \
  do {                                                        \
    auto e_ = (x);                                            \
    if ((int)e_) {                                            \
      printf("fail %s: %d line %d\n", #x, (int)e_, __LINE__); \
      exit(1);                                                \
    }                                                         \
  } while (0)
using bf16 = __nv_bfloat16;

__device__ uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__global__ void fill(bf16* p, size_t n, float sc, uint64_t key) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t h = mix64(key + (i + 1) * 0x9e3779b97f4a7c15ull);
    float u1 = ((h >> 40) + 0.5f) * 0x1p-24f, u2 = ((h >> 8) & 0xffffff) * 0x1p-24f;
    p[i] = __float2bfloat16_rn(sqrtf(-2.f * logf(u1)) * cospif(2.f * u2) * sc);
  }
}
// One block per row of an fp32 logits chunk: the bf16 gradient c (softmax - onehot) into g.
__global__ void grad_rows(const float* z, int64_t V, const int* y, float c, bf16* g) {
  __shared__ float sh[2][256];
  const float* r = z + blockIdx.x * V;
  bf16* o = g + blockIdx.x * V;
  const int t = y[blockIdx.x];
  if (t < 0) {
    for (int64_t j = threadIdx.x; j < V; j += 256) o[j] = __float2bfloat16_rn(0.f);
    return;
  }
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += 256) m = fmaxf(m, r[j]);
  sh[0][threadIdx.x] = m;
  __syncthreads();
  for (int s = 128; s; s >>= 1) {
    if (threadIdx.x < s) sh[0][threadIdx.x] = fmaxf(sh[0][threadIdx.x], sh[0][threadIdx.x + s]);
    __syncthreads();
  }
  m = sh[0][0];
  float s = 0;
  for (int64_t j = threadIdx.x; j < V; j += 256) s += expf(r[j] - m);
  sh[1][threadIdx.x] = s;
  __syncthreads();
  for (int k = 128; k; k >>= 1) {
    if (threadIdx.x < k) sh[1][threadIdx.x] += sh[1][threadIdx.x + k];
    __syncthreads();
  }
  const float lse = m + logf(sh[1][0]);
  for (int64_t j = threadIdx.x; j < V; j += 256)
    o[j] = __float2bfloat16_rn(c * (expf(r[j] - lse) - (j == t)));
}

cublasHandle_t H;
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* A, int lda,
          const void* B, int ldb, void* C, cudaDataType ct, int ldc) {
  float alpha = 1.f, beta = 0.f;
  CK(cublasGemmEx(H, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &beta, C,
                  ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

int main(int argc, char** argv) {
  const int64_t N = atol(argv[1]), Hd = atol(argv[2]), V = atol(argv[3]);
  CK(cublasCreate(&H));
  void* ws;
  CK(cudaMalloc(&ws, 64 << 20));
  CK(cublasSetWorkspace(H, ws, 64 << 20));
  bf16 *X, *W, *dX, *dW, *Z, *G;
  float* T;
  int* y;
  const int64_t cr = 1024;
  CK(cudaMalloc(&X, N * Hd * 2));
  CK(cudaMalloc(&W, V * Hd * 2));
  CK(cudaMalloc(&dX, N * Hd * 2));
  CK(cudaMalloc(&dW, V * Hd * 2));
  CK(cudaMalloc(&Z, N * V * 2));
  CK(cudaMalloc(&G, N * V * 2));
  CK(cudaMalloc(&T, cr * V * 4));
  CK(cudaMalloc(&y, N * 4));
  fill<<<2048, 256>>>(X, N * Hd, 1.f, 0x1234);
  fill<<<2048, 256>>>(W, V * Hd, 2.f / sqrtf((float)Hd), 0x9876);
  std::vector<int> hy(N);
  uint64_t st = 1;
  int64_t valid = 0;
  for (int64_t i = 0; i < N; ++i) {
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    hy[i] = i % 7 == 3 ? -100 : (int)((st >> 33) % V);
    valid += hy[i] >= 0;
  }
  CK(cudaMemcpy(y, hy.data(), N * 4, cudaMemcpyHostToDevice));
  int e;
  std::frexp(1.0 / valid, &e);
  const float c = std::ldexp(1.f, e);  // the mean's power of two, as the library's tile holds
  for (int64_t r0 = 0; r0 < N; r0 += cr) {
    const int64_t R = std::min(cr, N - r0);
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, V, R, Hd, W, Hd, X + r0 * Hd, Hd, T, CUDA_R_32F, V);
    grad_rows<<<R, 256>>>(T, V, y + r0, c, G + r0 * V);
  }
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timeit = [&](auto&& f) {
    CK(cudaEventRecord(e0));
    f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  };
  auto logits = [&] { gemm(CUBLAS_OP_T, CUBLAS_OP_N, V, N, Hd, W, Hd, X, Hd, Z, CUDA_R_16BF, V); };
  auto dx = [&](const bf16* g) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, Hd, N, V, W, Hd, g, V, dX, CUDA_R_16BF, Hd);
  };
  auto dw = [&](const bf16* g) {
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, Hd, V, N, X, Hd, g, V, dW, CUDA_R_16BF, Hd);
  };
  // warm-up
  logits();
  dx(Z);
  dw(Z);
  dx(G);
  dw(G);
  std::vector<float> t[6];
  for (int r = 0; r < 9; ++r) {
    t[0].push_back(timeit([&] {
      logits();
      dx(Z);
      dw(Z);
    }));
    t[1].push_back(timeit([&] {
      logits();
      dx(G);
      dw(G);
    }));
    t[2].push_back(timeit([&] { dx(Z); }));
    t[3].push_back(timeit([&] { dx(G); }));
    t[4].push_back(timeit([&] { dw(Z); }));
    t[5].push_back(timeit([&] { dw(G); }));
  }
  const char* names[] = {"floor, G = logits (the bench)",
                         "floor, G = true gradient",
                         "dX on logits",
                         "dX on true gradient",
                         "dW on logits",
                         "dW on true gradient"};
  printf("N %lld H %lld V %lld (1 in 7 rows ignored, mean's power of two %g)\n", (long long)N,
         (long long)Hd, (long long)V, c);
  for (int k = 0; k < 6; ++k) {
    std::sort(t[k].begin(), t[k].end());
    printf("  %-32s %.2f ms (min %.2f, max %.2f)\n", names[k], t[k][4], t[k][0], t[k][8]);
  }
  return 0;
}
