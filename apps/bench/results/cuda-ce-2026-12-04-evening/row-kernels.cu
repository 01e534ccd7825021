// Throwaway probe: one row kernel that reads the fp32 row twice (statistics forward, gradient
// backward so the second read starts where the first ended, in L2), writing the bf16 gradient in
// place over the row's second half; against the two kernels (statistics, then gradient over the
// first half).
// A throwaway probe beside the 2026-12-04 evening results (not built; row-kernels.txt):
//   nvcc -O3 -arch=sm_90 -o row-kernels row-kernels.cu && ./row-kernels R V [cluster size checked]
#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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
namespace cg = cooperative_groups;
constexpr int kLoads = 4;

__global__ void fill(float* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint64_t z = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    p[i] = ((z >> 40) * (1.0f / 16777216.0f) - 0.5f) * 8.f;
  }
}

template <int T>
__device__ float2 block_ms(float m, float s, float* sh) {
  for (int o = 16; o; o >>= 1) {
    float m2 = __shfl_xor_sync(~0u, m, o), s2 = __shfl_xor_sync(~0u, s, o);
    float M = fmaxf(m, m2);
    s = s * __expf(m - M) + s2 * __expf(m2 - M);
    m = M;
  }
  if ((threadIdx.x & 31) == 0) {
    sh[2 * (threadIdx.x >> 5)] = m;
    sh[2 * (threadIdx.x >> 5) + 1] = s;
  }
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < T / 32; ++w) M = fmaxf(M, sh[2 * w]);
  float S = 0;
  for (int w = 0; w < T / 32; ++w) S += sh[2 * w + 1] * __expf(sh[2 * w] - M);
  __syncthreads();
  return make_float2(M, S);
}

__device__ void acc4(float4 v, float& m, float& s) {
  float mx = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
  if (mx > m) {
    s *= __expf(m - mx);
    m = mx;
  }
  s += __expf(v.x - m) + __expf(v.y - m) + __expf(v.z - m) + __expf(v.w - m);
}
__device__ uint2 grad4(float4 v, float L, int64_t j, int64_t y) {
  __nv_bfloat162 p =
      __floats2bfloat162_rn(__expf(v.x - L) - (j == y), __expf(v.y - L) - (j + 1 == y));
  __nv_bfloat162 q =
      __floats2bfloat162_rn(__expf(v.z - L) - (j + 2 == y), __expf(v.w - L) - (j + 3 == y));
  uint2 u;
  u.x = *reinterpret_cast<unsigned*>(&p);
  u.y = *reinterpret_cast<unsigned*>(&q);
  return u;
}

// Two kernels as the library runs them (V % 4 == 0 here).
template <int T>
__global__ void __launch_bounds__(T) stats(const float* t, int64_t V, float* lse) {
  __shared__ float sh[64];
  const float4* r = reinterpret_cast<const float4*>(t + blockIdx.x * V);
  float m = -INFINITY, s = 0;
  const int64_t n4 = V / 4;
  for (int64_t b = threadIdx.x; b < n4; b += T * kLoads) {
    float4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      v[u] =
          b + u * T < n4 ? r[b + u * T] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      if (b + u * T < n4) acc4(v[u], m, s);
  }
  float2 ms = block_ms<T>(m, s, sh);
  if (threadIdx.x == 0) lse[blockIdx.x] = ms.x + __logf(ms.y);
}
template <int T>
__global__ void __launch_bounds__(T)
    grad_first_half(float* t, int64_t V, const float* lse, const int* tgt) {
  float4* r = reinterpret_cast<float4*>(t + blockIdx.x * V);
  uint2* o = reinterpret_cast<uint2*>(t + blockIdx.x * V);
  const float L = lse[blockIdx.x];
  const int64_t y = tgt[blockIdx.x], n4 = V / 4;
  for (int64_t b = 0; b < n4; b += T * kLoads) {
    float4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      int64_t i = b + u * T + threadIdx.x;
      if (i < n4) v[u] = r[i];
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      int64_t i = b + u * T + threadIdx.x;
      if (i < n4) o[i] = grad4(v[u], L, 4 * i, y);
    }
  }
}
// One kernel: statistics forward, gradient backward into the second half.
template <int T, int MINB>
__global__ void __launch_bounds__(T, MINB) fused(float* t, int64_t V, float* lse, const int* tgt) {
  __shared__ float sh[64];
  float4* r = reinterpret_cast<float4*>(t + blockIdx.x * V);
  uint2* o = reinterpret_cast<uint2*>(t + blockIdx.x * V + V / 2);
  const int64_t n4 = V / 4;
  float m = -INFINITY, s = 0;
  for (int64_t b = threadIdx.x; b < n4; b += T * kLoads) {
    float4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      v[u] =
          b + u * T < n4 ? r[b + u * T] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      if (b + u * T < n4) acc4(v[u], m, s);
  }
  float2 ms = block_ms<T>(m, s, sh);
  const float L = ms.x + __logf(ms.y);
  if (threadIdx.x == 0) lse[blockIdx.x] = L;
  const int64_t y = tgt[blockIdx.x];
  const int64_t span = T * kLoads;
  for (int64_t b = (n4 - 1) / span * span; b >= 0; b -= span) {
    float4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      int64_t i = b + u * T + threadIdx.x;
      if (i < n4) v[u] = r[i];
    }
    __syncthreads();
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      int64_t i = b + u * T + threadIdx.x;
      if (i < n4) o[i] = grad4(v[u], L, 4 * i, y);
    }
  }
}

