// CUDA helpers of the CUDA cases (see cuda_util.cuh). Kernels use grid-stride loops over n
// elements, or one 256-thread block per row of the [N, V] logits with a shared-memory tree
// reduction in double.
#include <chunkloss/gpu/context.h>

#include <cmath>

#include "cuda_util.cuh"

namespace chunkloss::bench {
namespace {

constexpr int kThreads = 256;

template <typename T>
__device__ double as_double(T v) {
  if constexpr (sizeof(T) == 2)
    return static_cast<double>(__bfloat162float(v));
  else
    return static_cast<double>(v);
}

template <typename T>
__device__ T from_float(float v) {
  if constexpr (sizeof(T) == 2)
    return __float2bfloat16_rn(v);
  else
    return v;
}

// Deterministic pseudo-random normal-ish values (sum of uniforms), scaled, plus an optional base.
template <typename T>
__global__ void fill_random_kernel(T* p, std::size_t n, float scale, unsigned seed, const T* base) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float acc = 0;
    for (unsigned k = 0; k < 4; ++k) {
      unsigned h = static_cast<unsigned>(i * 4 + k) * 2654435761u ^ seed;
      h ^= h >> 13;
      h *= 0x5bd1e995u;
      h ^= h >> 15;
      acc += static_cast<float>(h & 0xffffff) / 16777216.0f - 0.5f;
    }
    const float v = acc * 1.7320508f * scale;  // var of the sum of 4 U(-.5,.5) is 1/3
    p[i] = from_float<T>(base ? static_cast<float>(as_double(base[i])) + v : v);
  }
}

template <typename T>
__global__ void widen_kernel(const T* src, double* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = as_double(src[i]);
}

__global__ void narrow_kernel(const float* src, __nv_bfloat16* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

// One block per row; max and sum of exp reduced in double; the gradient written in place.
template <typename T>
__global__ void dense_rows_kernel(T* z, const int* y, std::int64_t v, const double* lse_in,
                                  const double* coef, double* lse_out, double* zy_out) {
  __shared__ double red[kThreads];
  T* row = z + blockIdx.x * v;
  const int t = y[blockIdx.x];
  double lse = 0;
  if (lse_in) {
    lse = lse_in[blockIdx.x];
  } else {
    double m = -1e300;
    for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x)
      m = fmax(m, static_cast<double>(row[j]));
    red[threadIdx.x] = m;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + s]);
      __syncthreads();
    }
    m = red[0];
    __syncthreads();
    double se = 0;
    for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x)
      se += exp(static_cast<double>(row[j]) - m);
    red[threadIdx.x] = se;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
      __syncthreads();
    }
    lse = m + log(red[0]);
  }
  if (threadIdx.x == 0) {
    if (lse_out) lse_out[blockIdx.x] = t < 0 ? 0.0 : lse;
    if (zy_out) zy_out[blockIdx.x] = t < 0 ? 0.0 : static_cast<double>(row[t]);
  }
  if (!coef) return;
  __syncthreads();  // row[t] is read above before it is overwritten
  const double c = t < 0 ? 0.0 : coef[blockIdx.x];
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const double g = c == 0.0 ? 0.0 : c * (exp(static_cast<double>(row[j]) - lse) - (j == t));
    row[j] = static_cast<T>(g);
  }
}

// Per-block partial sums of (a - b)^2 and b^2.
template <typename A, typename B>
__global__ void err_partials(const A* a, const B* b, std::size_t n, double* out) {
  __shared__ double s1[kThreads], s2[kThreads];
  double e = 0, r = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const double x = as_double(a[i]), yv = as_double(b[i]);
    e += (x - yv) * (x - yv);
    r += yv * yv;
  }
  s1[threadIdx.x] = e;
  s2[threadIdx.x] = r;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      s1[threadIdx.x] += s1[threadIdx.x + s];
      s2[threadIdx.x] += s2[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    out[2 * blockIdx.x] = s1[0];
    out[2 * blockIdx.x + 1] = s2[0];
  }
}

