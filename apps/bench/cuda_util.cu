// CUDA helpers of the CUDA cases (see cuda_util.cuh). Kernels use grid-stride loops over n
// elements, or one 256-thread block per row of the [N, V] logits with a shared-memory tree
// reduction in double.
#include <chunkloss/gpu/context.h>

#include <algorithm>
#include <cmath>
#include <string>

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

// SplitMix64's output function: a bijection of 64-bit words whose outputs for consecutive
// inputs are statistically independent.
__device__ __host__ inline std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Deterministic N(0, 1) values, scaled, plus an optional base: element i of the tensor with key
// k is a Box-Muller normal from the two 32-bit halves of mix64(k + (i + 1) * golden), the i-th
// output of a SplitMix64 stream seeded with k. Keys are mix64 of the caller's seed, so tensors
// with nearby seeds are independent (the hash this replaces on 2026-12-04 was not: it gave every
// row t of the bench's hidden a logit near -25 against weight row t, and 7-8 sigma outliers).
template <typename T>
__global__ void fill_random_kernel(T* p, std::size_t n, float scale, std::uint64_t key,
                                   const T* base) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t h =
        mix64(key + (static_cast<std::uint64_t>(i) + 1) * 0x9e3779b97f4a7c15ull);
    const float u1 = (static_cast<float>(h >> 40) + 0.5f) * 0x1p-24f;  // (0, 1)
    const float u2 = static_cast<float>((h >> 8) & 0xffffff) * 0x1p-24f;
    const float v = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2) * scale;
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

// out[0], out[1] = the sums of e and of r over the block's kThreads threads.
__device__ void block_sums(double e, double r, double* out) {
  __shared__ double s1[kThreads], s2[kThreads];
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
    out[0] = s1[0];
    out[1] = s2[0];
  }
}

// Per-block partial sums of (a - b)^2 and b^2.
template <typename A, typename B>
__global__ void err_partials(const A* a, const B* b, std::size_t n, double* out) {
  double e = 0, r = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const double x = as_double(a[i]), yv = as_double(b[i]);
    e += (x - yv) * (x - yv);
    r += yv * yv;
  }
  block_sums(e, r, out + 2 * blockIdx.x);
}

// Per row (one block each): the sums of (a - b)^2 and b^2 over its `cols` elements.
template <typename A>
__global__ void row_err_kernel(const A* a, const double* b, std::int64_t cols, double* out) {
  const std::size_t row = static_cast<std::size_t>(blockIdx.x) * static_cast<std::size_t>(cols);
  double e = 0, r = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
    const double x = as_double(a[row + j]), yv = b[row + j];
    e += (x - yv) * (x - yv);
    r += yv * yv;
  }
  block_sums(e, r, out + 2 * blockIdx.x);
}

template <typename A>
std::array<double, 3> row_err_quantiles_of(const A* a, const double* b, std::int64_t rows,
                                           std::int64_t cols) {
  BENCH_CHECK(cudaDeviceSynchronize());  // a and b are written on other streams
  gpu::DeviceBuffer part(static_cast<std::size_t>(rows) * 2 * sizeof(double));
  row_err_kernel<<<static_cast<unsigned>(rows), kThreads>>>(a, b, cols, part.as<double>());
  BENCH_CHECK(cudaGetLastError());
  std::vector<double> h(static_cast<std::size_t>(rows) * 2);
  gpu::copy_to_host(h.data(), part.data(), h.size() * sizeof(double));
  std::vector<double> err;
  for (std::size_t i = 0; i < h.size(); i += 2)
    if (h[i + 1] > 0) err.push_back(std::sqrt(h[i] / h[i + 1]));
  if (err.empty()) return {0, 0, 0};
  std::sort(err.begin(), err.end());
  return {err[err.size() / 2], err[err.size() * 99 / 100], err.back()};
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

void fill_random(float* p, std::size_t n, float scale, std::uint64_t seed, cudaStream_t s,
                 const float* base) {
  fill_random_kernel<<<1024, kThreads, 0, s>>>(p, n, scale, mix64(seed), base);
  BENCH_CHECK(cudaGetLastError());
}
void fill_random(__nv_bfloat16* p, std::size_t n, float scale, std::uint64_t seed, cudaStream_t s,
                 const __nv_bfloat16* base) {
  fill_random_kernel<<<1024, kThreads, 0, s>>>(p, n, scale, mix64(seed), base);
  BENCH_CHECK(cudaGetLastError());
}

RandomOperands fill_operands(const CaseConfig& c, void* x, void* w, std::size_t nh, std::size_t vh,
                             std::int64_t h, bool bf16, cudaStream_t s) {
  RandomOperands r;
  r.seed = c.seed * 4;
  r.weight_scale = static_cast<float>(c.logit_std / std::sqrt(static_cast<double>(h)));
  if (bf16) {
    fill_random(static_cast<__nv_bfloat16*>(x), nh, 1.0f, r.seed, s);
    fill_random(static_cast<__nv_bfloat16*>(w), vh, r.weight_scale, r.seed + 1, s);
  } else {
    fill_random(static_cast<float*>(x), nh, 1.0f, r.seed, s);
    fill_random(static_cast<float*>(w), vh, r.weight_scale, r.seed + 1, s);
  }
  r.description = "hidden ~ N(0, 1), weight ~ N(0, s^2/H) with s = " + fmt("%g", c.logit_std) +
                  " (logits' standard deviation), targets uniform in [0, V)";
  return r;
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
std::array<double, 3> row_err_quantiles(const float* a, const double* b, std::int64_t rows,
                                        std::int64_t cols) {
  return row_err_quantiles_of(a, b, rows, cols);
}
std::array<double, 3> row_err_quantiles(const __nv_bfloat16* a, const double* b, std::int64_t rows,
                                        std::int64_t cols) {
  return row_err_quantiles_of(a, b, rows, cols);
}

std::size_t free_bytes() {
  std::size_t f = 0, t = 0;
  BENCH_CHECK(cudaDeviceSynchronize());
  gpu::memory_info(&f, &t);
  return f;
}

std::size_t taken_since(std::size_t before, std::size_t known) {
  const std::size_t after = free_bytes();
  return before > after + known ? before - after - known : 0;
}

std::vector<int> int_targets(const std::vector<std::int64_t>& y) {
  return std::vector<int>(y.begin(), y.end());
}

void require_cuda_devices(int devices) {
  const int visible = gpu::device_count();
  CHUNKLOSS_CHECK(visible >= devices, "bench: --device cuda",
                  devices > 1 ? " --vocab-parallel " + std::to_string(devices) : std::string(),
                  " needs ", devices, " CUDA device(s), ", visible, " visible");
}

}  // namespace chunkloss::bench
