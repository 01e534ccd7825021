// CUDA cross-entropy benchmark case: CUDA events after warm-up, medians; the floor is the three
// bf16/fp32 cuBLAS GEMMs at full size (logits, dX, dW) timed in the same process; memory is read
// with cudaMemGetInfo around allocations; the naive path materialises the [N, V] fp32 logits.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <chunkloss/core/error.h>
#include <chunkloss/gpu/context.h>
#include <chunkloss/losses/cross_entropy.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "bench.h"

namespace chunkloss::bench {
namespace {

#define BENCH_CHECK(stmt)                                                     \
  do {                                                                        \
    const auto s_ = (stmt);                                                   \
    CHUNKLOSS_CHECK(static_cast<int>(s_) == 0, #stmt, " failed with status ", \
                    static_cast<int>(s_));                                    \
  } while (0)

constexpr int kIgnoreEvery = 7;  // one row in 7 ignored

// Deterministic pseudo-random normal-ish values (sum of uniforms), scaled.
template <typename T>
__global__ void fill_random(T* p, std::size_t n, float scale, unsigned seed) {
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
    if constexpr (sizeof(T) == 4)
      p[i] = v;
    else
      p[i] = __float2bfloat16_rn(v);
  }
}

template <typename T>
__device__ double as_double(T v) {
  if constexpr (sizeof(T) == 4)
    return static_cast<double>(v);
  else
    return static_cast<double>(__bfloat162float(v));
}

template <typename T>
__global__ void widen(const T* src, double* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = as_double(src[i]);
}

__global__ void narrow(const float* src, __nv_bfloat16* dst, std::size_t n) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16_rn(src[i]);
}

// Naive/exact softmax gradient over a materialised row: one block per row, in place,
// mean over valid rows; writes the row loss.
template <typename T>
__global__ void dense_ce_grad(T* z, const int* y, std::int64_t v, double inv_valid,
                              double* row_loss) {
  __shared__ double red[256];
  T* row = z + blockIdx.x * v;
  const int t = y[blockIdx.x];
  double m = -1e300;
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x)
    m = fmax(m, static_cast<double>(row[j]));
  red[threadIdx.x] = m;
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
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
  for (int s = 128; s > 0; s >>= 1) {
    if (threadIdx.x < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  const double lse = m + log(red[0]);
  if (threadIdx.x == 0)
    row_loss[blockIdx.x] = t < 0 ? 0.0 : (lse - static_cast<double>(row[t])) * inv_valid;
  __syncthreads();
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) {
    const double g =
        t < 0 ? 0.0 : (exp(static_cast<double>(row[j]) - lse) - (j == t ? 1.0 : 0.0)) * inv_valid;
    row[j] = static_cast<T>(g);
  }
}

