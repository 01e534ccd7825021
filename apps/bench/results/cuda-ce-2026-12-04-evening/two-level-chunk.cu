// Throwaway probe: does a vocab-sub-blocked fp32 logits scratch (small enough to stay in L2)
// with the chunk's logits kept as bf16 (z - block max) beat the fp32 chunk at 1 GiB?
// A throwaway probe beside the 2026-12-04 evening results (not built; two-level-chunk.txt):
//   nvcc -O3 -arch=sm_90 -o two-level-chunk two-level-chunk.cu -lcublas
//   ./two-level-chunk N H V [budget MiB] [repeats]
#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
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

__global__ void fill(bf16* p, size_t n, float sc, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t s = (i + 1) * 0x9E3779B97F4A7C15ull ^ (seed * 0xD1B54A32D192ED03ull);
    float a = 0;
    for (int k = 0; k < 4; ++k) {
      s += 0x9E3779B97F4A7C15ull;
      uint64_t z = s;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      a += (z >> 40) * (1.0f / 16777216.0f) - 0.5f;
    }
    p[i] = __float2bfloat16_rn(a * sc * 1.7320508f);
  }
}

__device__ float block_max(float v, float* sh) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : -INFINITY;
  if (threadIdx.x < 32)
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(~0u, v, o));
  if (threadIdx.x == 0) sh[32] = v;
  __syncthreads();
  v = sh[32];
  __syncthreads();
  return v;
}
__device__ float block_sum(float v, float* sh) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / 32 ? sh[threadIdx.x] : 0.f;
  if (threadIdx.x < 32)
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(~0u, v, o);
  if (threadIdx.x == 0) sh[32] = v;
  __syncthreads();
  v = sh[32];
  __syncthreads();
  return v;
}

