// Throwaway probe: can the memory-bound row kernels (statistics, gradient) of a chunk run at the
// same time as the compute-bound GEMMs, on a few SMs of their own, so that their time hides?
// Each chunk is split in S row sub-blocks: the rows of sub-block k run while the logits GEMM of
// sub-block k + 1 (or the dX GEMM of sub-block k - 1) runs. Two ways to keep SMs apart:
//   target: cublasSetSmCountTarget(132 - s) for the overlapped GEMMs, the row kernels on s blocks
//           of 1024 threads or 2 s of 512, on a low-priority stream;
//   green:  two green contexts (driver API) of 132 - s and s SMs.
// A throwaway probe beside the 2026-12-04 overlap results (not built; overlap.txt):
//   nvcc -O3 -gencode arch=compute_90a,code=sm_90a -o overlap overlap.cu -lcublas -lcuda
//   [ONLY=name,...] ./overlap N H V [budget MiB] [repeats]
#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
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

template <int T>
__device__ float2 block_ms(float m, float s, float* sh) {
  for (int o = 16; o; o >>= 1) {
    float m2 = __shfl_xor_sync(~0u, m, o), s2 = __shfl_xor_sync(~0u, s, o);
    float M = fmaxf(m, m2);
    s = (m == -INFINITY ? 0.f : s * __expf(m - M)) + (m2 == -INFINITY ? 0.f : s2 * __expf(m2 - M));
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
  for (int w = 0; w < T / 32; ++w)
    if (sh[2 * w] != -INFINITY) S += sh[2 * w + 1] * __expf(sh[2 * w] - M);
  __syncthreads();
  return make_float2(M, S);
}
__device__ void acc4(float4 v, float& m, float& s) {
  float mx = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
  if (mx > m) {
    s = m == -INFINITY ? 0.f : s * __expf(m - mx);
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

// Row kernels, grid-stride over rows so that any grid size works; 4 loads in flight per thread.
constexpr int kU = 4;
constexpr int kT = 512;
template <int T>
__global__ void __launch_bounds__(T) stats_k(const float* t, int64_t V, int R, float* lse) {
  __shared__ float sh[2 * T / 32];
  const int64_t n4 = V / 4;
  for (int row = blockIdx.x; row < R; row += gridDim.x) {
    const float4* r = reinterpret_cast<const float4*>(t + row * V);
    float m = -INFINITY, s = 0.f;
    int64_t i = threadIdx.x;
    for (; i + (kU - 1) * T < n4; i += kU * T) {
      float4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) v[u] = __ldcs(r + i + u * T);
#pragma unroll
      for (int u = 0; u < kU; ++u) acc4(v[u], m, s);
    }
    for (; i < n4; i += T) acc4(__ldcs(r + i), m, s);
    float2 ms = block_ms<T>(m, s, sh);
    if (threadIdx.x == 0) lse[row] = ms.x + __logf(ms.y);
  }
}
template <int T>
__global__ void __launch_bounds__(T) grad_k(const float* t, int64_t V, int R, const float* lse,
                                            bf16* g, int64_t ldg, const int* tgt) {
  const int64_t n4 = V / 4;
  for (int row = blockIdx.x; row < R; row += gridDim.x) {
    const float4* r = reinterpret_cast<const float4*>(t + row * V);
    uint2* o = reinterpret_cast<uint2*>(g + row * ldg);
    const float L = lse[row];
    const int64_t y = tgt[row];
    int64_t i = threadIdx.x;
    for (; i + (kU - 1) * T < n4; i += kU * T) {
      float4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; ++u) v[u] = __ldcs(r + i + u * T);
#pragma unroll
      for (int u = 0; u < kU; ++u) __stcs(o + i + u * T, grad4(v[u], L, 4 * (i + u * T), y));
    }
    for (; i < n4; i += T) __stcs(o + i, grad4(__ldcs(r + i), L, 4 * i, y));
  }
}

cublasHandle_t H;
void gemm(cudaStream_t s, int sms, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
          const void* A, int lda, const void* B, int ldb, void* C, cudaDataType ct, int ldc,
          float beta) {
  float alpha = 1.f;
  CK(cublasSetStream(H, s));
  CK(cublasSetSmCountTarget(H, sms));
  CK(cublasGemmEx(H, ta, tb, m, n, k, &alpha, A, CUDA_R_16BF, lda, B, CUDA_R_16BF, ldb, &beta, C,
                  ct, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

struct Green {
  cudaStream_t gemm = nullptr, rows = nullptr;
  int gemm_sms = 0, rows_sms = 0;
};
Green make_green(int rows_sms) {
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUdevResource all;
  CK(cuDeviceGetDevResource(dev, &all, CU_DEV_RESOURCE_TYPE_SM));
  CUdevResource part[2], rest;
  unsigned n = 1;
  CK(cuDevSmResourceSplitByCount(part, &n, &all, &rest, 0, rows_sms));
  Green g;
  g.rows_sms = part[0].sm.smCount;
  g.gemm_sms = rest.sm.smCount;
  CUdevResourceDesc dr, dg;
  CK(cuDevResourceGenerateDesc(&dr, &part[0], 1));
  CK(cuDevResourceGenerateDesc(&dg, &rest, 1));
  CUgreenCtx cr, cgm;
  CK(cuGreenCtxCreate(&cr, dr, dev, CU_GREEN_CTX_DEFAULT_STREAM));
  CK(cuGreenCtxCreate(&cgm, dg, dev, CU_GREEN_CTX_DEFAULT_STREAM));
  CUstream a, b;
  CK(cuGreenCtxStreamCreate(&a, cgm, CU_STREAM_NON_BLOCKING, 0));
  CK(cuGreenCtxStreamCreate(&b, cr, CU_STREAM_NON_BLOCKING, 0));
  g.gemm = (cudaStream_t)a;
  g.rows = (cudaStream_t)b;
  return g;
}

int main(int argc, char** argv) {
  const int64_t N = atol(argv[1]), Hd = atol(argv[2]), V = atol(argv[3]);
  const int64_t budget = (argc > 4 ? atol(argv[4]) : 1024) << 20;
  const int reps = argc > 5 ? atoi(argv[5]) : 7;
  setvbuf(stdout, nullptr, _IONBF, 0);
  CK(cuInit(0));
  CK(cudaSetDevice(0));
  CK(cudaFree(0));
  int nsm;
  CK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  CK(cublasCreate(&H));
  int plo, phi;
  CK(cudaDeviceGetStreamPriorityRange(&plo, &phi));
  cudaStream_t st, sa, sb;  // main; GEMMs (high priority); rows (low priority)
  CK(cudaStreamCreateWithPriority(&st, cudaStreamNonBlocking, phi));
  CK(cudaStreamCreateWithPriority(&sa, cudaStreamNonBlocking, phi));
  CK(cudaStreamCreateWithPriority(&sb, cudaStreamNonBlocking, plo));
  void* ws;
  CK(cudaMalloc(&ws, 64 << 20));
  CK(cublasSetWorkspace(H, ws, 64 << 20));
  bf16 *X, *W, *dX, *dW, *G;
  float* T;
  int* tgt;
  float* lse;
  CK(cudaMalloc(&X, N * Hd * 2));
  CK(cudaMalloc(&W, V * Hd * 2));
  CK(cudaMalloc(&dX, N * Hd * 2));
  CK(cudaMalloc(&dW, V * Hd * 2));
  CK(cudaMalloc(&G, N * V * 2));  // the floor's logits and gradient
  CK(cudaMalloc(&T, budget));     // the fp32 chunk; its gradient is written in place (bf16, ld 2V)
  CK(cudaMalloc(&tgt, N * 4));
  CK(cudaMalloc(&lse, N * 4));
  fill<<<1024, 256>>>(X, N * Hd, 1.f, 1);
  fill<<<1024, 256>>>(W, V * Hd, 2.f / sqrtf((float)Hd), 2);
  {
    std::vector<int> t(N);
    for (int64_t i = 0; i < N; ++i) t[i] = (int)((i * 2654435761ull) % V);
    CK(cudaMemcpy(tgt, t.data(), N * 4, cudaMemcpyHostToDevice));
  }
  std::vector<Green> greens = {make_green(24)};
  for (auto& g : greens) printf("green: rows %d SMs, GEMMs %d SMs\n", g.rows_sms, g.gemm_sms);

  auto floor = [&] {
    gemm(st, 0, CUBLAS_OP_T, CUBLAS_OP_N, V, N, Hd, W, Hd, X, Hd, G, CUDA_R_16BF, V, 0.f);
    gemm(st, 0, CUBLAS_OP_N, CUBLAS_OP_N, Hd, N, V, W, Hd, G, V, dX, CUDA_R_16BF, Hd, 0.f);
    gemm(st, 0, CUBLAS_OP_N, CUBLAS_OP_T, Hd, V, N, X, Hd, G, V, dW, CUDA_R_16BF, Hd, 0.f);
  };
  const int64_t rmax = budget / (V * 4);
  const int64_t nc = (N + rmax - 1) / rmax;
  // The gradient goes out of place, with the in-place layout's stride (bf16, ld 2V): the same
  // traffic as the library's in-place write.
  bf16* g = G;
  auto rows = [&](cudaStream_t s, int grid, int64_t r0, int64_t R, int64_t row_in_chunk,
                  bool wide = false) {
    const float* t = T + row_in_chunk * V;
    bf16* o = g + row_in_chunk * 2 * V;
    if (wide) {
      stats_k<1024><<<grid, 1024, 0, s>>>(t, V, (int)R, lse + r0);
      grad_k<1024><<<grid, 1024, 0, s>>>(t, V, (int)R, lse + r0, o, 2 * V, tgt + r0);
    } else {
      stats_k<kT><<<grid, kT, 0, s>>>(t, V, (int)R, lse + r0);
      grad_k<kT><<<grid, kT, 0, s>>>(t, V, (int)R, lse + r0, o, 2 * V, tgt + r0);
    }
  };
  auto sequential = [&](bool kernels) {
    for (int64_t c = 0; c < nc; ++c) {
      int64_t r0 = c * N / nc, R = (c + 1) * N / nc - r0;
      gemm(st, 0, CUBLAS_OP_T, CUBLAS_OP_N, V, R, Hd, W, Hd, X + r0 * Hd, Hd, T, CUDA_R_32F, V,
           0.f);
      if (kernels) rows(st, (int)R, r0, R, 0);
      gemm(st, 0, CUBLAS_OP_N, CUBLAS_OP_N, Hd, R, V, W, Hd, g, 2 * V, dX + r0 * Hd, CUDA_R_16BF,
           Hd, 0.f);
      gemm(st, 0, CUBLAS_OP_N, CUBLAS_OP_T, Hd, V, R, X + r0 * Hd, Hd, g, 2 * V, dW, CUDA_R_16BF,
           Hd, c ? 1.f : 0.f);
    }
  };
  // The overlapped chunk. mode 0: streams only; 1: SM-count target; 2: green contexts.
  constexpr int kEv = 64;
  std::vector<cudaEvent_t> ev(kEv);
  for (auto& e : ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  int evi = 0;
  auto link = [&](cudaStream_t from, cudaStream_t to) {  // `to` waits for what `from` has queued
    cudaEvent_t e = ev[evi++ % kEv];
    CK(cudaEventRecord(e, from));
    CK(cudaStreamWaitEvent(to, e, 0));
  };
  // A timeline of the second chunk, when `trace` is set: timing events on every stream.
  bool trace = false;
  std::vector<std::pair<std::string, cudaEvent_t>> marks;
  auto mark = [&](cudaStream_t s, const std::string& what) {
    cudaEvent_t e;
    CK(cudaEventCreate(&e));
    CK(cudaEventRecord(e, s));
    marks.push_back({what, e});
  };
  // The row kernels' grid: 2 s blocks of 512 threads, or (wide) s blocks of 1024.
  auto overlapped = [&](int mode, int s, int S, bool kernels, bool wide = false) {
    const Green* gr = nullptr;
    for (auto& x : greens)
      if (x.rows_sms == s) gr = &x;
    cudaStream_t A = mode == 2 ? gr->gemm : sa, B = mode == 2 ? gr->rows : sb;
    const int part_sms = mode == 1 ? nsm - s : mode == 2 ? gr->gemm_sms : 0;
    const int grid = wide ? s : 2 * s;
    cudaStream_t cur = st;  // the stream the GEMM sequence is on
    auto on = [&](cudaStream_t next) {
      if (next != cur) link(cur, next);
      cur = next;
    };
    link(st, B);
    std::vector<cudaEvent_t> done(S);  // rows of sub-block k done
    for (int64_t c = 0; c < nc; ++c) {
      int64_t r0 = c * N / nc, R = (c + 1) * N / nc - r0;
      std::vector<int64_t> k0(S + 1);
      for (int k = 0; k <= S; ++k) k0[k] = k * R / S;
      const bool tr = trace && c == 1;
      for (int k = 0; k < S; ++k) {  // logits of sub-block k; rows of sub-block k on B
        on(k == 0 ? st : A);
        int64_t a = k0[k], n = k0[k + 1] - a;
        if (tr) mark(cur, "logits " + std::to_string(k) + " start");
        gemm(cur, k == 0 ? 0 : part_sms, CUBLAS_OP_T, CUBLAS_OP_N, V, n, Hd, W, Hd,
             X + (r0 + a) * Hd, Hd, T + a * V, CUDA_R_32F, V, 0.f);
        if (tr) mark(cur, "logits " + std::to_string(k) + " end");
        if (kernels) {
          link(cur, B);
          if (tr) mark(B, "rows " + std::to_string(k) + " start");
          rows(B, grid, r0 + a, n, a, wide);
          if (tr) mark(B, "rows " + std::to_string(k) + " end");
          done[k] = ev[evi++ % kEv];
          CK(cudaEventRecord(done[k], B));
        }
      }
      for (int k = 0; k < S; ++k) {  // dX of sub-block k once its rows are done
        on(k == S - 1 ? st : A);
        if (kernels) CK(cudaStreamWaitEvent(cur, done[k], 0));
        int64_t a = k0[k], n = k0[k + 1] - a;
        if (tr) mark(cur, "dX " + std::to_string(k) + " start");
        gemm(cur, k == S - 1 ? 0 : part_sms, CUBLAS_OP_N, CUBLAS_OP_N, Hd, n, V, W, Hd,
             g + a * 2 * V, 2 * V, dX + (r0 + a) * Hd, CUDA_R_16BF, Hd, 0.f);
        if (tr) mark(cur, "dX " + std::to_string(k) + " end");
      }
      on(st);
      if (tr) mark(st, "dW start");
      gemm(st, 0, CUBLAS_OP_N, CUBLAS_OP_T, Hd, V, R, X + r0 * Hd, Hd, g, 2 * V, dW, CUDA_R_16BF,
           Hd, c ? 1.f : 0.f);
      if (tr) mark(st, "dW end");
    }
    on(st);
    link(B, st);
  };
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timeit = [&](const std::function<void()>& f) {
    CK(cudaEventRecord(e0, st));
    f();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    return ms;
  };
  // Correctness: the overlapped dX and dW equal the sequential ones bitwise (same GEMM shapes
  // only where the split does not change them: dW always; dX per sub-block may differ in the
  // GEMM's algorithm, so compare with a tolerance).
  auto snapshot = [&](std::vector<uint16_t>& a, std::vector<uint16_t>& b) {
    CK(cudaDeviceSynchronize());
    a.resize(N * Hd);
    b.resize(V * Hd);
    CK(cudaMemcpy(a.data(), dX, N * Hd * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), dW, V * Hd * 2, cudaMemcpyDeviceToHost));
  };
  auto tof = [](uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
  };
  auto relerr = [&](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      double d = tof(a[i]) - tof(b[i]);
      num += d * d;
      den += (double)tof(b[i]) * tof(b[i]);
    }
    return std::sqrt(num / den);
  };
  struct Case {
    std::string name;
    std::function<void()> f;
  };
  std::vector<Case> cases = {{"sequential", [&] { sequential(true); }},
                             {"sequential GEMMs only", [&] { sequential(false); }}};
  auto add = [&](int mode, int s, int S, bool k, bool wide) {
    const char* m[] = {"streams", "target", "green"};
    cases.push_back({"S" + std::to_string(S) + " " + m[mode] + " " + std::to_string(s) +
                         (wide ? "x1024" : "x2x512") + (k ? "" : " GEMMs only"),
                     [=, &overlapped] { overlapped(mode, s, S, k, wide); }});
  };
  for (int s : {16, 24, 32}) {
    add(1, s, 2, true, true);
    add(1, s, 2, false, true);
  }
  for (int s : {8, 16, 24, 32}) {
    add(1, s, 2, true, false);
    add(1, s, 4, true, false);
  }
  add(2, 24, 2, true, true);
  add(0, 24, 2, true, false);
  // The rows of half a chunk alone, on a grid of 2 s blocks and on one block per row.
  for (int s : {16, 24, 32, 0})
    cases.push_back(
        {"rows of R/2 alone, " + (s ? std::to_string(s) + "x1024" : "R/2 x 512"), [=, &rows] {
           const int64_t R = N / nc / 2;
           rows(st, s ? s : (int)R, 0, R, 0, s != 0);
         }});
  // ONLY=a,b,...: keep the cases whose names contain one of the strings, and skip the timelines.
  const char* only = getenv("ONLY");
  if (only) {
    std::vector<std::string> keep;
    for (std::string o = only; !o.empty();) {
      const size_t c = o.find(',');
      keep.push_back(o.substr(0, c));
      o = c == std::string::npos ? "" : o.substr(c + 1);
    }
    std::vector<Case> kept;
    for (auto& c : cases)
      for (auto& k : keep)
        if (c.name.find(k) != std::string::npos) {
          kept.push_back(c);
          break;
        }
    cases = kept;
  }
  printf("N %lld H %lld V %lld budget %lld MiB: %lld chunks of ~%lld rows, %d SMs\n", (long long)N,
         (long long)Hd, (long long)V, (long long)(budget >> 20), (long long)nc, (long long)(N / nc),
         nsm);
  std::vector<uint16_t> dx0, dw0, dx1, dw1;
  sequential(true);
  snapshot(dx0, dw0);
  for (size_t i = 0; i < cases.size(); ++i) {
    if (cases[i].name.find("sequential") != std::string::npos ||
        cases[i].name.find("only") != std::string::npos ||
        cases[i].name.find("alone") != std::string::npos)
      continue;
    CK(cudaMemset(dX, 0, N * Hd * 2));
    CK(cudaMemset(dW, 0, V * Hd * 2));
    cases[i].f();
    snapshot(dx1, dw1);
    printf("  check %-22s dX rel %.2e, dW rel %.2e\n", cases[i].name.c_str(), relerr(dx1, dx0),
           relerr(dw1, dw0));
  }
  floor();
  for (auto& c : cases) c.f();
  CK(cudaDeviceSynchronize());
  std::vector<std::vector<float>> t(cases.size() + 1);
  for (int r = 0; r < reps; ++r) {
    t[0].push_back(timeit(floor));
    for (size_t i = 0; i < cases.size(); ++i) {
      t[i + 1].push_back(timeit(cases[i].f));
      if (i % 4 == 3) t[0].push_back(timeit(floor));
    }
  }
  auto med = [](std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const float F = med(t[0]);
  printf("floor %.2f ms (median of %zu)\n", F, t[0].size());
  for (size_t i = 0; i < cases.size(); ++i)
    printf("  %-26s %7.2f ms  %.3f\n", cases[i].name.c_str(), med(t[i + 1]), med(t[i + 1]) / F);
  if (!only)
    for (auto [mode, s, S, wide] :
         {std::tuple{1, 24, 2, true}, std::tuple{1, 16, 2, false}, std::tuple{1, 24, 2, false}}) {
      trace = true;
      overlapped(mode, s, S, true, wide);
      trace = false;
      CK(cudaDeviceSynchronize());
      printf("timeline of chunk 2, S%d %s %d%s (ms from its first GEMM):\n", S,
             mode ? "target" : "streams", s, wide ? "x1024" : "x2x512");
      for (auto& [what, e] : marks) {
        float ms;
        CK(cudaEventElapsedTime(&ms, marks[0].second, e));
        printf("  %-16s %7.3f\n", what.c_str(), ms);
      }
      for (auto& m : marks) CK(cudaEventDestroy(m.second));
      marks.clear();
    }
  return 0;
}