// A cluster of C blocks per row: each streams its slice (statistics), the cluster merges them,
// then each re-reads its slice backward into a bf16 gradient held in shared memory, and after a
// second cluster barrier (every slice read) stores it over the row's second half.
template <int T>
__global__ void __launch_bounds__(T)
    clu(float* t, int64_t V, int64_t S, float* lse, const int* tgt) {
  extern __shared__ uint2 out[];
  __shared__ float sh[64];
  __shared__ float2 part;
  __shared__ float Ls;
  cg::cluster_group cl = cg::this_cluster();
  const unsigned rank = cl.block_rank(), C = cl.num_blocks();
  const int64_t row = blockIdx.x / C;
  float4* r = reinterpret_cast<float4*>(t + row * V);
  uint2* o = reinterpret_cast<uint2*>(t + row * V + V / 2);
  const int64_t a4 = rank * S / 4, b4 = ((rank + 1) * S < V ? (rank + 1) * S : V) / 4;
  float m = -INFINITY, s = 0;
  for (int64_t b = a4 + threadIdx.x; b < b4; b += T * kLoads) {
    float4 v[kLoads];
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      v[u] =
          b + u * T < b4 ? r[b + u * T] : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
#pragma unroll
    for (int u = 0; u < kLoads; ++u)
      if (b + u * T < b4) acc4(v[u], m, s);
  }
  float2 ms = block_ms<T>(m, s, sh);
  if (threadIdx.x == 0) part = ms;
  cl.sync();
  if (threadIdx.x == 0) {
    float M = -INFINITY, SS = 0;
    for (unsigned k = 0; k < C; ++k) M = fmaxf(M, cl.map_shared_rank(&part, k)->x);
    for (unsigned k = 0; k < C; ++k) {
      float2 q = *cl.map_shared_rank(&part, k);
      SS += q.y * __expf(q.x - M);
    }
    Ls = M + __logf(SS);
    if (rank == 0) lse[row] = Ls;
  }
  __syncthreads();
  const float L = Ls;
  const int64_t y = tgt[row];
  const int64_t span = T * kLoads, n = b4 - a4;
  for (int64_t b = (n - 1) / span * span; b >= 0; b -= span) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {
      int64_t i = b + u * T + threadIdx.x;
      if (i < n) out[i] = grad4(r[a4 + i], L, 4 * (a4 + i), y);
    }
  }
  cl.sync();
  for (int64_t i = threadIdx.x; i < n; i += T) o[a4 + i] = out[i];
}
template <int T>
void launch_clu(float* t, int64_t R, int64_t V, int C, float* lse, const int* tgt) {
  const int64_t S = ((V + C - 1) / C + 3) / 4 * 4;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3((unsigned)(R * C));
  cfg.blockDim = dim3(T);
  cfg.dynamicSmemBytes = S / 4 * 8;
  cudaLaunchAttribute at{};
  at.id = cudaLaunchAttributeClusterDimension;
  at.val.clusterDim.x = C;
  at.val.clusterDim.y = at.val.clusterDim.z = 1;
  cfg.attrs = &at;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, clu<T>, t, V, S, lse, tgt));
}