// Per-block partial sums of (a - b)^2 and b^2; `a` in storage type A, `b` double or float.
template <typename A, typename B>
__global__ void err_partials(const A* a, const B* b, std::size_t n, double* out) {
  __shared__ double s1[256], s2[256];
  double e = 0, r = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const double x = as_double(a[i]), y = static_cast<double>(b[i]);
    e += (x - y) * (x - y);
    r += y * y;
  }
  s1[threadIdx.x] = e;
  s2[threadIdx.x] = r;
  __syncthreads();
  for (int s = 128; s > 0; s >>= 1) {
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
double rel_err(const A* a, const B* b, std::size_t n) {
  constexpr int kBlocks = 1024;
  gpu::DeviceBuffer part(kBlocks * 2 * sizeof(double));
  err_partials<<<kBlocks, 256>>>(a, b, n, part.as<double>());
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

std::size_t free_bytes() {
  std::size_t f = 0, t = 0;
  BENCH_CHECK(cudaDeviceSynchronize());
  gpu::memory_info(&f, &t);
  return f;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median time in ms of `fn` on `stream` with CUDA events after one warm-up call.
template <typename Fn>
double time_ms(cudaStream_t s, int repeats, Fn&& fn) {
  cudaEvent_t e0, e1;
  BENCH_CHECK(cudaEventCreate(&e0));
  BENCH_CHECK(cudaEventCreate(&e1));
  fn();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    BENCH_CHECK(cudaEventRecord(e0, s));
    fn();
    BENCH_CHECK(cudaEventRecord(e1, s));
    BENCH_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    t.push_back(ms);
  }
  BENCH_CHECK(cudaEventDestroy(e0));
  BENCH_CHECK(cudaEventDestroy(e1));
  return median(t);
}

struct Gemms {
  cublasHandle_t h;
  cudaDataType_t in, out;
  // Row-major helpers: Z[N,V] = X W^T; dX[N,H] = G W; dW[V,H] = G^T X (see lib/gpu/src/gemm.cpp).
  void logits(const void* x, const void* w, void* z, int n, int hd, int v, cudaDataType_t zt,
              cublasComputeType_t ct) {
    const double one = 1, zero = 0;
    const float onef = 1, zerof = 0;
    const void* a = ct == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&one) : &onef;
    const void* b = ct == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&zero) : &zerof;
    BENCH_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, v, n, hd, a, w, in, hd, x, in, hd, b, z,
                             zt, v, ct, CUBLAS_GEMM_DEFAULT));
  }
  void dx(const void* g, const void* w, void* dxp, int n, int hd, int v, cudaDataType_t gt,
          cudaDataType_t wt, cudaDataType_t ot, cublasComputeType_t ct) {
    const double one = 1, zero = 0;
    const float onef = 1, zerof = 0;
    const void* a = ct == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&one) : &onef;
    const void* b = ct == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&zero) : &zerof;
    BENCH_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, hd, n, v, a, w, wt, hd, g, gt, v, b, dxp,
                             ot, hd, ct, CUBLAS_GEMM_DEFAULT));
  }
  void dw(const void* g, const void* x, void* dwp, int n, int hd, int v, cudaDataType_t gt,
          cudaDataType_t xt, cudaDataType_t ot, cublasComputeType_t ct) {
    const double one = 1, zero = 0;
    const float onef = 1, zerof = 0;
    const void* a = ct == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&one) : &onef;
    const void* b = ct == CUBLAS_COMPUTE_64F ? static_cast<const void*>(&zero) : &zerof;
    BENCH_CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, hd, v, n, a, x, xt, hd, g, gt, v, b, dwp,
                             ot, hd, ct, CUBLAS_GEMM_DEFAULT));
  }
};

}  // namespace

