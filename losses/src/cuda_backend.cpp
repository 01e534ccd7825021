// The CUDA backend of the token engine: cuBLAS GEMMs (bf16 or fp32 operands, fp32 accumulation)
// and the kernels of kernels/, enqueued on the context's stream, the weight-gradient work on its
// side (beside the hidden-gradient GEMMs that read the same tile). No allocation and no host
// synchronisation until finish(), which copies the scalar results once; a call with check_finite
// also reads its value checks in begin(), before anything is written.
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "chunkloss/core/error.h"
#include "chunkloss/gpu/check.h"
#include "chunkloss/gpu/gemm.h"
#include "chunkloss/kernels/token_epilogue.h"
#include "engine.h"
#include "row_arrays.h"
#include "tile_staging.h"
#include "vocab_parallel.h"

namespace chunkloss::detail {
namespace {

static_assert(kern::kGemmScalarsOffset * sizeof(double) + kern::kNumGemmScalars * sizeof(float) <=
              kDeviceScalarBytes);

kern::Elem elem(DType t) { return t == DType::kF32 ? kern::Elem::kF32 : kern::Elem::kBF16; }

class CudaTokenBackend final : public TokenBackend {
 public:
  CudaTokenBackend(const gpu::Context& ctx, const TokenCall& call, const Plan& plan,
                   const Workspace& ws, bool check_finite)
      : ctx_(ctx), c_(call), plan_(plan), lane_(&ctx), check_finite_(check_finite) {
    tile_ = tile_base_ = ws.at<unsigned char>(plan.logits);
    // The plan may be shared with a forward-only call (a reference head): accumulators only
    // for the gradients this call computes.
    if (plan.dw_accum.bytes && call.grad_w.defined()) dw_acc_ = ws.at<float>(plan.dw_accum);
    if (plan.dh_accum.bytes && call.grad_x.defined()) dh_acc_ = ws.at<float>(plan.dh_accum);
    if (plan.db_accum.bytes && call.grad_bias.defined()) db_acc_ = ws.at<float>(plan.db_accum);
    carve_staging(plan.staging.bytes ? ws.at<unsigned char>(plan.staging) : nullptr,
                  plan.staging.bytes);
    scalars_ = ws.at<double>(plan.scalars);
    const RowArrays r = RowArrays::carve(ws.at<float>(plan.row_stats), call.rows);
    p_.rows = call.rows;
    p_.vocab = call.vocab;
    p_.vocab_offset = call.vocab_offset;
    p_.vocab_total = call.total_vocab();
    p_.targets = call.targets.data();
    p_.targets_i64 = call.targets.dtype() == DType::kI64;
    p_.ignore_index = call.ignore_index;
    p_.bias = call.bias.defined() ? call.bias.data() : nullptr;
    p_.bias_elem = elem(call.x.dtype());
    p_.class_weights =
        call.class_weights.defined() ? call.class_weights.data_as<const float>() : nullptr;
    p_.token_weights =
        call.token_weights.defined() ? call.token_weights.data_as<const float>() : nullptr;
    p_.upstream = call.upstream.defined() ? call.upstream.data_as<const float>() : nullptr;
    p_.rule = call.rule;
    p_.softcap = call.softcap;
    p_.entropy = call.entropy;
    p_.scale = call.scale == RowScale::kMean  ? kern::Scale::kMean
               : call.scale == RowScale::kSum ? kern::Scale::kSum
                                              : kern::Scale::kUpstream;
    p_.row = {r.lse, r.a, r.b, r.g, r.loss, r.zloss, r.entropy, r.zsum, r.scale, r.argmax};
    p_.logit_sums = call.logit_sums;
    p_.row_scales = call.row_scales;
    p_.scalars = scalars_;
    ctx.activate();
  }
  ~CudaTokenBackend() override {
    try {  // a call that threw: the stream still waits for the side's work
      settle();
    } catch (const Error&) {
    }
  }
  CudaTokenBackend(const CudaTokenBackend&) = delete;
  CudaTokenBackend& operator=(const CudaTokenBackend&) = delete;