int main(int argc, char** argv) {
  const int64_t R = atol(argv[1]), V = atol(argv[2]);
  float *T0, *T, *lse, *lse2;
  int* tgt;
  const size_t n = R * V;
  CK(cudaMalloc(&T0, n * 4));
  CK(cudaMalloc(&T, n * 4));
  CK(cudaMalloc(&lse, R * 4));
  CK(cudaMalloc(&lse2, R * 4));
  CK(cudaMalloc(&tgt, R * 4));
  fill<<<2048, 256>>>(T0, n, 7);
  {
    std::vector<int> t(R);
    for (int64_t i = 0; i < R; ++i) t[i] = (int)((i * 2654435761ull) % V);
    CK(cudaMemcpy(tgt, t.data(), R * 4, cudaMemcpyHostToDevice));
  }
  for (auto k : {clu<256>, clu<512>}) {
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  }
  CK(cudaFuncSetAttribute(fused<1024, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize, 120 * 1024));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timeit = [&](auto&& f) {
    CK(cudaMemcpy(T, T0, n * 4, cudaMemcpyDeviceToDevice));
    CK(cudaEventRecord(e0));
    f();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaGetLastError());
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  };
  // Correctness of the fused kernel against the two kernels (bitwise on lse up to reduction
  // order; gradient compared loosely).
  timeit([&] {
    stats<512><<<R, 512>>>(T, V, lse);
    grad_first_half<512><<<R, 512>>>(T, V, lse, tgt);
  });
  std::vector<bf16> a(R * V), b(R * V);
  std::vector<float> ha(n);
  CK(cudaMemcpy(ha.data(), T, n * 4, cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < R; ++i)
    memcpy(&a[i * V], reinterpret_cast<char*>(ha.data()) + i * V * 4, V * 2);
  const int Ccheck = argc > 3 ? atoi(argv[3]) : 0;
  timeit([&] {
    if (Ccheck)
      launch_clu<256>(T, R, V, Ccheck, lse2, tgt);
    else
      fused<1024, 1><<<R, 1024>>>(T, V, lse2, tgt);
  });
  CK(cudaMemcpy(ha.data(), T, n * 4, cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < R; ++i)
    memcpy(&b[i * V], reinterpret_cast<char*>(ha.data()) + i * V * 4 + V * 2, V * 2);
  double d = 0, r2 = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    d = std::max(d, std::abs(x - y));
    r2 = std::max(r2, std::abs(x));
  }
  printf("R %lld V %lld: fused vs two kernels, max |diff| %.3g (max |g| %.3g)\n", (long long)R,
         (long long)V, d, r2);
  std::vector<const char*> names = {
      "two kernels 512", "two kernels 256", "fused 1024x1",   "fused 1024 (2/SM)", "fused 512",
      "fused 256",       "cluster 8x256",   "cluster 16x256", "cluster 8x512",     "cluster 4x512"};
  std::vector<std::vector<float>> t(names.size());
  for (int rep = 0; rep < 15; ++rep) {
    int k = 0;
    t[k++].push_back(timeit([&] {
      stats<512><<<R, 512>>>(T, V, lse);
      grad_first_half<512><<<R, 512>>>(T, V, lse, tgt);
    }));
    t[k++].push_back(timeit([&] {
      stats<256><<<R, 256>>>(T, V, lse);
      grad_first_half<256><<<R, 256>>>(T, V, lse, tgt);
    }));
    t[k++].push_back(timeit([&] { fused<1024, 1><<<R, 1024, 120 * 1024>>>(T, V, lse2, tgt); }));
    t[k++].push_back(timeit([&] { fused<1024, 2><<<R, 1024>>>(T, V, lse2, tgt); }));
    t[k++].push_back(timeit([&] { fused<512, 1><<<R, 512>>>(T, V, lse2, tgt); }));
    t[k++].push_back(timeit([&] { fused<256, 1><<<R, 256>>>(T, V, lse2, tgt); }));
    t[k++].push_back(timeit([&] { launch_clu<256>(T, R, V, 8, lse2, tgt); }));
    t[k++].push_back(timeit([&] { launch_clu<256>(T, R, V, 16, lse2, tgt); }));
    t[k++].push_back(timeit([&] { launch_clu<512>(T, R, V, 8, lse2, tgt); }));
    t[k++].push_back(timeit([&] { launch_clu<512>(T, R, V, 4, lse2, tgt); }));
  }
  for (size_t k = 0; k < names.size(); ++k) {
    std::sort(t[k].begin(), t[k].end());
    printf("  %-20s %.3f ms (min %.3f)\n", names[k], t[k][t[k].size() / 2], t[k][0]);
  }
  return 0;
}
