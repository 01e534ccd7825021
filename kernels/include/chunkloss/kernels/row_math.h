// Per-row math of the engine's epilogues, shared by the CPU backend and the CUDA kernels so the
// formulas exist once: a row's loss and its gradient coefficients from its statistics, and one
// element of the gradient dL/dz = c (alpha p - beta onehot - gamma u) * softcap'.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define CHUNKLOSS_HD __host__ __device__ __forceinline__
#else
#define CHUNKLOSS_HD inline
#endif

namespace chunkloss::kern {

/// Cross-entropy rule constants (label smoothing ls, z-loss zl, class weights cw).
struct RowRule {
  float one_minus_ls = 1.0f;  ///< 1 - ls
  float eps = 0.0f;           ///< ls / V
  float z_loss = 0.0f;        ///< zl
  float cw_sum = 0.0f;        ///< sum_j cw_j (V without class weights)
};

/// A row's loss parts and unscaled gradient coefficients: dz = c (alpha p - beta e_y - gamma u).
struct RowTerms {
  float ce;     ///< (1-ls) cw_y (lse - z_y) + eps (cw_sum lse - sum_j cw_j z_j)
  float zloss;  ///< zl cw_y lse^2
  float alpha;  ///< (1-ls) cw_y + eps cw_sum + 2 zl cw_y lse
  float beta;   ///< (1-ls) cw_y
  float gamma;  ///< eps
};

/// Terms of a valid row from its lse, target logit z_y, class weight cw_y and the
/// class-weighted logit sum sum_j cw_j z_j (plain sum without class weights).
CHUNKLOSS_HD RowTerms row_terms(const RowRule& r, float lse, float z_y, float cw_y, float sum_wz) {
  RowTerms t;
  t.beta = r.one_minus_ls * cw_y;
  // Without smoothing the logit sum takes no part: a masked (-inf) column would make it 0 * inf.
  t.ce = t.beta * (lse - z_y) + (r.eps != 0.0f ? r.eps * (r.cw_sum * lse - sum_wz) : 0.0f);
  // The z-loss is weighted by the row's class weight as its cross-entropy is, so that the mean
  // (over the class weights' sum) does not change when every class weight is scaled.
  t.zloss = r.z_loss * cw_y * lse * lse;
  t.alpha = t.beta + r.eps * r.cw_sum + 2.0f * r.z_loss * cw_y * lse;
  t.gamma = r.eps;
  return t;
}

/// A row's softmax statistics over a set of its logits: what each rank of a vocabulary-parallel
/// group contributes for its columns (32 bytes, the unit the ranks exchange).
struct alignas(16) RowStats {
  float m;           ///< max
  float s;           ///< sum exp(z - m)
  float sez;         ///< sum exp(z - m) z (entropy)
  float sz;          ///< sum z
  float swz;         ///< sum cw_j z_j
  float zy;          ///< the target logit where these columns hold the target, else 0
  std::int32_t arg;  ///< first (global) column of the max
};

/// Statistics of the union of two disjoint column sets; ties of the max keep the first column.
/// `exp` is the exponential to rescale with (the device's block reductions pass __expf).
template <typename Exp>
CHUNKLOSS_HD RowStats merge_stats(const RowStats& a, const RowStats& b, Exp exp) {
  RowStats r;
  r.m = fmaxf(a.m, b.m);
  const float ea = a.m == -INFINITY ? 0.0f : exp(a.m - r.m);
  const float eb = b.m == -INFINITY ? 0.0f : exp(b.m - r.m);
  r.s = a.s * ea + b.s * eb;
  r.sez = a.sez * ea + b.sez * eb;
  r.sz = a.sz + b.sz;
  r.swz = a.swz + b.swz;
  r.zy = a.zy + b.zy;
  r.arg = a.m > b.m ? a.arg : b.m > a.m ? b.arg : a.arg < b.arg ? a.arg : b.arg;
  return r;
}

/// merge_stats with expf: the merge of a vocabulary-parallel group's statistics, the same on the
/// CPU and the GPU.
CHUNKLOSS_HD RowStats merge_stats(const RowStats& a, const RowStats& b) {
  return merge_stats(a, b, [](float x) { return expf(x); });
}

/// Softcap: z = cap tanh(raw / cap); inv_cap == 0 means no softcap.
CHUNKLOSS_HD float softcap_value(float raw, float cap, float inv_cap) {
  return inv_cap == 0.0f ? raw : cap * tanhf(raw * inv_cap);
}

/// Gradient of one logit. `raw` is the pre-softcap logit, `is_target` marks k == y, `u_k` is
/// cw_k (1 without class weights). a, b, g are the row's coefficients already multiplied by c.
/// Ignored rows have a = b = g = 0 and get exactly 0.
CHUNKLOSS_HD float grad_element(float raw, bool is_target, float lse, float a, float b, float g,
                                float u_k, float cap, float inv_cap) {
  if (inv_cap == 0.0f) {
    const float d = a * expf(raw - lse) - g * u_k;
    return is_target ? d - b : d;
  }
  const float t = tanhf(raw * inv_cap);
  const float z = cap * t;
  float d = a * expf(z - lse) - g * u_k;
  if (is_target) d -= b;
  return d * (1.0f - t * t);
}

}  // namespace chunkloss::kern