  // The scalar block, once the stream has reached this point.
  std::array<double, kern::kNumScalars> read_scalars() const {
    std::array<double, kern::kNumScalars> s{};
    CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(s.data(), scalars_, sizeof s, cudaMemcpyDeviceToHost,
                                        static_cast<cudaStream_t>(stream())));
    CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream())));
    return s;
  }

  // Throws for the invalid inputs the device counted in `s`: before anything was written, or at
  // the end (`ran`), when the call has added nothing to the gradients (kern::refused_call).
  void check_counts(const std::array<double, kern::kNumScalars>& s, bool ran) const {
    const std::string over_vocab = c_.vocab_group && check_finite_
                                       ? ", summed over the ranks of vocab_shard.group (each "
                                         "counts the inputs they share)"
                                       : "";
    const std::string over_group = c_.data_group ? ", counted over the ranks of data_group" : "";
    const std::string tail = ran ? "; checked on the device as the call ran, which added nothing "
                                   "to accumulated gradients (overwritten ones hold zeros) and "
                                   "wrote no per-row output"
                                 : "; checked on the device before anything was written";
    const std::string state = over_vocab + over_group + tail;
    CHUNKLOSS_CHECK(s[kern::kBadTargets] == 0, c_.who, ": targets ", c_.targets.str(), " has ",
                    s[kern::kBadTargets], " values outside [0, V=", c_.total_vocab(),
                    ") that are not ignore_index (", c_.ignore_index, ")", state);
    CHUNKLOSS_CHECK(s[kern::kBadClassWeights] == 0, c_.who, ": class_weights ",
                    c_.class_weights.str(), " has ", s[kern::kBadClassWeights],
                    " values that are negative or not finite", state);
    if (s[kern::kNonFinite] == 0) return;
    // Which of this rank's inputs hold them: counted again, one input at a time (error path).
    std::string where;
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"hidden", &c_.x},
                                  {"weight", &c_.w},
                                  {"bias", &c_.bias},
                                  {"token_weights", &c_.token_weights},
                                  {"grad_output", &c_.upstream}}) {
      if (!t->defined()) continue;
      if (const std::uint64_t n = cuda_count_nonfinite(ctx_, *t, scalars_))
        where += (where.empty() ? "" : ", ") + std::string(name) + " " + t->str() + " has " +
                 std::to_string(n);
    }
    CHUNKLOSS_FAIL(c_.who, ": check_finite found ", s[kern::kNonFinite],
                   " non-finite values in hidden/weight/bias/token_weights/grad_output", over_vocab,
                   over_group, " (", where.empty() ? "none on this rank" : where, ")", tail);
  }

  void begin() override {
    CHUNKLOSS_LAUNCH_CHECK(kern::launch_token_begin(p_, stream()));
    if (check_finite_) {
      for (const TensorView* t : {&c_.x, &c_.w, &c_.bias, &c_.token_weights, &c_.upstream})
        if (t->defined())
          CHUNKLOSS_LAUNCH_CHECK(kern::launch_count_nonfinite(t->data(), elem(t->dtype()),
                                                              t->numel(), scalars_, stream()));
      CHUNKLOSS_LAUNCH_CHECK(kern::launch_nonfinite_as_double(scalars_, stream()));
    }
    // The valid rows, the divisor and the invalid inputs over the group, so that every rank
    // refuses the call when one rank's inputs are bad (kInvDenom, summed too, is set again).
    if (c_.data_group) {
      static_assert(kern::kWeightSum == kern::kValidRows + 1 &&
                    kern::kBadClassWeights == kern::kValidRows + 2 &&
                    kern::kInvDenom == kern::kValidRows + 3 &&
                    kern::kBadTargets == kern::kValidRows + 4 &&
                    kern::kNonFinite == kern::kValidRows + 5);
      c_.data_group->all_reduce_sum(ctx_, scalars_ + kern::kValidRows, 6);
      CHUNKLOSS_LAUNCH_CHECK(kern::launch_set_divisor(p_, stream()));
    }
    // Over a vocabulary split each rank counts its own weight and bias shard too, and the ranks
    // of a split that breaks the rule of equal targets and class weights would count those
    // differently: with check_finite, whose counts every rank reads below, they are summed so
    // that every rank throws there, not one while the others wait for it in a collective (the
    // ranks agreed on check_finite: LinearCrossEntropy's vocabulary kind; the sequence losses
    // check on the host, never here). kInvDenom, summed too, is set again.
    if (c_.vocab_group && check_finite_) {
      c_.vocab_group->all_reduce_sum(ctx_, scalars_ + kern::kBadClassWeights, 4);
      CHUNKLOSS_LAUNCH_CHECK(kern::launch_set_divisor(p_, stream()));
    }
    // The caller asked for checks: they are read here, before anything is written, at the cost
    // of one wait for the stream (NaN in an input would reach the gradients through the GEMMs
    // whatever the coefficients). With groups the counts are the groups' by now, and the ranks
    // agreed on check_finite, so every rank throws here.
    if (check_finite_) check_counts(read_scalars(), false);
    if (db_acc_) CHUNKLOSS_LAUNCH_CHECK(kern::launch_zero(db_acc_, c_.vocab, stream()));
  }

  void logits(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1) override {
    settle();
    gpu::gemm(ctx_, x_rows(r0, r1), false, w_rows(v0, v1), true, tile_, plan_.logits_dtype, v1 - v0,
              0.0f);
  }

  // With the vocabulary split: each row's statistics of this rank's columns, all-gathered and
  // merged in rank order, then the row rule (equal on every rank).
  void row_stats(std::int64_t r0, std::int64_t r1) override {
    settle();
    kern::TokenParams p = p_;
    p.partials = vp_.own;
    CHUNKLOSS_LAUNCH_CHECK(kern::launch_row_stats(p, tile_, elem(plan_.logits_dtype), c_.vocab, r0,
                                                  r1 - r0, stream()));
    if (!vp_.own) return;
    const std::int64_t rows = r1 - r0;
    c_.vocab_group->all_gather(ctx_, vp_.own, vp_.all,
                               static_cast<std::size_t>(rows) * sizeof(kern::RowStats));
    CHUNKLOSS_LAUNCH_CHECK(
        kern::launch_merge_row_stats(p_, vp_.all, c_.vocab_group->size(), r0, rows, stream()));
  }

  // The bias gradient is summed from the fp32 logits first, then the tile becomes the gradient.
  void grad_epilogue(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1) override {
    settle();
    if (db_acc_)
      CHUNKLOSS_LAUNCH_CHECK(kern::launch_bias_grad(p_, tile_, elem(plan_.logits_dtype), v1 - v0,
                                                    r0, r1 - r0, v0, v1 - v0, db_acc_ + v0,
                                                    stream()));
    CHUNKLOSS_LAUNCH_CHECK(kern::launch_grad_epilogue(p_, tile_, elem(plan_.logits_dtype),
                                                      elem(c_.x.dtype()), v1 - v0, r0, r1 - r0, v0,
                                                      v1 - v0, stream()));
  }

  void grad_x(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1,
              bool first) override {
    if (!c_.grad_x.defined()) return;
    fork();
    const std::int64_t h = c_.hidden;
    auto* dst =
        static_cast<unsigned char*>(c_.grad_x.data()) + r0 * h * dtype_size(c_.grad_x.dtype());
    if (vp_.dh) {  // fp32 rows summed over the group, then scaled (row scales) and rounded once
      grad_gemm(grad_tile(r0, r1, v0, v1), false, w_rows(v0, v1), vp_.dh, DType::kF32, h,
                uniform_alpha(), 0.0f);
      c_.vocab_group->all_reduce_sum(ctx_, vp_.dh, (r1 - r0) * h);
      const float* scale = c_.row_scales ? p_.row.scale + r0 : gemm_scalar(kern::kOne);
      CHUNKLOSS_LAUNCH_CHECK(kern::launch_scale_rows(
          dst, elem(c_.grad_x.dtype()), h, vp_.dh, kern::Elem::kF32, h, scale, r1 - r0, h,
          !first || c_.accumulate, stream(), c_.row_scales ? 1 : 0));
      return;
    }
    if (dh_acc_) {
      grad_gemm(grad_tile(r0, r1, v0, v1), false, w_rows(v0, v1), dh_acc_ + r0 * h, DType::kF32, h,
                uniform_alpha(), first ? 0.0f : 1.0f);
      return;
    }
    // fp32 rows, scaled, rounded once into dH: by each row's scale (row scales), or by the
    // mean's device alpha (host_dx_); in the tile's free halves (one fp32 row apart) or staging.
    if (host_dx_ || dh_stage_ || in_tile_) {
      float* st = dh_stage_ ? dh_stage_ : reinterpret_cast<float*>(tile_ + free_offset_);
      const std::int64_t ld = dh_stage_ ? h : c_.vocab;
      grad_gemm(grad_tile(r0, r1, v0, v1), false, w_rows(v0, v1), st, DType::kF32, ld,
                host_dx_ ? 1.0f : uniform_alpha(), 0.0f);
      const float* scale = host_dx_ ? gemm_scalar(kern::kAlpha) : p_.row.scale + r0;
      CHUNKLOSS_LAUNCH_CHECK(
          kern::launch_scale_rows(dst, elem(c_.grad_x.dtype()), h, st, kern::Elem::kF32, ld, scale,
                                  r1 - r0, h, !first || c_.accumulate, stream(), host_dx_ ? 0 : 1));
      return;
    }
    grad_gemm(grad_tile(r0, r1, v0, v1), false, w_rows(v0, v1), dst, c_.grad_x.dtype(), h,
              uniform_alpha(), first && !c_.accumulate ? 0.0f : 1.0f);
  }

  void grad_w(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1,
              bool first) override {
    const OnSide side(*this);
    weight_grad(r0, r1, v0, v1, first, std::nullopt, shared_mantissa());
  }

  void grad_w_rescaled(std::int64_t r0, std::int64_t r1, bool first, float factor) override {
    const OnSide side(*this);
    weight_grad(r0, r1, 0, c_.vocab, first, factor, shared_mantissa());
  }

  void clear_grad_x() override {
    zero_gradient(dh_acc_, c_.rows * c_.hidden, c_.grad_x);
    if (c_.row_scales)
      CHUNKLOSS_GPU_CHECK(cudaMemsetAsync(p_.row.scale, 0,
                                          static_cast<std::size_t>(c_.rows) * sizeof(float),
                                          static_cast<cudaStream_t>(stream())));
  }

  void clear_grad_w() override { zero_gradient(dw_acc_, c_.vocab * c_.hidden, c_.grad_w); }

  // In place, the rows as one contiguous run scaled by the device factor.
  void scale_grad_x_rows(std::int64_t r0, std::int64_t r1, float factor) override {
    settle();
    if (!dh_acc_) return;
    float* rows = dh_acc_ + r0 * c_.hidden;
    const std::int64_t n = (r1 - r0) * c_.hidden;
    CHUNKLOSS_LAUNCH_CHECK(
        kern::launch_scale_rows(rows, kern::Elem::kF32, n, rows, kern::Elem::kF32, n,
                                set_scalar(kern::kFactor, factor), 1, n, false, stream()));
  }

  // Several ranges (a packed chunk's pieces): their X rows copied side by side into staging
  // (gather_x), one GEMM; each GEMM reads all of W, which short ranges would pay once each.
  void logits_ranges(const std::vector<RowRange>& ranges) override {
    settle();
    if (!gather_x(ranges)) {
      TokenBackend::logits_ranges(ranges);
      return;
    }
    select_tile(0);
    gpu::gemm(ctx_, {x_stage_, c_.x.dtype(), row_count(ranges), c_.hidden, c_.hidden}, false,
              w_rows(0, c_.vocab), true, tile_, plan_.logits_dtype, c_.vocab, 0.0f);
  }

  // Several ranges: one dH GEMM over their gradient tiles into fp32 rows, in the tiles' free
  // halves (tile_staging.h) or in staging (the dH staging with row scales, else the packed
  // chunk's); then each range's rows scaled (by each row's scale, else the mean's device alpha
  // or 1) and rounded once into dH; else grad_x per range.
  void grad_x_ranges(const std::vector<RowRange>& ranges) override {
    const bool in_free_halves =
        c_.row_scales ? in_tile_
                      : staging_fits_tile(c_.vocab, c_.hidden, plan_.logits_dtype, c_.x.dtype());
    float* staged = c_.row_scales ? dh_stage_ : dh_pack_;
    if (ranges.size() < 2 || !c_.grad_x.defined() || vp_.dh || dh_acc_ ||
        !(in_free_halves || staged)) {
      TokenBackend::grad_x_ranges(ranges);
      return;
    }
    fork();
    select_tile(0);
    const std::int64_t h = c_.hidden, v = c_.vocab, ld = in_free_halves ? v : h;
    float* rows = in_free_halves ? reinterpret_cast<float*>(tile_ + free_offset_) : staged;
    grad_gemm(grad_tile(0, row_count(ranges), 0, v), false, w_rows(0, v), rows, DType::kF32, ld,
              host_dx_ ? 1.0f : uniform_alpha(), 0.0f);
    const std::size_t row_bytes = static_cast<std::size_t>(h) * dtype_size(c_.grad_x.dtype());
    std::int64_t row = 0;
    for (const RowRange& r : ranges) {
      const float* scale =
          c_.row_scales ? p_.row.scale + r.r0 : gemm_scalar(host_dx_ ? kern::kAlpha : kern::kOne);
      CHUNKLOSS_LAUNCH_CHECK(kern::launch_scale_rows(
          static_cast<unsigned char*>(c_.grad_x.data()) + r.r0 * row_bytes, elem(c_.grad_x.dtype()),
          h, rows + row * ld, kern::Elem::kF32, ld, scale, r.r1 - r.r0, h, c_.accumulate, stream(),
          c_.row_scales ? 1 : 0));
      row += r.r1 - r.r0;
    }
  }

  // Several ranges (a resident group's or a packed chunk's sequences, their tiles one after
  // another): their X rows are copied side by side into staging (scaled, with row scales of
  // several mantissas) so dW gets one GEMM over all their rows, which reads and writes dW once
  // instead of once per range. With row scales, runs of ranges sharing a mantissa get one GEMM
  // each with the mantissa as alpha instead, when every run is long enough (mantissa_runs).
  void grad_w_ranges(const std::vector<RowRange>& ranges, bool first) override {
    const OnSide side(*this);
    std::vector<Run> runs = mantissa_runs(ranges);
    if (runs.empty()) runs.push_back({0, ranges.size(), 0, shared_mantissa()});
    for (const Run& run : runs) {
      staged_weight_grad(ranges, run, first);
      first = false;
    }
  }

  std::int64_t gather_rows() const override { return x_stage_ ? x_stage_rows_ : 0; }

  void select_tile(std::int64_t row_offset) override {
    tile_ = tile_base_ + row_offset * c_.vocab * dtype_size(plan_.logits_dtype);
  }

  void fetch_rows(std::int64_t r0, std::int64_t r1, float* loss, float* logit_sum) override {
    settle();
    const auto s = static_cast<cudaStream_t>(stream());
    const std::size_t bytes = static_cast<std::size_t>(r1 - r0) * sizeof(float);
    CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(loss, p_.row.loss + r0, bytes, cudaMemcpyDeviceToHost, s));
    if (logit_sum)
      CHUNKLOSS_GPU_CHECK(
          cudaMemcpyAsync(logit_sum, p_.row.zsum + r0, bytes, cudaMemcpyDeviceToHost, s));
    CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(s));
  }

  // Pageable host memory: each copy returns once its source is staged, so the host vectors
  // may be reused at once. The stats epilogue left g = 0 (no smoothing under the plain rule).
  // With row scales c = +-2^e * m: the tile gets the signed power of two exactly, the mantissa
  // m in [0.5, 1) scales the dH rows, and the dW GEMM's alpha when every row since the last dW
  // GEMM shares it (as a pair of an antisymmetric sum objective does), else the X rows.
  void set_coefficients(std::int64_t r0, std::int64_t r1, const float* c) override {
    settle();
    const auto s = static_cast<cudaStream_t>(stream());
    const std::size_t bytes = static_cast<std::size_t>(r1 - r0) * sizeof(float);
    const float* ab = c;
    if (c_.row_scales) {
      if (coef_consumed_) {
        set_ranges_.clear();
        coef_consumed_ = false;
      }
      float range_mantissa = 0.0f;  // the rows' shared mantissa; -1: several
      pow2_.resize(static_cast<std::size_t>(r1 - r0));
      mant_.resize(pow2_.size());
      for (std::size_t i = 0; i < pow2_.size(); ++i) {
        int e = 0;
        mant_[i] = std::abs(std::frexp(c[i], &e));
        pow2_[i] = c[i] == 0.0f ? 0.0f : std::copysign(std::ldexp(1.0f, e), c[i]);
        if (c[i] == 0.0f) continue;
        if (range_mantissa == 0.0f) range_mantissa = mant_[i];
        if (mant_[i] != range_mantissa) range_mantissa = -1.0f;
      }
      set_ranges_.push_back({{r0, r1}, range_mantissa});
      ab = pow2_.data();
      CHUNKLOSS_GPU_CHECK(
          cudaMemcpyAsync(p_.row.scale + r0, mant_.data(), bytes, cudaMemcpyHostToDevice, s));
    }
    CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(p_.row.a + r0, ab, bytes, cudaMemcpyHostToDevice, s));
    CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(p_.row.b + r0, ab, bytes, cudaMemcpyHostToDevice, s));
  }

  void skip_rows(std::int64_t r0, std::int64_t r1) override {
    settle();
    const auto s = static_cast<cudaStream_t>(stream());
    const std::size_t n = static_cast<std::size_t>(r1 - r0);
    CHUNKLOSS_GPU_CHECK(cudaMemsetAsync(p_.row.loss + r0, 0, n * sizeof(float), s));
    CHUNKLOSS_GPU_CHECK(cudaMemsetAsync(p_.row.lse + r0, 0xFF, n * sizeof(float), s));  // NaN
    if (c_.grad_x.defined() && !c_.accumulate) {
      const std::size_t row_bytes =
          static_cast<std::size_t>(c_.hidden) * dtype_size(c_.grad_x.dtype());
      CHUNKLOSS_GPU_CHECK(cudaMemsetAsync(
          static_cast<unsigned char*>(c_.grad_x.data()) + static_cast<std::size_t>(r0) * row_bytes,
          0, n * row_bytes, s));
    }
  }

  TokenTotals finish() override {
    settle();
    if (c_.weight_grad_group) {  // the group's sums, before the one rounding
      if (dw_acc_) c_.weight_grad_group->all_reduce_sum(ctx_, dw_acc_, c_.vocab * c_.hidden);
      if (db_acc_) c_.weight_grad_group->all_reduce_sum(ctx_, db_acc_, c_.vocab);
    }
    if (dw_acc_) flush(c_.grad_w, dw_acc_);
    if (dh_acc_ && c_.row_scales)
      CHUNKLOSS_LAUNCH_CHECK(kern::launch_scale_rows(
          c_.grad_x.data(), elem(c_.grad_x.dtype()), c_.hidden, dh_acc_, kern::Elem::kF32,
          c_.hidden, p_.row.scale, c_.rows, c_.hidden, c_.accumulate, stream()));
    else if (dh_acc_)
      flush(c_.grad_x, dh_acc_);
    if (db_acc_) flush(c_.grad_bias, db_acc_);
    CHUNKLOSS_LAUNCH_CHECK(kern::launch_token_finish(
        p_, c_.out_row_loss.defined() ? c_.out_row_loss.data_as<float>() : nullptr,
        c_.out_lse.defined() ? c_.out_lse.data_as<float>() : nullptr,
        c_.out_pred.defined() ? c_.out_pred.data_as<std::int32_t>() : nullptr,
        c_.data_group != nullptr, stream()));
    if (c_.data_group) {
      c_.data_group->all_reduce_sum(ctx_, scalars_ + kern::kLoss, 4);
      CHUNKLOSS_LAUNCH_CHECK(kern::launch_scale_totals(p_, stream()));
    }
    if (c_.out_scalars.defined())
      CHUNKLOSS_LAUNCH_CHECK(
          kern::launch_export_scalars(scalars_, c_.out_scalars.data_as<float>(), stream()));
    if (!c_.copy_results) return {};
    const std::array<double, kern::kNumScalars> s = read_scalars();
    check_counts(s, true);
    TokenTotals t;
    t.loss = s[kern::kLoss];
    t.z_loss = s[kern::kZLoss];
    t.valid_rows = static_cast<std::int64_t>(s[kern::kValidRows]);
    t.weight_sum = s[kern::kWeightSum];
    t.correct = s[kern::kAccuracy] * static_cast<double>(t.valid_rows);
    t.entropy = s[kern::kEntropy] * static_cast<double>(t.valid_rows);
    return t;
  }

 private:
  std::int64_t call_vocab() const override { return c_.vocab; }
  // dw[v0:v1] = f tile^T x[r0:r1] + (first ? 0 : f dw[v0:v1]) with f = factor (1 without);
  // with row scales the mantissas go into alpha when the rows share one, else into scaled
  // copies of the X rows.
  void weight_grad(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1, bool first,
                   std::optional<float> factor, float mantissa) {
    if (!c_.grad_w.defined()) return;
    coef_consumed_ = true;
    const gpu::Matrix g = grad_tile(r0, r1, v0, v1);
    gpu::Matrix x = x_rows(r0, r1);
    const float keep = factor.value_or(1.0f);
    std::optional<float> alpha = factor ? factor : uniform_alpha();
    if (mantissa != 0.0f) {
      alpha = mantissa * keep;
    } else if (in_tile_) {  // the chunk's X rows scaled in the tile
      x = scaled_x_in_tile(tile_, r1 - r0);
      scale_x_rows(const_cast<void*>(x.data), x.ld, r0, r1);
    } else if (x_scaled_) {  // the same in staging; in vocab-block order once for all rows
      const bool vocab_order = plan_.order == LoopOrder::kVocabBlock;
      if (!vocab_order || !x_scaled_ready_)
        scale_x_rows(x_scaled_, c_.hidden, vocab_order ? 0 : r0, vocab_order ? c_.rows : r1);
      x_scaled_ready_ = vocab_order;
      x.data = x_scaled_ + (vocab_order ? r0 * x_row_bytes() : 0);
    }
    dw_gemm(g, x, v0, r1, first, alpha, keep);
  }
  // dw[v0:] = alpha g^T x + (first ? 0 : keep dw[v0:]) in the fp32 accumulator or the caller's
  // dW (kept when accumulating), where g's rows end at row `r1`; with host_dw_, alpha 1 until
  // the last chunk (ending at chunks_end_), which scales the sum by the mean's alpha.
  void dw_gemm(const gpu::Matrix& g, const gpu::Matrix& x, std::int64_t v0, std::int64_t r1,
               bool first, std::optional<float> alpha, float keep) {
    const std::int64_t h = c_.hidden;
    if (dw_acc_) {
      grad_gemm(g, true, x, dw_acc_ + v0 * h, DType::kF32, h, alpha, first ? 0.0f : keep);
      return;
    }
    auto* dst =
        static_cast<unsigned char*>(c_.grad_w.data()) + v0 * h * dtype_size(c_.grad_w.dtype());
    if (host_dw_ && r1 < chunks_end_) {  // alpha deferred to the last chunk (see host_dw_)
      gpu::gemm(*lane_, g, true, x, false, dst, c_.grad_w.dtype(), h, first ? 0.0f : 1.0f);
      return;
    }
    if (host_dw_) {  // the last chunk: dw = alpha (dw + tile^T x)
      const float* mean_alpha = gemm_scalar(kern::kAlpha);
      gpu::gemm_device_scalars(*lane_, g, true, x, false, dst, c_.grad_w.dtype(), h, mean_alpha,
                               mean_alpha);
      return;
    }
    grad_gemm(g, true, x, dst, c_.grad_w.dtype(), h, alpha, first && !c_.accumulate ? 0.0f : keep);
  }
  // The coefficient mantissa every row set since the last dW GEMM shares (0: none, or several).
  float shared_mantissa() const {
    float m = 0.0f;
    for (const auto& [range, rm] : set_ranges_) {
      if (rm == 0.0f) continue;
      if (rm < 0.0f || (m != 0.0f && rm != m)) return 0.0f;
      m = rm;
    }
    return c_.row_scales ? m : 0.0f;
  }
  // Ranges [i0, i1) of a grad_w_ranges call, their tiles from `offset` rows into the logits
  // slice, with the coefficient mantissa their rows share (0: several).
  struct Run {
    std::size_t i0, i1;
    std::int64_t offset;
    float mantissa;
  };
  // When the rows set since the last dW GEMM have several mantissas but each of `ranges` (set
  // by one call each) has one: the maximal runs of consecutive ranges sharing a mantissa, if
  // each has at least kRunRows rows (a dW GEMM long enough to pay its rewrite of dW); else none.
  std::vector<Run> mantissa_runs(const std::vector<RowRange>& ranges) const {
    constexpr std::int64_t kRunRows = 512;
    if (!c_.row_scales || shared_mantissa() != 0.0f || ranges.size() < 2) return {};
    std::vector<Run> runs;
    std::int64_t offset = 0, rows = 0;
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const RowRange& r = ranges[i];
      const auto it = std::find_if(set_ranges_.begin(), set_ranges_.end(),
                                   [&](const auto& s) { return s.first == r; });
      if (it == set_ranges_.end() || it->second <= 0.0f) return {};
      if (!runs.empty() && runs.back().mantissa == it->second) {
        runs.back().i1 = i + 1;
      } else {
        if (!runs.empty() && rows < kRunRows) return {};
        runs.push_back({i, i + 1, offset, it->second});
        rows = 0;
      }
      rows += r.r1 - r.r0;
      offset += r.r1 - r.r0;
    }
    return rows < kRunRows ? std::vector<Run>{} : runs;
  }
  // dW (+)= the run's tiles^T times its X rows: one GEMM over X rows staged side by side (copied
  // with alpha = the shared mantissa, or scaled by each row's), or without staging one GEMM per
  // range.
  void staged_weight_grad(const std::vector<RowRange>& ranges, const Run& run, bool first) {
    const std::size_t n = run.i1 - run.i0;
    const bool scale = c_.row_scales && run.mantissa == 0.0f;
    const std::vector<RowRange> mine(ranges.begin() + static_cast<std::ptrdiff_t>(run.i0),
                                     ranges.begin() + static_cast<std::ptrdiff_t>(run.i1));
    const std::int64_t total = row_count(mine), h = c_.hidden;
    select_tile(run.offset);
    if (!scale && c_.grad_w.defined() && gather_x(mine)) {  // (maybe gathered by logits_ranges)
      coef_consumed_ = true;
      dw_gemm(grad_tile(0, total, 0, c_.vocab), {x_stage_, c_.x.dtype(), total, h, h}, 0,
              mine.back().r1, first,
              run.mantissa != 0.0f ? std::optional<float>(run.mantissa) : uniform_alpha(), 1.0f);
      return;
    }
    gpu::Matrix x{n == 1 && scale ? x_scaled_ : x_stage_, c_.x.dtype(), total, h, h};
    if (in_tile_) x = scaled_x_in_tile(tile_, total);
    auto* stage = static_cast<unsigned char*>(const_cast<void*>(x.data));
    if ((n == 1 && !scale) || !stage || !c_.grad_w.defined()) {
      std::int64_t offset = run.offset;
      for (std::size_t i = run.i0; i < run.i1; ++i) {
        select_tile(offset);
        weight_grad(ranges[i].r0, ranges[i].r1, 0, c_.vocab, first && i == run.i0, std::nullopt,
                    run.mantissa);
        offset += ranges[i].r1 - ranges[i].r0;
      }
      return;
    }
    CHUNKLOSS_CHECK(in_tile_ || x.data != x_stage_ || total <= x_stage_rows_,
                    "CUDA backend: ", total, " X rows to stage, room for ", x_stage_rows_,
                    " (internal error)");
    const std::size_t elt = dtype_size(c_.x.dtype());
    const auto s = static_cast<cudaStream_t>(stream());
    packed_.clear();  // (x_stage_ may be overwritten below)
    std::int64_t rows = 0;
    for (std::size_t i = run.i0; i < run.i1; ++i) {
      const RowRange& r = ranges[i];
      unsigned char* dst = stage + static_cast<std::size_t>(rows * x.ld) * elt;
      if (scale)
        scale_x_rows(dst, x.ld, r.r0, r.r1);
      else
        CHUNKLOSS_GPU_CHECK(cudaMemcpy2DAsync(
            dst, static_cast<std::size_t>(x.ld) * elt,
            static_cast<const unsigned char*>(c_.x.data()) + r.r0 * x_row_bytes(), x_row_bytes(),
            x_row_bytes(), static_cast<std::size_t>(r.r1 - r.r0), cudaMemcpyDeviceToDevice, s));
      rows += r.r1 - r.r0;
    }
    coef_consumed_ = true;
    dw_gemm(grad_tile(0, rows, 0, c_.vocab), x, 0, ranges[run.i1 - 1].r1, first,
            run.mantissa != 0.0f ? std::optional<float>(run.mantissa) : uniform_alpha(), 1.0f);
  }
  // Whether x_stage_ holds the X rows of several `ranges` side by side (unscaled), copying them
  // there unless it already does; false for fewer than two ranges or when they do not fit. (With
  // row scales, staged_weight_grad may overwrite them with scaled rows, and then forgets them.)
  bool gather_x(const std::vector<RowRange>& ranges) {
    if (ranges.size() < 2 || !x_stage_ || row_count(ranges) > x_stage_rows_) return false;
    if (ranges == packed_) return true;
    std::int64_t row = 0;
    for (const RowRange& r : ranges) {
      CHUNKLOSS_GPU_CHECK(
          cudaMemcpyAsync(x_stage_ + static_cast<std::size_t>(row) * x_row_bytes(),
                          static_cast<const unsigned char*>(c_.x.data()) + r.r0 * x_row_bytes(),
                          static_cast<std::size_t>(r.r1 - r.r0) * x_row_bytes(),
                          cudaMemcpyDeviceToDevice, static_cast<cudaStream_t>(stream())));
      row += r.r1 - r.r0;
    }
    packed_ = ranges;
    return true;
  }
  std::size_t x_row_bytes() const {
    return static_cast<std::size_t>(c_.hidden) * dtype_size(c_.x.dtype());
  }
  // The staging slice (see plan.cpp's staging_per_row): with row scales, fp32 dH rows for one
  // chunk (token-chunk order) and scaled X rows (one chunk, or all rows in vocab-block order);
  // without, a packed chunk's fp32 dH rows where the tile has no free halves for them; the
  // rest, if any, holds the X rows of a resident group or a packed chunk side by side.
  void carve_staging(unsigned char* s, std::size_t bytes) {
    unsigned char* end = s + bytes;
    if (c_.vocab_group)
      vp_ = carve_vocab_parallel(s, plan_.chunk_rows, c_.hidden, c_.vocab_group->size(),
                                 c_.grad_x.defined());
    const bool vocab_order = plan_.order == LoopOrder::kVocabBlock;
    in_tile_ = c_.row_scales && !vocab_order &&
               stages_in_tile(c_.vocab, c_.hidden, plan_.logits_dtype, c_.x.dtype(),
                              c_.vocab_group ? c_.vocab_group->size() : 1);
    free_offset_ = tile_free_offset(c_.vocab);
    // The mean's alpha lives on the device; the other reductions' is 1 (uniform_alpha).
    const bool token_plain = !c_.row_scales && !vocab_order && c_.scale == RowScale::kMean;
    host_dx_ = token_plain && c_.grad_x.defined() && !dh_acc_ && !vp_.dh &&
               staging_fits_tile(c_.vocab, c_.hidden, plan_.logits_dtype, c_.x.dtype());
    host_dw_ = token_plain && c_.chunks_in_order && c_.grad_w.defined() && !dw_acc_ &&
               !c_.accumulate && token_chunks(c_, plan_).size() > 1;
    const std::vector<RowRange> computed = computed_rows(c_);
    chunks_end_ = computed.empty() ? 0 : computed.back().r1;
    if (s && c_.row_scales && !in_tile_) {
      const std::int64_t rows = vocab_order ? c_.rows : plan_.chunk_rows;
      if (!vocab_order && c_.grad_x.defined()) {
        dh_stage_ = reinterpret_cast<float*>(s);
        s += static_cast<std::size_t>(rows * c_.hidden) * 4;
      }
      if (c_.grad_w.defined()) {
        x_scaled_ = s;
        s += static_cast<std::size_t>(rows) * x_row_bytes();
      }
    }
    if (s && !c_.row_scales && plan_.packed_pieces && c_.grad_x.defined() &&
        packed_dh_in_staging(c_.vocab, c_.hidden, plan_.logits_dtype, c_.x.dtype(),
                             c_.vocab_group ? c_.vocab_group->size() : 1)) {
      dh_pack_ = reinterpret_cast<float*>(s);
      s += static_cast<std::size_t>(plan_.chunk_rows * c_.hidden) * 4;
    }
    CHUNKLOSS_CHECK(!s || s <= end, "CUDA backend: the plan's staging (", bytes,
                    " bytes) is smaller than this call's (internal error)");
    if (s && s < end) {
      x_stage_ = s;
      x_stage_rows_ = static_cast<std::int64_t>(static_cast<std::size_t>(end - s) / x_row_bytes());
    }
  }
  // dst rows (leading dimension dst_ld) = scale * X rows [r0, r1), in X's dtype.
  void scale_x_rows(void* dst, std::int64_t dst_ld, std::int64_t r0, std::int64_t r1) {
    const kern::Elem e = elem(c_.x.dtype());
    CHUNKLOSS_LAUNCH_CHECK(kern::launch_scale_rows(
        dst, e, dst_ld, static_cast<const unsigned char*>(c_.x.data()) + r0 * x_row_bytes(), e,
        c_.hidden, p_.row.scale + r0, r1 - r0, c_.hidden, false, stream()));
  }
  // The scaled X rows kept in the free halves of `rows` fp32 tile rows from `tile`, after the
  // fp32 dH rows (tile_staging.h).
  gpu::Matrix scaled_x_in_tile(unsigned char* tile, std::int64_t rows) const {
    return {tile + free_offset_ + static_cast<std::size_t>(c_.hidden) * 4, c_.x.dtype(), rows,
            c_.hidden, 2 * c_.vocab};
  }
  gpu::Matrix x_rows(std::int64_t r0, std::int64_t r1) const {
    const std::int64_t h = c_.hidden;
    return {static_cast<const unsigned char*>(c_.x.data()) + r0 * h * dtype_size(c_.x.dtype()),
            c_.x.dtype(), r1 - r0, h, h};
  }
  gpu::Matrix w_rows(std::int64_t v0, std::int64_t v1) const {
    const std::int64_t h = c_.hidden;
    return {static_cast<const unsigned char*>(c_.w.data()) + v0 * h * dtype_size(c_.w.dtype()),
            c_.w.dtype(), v1 - v0, h, h};
  }
  // The gradient tile in the input dtype; narrower than the logits, its rows keep the logits'
  // stride.
  gpu::Matrix grad_tile(std::int64_t r0, std::int64_t r1, std::int64_t v0, std::int64_t v1) const {
    const std::int64_t cols = v1 - v0;
    const auto ld =
        static_cast<std::int64_t>(cols * dtype_size(plan_.logits_dtype) / dtype_size(c_.x.dtype()));
    return {tile_, c_.x.dtype(), r1 - r0, cols, ld};
  }
  const float* gemm_scalar(kern::GemmScalar i) const {
    return reinterpret_cast<const float*>(scalars_ + kern::kGemmScalarsOffset) + i;
  }
  // Puts `value` in device slot `i` (from pageable memory: the copy has staged it when it
  // returns) and returns the slot.
  const float* set_scalar(kern::GemmScalar i, float value) {
    const float* slot = gemm_scalar(i);
    CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(const_cast<float*>(slot), &value, sizeof value,
                                        cudaMemcpyHostToDevice,
                                        static_cast<cudaStream_t>(stream())));
    return slot;
  }
  // The alpha of a gradient GEMM over tiles of the uniform coefficient: the mantissa of the
  // mean's 1/D, which lives on the device (none here), or 1 for the sum and upstream reductions.
  std::optional<float> uniform_alpha() const {
    return c_.scale == RowScale::kMean ? std::nullopt : std::optional<float>(1.0f);
  }
  // dst (leading dimension ld) = alpha op(a) b + beta dst; alpha none: the device's mean alpha.
  // alpha = 1 goes to cuBLAS as host scalars, so it runs its kernels for beta 0 and 1 (its
  // generic-beta kernels, which device scalars get, measured 6-7% slower on the H200). Any other
  // alpha stays in device memory: with a host alpha = mantissa the bf16 dW against float64 rose
  // from 1.76e-3 to 1.86e-3 (DPO, 2 x 1024) and from 1.88e-3 to 2.02e-3 (KTO) on the H200.
  void grad_gemm(const gpu::Matrix& a, bool trans_a, const gpu::Matrix& b, void* dst,
                 DType dst_dtype, std::int64_t ld, std::optional<float> alpha, float beta) {
    if (alpha == 1.0f) {
      gpu::gemm(*lane_, a, trans_a, b, false, dst, dst_dtype, ld, beta);
      return;
    }
    const float* a_dev = alpha ? set_scalar(kern::kWeightAlpha, *alpha) : gemm_scalar(kern::kAlpha);
    const float* b_dev = beta == 0.0f   ? gemm_scalar(kern::kZero)
                         : beta == 1.0f ? gemm_scalar(kern::kOne)
                                        : set_scalar(kern::kFactor, beta);
    gpu::gemm_device_scalars(*lane_, a, trans_a, b, false, dst, dst_dtype, ld, a_dev, b_dev);
  }
  // Zeros the fp32 accumulator `acc` of n values when there is one, else the caller's `grad`
  // unless accumulating.
  void zero_gradient(float* acc, std::int64_t n, const TensorView& grad) {
    settle();
    const auto s = static_cast<cudaStream_t>(stream());
    if (acc)
      CHUNKLOSS_GPU_CHECK(cudaMemsetAsync(acc, 0, static_cast<std::size_t>(n) * sizeof(float), s));
    else if (grad.defined() && !c_.accumulate)
      CHUNKLOSS_GPU_CHECK(cudaMemsetAsync(grad.data(), 0, grad.nbytes(), s));
  }
  void flush(const TensorView& dst, const float* acc) {
    CHUNKLOSS_LAUNCH_CHECK(kern::launch_store_f32(dst.data(), elem(dst.dtype()), acc, dst.numel(),
                                                  c_.accumulate, stream()));
  }

  // The stream work is enqueued on now: the context's, or its side's (OnSide).
  void* stream() const { return lane_->stream(); }
  // The side (gpu::Context::side()) runs the weight-gradient steps beside the hidden-gradient
  // GEMMs: both read the gradient tile, and write disjoint buffers (dW or its fp32 accumulator
  // and X rows staged or scaled for it; dH, its accumulator, or fp32 rows in the dH staging or
  // in the tile's free halves apart from those X rows). The first of grad_x* and grad_w* after any
  // other step forks the side after that step's work; every other step that enqueues work joins it
  // first, so nothing else runs beside it. The device scalar slots the side writes (the dW GEMM's
  // alpha and beta) are not read by grad_x*.
  void fork() {
    if (forked_) return;
    ctx_.fork();
    forked_ = true;
  }
  void settle() {
    if (!forked_) return;
    ctx_.join();
    forked_ = false;
  }
  // The steps of its scope enqueue their GEMMs, kernels and copies on the side.
  class OnSide {
   public:
    explicit OnSide(CudaTokenBackend& b) : b_(b) {
      b.fork();
      b.lane_ = &b.ctx_.side();
    }
    ~OnSide() { b_.lane_ = &b_.ctx_; }
    OnSide(const OnSide&) = delete;
    OnSide& operator=(const OnSide&) = delete;

   private:
    CudaTokenBackend& b_;
  };

  const gpu::Context& ctx_;
  const TokenCall& c_;
  const Plan& plan_;
  const gpu::Context* lane_;  // where work is enqueued now: ctx_ or its side
  bool forked_ = false;
  bool check_finite_;
  unsigned char *tile_ = nullptr, *tile_base_ = nullptr, *x_stage_ = nullptr;
  unsigned char* x_scaled_ = nullptr;
  float* dh_stage_ = nullptr;  // with row scales: a chunk's fp32 dH rows before their scales
  float* dh_pack_ = nullptr;   // without: a packed chunk's fp32 dH rows (grad_x_ranges)
  VocabParallelStaging vp_;
  bool x_scaled_ready_ = false;
  bool in_tile_ = false;           // row scales staged in the tile's free halves (tile_staging.h)
  std::int64_t x_stage_rows_ = 0;  // the X rows x_stage_ holds
  std::vector<RowRange> packed_;   // the ranges whose X rows x_stage_ holds side by side
  // The mean in token-chunk order without row scales: its gradient GEMMs get alpha = 1 as host
  // scalars too (see grad_gemm). host_dx_: the dH GEMM into fp32 rows in the tile's free
  // halves, then times the device alpha (the mean's mantissa), rounded once. host_dw_: the
  // chunks before the last accumulate dw + tile^T x unscaled in the caller's buffer, and the
  // last GEMM scales all of it by alpha, as the deferred regime does (one bf16 rounding per
  // chunk, as before).
  bool host_dx_ = false, host_dw_ = false;
  std::int64_t chunks_end_ = 0;  // where the last chunk of token-chunk order ends
  std::size_t free_offset_ = 0;
  std::vector<float> pow2_, mant_;
  bool coef_consumed_ = true;
  // Per set_coefficients call since the last dW GEMM: its rows and their shared mantissa (0: all
  // zero, -1: several).
  std::vector<std::pair<RowRange, float>> set_ranges_;
  float *dw_acc_ = nullptr, *dh_acc_ = nullptr, *db_acc_ = nullptr;
  double* scalars_ = nullptr;
  kern::TokenParams p_;
};

}  // namespace