template <typename A, typename B>
double rel_err_of(const A* a, const B* b, std::size_t n) {
  constexpr int kBlocks = 1024;
  BENCH_CHECK(cudaDeviceSynchronize());  // a and b are written on other streams
  gpu::DeviceBuffer part(kBlocks * 2 * sizeof(double));
  err_partials<<<kBlocks, kThreads>>>(a, b, n, part.as<double>());
  BENCH_CHECK(cudaGetLastError());
  std::vector<double> h(kBlocks * 2);
  gpu::copy_to_host(h.data(), part.data(), h.size() * sizeof(double));
  double e = 0, r = 0;
  for (int i = 0; i < kBlocks; ++i) {
    e += h[2 * i];
    r += h[2 * i + 1];
  }
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

template <typename T>
void dense_rows_of(T* z, const int* y, std::int64_t n, std::int64_t v, const double* lse_in,
                   const double* coef, double* lse_out, double* zy_out, cudaStream_t s) {
  dense_rows_kernel<T>
      <<<static_cast<unsigned>(n), kThreads, 0, s>>>(z, y, v, lse_in, coef, lse_out, zy_out);
  BENCH_CHECK(cudaGetLastError());
}

}  // namespace

void fill_random(float* p, std::size_t n, float scale, unsigned seed, cudaStream_t s,
                 const float* base) {
  fill_random_kernel<<<1024, kThreads, 0, s>>>(p, n, scale, seed, base);
  BENCH_CHECK(cudaGetLastError());
}
void fill_random(__nv_bfloat16* p, std::size_t n, float scale, unsigned seed, cudaStream_t s,
                 const __nv_bfloat16* base) {
  fill_random_kernel<<<1024, kThreads, 0, s>>>(p, n, scale, seed, base);
  BENCH_CHECK(cudaGetLastError());
}

void widen(const float* src, double* dst, std::size_t n, cudaStream_t s) {
  widen_kernel<<<4096, kThreads, 0, s>>>(src, dst, n);
  BENCH_CHECK(cudaGetLastError());
}
void widen(const __nv_bfloat16* src, double* dst, std::size_t n, cudaStream_t s) {
  widen_kernel<<<4096, kThreads, 0, s>>>(src, dst, n);
  BENCH_CHECK(cudaGetLastError());
}
void narrow(const float* src, __nv_bfloat16* dst, std::size_t n, cudaStream_t s) {
  narrow_kernel<<<4096, kThreads, 0, s>>>(src, dst, n);
  BENCH_CHECK(cudaGetLastError());
}

void dense_rows(float* z, const int* y, std::int64_t n, std::int64_t v, const double* lse_in,
                const double* coef, double* lse_out, double* zy_out, cudaStream_t s) {
  dense_rows_of(z, y, n, v, lse_in, coef, lse_out, zy_out, s);
}
void dense_rows(double* z, const int* y, std::int64_t n, std::int64_t v, const double* lse_in,
                const double* coef, double* lse_out, double* zy_out, cudaStream_t s) {
  dense_rows_of(z, y, n, v, lse_in, coef, lse_out, zy_out, s);
}

double rel_err(const float* a, const float* b, std::size_t n) { return rel_err_of(a, b, n); }
double rel_err(const __nv_bfloat16* a, const float* b, std::size_t n) {
  return rel_err_of(a, b, n);
}
double rel_err(const float* a, const double* b, std::size_t n) { return rel_err_of(a, b, n); }
double rel_err(const __nv_bfloat16* a, const double* b, std::size_t n) {
  return rel_err_of(a, b, n);
}

std::size_t free_bytes() {
  std::size_t f = 0, t = 0;
  BENCH_CHECK(cudaDeviceSynchronize());
  gpu::memory_info(&f, &t);
  return f;
}

}  // namespace chunkloss::bench
