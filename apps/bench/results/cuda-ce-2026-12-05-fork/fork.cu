// Throwaway probe: does running a chunk's dX and dW GEMMs on two streams at once beat running them
// one after the other? The chunk is the library's: an fp32 logits chunk, a statistics pass, the
// bf16 gradient written in place (leading dimension 2V), then dX = G W and dW += G^T X (bf16,
// beta 1 after the first chunk). cuBLAS default algorithm; each stream has its own handle and
// workspace.
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
using bf16 = __nv_bfloat16;
cublasHandle_t h0, h1;
void gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
          const void* A, int lda, const void* B, int ldb, void* C, int ldc, cudaDataType ct,
          float beta) {
  float alpha = 1.0f;
  CK(cublasGemmEx(h, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &beta, C,
                  ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}
__global__ void fill(bf16* p, size_t n, unsigned s) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    unsigned x = (unsigned)(i * 2654435761u) ^ s;
    x ^= x >> 13;
    x *= 0x5bd1e995;
    x ^= x >> 15;
    p[i] = __float2bfloat16(((x & 0xffff) / 65536.0f - 0.5f) * 0.05f);
  }
}
// Stand-in for the statistics pass: one block per row reads the row once.
__global__ void stats(const float* L, long V, float* out) {
  const float* row = L + blockIdx.x * V;
  float s = 0.f;
  for (long j = threadIdx.x * 4; j < V; j += blockDim.x * 4) {
    float4 v = *reinterpret_cast<const float4*>(row + j);
    s += __expf(v.x) + __expf(v.y) + __expf(v.z) + __expf(v.w);
  }
  __shared__ float red[32];
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(~0u, s, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) s += red[w];
    out[blockIdx.x] = s;
  }
}
// Stand-in for the gradient pass: bf16 written in place over each fp32 row, tile by tile.
__global__ void grad(float* L, long V, const float* sums) {
  float* row = L + blockIdx.x * V;
  bf16* g = reinterpret_cast<bf16*>(row);
  const float inv = 1.0f / sums[blockIdx.x];
  for (long t = 0; t < V; t += blockDim.x * 8) {
    long j = t + threadIdx.x * 8;
    float4 a{}, b{};
    if (j < V) {
      a = *reinterpret_cast<const float4*>(row + j);
      b = *reinterpret_cast<const float4*>(row + j + 4);
    }
    __syncthreads();
    if (j < V) {
      __align__(16)
          bf16 o[8] = {__float2bfloat16(__expf(a.x) * inv), __float2bfloat16(__expf(a.y) * inv),
                       __float2bfloat16(__expf(a.z) * inv), __float2bfloat16(__expf(a.w) * inv),
                       __float2bfloat16(__expf(b.x) * inv), __float2bfloat16(__expf(b.y) * inv),
                       __float2bfloat16(__expf(b.z) * inv), __float2bfloat16(__expf(b.w) * inv)};
      *reinterpret_cast<uint4*>(g + j) = *reinterpret_cast<uint4*>(o);
    }
    __syncthreads();
  }
}
float time_ms(cudaStream_t s, const std::function<void()>& f) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaEventRecord(a, s);
  f();
  cudaEventRecord(b, s);
  cudaEventSynchronize(b);
  float ms;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}
