// Helpers of the one-pass probe kernels (one-pass-kernels.cu), on top of the library's
// kernels/src/row_acc.cuh at the commit named in ../cuda-ce-2026-12-05-one-pass.md: the row rule
// without storing, and the per-vector steps of the statistics and gradient kernels.
#pragma once

#include "../../../../kernels/src/row_acc.cuh"

namespace chunkloss::kern {

/// Row t's lse, entropy, argmax, logit sum, scaled coefficients (divided by the GEMMs' alpha,
/// see kGemmScalarsOffset), loss and z-loss from its merged statistics.
struct RowResult {
  RowOut out;
  float entropy, zsum, loss, zloss;
  std::int32_t arg;
};

/// The row rule of row t from its merged statistics; `y` is valid_target(p, t).
__device__ inline RowResult row_rule(const TokenParams& p, std::int64_t t, std::int64_t y,
                                     const RowStats& r) {
  RowResult x{};
  const float lse = r.m + logf(r.s);
  x.out.lse = lse;
  x.entropy = p.entropy ? lse - r.sez / r.s : 0.0f;
  x.arg = r.arg;
  x.zsum = p.logit_sums ? r.sz : 0.0f;
  if (is_valid(p, y)) {
    const float cw_y = p.class_weights ? p.class_weights[y] : 1.0f;
    const float sum_wz = p.class_weights ? r.swz : r.sz;
    RowRule rule = p.rule;
    rule.cw_sum = static_cast<float>(p.scalars[kClassWeightSum]);
    const RowTerms rt = row_terms(rule, lse, r.zy, cw_y, sum_wz);
    const float tw = p.token_weights ? p.token_weights[t] : 1.0f;
    float coef = tw;
    if (p.scale == Scale::kMean) coef *= static_cast<float>(p.scalars[kRowScale]);
    if (p.scale == Scale::kUpstream && p.upstream) coef *= p.upstream[t];  // null: forward only
    x.out.a = coef * rt.alpha;
    x.out.b = coef * rt.beta;
    x.out.g = coef * rt.gamma;
    x.loss = tw * (rt.ce + rt.zloss);
    x.zloss = tw * rt.zloss;
  }
  return x;
}

/// Adds one vector of V logits of a row, starting at column j (< n, the row's columns), to its
/// statistics; `y_col` is the target's column. kPlain (see plain_rows): the vector rescales the
/// running sum once (its max first) instead of branching per element; its pads past n are set
/// to -inf so they never win.
template <bool kPlain, int V>
__device__ __forceinline__ void add_vector(RowAcc& acc, const TokenParams& p, float (&z)[V],
                                           std::int64_t j, std::int64_t n, std::int64_t y_col,
                                           float cap, float inv_cap, bool want_sum) {
  if constexpr (kPlain) {
    if (j + V > n) {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (j + k >= n) z[k] = -INFINITY;
    }
    float vm = z[0];
#pragma unroll
    for (int k = 1; k < V; ++k) vm = fmaxf(vm, z[k]);
    if (vm > acc.m) {  // a new running max, at its first column in this vector
      int vi = V - 1;
#pragma unroll
      for (int k = V - 1; k >= 0; --k)
        if (z[k] == vm) vi = k;
      acc.s *= __expf(acc.m - vm);
      acc.m = vm;
      acc.arg = static_cast<int>(j) + vi;
    }
#pragma unroll
    for (int k = 0; k < V; ++k) acc.s += __expf(z[k] - acc.m);
    if (p.logit_sums) {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (j + k < n) acc.sz += z[k];
    }
    // The target's place in this vector, if there (not a pad: another rank's column).
    const std::int64_t dy = y_col - j;
    if (dy >= 0 && dy < V && y_col < n) {
#pragma unroll
      for (int k = 0; k < V; ++k)
        if (k == dy) acc.zy = z[k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const std::int64_t col = j + k;
      if (col >= n) break;
      accumulate_logit(acc, p, softcap_value(z[k] + bias_at(p, col), cap, inv_cap), col, y_col,
                       want_sum);
    }
  }
}

/// dL/dz of one vector of V logits of a row at tile column j of `cols`, the tile starting at
/// call column v0; `y` is the target's tile column. Columns past `cols` and rows whose
/// coefficients are all 0 (`zero`) get 0. kPlain: a exp(z - lse) - b onehot, one exp each.
template <bool kPlain, int V>
__device__ __forceinline__ void grad_vector(float (&d)[V], const float (&z)[V],
                                            const TokenParams& p, const RowOut& o, bool zero,
                                            std::int64_t j, std::int64_t cols, std::int64_t y,
                                            std::int64_t v0, float cap, float inv_cap) {
  const int live = zero ? 0 : cols - j < V ? static_cast<int>(cols - j) : V;
  const std::int64_t dy = y - j;
  const int hit = dy >= 0 && dy < V ? static_cast<int>(dy) : -1;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (k >= live) {
      d[k] = 0.0f;
    } else if constexpr (kPlain) {
      d[k] = o.a * __expf(z[k] - o.lse) - (k == hit ? o.b : 0.0f);
    } else {
      const std::int64_t col = j + k;
      const float w = class_weight_at(p, v0 + col);
      d[k] = grad_element(z[k] + bias_at(p, v0 + col), k == hit, o.lse, o.a, o.b, o.g, w, cap,
                          inv_cap);
    }
  }
}

}  // namespace chunkloss::kern