void cuda_read_to_host(Context& ctx, const TensorView& t, void* dst) {
  CHUNKLOSS_CHECK(ctx.device() == Device::kCuda, "read_to_host: ", t.str(),
                  " is device memory but the context is on the CPU");
  const auto& g = static_cast<const gpu::Context&>(ctx);
  g.activate();
  const auto s = static_cast<cudaStream_t>(g.stream());
  CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(dst, t.data(), t.nbytes(), cudaMemcpyDeviceToHost, s));
  CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(s));
}

void cuda_all_reduce_host(Context& ctx, dist::Communicator& group, double* values, std::int64_t n) {
  const auto& g = static_cast<const gpu::Context&>(ctx);
  g.activate();
  const auto s = static_cast<cudaStream_t>(g.stream());
  const std::size_t bytes = static_cast<std::size_t>(n) * sizeof(double);
  CHUNKLOSS_CHECK(bytes <= gpu::Context::kScratchBytes, "all_reduce_host: ", n,
                  " doubles exceed the context's scratch of ", gpu::Context::kScratchBytes,
                  " bytes");
  auto* device = static_cast<double*>(g.scratch());
  CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(device, values, bytes, cudaMemcpyHostToDevice, s));
  group.all_reduce_sum(ctx, device, n);
  CHUNKLOSS_GPU_CHECK(cudaMemcpyAsync(values, device, bytes, cudaMemcpyDeviceToHost, s));
  CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(s));
}