// Scheme A: stats over a full fp32 row (two reads: max then sum, second one mostly L1/L2? no:
// online max/sum in one read).
__global__ void stats_f32(const float* t, int64_t V, float* lse) {
  __shared__ float sh[33];
  const float4* r = reinterpret_cast<const float4*>(t + blockIdx.x * V);
  float m = -INFINITY, s = 0.f;
  for (int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) {
    float4 v = r[i];
    float mx = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
    if (mx > m) {
      s *= __expf(m - mx);
      m = mx;
    }
    s += __expf(v.x - m) + __expf(v.y - m) + __expf(v.z - m) + __expf(v.w - m);
  }
  float M = block_max(m, sh);
  s = block_sum(s * __expf(m - M), sh);
  if (threadIdx.x == 0) lse[blockIdx.x] = M + __logf(s);
}
// Scheme A: gradient from fp32, bf16 out of place (same traffic as in place).
__global__ void grad_f32(const float* t, int64_t V, const float* lse, bf16* g, int64_t ldg,
                         const int* tgt) {
  const float4* r = reinterpret_cast<const float4*>(t + blockIdx.x * V);
  uint2* o = reinterpret_cast<uint2*>(g + blockIdx.x * ldg);
  const float L = lse[blockIdx.x];
  const int tt = tgt[blockIdx.x];
  for (int64_t i = threadIdx.x; i < V / 4; i += blockDim.x) {
    float4 v = r[i];
    float a = __expf(v.x - L) - (4 * i == tt), b = __expf(v.y - L) - (4 * i + 1 == tt),
          c = __expf(v.z - L) - (4 * i + 2 == tt), d = __expf(v.w - L) - (4 * i + 3 == tt);
    __nv_bfloat162 p = __floats2bfloat162_rn(a, b), q = __floats2bfloat162_rn(c, d);
    uint2 u;
    u.x = *reinterpret_cast<unsigned*>(&p);
    u.y = *reinterpret_cast<unsigned*>(&q);
    o[i] = u;
  }
}
// Scheme B pass 1: one block per row of a sub-block (Vb fp32 values, Vb % 4 == 0): block max,
// sum of exp relative to it, bf16 (z - max) into the chunk's bf16 logits.
template <int PER>
__global__ void sub_stats(const float* sub, int Vb, bf16* g, int64_t ldg, int64_t v0, int nb, int b,
                          float2* part) {
  __shared__ float sh[33];
  const float4* r = reinterpret_cast<const float4*>(sub + (int64_t)blockIdx.x * Vb);
  float4 v[PER];
  float m = -INFINITY;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    int i = threadIdx.x + k * blockDim.x;
    v[k] = i < Vb / 4 ? r[i] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    m = fmaxf(m, fmaxf(fmaxf(v[k].x, v[k].y), fmaxf(v[k].z, v[k].w)));
  }
  const float M = block_max(m, sh);
  float s = 0.f;
  uint2* o = reinterpret_cast<uint2*>(g + blockIdx.x * ldg + v0);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    int i = threadIdx.x + k * blockDim.x;
    if (i < Vb / 4) {
      float a = v[k].x - M, bb = v[k].y - M, c = v[k].z - M, d = v[k].w - M;
      s += __expf(a) + __expf(bb) + __expf(c) + __expf(d);
      __nv_bfloat162 p = __floats2bfloat162_rn(a, bb), q = __floats2bfloat162_rn(c, d);
      uint2 u;
      u.x = *reinterpret_cast<unsigned*>(&p);
      u.y = *reinterpret_cast<unsigned*>(&q);
      o[i] = u;
    }
  }
  s = block_sum(s, sh);
  if (threadIdx.x == 0) part[(int64_t)blockIdx.x * nb + b] = make_float2(M, s);
}
// Scheme B pass 2: lse from the partials, then the gradient in place over bf16 shifted logits.
__global__ void sub_grad(bf16* g, int64_t V, int64_t ldg, int Vb, int nb, const float2* part,
                         const int* tgt) {
  __shared__ float sh[33];
  __shared__ float shift[1024];
  float m = -INFINITY;
  for (int b = threadIdx.x; b < nb; b += blockDim.x)
    m = fmaxf(m, part[(int64_t)blockIdx.x * nb + b].x);
  const float M = block_max(m, sh);
  float s = 0.f;
  for (int b = threadIdx.x; b < nb; b += blockDim.x) {
    float2 p = part[(int64_t)blockIdx.x * nb + b];
    s += p.y * __expf(p.x - M);
  }
  const float L = M + __logf(block_sum(s, sh));
  for (int b = threadIdx.x; b < nb; b += blockDim.x)
    shift[b] = part[(int64_t)blockIdx.x * nb + b].x - L;
  __syncthreads();
  uint4* r = reinterpret_cast<uint4*>(g + blockIdx.x * ldg);
  const int tt = tgt[blockIdx.x];
  for (int64_t i = threadIdx.x; i < V / 8; i += blockDim.x) {
    uint4 u = r[i];
    const float sft = shift[(8 * i) / Vb];  // Vb % 8 == 0: one block per vector
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float2 f = __bfloat1622float2(h[k]);
      f.x = __expf(f.x + sft) - (8 * i + 2 * k == tt);
      f.y = __expf(f.y + sft) - (8 * i + 2 * k + 1 == tt);
      h[k] = __floats2bfloat162_rn(f.x, f.y);
    }
    r[i] = u;
  }
}