CaseResult run_ce_cuda(const CaseConfig& c, BenchDevice&) {
  CHUNKLOSS_CHECK(gpu::device_count() > 0, "bench: --device cuda but no CUDA device is visible");
  CaseResult res;
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  res.device_desc = prop.name;
  const std::int64_t n = c.rows, h = c.hidden, v = c.vocab;
  const DType dt = c.dtype;
  const bool bf16 = dt == DType::kBF16;
  const std::size_t es = dtype_size(dt);
  const cudaDataType_t ct = bf16 ? CUDA_R_16BF : CUDA_R_32F;

  const std::size_t before_ctx = free_bytes();
  gpu::Context ctx(0);
  const std::size_t context_bytes = before_ctx - free_bytes();
  auto s = static_cast<cudaStream_t>(ctx.stream());

  // Inputs, gradients and targets (not counted as extra memory).
  gpu::DeviceBuffer x(n * h * es), w(v * h * es), dx(n * h * es), dw(v * h * es), y(n * 4);
  const float wscale = 2.0f / std::sqrt(static_cast<float>(h));
  const auto seed = static_cast<unsigned>(c.seed * 2654435761u);
  if (bf16) {
    fill_random<<<1024, 256, 0, s>>>(x.as<__nv_bfloat16>(), n * h, 1.0f, seed);
    fill_random<<<1024, 256, 0, s>>>(w.as<__nv_bfloat16>(), v * h, wscale, seed + 1);
  } else {
    fill_random<<<1024, 256, 0, s>>>(x.as<float>(), n * h, 1.0f, seed);
    fill_random<<<1024, 256, 0, s>>>(w.as<float>(), v * h, wscale, seed + 1);
  }
  BENCH_CHECK(cudaGetLastError());
  std::vector<int> hy(static_cast<std::size_t>(n));
  std::uint64_t state = c.seed;
  std::int64_t valid = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    hy[static_cast<std::size_t>(i)] =
        i % kIgnoreEvery == 3 ? -100
                              : static_cast<int>((state >> 33) % static_cast<std::uint64_t>(v));
    valid += hy[static_cast<std::size_t>(i)] >= 0;
  }
  gpu::copy_to_device(y.data(), hy.data(), hy.size() * 4);

  // The floor: the three GEMMs at full size, gradient operand of the input dtype.
  Gemms gm{static_cast<cublasHandle_t>(ctx.cublas()), ct, ct};
  {
    gpu::DeviceBuffer z(n * v * es);
    res.gemm_ms.emplace_back("logits X W^T", time_ms(s, c.repeats, [&] {
                               gm.logits(x.data(), w.data(), z.data(), int(n), int(h), int(v), ct,
                                         CUBLAS_COMPUTE_32F);
                             }));
    res.gemm_ms.emplace_back("dX = G W", time_ms(s, c.repeats, [&] {
                               gm.dx(z.data(), w.data(), dx.data(), int(n), int(h), int(v), ct, ct,
                                     ct, CUBLAS_COMPUTE_32F);
                             }));
    res.gemm_ms.emplace_back("dW = G^T X", time_ms(s, c.repeats, [&] {
                               gm.dw(z.data(), x.data(), dw.data(), int(n), int(h), int(v), ct, ct,
                                     ct, CUBLAS_COMPUTE_32F);
                             }));
    res.floor_ms = time_ms(s, c.repeats, [&] {
      gm.logits(x.data(), w.data(), z.data(), int(n), int(h), int(v), ct, CUBLAS_COMPUTE_32F);
      gm.dx(z.data(), w.data(), dx.data(), int(n), int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
      gm.dw(z.data(), x.data(), dw.data(), int(n), int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
    });
  }

  // The library.
  CrossEntropyOptions o;
  o.memory_budget_bytes = c.budget_bytes;
  o.fp32_weight_grad_accumulator = c.fp32_weight_grad_accumulator;
  o.loop_order = c.order;
  const LinearCrossEntropy ce(o);
  CrossEntropyInputs in;
  in.hidden = TensorView(x.data(), dt, {n, h}, Device::kCuda);
  in.weight = TensorView(w.data(), dt, {v, h}, Device::kCuda);
  in.targets = TensorView(y.data(), DType::kI32, {n}, Device::kCuda);
  CrossEntropyGrads gr;
  gr.hidden = TensorView(dx.data(), dt, {n, h}, Device::kCuda);
  gr.weight = TensorView(dw.data(), dt, {v, h}, Device::kCuda);
  const Plan plan = ce.plan(in, gr);
  res.plan = plan;
  res.extra_bytes = plan.workspace_bytes();
  res.floor_what = std::string("3 cuBLAS GEMMs at full size (logits, dX, dW), ") +
                   (bf16 ? "bf16" : "fp32") + " operands and outputs, fp32 accumulation";
  res.device_desc +=
      ", gpu::Context (cuBLAS workspace) " + std::to_string(context_bytes >> 20) + " MiB";
  const std::size_t before_ws = free_bytes();
  gpu::DeviceBuffer ws(plan.workspace_bytes());
  const Workspace wsv(ws.data(), ws.bytes(), Device::kCuda);
  res.loss_value = ce.forward_backward(ctx, in, gr, {}, wsv).loss;
  res.extra_measured = {before_ws - free_bytes(),
                        "cudaMemGetInfo: free before allocating the workspace minus free after the "
                        "first call"};
  const double first_loss = res.loss_value;
  res.time_ms = time_ms(s, c.repeats, [&] {
    res.loss_value = ce.forward_backward(ctx, in, gr, {}, wsv).loss;
    res.loss_repeatable = res.loss_repeatable && res.loss_value == first_loss;
  });
  res.ratio = res.time_ms / res.floor_ms;

  const auto ni = int(n), hi = int(h), vi = int(v);
  if (c.naive) {
    // Materialised: fp32 logits [N, V] from the input-dtype GEMM, fp32 softmax gradient, the
    // gradient rounded to the input dtype [N, V], then the two gradient GEMMs into fp32 outputs.
    const std::size_t before_naive = free_bytes();
    gpu::DeviceBuffer z(n * v * 4), zg(bf16 ? n * v * 2 : 0), rl(n * 8), ndx(n * h * 4),
        ndw(v * h * 4);
    res.naive_extra = PeakMemory{before_naive - free_bytes() - (n * h * 4 + v * h * 4),
                                 "cudaMemGetInfo around its buffers, less its fp32 gradients"};
    res.naive_logits_bytes = static_cast<std::size_t>(n * v * 4);
    res.reference = std::string("materialised fp32 logits [N, V] from the ") +
                    (bf16 ? "bf16" : "fp32") +
                    " GEMM, fp64 softmax gradient rounded to the input dtype, fp32-output GEMMs";
    const void* g = bf16 ? zg.data() : z.data();
    auto naive = [&] {
      gm.logits(x.data(), w.data(), z.data(), ni, hi, vi, CUDA_R_32F, CUBLAS_COMPUTE_32F);
      dense_ce_grad<float><<<static_cast<unsigned>(n), 256, 0, s>>>(z.as<float>(), y.as<int>(), v,
                                                                    1.0 / valid, rl.as<double>());
      if (bf16)
        narrow<<<4096, 256, 0, s>>>(z.as<float>(), zg.as<__nv_bfloat16>(),
                                    static_cast<std::size_t>(n * v));
      gm.dx(g, w.data(), ndx.data(), ni, hi, vi, ct, ct, CUDA_R_32F, CUBLAS_COMPUTE_32F);
      gm.dw(g, x.data(), ndw.data(), ni, hi, vi, ct, ct, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    };
    res.naive_ms = time_ms(s, c.repeats, naive);
    BENCH_CHECK(cudaStreamSynchronize(s));
    std::vector<double> hl(static_cast<std::size_t>(n));
    gpu::copy_to_host(hl.data(), rl.data(), hl.size() * 8);
    double naive_loss = 0;
    for (double l : hl) naive_loss += l;
    res.naive_loss_value = naive_loss;
    const double e_loss = std::abs(res.loss_value - naive_loss) / std::abs(naive_loss);
    const double e_dx = bf16 ? rel_err(dx.as<__nv_bfloat16>(), ndx.as<float>(), n * h)
                             : rel_err(dx.as<float>(), ndx.as<float>(), n * h);
    const double e_dw = bf16 ? rel_err(dw.as<__nv_bfloat16>(), ndw.as<float>(), v * h)
                             : rel_err(dw.as<float>(), ndw.as<float>(), v * h);
    res.err_loss = e_loss;
    res.err_grad_hidden = e_dx;
    res.err_grad_weight = e_dw;
    res.max_rel_err_vs_naive = std::max({e_loss, e_dx, e_dw});
  }
  if (c.exact) {
    // float64 on the same input values: widened operands, fp64 GEMMs, fp64 softmax gradient.
    gpu::DeviceBuffer xd(n * h * 8), wd(v * h * 8), zd(n * v * 8), rl(n * 8), dxd(n * h * 8),
        dwd(v * h * 8);
    if (bf16) {
      widen<<<4096, 256, 0, s>>>(x.as<__nv_bfloat16>(), xd.as<double>(),
                                 static_cast<std::size_t>(n * h));
      widen<<<4096, 256, 0, s>>>(w.as<__nv_bfloat16>(), wd.as<double>(),
                                 static_cast<std::size_t>(v * h));
    } else {
      widen<<<4096, 256, 0, s>>>(x.as<float>(), xd.as<double>(), static_cast<std::size_t>(n * h));
      widen<<<4096, 256, 0, s>>>(w.as<float>(), wd.as<double>(), static_cast<std::size_t>(v * h));
    }
    Gemms g64{gm.h, CUDA_R_64F, CUDA_R_64F};
    g64.logits(xd.data(), wd.data(), zd.data(), ni, hi, vi, CUDA_R_64F, CUBLAS_COMPUTE_64F);
    dense_ce_grad<double><<<static_cast<unsigned>(n), 256, 0, s>>>(zd.as<double>(), y.as<int>(), v,
                                                                   1.0 / valid, rl.as<double>());
    g64.dx(zd.data(), wd.data(), dxd.data(), ni, hi, vi, CUDA_R_64F, CUDA_R_64F, CUDA_R_64F,
           CUBLAS_COMPUTE_64F);
    g64.dw(zd.data(), xd.data(), dwd.data(), ni, hi, vi, CUDA_R_64F, CUDA_R_64F, CUDA_R_64F,
           CUBLAS_COMPUTE_64F);
    BENCH_CHECK(cudaGetLastError());
    res.f64_err_grad_hidden = bf16 ? rel_err(dx.as<__nv_bfloat16>(), dxd.as<double>(), n * h)
                                   : rel_err(dx.as<float>(), dxd.as<double>(), n * h);
    res.f64_err_grad_weight = bf16 ? rel_err(dw.as<__nv_bfloat16>(), dwd.as<double>(), v * h)
                                   : rel_err(dw.as<float>(), dwd.as<double>(), v * h);
  }
  return res;
}

}  // namespace chunkloss::bench
