// The CPU backend of the token engine: Eigen GEMMs (multi-threaded through OpenMP) on fp32
// operands, vectorised Eigen array epilogues, one thread per row. bf16 operands are staged as
// fp32 copies (a tile of W rows at a time) in the workspace; that widening, and the rounding
// of bf16 gradients, run on the call's threads. Nothing is allocated per call.
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>

#include "chunkloss/core/error.h"
#include "engine.h"
#include "row_arrays.h"
#include "vocab_parallel.h"

namespace chunkloss::detail {
namespace {

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatMap = Eigen::Map<RowMat>;
using CMatMap = Eigen::Map<const RowMat>;
using ArrMap = Eigen::Map<Eigen::ArrayXf>;
using CArrMap = Eigen::Map<const Eigen::ArrayXf>;

constexpr std::int64_t kWeightTile = 256;  // rows of W converted at a time (matches plan.cpp)

constexpr std::int64_t kSumColumns = 1024;  // columns of the bias gradient's sums per thread

// Conversions below this many values stay on the calling thread.
constexpr std::int64_t kParallelValues = std::int64_t{1} << 16;

// dst[i] = t[offset + i] as fp32, bf16 values widened on `threads` threads.
void to_f32(int threads, const TensorView& t, std::int64_t offset, std::int64_t count, float* dst) {
  if (t.dtype() == DType::kF32) {
    std::copy_n(t.data_as<const float>() + offset, count, dst);
  } else {
    const BFloat16* s = t.data_as<const BFloat16>() + offset;
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= kParallelValues)
    for (std::int64_t i = 0; i < count; ++i) dst[i] = static_cast<float>(s[i]);
  }
}

// dst[offset + i] = factor ((add ? dst : 0) + src[i]), in dst's float dtype, on `threads`
// threads.
void store_f32(int threads, const TensorView& dst, std::int64_t offset, std::int64_t count,
               const float* src, bool add, float factor = 1.0f) {
  if (dst.dtype() == DType::kF32) {
    float* d = dst.data_as<float>() + offset;
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= kParallelValues)
    for (std::int64_t i = 0; i < count; ++i) d[i] = factor * (add ? d[i] + src[i] : src[i]);
  } else {
    BFloat16* d = dst.data_as<BFloat16>() + offset;
#pragma omp parallel for num_threads(threads) schedule(static) if (count >= kParallelValues)
    for (std::int64_t i = 0; i < count; ++i)
      d[i] = BFloat16(factor * (add ? static_cast<float>(d[i]) + src[i] : src[i]));
  }
}

// The logit of a column masked through the bias.
constexpr float kMasked = -std::numeric_limits<float>::infinity();

