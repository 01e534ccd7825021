// Elementwise helpers of the engine: fp32 accumulators flushed into caller buffers (f32 or
// bf16, overwrite or add), a non-finite count for check_finite, and zero fills. Grid-stride
// loops, one element per thread per step.
#include <cub/block/block_reduce.cuh>

#include "device_util.cuh"

namespace chunkloss::kern {
namespace {

constexpr int kThreads = 256;

unsigned blocks_for(std::int64_t n) {
  const std::int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 65535 * 16 ? (b > 0 ? b : 1) : 65535 * 16);
}

template <typename T>
__global__ void store_f32_kernel(T* dst, const float* src, std::int64_t n, bool add) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    dst[i] = from_float<T>(add ? to_float(dst[i]) + src[i] : src[i]);
}

struct RowsShape {
  std::int64_t n, cols, dst_ld, src_ld, scale_stride;
};

template <typename TD, typename TS>
__global__ void scale_rows_kernel(TD* dst, const TS* src, const float* scale, RowsShape sh,
                                  bool add) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < sh.n;
       i += stride) {
    const std::int64_t r = i / sh.cols, j = i % sh.cols;
    const float v = scale[r * sh.scale_stride] * to_float(src[r * sh.src_ld + j]);
    TD& d = dst[r * sh.dst_ld + j];
    d = from_float<TD>(add ? to_float(d) + v : v);
  }
}

template <typename TD>
int scale_rows_from(TD* dst, const void* src, Elem src_elem, const float* scale, RowsShape sh,
                    bool add, cudaStream_t s) {
  if (src_elem == Elem::kF32)
    scale_rows_kernel<<<blocks_for(sh.n), kThreads, 0, s>>>(dst, static_cast<const float*>(src),
                                                            scale, sh, add);
  else
    scale_rows_kernel<<<blocks_for(sh.n), kThreads, 0, s>>>(
        dst, static_cast<const __nv_bfloat16*>(src), scale, sh, add);
  return static_cast<int>(cudaGetLastError());
}

// Integer counts: each block reduces its count and adds it with one integer atomic, so the
// total is exact and deterministic.
template <typename T>
__global__ void count_nonfinite_kernel(const T* x, std::int64_t n, unsigned long long* count) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  unsigned long long c = 0;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    c += isfinite(to_float(x[i])) ? 0 : 1;
  const unsigned long long total = Reduce(tmp).Sum(c);
  if (threadIdx.x == 0 && total) atomicAdd(count, total);
}

__global__ void nonfinite_as_double_kernel(double* scalars) {
  unsigned long long count;
  memcpy(&count, scalars + kNonFinite, sizeof count);
  scalars[kNonFinite] = static_cast<double>(count);
}

__global__ void zero_kernel(float* x, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    x[i] = 0.0f;
}

}  // namespace

int launch_store_f32(void* dst, Elem dst_elem, const float* src, std::int64_t n, bool add,
                     void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (dst_elem == Elem::kF32)
    store_f32_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<float*>(dst), src, n, add);
  else
    store_f32_kernel<<<blocks_for(n), kThreads, 0, s>>>(static_cast<__nv_bfloat16*>(dst), src, n,
                                                        add);
  return static_cast<int>(cudaGetLastError());
}

int launch_scale_rows(void* dst, Elem dst_elem, std::int64_t dst_ld, const void* src, Elem src_elem,
                      std::int64_t src_ld, const float* scale, std::int64_t rows, std::int64_t cols,
                      bool add, void* stream, std::int64_t scale_stride) {
  auto s = static_cast<cudaStream_t>(stream);
  const RowsShape sh{rows * cols, cols, dst_ld, src_ld, scale_stride};
  if (sh.n == 0) return 0;
  if (dst_elem == Elem::kF32)
    return scale_rows_from(static_cast<float*>(dst), src, src_elem, scale, sh, add, s);
  return scale_rows_from(static_cast<__nv_bfloat16*>(dst), src, src_elem, scale, sh, add, s);
}

int launch_count_nonfinite(const void* x, Elem elem, std::int64_t n, double* scalars,
                           void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  auto* count = reinterpret_cast<unsigned long long*>(scalars + kNonFinite);
  const unsigned grid = blocks_for(n) < 1024 ? blocks_for(n) : 1024;
  if (elem == Elem::kF32)
    count_nonfinite_kernel<<<grid, kThreads, 0, s>>>(static_cast<const float*>(x), n, count);
  else
    count_nonfinite_kernel<<<grid, kThreads, 0, s>>>(static_cast<const __nv_bfloat16*>(x), n,
                                                     count);
  return static_cast<int>(cudaGetLastError());
}

int launch_nonfinite_as_double(double* scalars, void* stream) {
  nonfinite_as_double_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(scalars);
  return static_cast<int>(cudaGetLastError());
}

int launch_zero(float* x, std::int64_t n, void* stream) {
  zero_kernel<<<blocks_for(n), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, n);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace chunkloss::kern
