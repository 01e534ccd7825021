// Online softmax statistics of a row (max, sum-exp, entropy term, logit sums, target logit,
// first argmax), their merge, and the row rule that turns them into the row's lse, loss and
// gradient coefficients.
#pragma once

#include <climits>

#include "device_util.cuh"

namespace chunkloss::kern {

/// Online softmax statistics of a set of logits; `merge` is associative up to rounding and the
/// reduction tree is fixed, so results are run-to-run identical.
/// The fields are RowStats' (arg: the first column of the max within the call's columns).
struct RowAcc : RowStats {
  __device__ static RowAcc empty() {
    RowAcc a;
    a.m = -INFINITY;
    a.s = a.sez = a.sz = a.swz = a.zy = 0.0f;
    a.arg = INT_MAX;
    return a;
  }

  /// A logit of -inf (a column masked through the bias) adds nothing: exp(z - m) would be
  /// exp(NaN) while m is still -inf, and e * z is 0 * -inf.
  __device__ void push(float z, int j) {
    if (z > m) {
      const float r = __expf(m - z);
      s = s * r + 1.0f;
      sez = sez * r + z;
      m = z;
      arg = j;
    } else if (z != -INFINITY) {
      const float e = __expf(z - m);
      s += e;
      sez += e * z;
    }
  }
};

struct MergeAcc {
  __device__ RowAcc operator()(const RowAcc& a, const RowAcc& b) const {
    RowAcc r;
    static_cast<RowStats&>(r) = merge_stats(a, b, [](float x) { return __expf(x); });
    return r;
  }
};

/// Adds softcapped logit `zc` of column `col` to a row's statistics; `y_col` is the column of
/// the row's target.
__device__ __forceinline__ void accumulate_logit(RowAcc& acc, const TokenParams& p, float zc,
                                                 std::int64_t col, std::int64_t y_col,
                                                 bool want_sum) {
  acc.push(zc, static_cast<int>(col));
  if (want_sum) {
    acc.sz += zc;
    if (p.class_weights) acc.swz += class_weight_at(p, col) * zc;
  }
  if (col == y_col) acc.zy = zc;
}

/// Writes row t's lse, entropy, argmax, scaled coefficients (divided by the GEMMs' alpha, see
/// kGemmScalarsOffset), loss and z-loss from its merged statistics; `y` is valid_target(p, t).
/// A refused call (refused_call) gets zero coefficients.
__device__ inline void apply_row_rule(const TokenParams& p, std::int64_t t, std::int64_t y,
                                      const RowStats& r) {
  const float lse = r.m + logf(r.s);
  p.row.lse[t] = lse;
  p.row.entropy[t] = p.entropy ? lse - r.sez / r.s : 0.0f;
  p.row.argmax[t] = r.arg;
  p.row.zsum[t] = p.logit_sums ? r.sz : 0.0f;
  float a = 0, b = 0, g = 0, loss = 0, zl = 0;
  if (is_valid(p, y) && !refused_call(p)) {
    const float cw_y = p.class_weights ? p.class_weights[y] : 1.0f;
    const float sum_wz = p.class_weights ? r.swz : r.sz;
    RowRule rule = p.rule;
    rule.cw_sum = static_cast<float>(p.scalars[kClassWeightSum]);
    const RowTerms rt = row_terms(rule, lse, r.zy, cw_y, sum_wz);
    const float tw = p.token_weights ? p.token_weights[t] : 1.0f;
    float coef = tw;
    if (p.scale == Scale::kMean) coef *= static_cast<float>(p.scalars[kRowScale]);
    if (p.scale == Scale::kUpstream && p.upstream) coef *= p.upstream[t];  // null: forward only
    a = coef * rt.alpha;
    b = coef * rt.beta;
    g = coef * rt.gamma;
    loss = tw * (rt.ce + rt.zloss);
    zl = tw * rt.zloss;
  }
  p.row.a[t] = a;
  p.row.b[t] = b;
  p.row.g[t] = g;
  p.row.loss[t] = loss;
  p.row.zloss[t] = zl;
}

}  // namespace chunkloss::kern
