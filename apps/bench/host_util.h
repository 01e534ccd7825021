// Host-side helpers shared by the CPU cases of chunkloss-bench: fresh-page buffers (so resident-set
// growth shows what a stretch of work touched), seeded inputs, bf16 rounding, relative-norm errors
// and the two row steps of a naive materialised softmax (statistics, then the gradient in place).
#pragma once

#include <chunkloss/core/dtype.h>
#include <Eigen/Core>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

namespace chunkloss::bench {

/// An anonymous mapping of fresh pages (page-aligned, so 256-byte aligned): its pages become
/// resident on first write, so the resident-set growth of a window shows what was touched.
class HostBuffer {
 public:
  explicit HostBuffer(std::size_t bytes);
  ~HostBuffer();
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  std::size_t bytes() const { return bytes_; }
  /// Writes zeros over the whole buffer (makes its pages resident).
  void zero();

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

/// p[i] ~ N(0, stddev^2), deterministic for a seed whatever the thread count (one generator per
/// block of 64 Ki values).
void fill_normal(float* p, std::int64_t n, float stddev, std::uint64_t seed, int threads);

/// dst[i] = bf16(src[i]) and src[i] = float(dst[i]): the fp32 copy holds the bf16 values.
void round_to_bf16(float* src, BFloat16* dst, std::int64_t n, int threads);

/// dst[i] = double(src[i]).
void widen_to_double(const float* src, double* dst, std::int64_t n, int threads);

/// ||a - b|| / ||b|| in double (||a - b|| when b is zero); a in f32, bf16 or f64, b f32 or f64.
double rel_norm_err(const float* a, const float* b, std::int64_t n, int threads);
double rel_norm_err(const BFloat16* a, const float* b, std::int64_t n, int threads);
double rel_norm_err(const float* a, const double* b, std::int64_t n, int threads);
double rel_norm_err(const BFloat16* a, const double* b, std::int64_t n, int threads);

/// ||bf16(b) - b|| / ||b||: the error of storing the reference result itself in bf16.
double bf16_storage_err(const float* b, std::int64_t n, int threads);

/// /proc/loadavg, one line.
std::string loadavg();

/// A row-major Eigen matrix of S.
template <typename S>
using RowMat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// Row statistics of materialised logits z [N, V] (row-major), for rows whose target is not
/// `ignore`: lse[t] = log sum_j exp(z_tj) (max-shifted, Eigen's vectorised exp) and
/// zy[t] = z_t[y_t]; ignored rows get lse = zy = 0. Precision of S (float or double).
template <typename S, typename Y>
void dense_row_stats(const S* z, std::int64_t n, std::int64_t v, const Y* y, std::int64_t ignore,
                     S* lse, S* zy, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t yt = static_cast<std::int64_t>(y[t]);
    if (yt == ignore) {
      lse[t] = zy[t] = S(0);
      continue;
    }
    const Eigen::Map<const Eigen::Array<S, Eigen::Dynamic, 1>> a(z + t * v, v);
    const S m = a.maxCoeff();
    lse[t] = m + std::log((a - m).exp().sum());
    zy[t] = a[yt];
  }
}

/// Overwrites z [N, V] with the softmax gradient coef[t] * (softmax(z_t) - onehot(y_t)) from the
/// stored lse; ignored rows (and rows with coef 0) become zero.
template <typename S, typename Y>
void dense_softmax_grad(S* z, std::int64_t n, std::int64_t v, const Y* y, std::int64_t ignore,
                        const S* lse, const S* coef, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t t = 0; t < n; ++t) {
    Eigen::Map<Eigen::Array<S, Eigen::Dynamic, 1>> a(z + t * v, v);
    const std::int64_t yt = static_cast<std::int64_t>(y[t]);
    if (yt == ignore || coef[t] == S(0)) {
      a.setZero();
      continue;
    }
    a = (a - lse[t]).exp() * coef[t];
    a[yt] -= coef[t];
  }
}

}  // namespace chunkloss::bench