int main(int argc, char** argv) {
  long N = atol(argv[1]), H = atol(argv[2]), V = atol(argv[3]), C = atol(argv[4]);
  int reps = argc > 5 ? atoi(argv[5]) : 7;
  int lo, hi;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  cudaStream_t s0, s1, s1hi;
  CK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithPriority(&s1hi, cudaStreamNonBlocking, hi));
  CK(cublasCreate(&h0));
  CK(cublasCreate(&h1));
  void *ws0, *ws1;
  CK(cudaMalloc(&ws0, 64 << 20));
  CK(cudaMalloc(&ws1, 64 << 20));
  CK(cublasSetWorkspace(h0, ws0, 64 << 20));
  CK(cublasSetWorkspace(h1, ws1, 64 << 20));
  CK(cublasSetStream(h0, s0));
  bf16 *X, *W, *Gfull, *dX, *dW;
  float *L, *sums;
  CK(cudaMalloc(&X, N * H * 2));
  CK(cudaMalloc(&W, V * H * 2));
  CK(cudaMalloc(&Gfull, N * V * 2));
  CK(cudaMalloc(&dX, N * H * 2));
  CK(cudaMalloc(&dW, V * H * 2));
  CK(cudaMalloc(&L, C * V * 4));
  CK(cudaMalloc(&sums, C * 4));
  fill<<<1024, 256>>>(X, N * H, 1);
  fill<<<1024, 256>>>(W, V * H, 2);
  fill<<<1024, 256>>>(Gfull, N * V, 3);
  CK(cudaDeviceSynchronize());
  auto T = CUBLAS_OP_T, Nn = CUBLAS_OP_N;
  const long nc = N / C;
  const bf16* G = reinterpret_cast<const bf16*>(L);  // the in-place gradient, ld 2V
  cudaEvent_t ready, done;
  CK(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  // One chunk: logits (+ row passes) on s0, then dX and dW, either both on s0 or one on `side`.
  enum Mode { kSeq, kForkDW, kForkDX };
  auto chunk = [&](long c, bool rows, Mode mode, cudaStream_t side) {
    CK(cublasSetStream(h0, s0));
    gemm(h0, T, Nn, V, C, H, W, H, X + c * C * H, H, L, V, CUDA_R_32F, 0);
    if (rows) {
      stats<<<C, 1024, 0, s0>>>(L, V, sums);
      grad<<<C, 1024, 0, s0>>>(L, V, sums);
    }
    auto dx = [&](cublasHandle_t h) {
      gemm(h, Nn, Nn, H, C, V, W, H, G, 2 * V, dX + c * C * H, H, CUDA_R_16BF, 0);
    };
    auto dw = [&](cublasHandle_t h) {
      gemm(h, Nn, T, H, V, C, X + c * C * H, H, G, 2 * V, dW, H, CUDA_R_16BF, c ? 1.f : 0.f);
    };
    if (mode == kSeq) {
      dx(h0);
      dw(h0);
      return;
    }
    CK(cudaEventRecord(ready, s0));
    CK(cudaStreamWaitEvent(side, ready));
    CK(cublasSetStream(h1, side));
    if (mode == kForkDW) {
      dw(h1);
      dx(h0);
    } else {
      dx(h1);
      dw(h0);
    }
    CK(cudaEventRecord(done, side));
    CK(cudaStreamWaitEvent(s0, done));
  };
  auto loop = [&](bool rows, Mode mode, cudaStream_t side) {
    return [=, &chunk] {
      for (long c = 0; c < nc; ++c) chunk(c, rows, mode, side);
    };
  };
  struct Case {
    const char* name;
    std::function<void()> f;
  };
  std::vector<Case> cases = {
      {"floor (3 full GEMMs)",
       [&] {
         CK(cublasSetStream(h0, s0));
         gemm(h0, T, Nn, V, N, H, W, H, X, H, Gfull, V, CUDA_R_16BF, 0);
         gemm(h0, Nn, Nn, H, N, V, W, H, Gfull, V, dX, H, CUDA_R_16BF, 0);
         gemm(h0, Nn, T, H, V, N, X, H, Gfull, V, dW, H, CUDA_R_16BF, 0);
       }},
      {"GEMMs seq", loop(false, kSeq, s1)},
      {"GEMMs fork dW side", loop(false, kForkDW, s1)},
      {"GEMMs fork dX side", loop(false, kForkDX, s1)},
      {"GEMMs fork dX side hi", loop(false, kForkDX, s1hi)},
      {"rows seq", loop(true, kSeq, s1)},
      {"rows fork dW side", loop(true, kForkDW, s1)},
      {"rows fork dX side", loop(true, kForkDX, s1)},
      {"rows fork dX side hi", loop(true, kForkDX, s1hi)},
  };
  for (auto& c : cases) c.f();
  CK(cudaDeviceSynchronize());
  std::vector<std::vector<float>> t(cases.size());
  for (int r = 0; r < reps; ++r)
    for (size_t i = 0; i < cases.size(); ++i) t[i].push_back(time_ms(s0, cases[i].f));
  printf("N=%ld H=%ld V=%ld C=%ld chunks=%ld reps=%d\n", N, H, V, C, nc, reps);
  float floor_ms = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    auto v = t[i];
    std::sort(v.begin(), v.end());
    const float med = v[v.size() / 2];
    if (i == 0) floor_ms = med;
    printf("  %-24s %8.3f ms  %.3f of the floor  (min %.3f, max %.3f)\n", cases[i].name, med,
           med / floor_ms, v.front(), v.back());
  }
  CK(cudaGetLastError());
}