cublasHandle_t H;
void gemm(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k, const void* A, int lda,
          const void* B, int ldb, void* C, cudaDataType ct, int ldc, float beta) {
  float alpha = 1.f;
  CK(cublasGemmEx(H, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &beta, C,
                  ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

int main(int argc, char** argv) {
  const int64_t N = atol(argv[1]), Hd = atol(argv[2]), V = atol(argv[3]);
  const int64_t budget = (argc > 4 ? atol(argv[4]) : 1024) << 20;
  CK(cublasCreate(&H));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  CK(cublasSetStream(H, st));
  void* ws;
  CK(cudaMalloc(&ws, 64 << 20));
  CK(cublasSetWorkspace(H, ws, 64 << 20));
  bf16 *X, *W, *dX, *dW, *G;
  float* T;
  int* tgt;
  float* lse;
  float2* part;
  CK(cudaMalloc(&X, N * Hd * 2));
  CK(cudaMalloc(&W, V * Hd * 2));
  CK(cudaMalloc(&dX, N * Hd * 2));
  CK(cudaMalloc(&dW, V * Hd * 2));
  CK(cudaMalloc(&G, N * V * 2));  // floor's logits / gradient; scheme A's bf16 gradient
  CK(cudaMalloc(&T, budget));     // scheme A's fp32 chunk; scheme B's bf16 chunk + sub
  CK(cudaMalloc(&tgt, N * 4));
  CK(cudaMalloc(&lse, N * 4));
  CK(cudaMalloc(&part, N * 4096 * 8));
  fill<<<1024, 256>>>(X, N * Hd, 1.f, 1);
  fill<<<1024, 256>>>(W, V * Hd, 2.f / sqrtf((float)Hd), 2);
  {
    std::vector<int> t(N);
    for (int64_t i = 0; i < N; ++i) t[i] = (int)((i * 2654435761ull) % V);
    CK(cudaMemcpy(tgt, t.data(), N * 4, cudaMemcpyHostToDevice));
  }
  auto floor = [&] {
    gemm(CUBLAS_OP_T, CUBLAS_OP_N, V, N, Hd, W, Hd, X, Hd, G, CUDA_R_16BF, V, 0.f);
    gemm(CUBLAS_OP_N, CUBLAS_OP_N, Hd, N, V, W, Hd, G, V, dX, CUDA_R_16BF, Hd, 0.f);
    gemm(CUBLAS_OP_N, CUBLAS_OP_T, Hd, V, N, X, Hd, G, V, dW, CUDA_R_16BF, Hd, 0.f);
  };
  // Scheme A: fp32 chunk of R rows.
  const int64_t ra_max = budget / (V * 4);
  const int64_t na = (N + ra_max - 1) / ra_max;
  auto schemeA = [&](bool kernels) {
    for (int64_t c = 0; c < na; ++c) {
      int64_t r0 = c * N / na, r1 = (c + 1) * N / na, R = r1 - r0;
      gemm(CUBLAS_OP_T, CUBLAS_OP_N, V, R, Hd, W, Hd, X + r0 * Hd, Hd, T, CUDA_R_32F, V, 0.f);
      // the library's in-place gradient: bf16 rows with the fp32 stride
      bf16* g = reinterpret_cast<bf16*>(T);
      if (kernels) {
        stats_f32<<<R, 512, 0, st>>>(T, V, lse + r0);
        grad_f32<<<R, 512, 0, st>>>(T, V, lse + r0, G, 2 * V, tgt + r0);
        g = G;
      }
      gemm(CUBLAS_OP_N, CUBLAS_OP_N, Hd, R, V, W, Hd, g, 2 * V, dX + r0 * Hd, CUDA_R_16BF, Hd, 0.f);
      gemm(CUBLAS_OP_N, CUBLAS_OP_T, Hd, V, R, X + r0 * Hd, Hd, g, 2 * V, dW, CUDA_R_16BF, Hd,
           c ? 1.f : 0.f);
    }
  };
  // Scheme B: bf16 chunk of R rows and an fp32 sub-block scratch of about `sub` bytes.
  auto schemeB = [&](int64_t sub, bool kernels, bool print) {
    const int64_t rb_max = (budget - sub - 64 * 1024 * 1024 / 8) / (V * 2);
    const int64_t nbk = (N + rb_max - 1) / rb_max;
    const int64_t rmax = (N + nbk - 1) / nbk;
    int64_t Vb = sub / (rmax * 4) / 8 * 8;
    Vb = std::min<int64_t>(Vb, 4096 * 4);
    const int nb = (int)((V + Vb - 1) / Vb);
    if (print)
      printf("  B sub %lld MiB: %lld chunks of %lld rows, Vb %lld (%d blocks)\n",
             (long long)(sub >> 20), (long long)nbk, (long long)rmax, (long long)Vb, nb);
    bf16* g = reinterpret_cast<bf16*>(T);
    float* s = reinterpret_cast<float*>(reinterpret_cast<char*>(T) + rmax * V * 2);
    for (int64_t c = 0; c < nbk; ++c) {
      int64_t r0 = c * N / nbk, r1 = (c + 1) * N / nbk, R = r1 - r0;
      for (int b = 0; b < nb; ++b) {
        int64_t v0 = b * Vb, vb = std::min(Vb, V - v0);
        gemm(CUBLAS_OP_T, CUBLAS_OP_N, vb, R, Hd, W + v0 * Hd, Hd, X + r0 * Hd, Hd, s, CUDA_R_32F,
             vb, 0.f);
        if (kernels) {
          int per = (int)((vb / 4 + 255) / 256);
          if (per <= 4)
            sub_stats<4><<<R, 256, 0, st>>>(s, vb, g, V, v0, nb, b, part);
          else if (per <= 8)
            sub_stats<8><<<R, 256, 0, st>>>(s, vb, g, V, v0, nb, b, part);
          else
            sub_stats<16><<<R, 256, 0, st>>>(s, vb, g, V, v0, nb, b, part);
        }
      }
      if (kernels) sub_grad<<<R, 512, 0, st>>>(g, V, V, (int)Vb, nb, part, tgt + r0);
      gemm(CUBLAS_OP_N, CUBLAS_OP_N, Hd, R, V, W, Hd, g, V, dX + r0 * Hd, CUDA_R_16BF, Hd, 0.f);
      gemm(CUBLAS_OP_N, CUBLAS_OP_T, Hd, V, R, X + r0 * Hd, Hd, g, V, dW, CUDA_R_16BF, Hd,
           c ? 1.f : 0.f);
    }
  };
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timeit = [&](auto&& f) {
    CK(cudaEventRecord(e0, st));
    f();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  };
  const std::vector<int64_t> subs = {16 << 20, 24 << 20, 32 << 20, 48 << 20, 96 << 20};
  printf("N %lld H %lld V %lld budget %lld MiB; A: %lld chunks of ~%lld rows\n", (long long)N,
         (long long)Hd, (long long)V, (long long)(budget >> 20), (long long)na,
         (long long)(N / na));
  for (auto s : subs) schemeB(s, true, true);
  // warm-up
  floor();
  schemeA(true);
  for (auto s : subs) schemeB(s, true, false);
  CK(cudaStreamSynchronize(st));
  const int reps = argc > 5 ? atoi(argv[5]) : 7;
  std::vector<std::vector<float>> t(4 + 2 * subs.size());
  for (int r = 0; r < reps; ++r) {
    int k = 0;
    t[k++].push_back(timeit(floor));
    t[k++].push_back(timeit([&] { schemeA(true); }));
    t[k++].push_back(timeit([&] { schemeA(false); }));
    for (auto s : subs) {
      t[k++].push_back(timeit([&] { schemeB(s, true, false); }));
      t[k++].push_back(timeit([&] { schemeB(s, false, false); }));
    }
    t[k++].push_back(timeit(floor));
  }
  auto med = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<float> fl = t[0];
  fl.insert(fl.end(), t.back().begin(), t.back().end());
  const float F = med(fl);
  printf("floor %.2f ms\n", F);
  printf("A fp32 chunk: %.2f ms (%.3f), GEMMs only %.2f (%.3f)\n", med(t[1]), med(t[1]) / F,
         med(t[2]), med(t[2]) / F);
  int k = 3;
  for (auto s : subs) {
    float a = med(t[k++]), b = med(t[k++]);
    printf("B sub %3lld MiB: %.2f ms (%.3f), GEMMs only %.2f (%.3f)\n", (long long)(s >> 20), a,
           a / F, b, b / F);
  }
  return 0;
}