std::uint64_t cuda_count_nonfinite(const Context& ctx, const TensorView& t, double* scalars) {
  const auto& g = static_cast<const gpu::Context&>(ctx);
  g.activate();
  const auto s = static_cast<cudaStream_t>(g.stream());
  CHUNKLOSS_GPU_CHECK(cudaMemsetAsync(scalars + kern::kNonFinite, 0, sizeof(double), s));
  CHUNKLOSS_LAUNCH_CHECK(
      kern::launch_count_nonfinite(t.data(), elem(t.dtype()), t.numel(), scalars, s));
  std::uint64_t count = 0;
  CHUNKLOSS_GPU_CHECK(
      cudaMemcpyAsync(&count, scalars + kern::kNonFinite, sizeof count, cudaMemcpyDeviceToHost, s));
  CHUNKLOSS_GPU_CHECK(cudaStreamSynchronize(s));
  return count;
}

std::unique_ptr<TokenBackend> make_cuda_token_backend(Context& ctx, const TokenCall& call,
                                                      const Plan& plan, const Workspace& ws) {
  CHUNKLOSS_CHECK(ws.device() == Device::kCuda, call.who, ": the workspace must be device memory");
  return std::make_unique<CudaTokenBackend>(static_cast<const gpu::Context&>(ctx), call, plan, ws,
                                            call.check_finite);
}

}  // namespace chunkloss::detail