class CpuTokenBackend final : public TokenBackend {
 public:
  CpuTokenBackend(const CpuContext& ctx, const TokenCall& call, const Plan& plan,
                  const Workspace& ws)
      : ctx_(ctx), c_(call), plan_(plan), threads_(ctx.threads()), h_(call.hidden), v_(call.vocab) {
    tile_ = tile_base_ = ws.at<float>(plan.logits);
    rows_ = RowArrays::carve(ws.at<float>(plan.row_stats), call.rows);
    // The plan may be shared with a forward-only call (a reference head): accumulators only
    // for the gradients this call computes.
    if (plan.dw_accum.bytes && call.grad_w.defined()) dw_acc_ = ws.at<float>(plan.dw_accum);
    if (plan.dh_accum.bytes && call.grad_x.defined()) dh_acc_ = ws.at<float>(plan.dh_accum);
    if (plan.db_accum.bytes && call.grad_bias.defined()) db_acc_ = ws.at<float>(plan.db_accum);
    float* s = plan.staging.bytes ? ws.at<float>(plan.staging) : nullptr;
    const float* end = s + plan.staging.bytes / sizeof(float);
    if (call.vocab_group) {
      auto* b = reinterpret_cast<unsigned char*>(s);
      vp_ = carve_vocab_parallel(b, plan.chunk_rows, h_, call.vocab_group->size(),
                                 call.grad_x.defined());
      s = reinterpret_cast<float*>(b);
    }
    const bool bf16_in = call.x.dtype() == DType::kBF16;
    const bool vocab_order = plan.order == LoopOrder::kVocabBlock;
    const std::int64_t stage_rows = vocab_order ? call.rows : plan.chunk_rows;
    auto take = [&](std::int64_t floats) {
      float* p = s;
      s += floats;
      return p;
    };
    if (bf16_in) {
      w_tile_ = take(kWeightTile * h_);
      x32_ = take(stage_rows * h_);
    }
    if (call.grad_w.defined() && call.grad_w.dtype() == DType::kBF16 && !dw_acc_)
      dw_tile_ = take(kWeightTile * h_);
    if (!vocab_order && call.grad_x.defined() && call.grad_x.dtype() == DType::kBF16 && !vp_.dh)
      dh32_ = take(stage_rows * h_);
    // The *_ranges steps gather X rows in the bf16 staging, or in what the plan left for fp32 X,
    // and dH rows in bf16 dH's staging, or in what it left for fp32 dH.
    const std::int64_t c = plan.chunk_rows;
    if (bf16_in) {
      x_pack_ = x32_;
      x_pack_rows_ = stage_rows;
    } else if (s && end - s >= c * h_) {
      x_pack_ = take(c * h_);
      x_pack_rows_ = c;
    }
    if (dh32_) {
      dh_pack_rows_ = stage_rows;
    } else if (call.grad_x.defined() && !vp_.dh && s && end - s >= c * h_) {
      dh_pack_ = take(c * h_);
      dh_pack_rows_ = c;
    }
    if (call.class_weights.defined()) cw_ = call.class_weights.data_as<const float>();
    // A -inf bias entry masks its column (with softcap it is capped instead).
    if (c_.bias.defined() && !(c_.softcap > 0.0f)) {
      for (std::int64_t j = 0; j < v_ && !masked_bias_; ++j)
        masked_bias_ = bias_value(j) == kMasked;
    }
    // Eigen's GEMMs take their threads from the calling thread's OpenMP setting (not from
    // Eigen::setNbThreads, a process-wide value other threads' calls would race on); the
    // caller's setting is restored when the call ends.
    omp_set_num_threads(threads_);
  }

  ~CpuTokenBackend() override { omp_set_num_threads(caller_threads_); }
  CpuTokenBackend(const CpuTokenBackend&) = delete;
  CpuTokenBackend& operator=(const CpuTokenBackend&) = delete;

  void begin() override {
    const std::int64_t n = c_.rows;
    for (std::int64_t t = 0; t < n; ++t) {
      const std::int64_t y = target(t);
      if (y == c_.ignore_index) continue;
      ++valid_;
      denom_ += cw_ ? static_cast<double>(cw_[y]) : 1.0;
    }
    if (c_.data_group) {  // the valid rows and the divisor over the group's rows
      double sums[2] = {static_cast<double>(valid_), denom_};
      c_.data_group->all_reduce_sum(ctx_, sums, 2);
      valid_ = static_cast<std::int64_t>(sums[0]);
      denom_ = sums[1];
    }
    inv_denom_ = denom_ > 0 ? static_cast<float>(1.0 / denom_) : 0.0f;
    if (db_acc_) std::fill_n(db_acc_, v_, 0.0f);
  }

  void logits(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1) override {
    logits_of(x_rows(r0, r1), r1 - r0, v0, v1);
  }

  // Several ranges: their X rows gathered side by side, one GEMM (each GEMM call reads and
  // packs all of W, which short ranges would pay once each).
  void logits_ranges(const std::vector<RowRange>& ranges) override {
    if (!gather_x(ranges)) {
      TokenBackend::logits_ranges(ranges);
      return;
    }
    select_tile(0);
    logits_of(x_pack_, row_count(ranges), 0, v_);
  }

  // The bias of this call's column j.
  float bias_value(std::int64_t j) const {
    return c_.bias.dtype() == DType::kF32
               ? c_.bias.data_as<const float>()[j]
               : static_cast<float>(c_.bias.data_as<const BFloat16>()[j]);
  }

  // tile [rows, v1 - v0] = x w[v0:v1]^T (+ bias[v0:v1]) for `rows` fp32 X rows `x`.
  void logits_of(const float* x, std::int64_t rows, std::int64_t v0, std::int64_t v1) {
    const std::int64_t cols = v1 - v0;
    MatMap z(tile_, rows, cols);
    CMatMap xm(x, rows, h_);
    for_weight_tiles(v0, v1, [&](std::int64_t t0, std::int64_t t1, const float* w) {
      z.middleCols(t0 - v0, t1 - t0).noalias() = xm * CMatMap(w, t1 - t0, h_).transpose();
    });
    if (c_.bias.defined() && c_.bias.dtype() == DType::kF32) {
      const CArrMap b(c_.bias.data_as<const float>() + v0, cols);
#pragma omp parallel for num_threads(threads_) schedule(static)
      for (std::int64_t i = 0; i < rows; ++i) ArrMap(tile_ + i * cols, cols) += b;
    } else if (c_.bias.defined()) {
      const BFloat16* b = c_.bias.data_as<const BFloat16>() + v0;
#pragma omp parallel for num_threads(threads_) schedule(static)
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) z(i, j) += static_cast<float>(b[j]);
    }
    capped_ = false;
  }

  // Each row's statistics of this call's columns; with the vocabulary split, exchanged and
  // merged in rank order; then the row rule.
  void row_stats(std::int64_t r0, std::int64_t r1) override {
    const float cap = c_.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    const bool want_sum = c_.rule.eps != 0.0f || c_.logit_sums;
    const float* cw = cw_ ? cw_ + c_.vocab_offset : nullptr;
    kern::RowStats* part = vp_.own;  // set: the vocabulary is split
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t t = r0; t < r1; ++t) {
      ArrMap z(tile_ + (t - r0) * v_, v_);
      if (inv_cap != 0.0f) z = cap * (z * inv_cap).tanh();
      // The max and its first column leave NaNs out, as on CUDA; where no column is above -inf
      // (every column masked, or NaN), m is -inf and the first column is taken.
      kern::RowStats st;
      st.m = z.maxCoeff<Eigen::PropagateNumbers>();
      std::int64_t arg = 0;
      if (st.m > kMasked) {
        while (z[arg] != st.m) ++arg;
      } else {
        st.m = kMasked;
      }
      st.arg = static_cast<std::int32_t>(c_.vocab_offset + arg);
      // A -inf logit (a column masked through the bias) adds nothing to s and sez; logits that
      // are all -inf here (with a vocabulary split, a whole masked shard) add nothing at all,
      // as on CUDA, where exp(z - m) would be NaN. A NaN makes s NaN.
      const bool all_masked = st.m == kMasked && !z.isNaN().any();
      st.s = all_masked ? 0.0f : (z - st.m).exp().sum();
      st.sez = c_.entropy && !all_masked ? (z == kMasked).select(0.0f, (z - st.m).exp() * z).sum()
                                         : 0.0f;
      st.sz = want_sum ? z.sum() : 0.0f;
      st.swz = want_sum && cw ? (z * CArrMap(cw, v_)).sum() : 0.0f;
      const std::int64_t y = target(t) - c_.vocab_offset;
      st.zy = y >= 0 && y < v_ ? z[y] : 0.0f;
      if (part)
        part[t - r0] = st;
      else
        row_rule(t, st);
    }
    capped_ = inv_cap != 0.0f;
    if (!part) return;
    const std::int64_t rows = r1 - r0;
    const int ranks = c_.vocab_group->size();
    c_.vocab_group->all_gather(ctx_, part, vp_.all,
                               static_cast<std::size_t>(rows) * sizeof(kern::RowStats));
    for (std::int64_t i = 0; i < rows; ++i) {
      kern::RowStats st = vp_.all[i];
      for (int k = 1; k < ranks; ++k) st = kern::merge_stats(st, vp_.all[k * rows + i]);
      row_rule(r0 + i, st);
    }
  }

  void grad_epilogue(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1) override {
    const std::int64_t cols = v1 - v0;
    const float cap = c_.softcap, inv_cap = cap > 0 ? 1.0f / cap : 0.0f;
    const bool apply_cap = inv_cap != 0.0f && !capped_;
    const float* cw = cw_ ? cw_ + c_.vocab_offset + v0 : nullptr;
#pragma omp parallel for num_threads(threads_) schedule(static)
    for (std::int64_t t = r0; t < r1; ++t) {
      ArrMap z(tile_ + (t - r0) * cols, cols);
      const float a = rows_.a[t], b = rows_.b[t], g = rows_.g[t], lse = rows_.lse[t];
      if (a == 0.0f && b == 0.0f && g == 0.0f) {
        z.setZero();
        continue;
      }
      if (apply_cap) z = cap * (z * inv_cap).tanh();
      const std::int64_t y = target(t) - c_.vocab_offset - v0;
      const bool has_y = y >= 0 && y < cols;
      const float chain_y =
          has_y && inv_cap != 0.0f ? 1.0f - (z[y] * inv_cap) * (z[y] * inv_cap) : 1.0f;
      if (inv_cap == 0.0f) {
        if (cw)
          z = a * (z - lse).exp() - g * CArrMap(cw, cols);
        else
          z = a * (z - lse).exp() - g;
      } else if (cw) {
        z = (a * (z - lse).exp() - g * CArrMap(cw, cols)) * (1.0f - (z * inv_cap).square());
      } else {
        z = (a * (z - lse).exp() - g) * (1.0f - (z * inv_cap).square());
      }
      // Eigen's vectorised exp gives 2.9e-39, not 0, at -inf: a masked column's probability is
      // made exactly 0, as on CUDA (a select in the expression above would not vectorise).
      if (masked_bias_) {
        for (std::int64_t j = 0; j < cols; ++j)
          if (bias_value(v0 + j) == kMasked) z[j] = -g * (cw ? cw[j] : 1.0f);
      }
      if (has_y) z[y] -= b * chain_y;
    }
  }

  void grad_x(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1,
              bool first) override {
    if (!c_.grad_x.defined()) return;
    const std::int64_t rows = r1 - r0;
    // Destination: the fp32 dH accumulator, the caller's fp32 dH, or fp32 staging for bf16 or
    // for the sum over a vocabulary-parallel group.
    float* dst = vp_.dh                             ? vp_.dh
                 : dh_acc_                          ? dh_acc_ + r0 * h_
                 : c_.grad_x.dtype() == DType::kF32 ? c_.grad_x.data_as<float>() + r0 * h_
                                                    : dh32_;
    const bool into_caller = !vp_.dh && !dh_acc_ && c_.grad_x.dtype() == DType::kF32;
    dh_gemm(rows, v0, v1, dst, first && !(into_caller && c_.accumulate));
    if (vp_.dh) c_.vocab_group->all_reduce_sum(ctx_, vp_.dh, rows * h_);
    if (dst == dh32_ || dst == vp_.dh)
      store_f32(threads_, c_.grad_x, r0 * h_, rows * h_, dst, !first || c_.accumulate);
  }

  // Several ranges: one GEMM into fp32 rows side by side (bf16 dH's staging, or fp32 dH's when
  // the plan left it), then each range's rows stored into dH.
  void grad_x_ranges(const std::vector<RowRange>& ranges) override {
    const std::int64_t total = row_count(ranges);
    float* rows = c_.grad_x.defined() && c_.grad_x.dtype() == DType::kBF16 ? dh32_ : dh_pack_;
    if (ranges.size() < 2 || !rows || vp_.dh || dh_acc_ || total > dh_pack_rows_) {
      TokenBackend::grad_x_ranges(ranges);
      return;
    }
    select_tile(0);
    dh_gemm(total, 0, v_, rows, true);
    std::int64_t row = 0;
    for (const RowRange& r : ranges) {
      store_f32(threads_, c_.grad_x, r.r0 * h_, (r.r1 - r.r0) * h_, rows + row * h_, c_.accumulate);
      row += r.r1 - r.r0;
    }
  }

  void grad_w(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1,
              bool first) override {
    weight_grad(x_rows(r0, r1), r1 - r0, v0, v1, first, 1.0f);
  }

  // One GEMM over all the ranges' rows, their X rows gathered side by side (by logits_ranges,
  // or here), when they fit the staging: dW is read and written once instead of once per range.
  void grad_w_ranges(const std::vector<RowRange>& ranges, bool first) override {
    if (!c_.grad_w.defined() || !gather_x(ranges)) {
      TokenBackend::grad_w_ranges(ranges, first);
      return;
    }
    select_tile(0);
    weight_grad(x_pack_, row_count(ranges), 0, v_, first, 1.0f);
  }

  void grad_w_rescaled(std::int64_t r0, std::int64_t r1, bool first, float factor) override {
    weight_grad(x_rows(r0, r1), r1 - r0, 0, v_, first, factor);
  }

  void clear_grad_x() override { zero_gradient(dh_acc_, c_.rows * h_, c_.grad_x); }

  void clear_grad_w() override { zero_gradient(dw_acc_, v_ * h_, c_.grad_w); }

  void scale_grad_x_rows(std::int64_t r0, std::int64_t r1, float factor) override {
    if (dh_acc_) ArrMap(dh_acc_ + r0 * h_, (r1 - r0) * h_) *= factor;
  }

  void select_tile(std::int64_t row_offset) override { tile_ = tile_base_ + row_offset * v_; }

  std::int64_t gather_rows() const override { return x_pack_ ? x_pack_rows_ : 0; }

  void fetch_rows(std::int64_t r0, std::int64_t r1, float* loss, float* logit_sum) override {
    std::copy(rows_.loss + r0, rows_.loss + r1, loss);
    if (logit_sum) std::copy(rows_.zsum + r0, rows_.zsum + r1, logit_sum);
  }

  void set_coefficients(std::int64_t r0, std::int64_t r1, const float* c) override {
    std::copy(c, c + (r1 - r0), rows_.a + r0);
    std::copy(c, c + (r1 - r0), rows_.b + r0);
    std::fill(rows_.g + r0, rows_.g + r1, 0.0f);
  }

  void skip_rows(std::int64_t r0, std::int64_t r1) override {
    std::fill(rows_.loss + r0, rows_.loss + r1, 0.0f);
    std::fill(rows_.lse + r0, rows_.lse + r1, std::numeric_limits<float>::quiet_NaN());
    if (c_.grad_x.defined() && !c_.accumulate) {
      const std::int64_t row_bytes = h_ * static_cast<std::int64_t>(dtype_size(c_.grad_x.dtype()));
      std::fill_n(static_cast<unsigned char*>(c_.grad_x.data()) + r0 * row_bytes,
                  (r1 - r0) * row_bytes, 0);
    }
  }

  TokenTotals finish() override {
    if (c_.weight_grad_group) {  // the group's sums, before the one rounding
      if (dw_acc_) c_.weight_grad_group->all_reduce_sum(ctx_, dw_acc_, v_ * h_);
      if (db_acc_) c_.weight_grad_group->all_reduce_sum(ctx_, db_acc_, v_);
    }
    if (dw_acc_) store_f32(threads_, c_.grad_w, 0, v_ * h_, dw_acc_, c_.accumulate);
    if (dh_acc_) store_f32(threads_, c_.grad_x, 0, c_.rows * h_, dh_acc_, c_.accumulate);
    if (db_acc_) store_f32(threads_, c_.grad_bias, 0, v_, db_acc_, c_.accumulate);
    TokenTotals tot;
    tot.valid_rows = valid_;
    tot.weight_sum = denom_;
    for (std::int64_t t = 0; t < c_.rows; ++t) {
      const std::int64_t y = target(t);
      const bool valid = y != c_.ignore_index;
      if (valid) {
        tot.loss += rows_.loss[t];
        tot.z_loss += rows_.zloss[t];
        tot.correct += rows_.argmax[t] == y ? 1.0 : 0.0;
        tot.entropy += rows_.entropy[t];
      }
      if (c_.out_lse.defined()) c_.out_lse.data_as<float>()[t] = rows_.lse[t];
      if (c_.out_row_loss.defined()) c_.out_row_loss.data_as<float>()[t] = rows_.loss[t];
      if (c_.out_pred.defined())
        c_.out_pred.data_as<std::int32_t>()[t] = valid ? rows_.argmax[t] : -1;
    }
    if (c_.data_group) {
      double sums[4] = {tot.loss, tot.z_loss, tot.correct, tot.entropy};
      c_.data_group->all_reduce_sum(ctx_, sums, 4);
      tot.loss = sums[0];
      tot.z_loss = sums[1];
      tot.correct = sums[2];
      tot.entropy = sums[3];
    }
    if (c_.scale == RowScale::kMean) {
      tot.loss = denom_ > 0 ? tot.loss / denom_ : 0.0;
      tot.z_loss = denom_ > 0 ? tot.z_loss / denom_ : 0.0;
    }
    if (c_.out_scalars.defined()) {
      const double v = static_cast<double>(valid_);
      const double out[7] = {
          tot.loss, tot.z_loss, v > 0 ? tot.correct / v : 0.0, v > 0 ? tot.entropy / v : 0.0, v,
          denom_,   0.0};
      float* dst = c_.out_scalars.data_as<float>();
      for (int i = 0; i < 7; ++i) dst[i] = static_cast<float>(out[i]);
    }
    return tot;
  }

 private:
  // Row t's lse, entropy, argmax, logit sum, coefficients and loss from its statistics.
  void row_rule(std::int64_t t, const kern::RowStats& st) {
    const float lse = st.m + std::log(st.s);
    rows_.lse[t] = lse;
    rows_.entropy[t] = c_.entropy ? lse - st.sez / st.s : 0.0f;
    rows_.zsum[t] = c_.logit_sums ? st.sz : 0.0f;
    rows_.argmax[t] = st.arg;
    const std::int64_t y = target(t);
    float a = 0, b = 0, g = 0, loss = 0, zl = 0;
    if (y != c_.ignore_index) {
      const float cw_y = cw_ ? cw_[y] : 1.0f;
      const float sum_wz = cw_ ? st.swz : st.sz;
      const kern::RowTerms rt = kern::row_terms(c_.rule, lse, st.zy, cw_y, sum_wz);
      const float tw =
          c_.token_weights.defined() ? c_.token_weights.data_as<const float>()[t] : 1.0f;
      float coef = tw;
      if (c_.scale == RowScale::kMean) coef *= inv_denom_;
      if (c_.scale == RowScale::kUpstream && c_.upstream.defined())  // absent: forward only
        coef *= c_.upstream.data_as<const float>()[t];
      a = coef * rt.alpha;
      b = coef * rt.beta;
      g = coef * rt.gamma;
      loss = tw * (rt.ce + rt.zloss);
      zl = tw * rt.zloss;
    }
    rows_.a[t] = a;
    rows_.b[t] = b;
    rows_.g[t] = g;
    rows_.loss[t] = loss;
    rows_.zloss[t] = zl;
  }

  // dw[v0:v1] = factor ((first ? 0 : dw[v0:v1]) + tile^T x) over `rows` rows of the tile and of
  // fp32 X rows `x`; db[v0:v1] += colsum(tile).
  void weight_grad(const float* x, std::int64_t rows, std::int64_t v0, std::int64_t v1, bool first,
                   float factor) {
    const std::int64_t cols = v1 - v0;
    CMatMap gm(tile_, rows, cols);
    if (db_acc_) {  // column sums, a block of columns per thread
#pragma omp parallel for num_threads(threads_) schedule(static)
      for (std::int64_t j0 = 0; j0 < cols; j0 += kSumColumns) {
        const std::int64_t n = std::min(kSumColumns, cols - j0);
        Eigen::Map<Eigen::RowVectorXf>(db_acc_ + v0 + j0, n) +=
            gm.middleCols(j0, n).colwise().sum();
      }
    }
    if (!c_.grad_w.defined()) return;
    CMatMap xm(x, rows, h_);
    if (dw_acc_ || c_.grad_w.dtype() == DType::kF32) {
      float* base = dw_acc_ ? dw_acc_ : c_.grad_w.data_as<float>();
      MatMap d(base + v0 * h_, cols, h_);
      if (first && (dw_acc_ || !c_.accumulate))
        d.noalias() = gm.transpose() * xm;
      else
        d.noalias() += gm.transpose() * xm;
      if (factor != 1.0f) {
#pragma omp parallel for num_threads(threads_) schedule(static)
        for (std::int64_t j = 0; j < cols; ++j) d.row(j) *= factor;
      }
      return;
    }
    // bf16 dW without an fp32 accumulator: a tile of rows at a time through fp32 scratch.
    for (std::int64_t t0 = v0; t0 < v1; t0 += kWeightTile) {
      const std::int64_t t1 = std::min(v1, t0 + kWeightTile);
      MatMap d(dw_tile_, t1 - t0, h_);
      d.noalias() = gm.middleCols(t0 - v0, t1 - t0).transpose() * xm;
      store_f32(threads_, c_.grad_w, t0 * h_, (t1 - t0) * h_, dw_tile_, !first || c_.accumulate,
                factor);
    }
  }
  std::int64_t call_vocab() const override { return v_; }
  // dst [rows, H] (+)= tile w[v0:v1] over `rows` tile rows of v1 - v0 columns; `assign`
  // overwrites dst.
  void dh_gemm(std::int64_t rows, std::int64_t v0, std::int64_t v1, float* dst, bool assign) {
    const CMatMap gm(tile_, rows, v1 - v0);
    MatMap d(dst, rows, h_);
    for_weight_tiles(v0, v1, [&](std::int64_t t0, std::int64_t t1, const float* w) {
      if (assign)
        d.noalias() = gm.middleCols(t0 - v0, t1 - t0) * CMatMap(w, t1 - t0, h_);
      else
        d.noalias() += gm.middleCols(t0 - v0, t1 - t0) * CMatMap(w, t1 - t0, h_);
      assign = false;
    });
  }
  // Zeros the fp32 accumulator `acc` of n values when there is one, else the caller's `grad`
  // unless accumulating.
  void zero_gradient(float* acc, std::int64_t n, const TensorView& grad) {
    if (acc)
      std::fill_n(acc, n, 0.0f);
    else if (grad.defined() && !c_.accumulate)
      std::fill_n(static_cast<unsigned char*>(grad.data()), grad.nbytes(), 0);
  }
  // Whether x_pack_ holds the X rows of several `ranges` side by side, gathering them unless it
  // already does; false for fewer than two ranges, or when they do not fit.
  bool gather_x(const std::vector<RowRange>& ranges) {
    if (ranges.size() < 2 || !x_pack_ || row_count(ranges) > x_pack_rows_) return false;
    if (ranges == packed_) return true;
    std::int64_t row = 0;
    for (const RowRange& r : ranges) {
      to_f32(threads_, c_.x, r.r0 * h_, (r.r1 - r.r0) * h_, x_pack_ + row * h_);
      row += r.r1 - r.r0;
    }
    x32_r0_ = x32_r1_ = -1;  // x32_ (which x_pack_ may be) no longer holds one range's rows
    packed_ = ranges;
    return true;
  }
  std::int64_t target(std::int64_t t) const {
    return c_.targets.dtype() == DType::kI32 ? c_.targets.data_as<const std::int32_t>()[t]
                                             : c_.targets.data_as<const std::int64_t>()[t];
  }

  // Rows [r0, r1) of X as fp32, converted into staging when X is bf16.
  const float* x_rows(std::int64_t r0, std::int64_t r1) {
    if (!x32_) return c_.x.data_as<const float>() + r0 * h_;
    if (x32_r0_ != r0 || x32_r1_ != r1) {
      to_f32(threads_, c_.x, r0 * h_, (r1 - r0) * h_, x32_);
      x32_r0_ = r0;
      x32_r1_ = r1;
      if (x_pack_ == x32_) packed_.clear();
    }
    return x32_;
  }

  // Calls fn(t0, t1, w) for W rows [v0, v1) as fp32: one call for fp32 W, tiles for bf16.
  template <typename Fn>
  void for_weight_tiles(std::int64_t v0, std::int64_t v1, Fn&& fn) {
    if (!w_tile_) {
      fn(v0, v1, c_.w.data_as<const float>() + v0 * h_);
      return;
    }
    for (std::int64_t t0 = v0; t0 < v1; t0 += kWeightTile) {
      const std::int64_t t1 = std::min(v1, t0 + kWeightTile);
      to_f32(threads_, c_.w, t0 * h_, (t1 - t0) * h_, w_tile_);
      fn(t0, t1, w_tile_);
    }
  }

  const CpuContext& ctx_;
  int caller_threads_ = omp_get_max_threads();
  const TokenCall& c_;
  const Plan& plan_;
  int threads_;
  std::int64_t h_, v_;
  float *tile_ = nullptr, *tile_base_ = nullptr;
  RowArrays rows_;
  float *dw_acc_ = nullptr, *dh_acc_ = nullptr, *db_acc_ = nullptr;
  float *w_tile_ = nullptr, *x32_ = nullptr, *dw_tile_ = nullptr, *dh32_ = nullptr;
  float* x_pack_ = nullptr;   // the *_ranges steps' X rows (x32_ for bf16 X)
  float* dh_pack_ = nullptr;  // grad_x_ranges' rows for fp32 dH (bf16 dH: dh32_)
  std::int64_t x_pack_rows_ = 0, dh_pack_rows_ = 0;
  std::vector<RowRange> packed_;  // the ranges whose X rows x_pack_ holds
  std::int64_t x32_r0_ = -1, x32_r1_ = -1;
  const float* cw_ = nullptr;
  bool masked_bias_ = false;  // the bias masks a column
  std::int64_t valid_ = 0;
  double denom_ = 0;
  float inv_denom_ = 0;
  bool capped_ = false;
  VocabParallelStaging vp_;
};

}  // namespace

std::unique_ptr<TokenBackend> make_cpu_token_backend(Context& ctx, const TokenCall& call,
                                                     const Plan& plan, const Workspace& ws) {
  return std::make_unique<CpuTokenBackend>(static_cast<const CpuContext&>(ctx), call, plan, ws);
}

}  // namespace chunkloss::detail
