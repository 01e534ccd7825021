// TokenLoss: a token objective's boundary (the cross-entropy head's checks), the targets read on
// the host, and the objective evaluated per chunk between the row statistics and the gradient.
#include "chunkloss/losses/token.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <exception>
#include <limits>
#include <optional>
#include <span>
#include <string>

#include "agreement.h"
#include "ce_call.h"
#include "chunkloss/core/error.h"
#include "engine.h"
#include "objective_call.h"
#include "validate.h"

namespace chunkloss {

namespace {

// The cross-entropy head's options that a token objective shares: the engine's. The rows' sum
// is taken under the plain rule; the mean is the token loss's own (its coefficients).
CrossEntropyOptions head_options(const TokenOptions& o) {
  CrossEntropyOptions c;
  c.ignore_index = o.ignore_index;
  c.reduction = Reduction::kSum;
  c.memory_budget_bytes = o.memory_budget_bytes;
  c.loop_order = o.loop_order;
  c.logits_dtype = o.logits_dtype;
  c.fp32_weight_grad_accumulator = o.fp32_weight_grad_accumulator;
  c.check_finite = o.check_finite;
  c.skip_ignored_rows = o.skip_ignored_rows;
  c.reduce_weight_grad_over_data_group = o.reduce_weight_grad_over_data_group;
  return c;
}

CrossEntropyInputs head_inputs(const TokenInputs& in) {
  CrossEntropyInputs c;
  c.hidden = in.hidden;
  c.weight = in.weight;
  c.bias = in.bias;
  c.targets = in.targets;
  c.vocab_shard = in.vocab_shard;
  c.data_group = in.data_group;
  return c;
}

// The objective as far as the library sees it (its name and extra metrics) and the reduction,
// which every rank of either group must share.
std::array<double, 2> objective_kind(const TokenObjective& obj,
                                     const std::vector<std::string>& extra_names,
                                     const TokenOptions& o) {
  std::string names(obj.name());
  for (const std::string& m : extra_names) names += '\n' + m;
  return {static_cast<double>(o.reduction),
          detail::kind_digest({reinterpret_cast<const std::uint8_t*>(names.data()), names.size()})};
}

// What the ranks of a data group compare before the first collective: H, V, dW and db summed
// in the call or not, check_finite (on CUDA its ranks read the group's counts at the start), and
// the objective's kind.
constexpr std::size_t kDataKind = 7;

std::array<double, kDataKind> data_call_kind(const std::array<double, 2>& objective,
                                             const TokenOptions& o, const detail::TokenCall& k) {
  const bool sum = k.weight_grad_group != nullptr;
  return {static_cast<double>(k.hidden),
          static_cast<double>(k.vocab),
          sum && k.grad_w.defined() ? 1.0 : 0.0,
          sum && k.grad_bias.defined() ? 1.0 : 0.0,
          o.check_finite ? 1.0 : 0.0,
          objective[0],
          objective[1]};
}

// ... and of a vocabulary split: its chunks' collectives (detail::vocab_call_kind) and the
// objective's kind.
constexpr std::size_t kVocabKind = detail::kVocabKind + 2;

std::array<double, kVocabKind> vocab_call_kind(const std::array<double, 2>& objective,
                                               const TokenOptions& o, const detail::TokenCall& k,
                                               const Plan& plan) {
  std::array<double, kVocabKind> kind{};
  const std::array<double, detail::kVocabKind> call =
      detail::vocab_call_kind(k, plan, o.check_finite);
  std::copy(call.begin(), call.end(), kind.begin());
  std::copy(objective.begin(), objective.end(), kind.begin() + detail::kVocabKind);
  return kind;
}

// A digest of the values an objective gave (each chunk's coefficients, then the totals), which
// the ranks of a vocabulary split compare at the end: each runs its own copy of the objective on
// the same rows. (64-bit FNV-style mixing of the values' bits; its top 40 bits, as kinds hold.)
class ValuesDigest {
 public:
  void add(std::span<const float> values) {
    for (float x : values) mix(std::bit_cast<std::uint32_t>(x));
  }
  void add(std::span<const double> values) {
    for (double x : values) mix(std::bit_cast<std::uint64_t>(x));
  }
  double value() const { return static_cast<double>(h_ >> 24); }

 private:
  void mix(std::uint64_t word) { h_ = (h_ ^ word) * 0x100000001b3ULL; }
  std::uint64_t h_ = 0xcbf29ce484222325ULL;
};

Device call_device(const TokenInputs& in) {
  return in.hidden.defined() ? in.hidden.device() : Device::kCpu;
}

// The checks of a call's shapes: the cross-entropy head's, then the objective's row count.
detail::CeCall check_call(const TokenObjective& obj, const std::string& who, const TokenOptions& o,
                          Device device, const TokenInputs& in, const CrossEntropyGrads& grads,
                          bool on_device) {
  detail::CeCall c = detail::check_ce_call(who.c_str(), head_options(o), device, head_inputs(in),
                                           grads, {}, on_device);
  const std::optional<std::int64_t> rows = obj.rows();
  CHUNKLOSS_CHECK(!rows || *rows == c.request.rows, who, ": the objective holds per-row data for ",
                  rows.value_or(0), " rows, but hidden [N, H] has N=", c.request.rows);
  return c;
}

}  // namespace

TokenLoss::TokenLoss(std::shared_ptr<const TokenObjective> objective, const TokenOptions& options)
    : objective_(std::move(objective)), options_(options) {
  CHUNKLOSS_CHECK(objective_ != nullptr, "TokenLoss: the objective is null");
  const std::string who(objective_->name());
  CHUNKLOSS_CHECK(
      options.reduction == Reduction::kMean || options.reduction == Reduction::kSum, who,
      ": reduction must be mean or sum (an objective weighs its rows itself), got ",
      reduction_name(options.reduction) == "?" ? std::to_string(static_cast<int>(options.reduction))
                                               : std::string(reduction_name(options.reduction)));
  detail::check_loop_order(who, options.loop_order);
  CHUNKLOSS_CHECK(options.logits_dtype == DType::kF32 || options.logits_dtype == DType::kBF16, who,
                  ": logits_dtype must be f32 or bf16, got ", dtype_name(options.logits_dtype));
}

Plan TokenLoss::plan(const TokenInputs& in, const CrossEntropyGrads& grads) const {
  const std::string who(objective_->name());
  return plan_token_objective(
      check_call(*objective_, who, options_, call_device(in), in, grads, false).request);
}

std::size_t TokenLoss::workspace_bytes(const TokenInputs& in,
                                       const CrossEntropyGrads& grads) const {
  return plan(in, grads).workspace_bytes();
}

TokenResult TokenLoss::forward_backward(Context& ctx, const TokenInputs& in,
                                        const CrossEntropyGrads& grads, const Workspace& ws) const {
  const TokenObjective& obj = *objective_;
  const std::string who(obj.name());
  const CrossEntropyOptions o = head_options(options_);
  dist::Communicator* const group = in.data_group;
  dist::Communicator* const vocab_group = detail::vocab_split_group(in.vocab_shard);
  const bool grouped = group || vocab_group;
  // Everything checked before the first collective; with groups the ranks then agree whether
  // any rank rejected its call or makes another kind of call, and sum the valid rows over the
  // data group (a vocabulary split's ranks share their rows).
  std::optional<detail::CeCall> c;
  Plan plan;
  std::vector<std::int64_t> y;
  std::vector<std::uint8_t> valid;  // per row: the target is not ignore_index
  std::exception_ptr rejected;
  std::array<double, kDataKind> data_kind{};
  std::array<double, kVocabKind> vocab_kind{};
  double valid_rows = 0;  // the data group's, after the exchange
  std::vector<std::string> extra_names;
  try {
    c.emplace(check_call(obj, who, options_, ctx.device(), in, grads, true));
    plan = plan_token_objective(c->request);
    CHUNKLOSS_CHECK(ws.device() == ctx.device(), who, ": workspace is on ",
                    device_name(ws.device()), ", the context on ", device_name(ctx.device()));
    detail::check_memory(who.c_str(), ctx, ws,
                         {{"hidden", &in.hidden},
                          {"weight", &in.weight},
                          {"bias", &in.bias},
                          {"targets", &in.targets}},
                         {{"grads.hidden", &grads.hidden},
                          {"grads.weight", &grads.weight},
                          {"grads.bias", &grads.bias}});
    ws.require(plan.layout, who.c_str());
    y = detail::read_target_ids(ctx, who.c_str(), "targets", in.targets, c->call.total_vocab(),
                                options_.ignore_index);
    for (std::int64_t t : y) valid.push_back(t != options_.ignore_index);
    valid_rows = static_cast<double>(std::count(valid.begin(), valid.end(), 1));
    if (detail::skips_rows(o, plan, c->call))
      c->call.row_ranges = detail::rows_to_compute(valid, plan.skip_gap_rows);
    extra_names = obj.extra_metrics();
    const std::array<double, 2> objective = objective_kind(obj, extra_names, options_);
    data_kind = data_call_kind(objective, options_, c->call);
    vocab_kind = vocab_call_kind(objective, options_, c->call, plan);
  } catch (...) {
    if (!grouped) throw;
    rejected = std::current_exception();
    data_kind = {};
    vocab_kind = {};
    valid_rows = 0;
  }
  if (grouped)
    detail::agree_on_call(ctx, who.c_str(), vocab_group, group, rejected,
                          {vocab_kind,
                           data_kind,
                           {&valid_rows, 1},
                           "their rows, plans, rows computed, H, grad_hidden asked for, "
                           "check_finite, vocab_shard.size, ignore_index, the reduction, or the "
                           "objective's name and metrics",
                           "H, V, dW or db summed in the call, check_finite, the reduction, or "
                           "the objective's name and metrics"});
  detail::TokenCall& k = c->call;

  const double divisor =
      options_.reduction == Reduction::kMean && valid_rows > 0 ? valid_rows : 1.0;
  std::vector<double> extras(extra_names.size());
  // The loss, the extras' sums, then the objective's failures and mismatches (at the end).
  std::vector<double> sums(extra_names.size() + 3, 0.0);
  TokenResult r;
  r.logps.assign(y.size(), std::numeric_limits<double>::quiet_NaN());
  std::exception_ptr failed;  // with groups, thrown at the end once the ranks know of it
  // Gradients are (or, with groups, will be) written before the objective's failure throws.
  bool written = grouped && k.any_grad();
  ValuesDigest values;  // with a vocabulary split
  const detail::RowCoefficients coefficients = [&](std::int64_t r0, std::int64_t r1,
                                                   const float* row_loss, float* coef) {
    const char* note = written ? "; gradients were already written, so the gradient buffers "
                                 "hold unspecified values"
                               : "";
    for (std::int64_t t = r0; t < r1; ++t) {
      const auto i = static_cast<std::size_t>(t);
      float& c_t = coef[t - r0];
      c_t = 0.0f;
      if (!valid[i]) continue;
      try {
        const TokenStats st{t, y[i], -static_cast<double>(row_loss[t - r0])};
        std::fill(extras.begin(), extras.end(), 0.0);
        const TokenValue v = detail::call_objective(
            who, [t] { return "for row " + std::to_string(t); }, note,
            [&] { return obj.evaluate(st, extras); });
        bool finite = std::isfinite(st.logp) && std::isfinite(v.loss) && std::isfinite(v.dlogp);
        for (double e : extras) finite = finite && std::isfinite(e);
        CHUNKLOSS_CHECK(finite, who, ": row ", t, " (target ", y[i], ", logp ", st.logp,
                        ") gave loss ", v.loss, ", dlogp ", v.dlogp,
                        extras.empty() ? "" : " or a non-finite extra metric",
                        ": the objective must return finite values", note);
        r.logps[i] = st.logp;
        sums[0] += v.loss;
        for (std::size_t m = 0; m < extras.size(); ++m) sums[m + 1] += extras[m];
        c_t = static_cast<float>(-v.dlogp / divisor);
      } catch (...) {
        if (!grouped) throw;
        if (!failed) failed = std::current_exception();
      }
    }
    if (vocab_group) values.add({coef, static_cast<std::size_t>(r1 - r0)});
    written = written || (k.any_grad() && plan.order == LoopOrder::kTokenChunk);
  };
  const detail::TokenTotals totals = detail::run_token_objective(ctx, k, plan, ws, coefficients);
  // The ranks of a vocabulary split count their failures and compare the values their objectives
  // gave (each runs its own copy on the same rows); the data group then sums the loss, the
  // extras, those failures and mismatches, so that in a grid every rank counts each failing rank
  // once, and learns of a mismatch in another vocabulary group.
  values.add({sums.data(), sums.size() - 2});
  double& failures = sums[sums.size() - 2];
  double& mismatches = sums.back();
  failures = failed ? 1.0 : 0.0;
  if (vocab_group) {
    const double digest = values.value();
    const bool same =
        detail::exchange(detail::GroupSum{ctx, vocab_group}, false, {&digest, 1}, {&failures, 1})
            .second;
    mismatches = same ? 0.0 : 1.0;
  }
  detail::GroupSum{ctx, group}(sums.data(), sums.size());
  if (failed) std::rethrow_exception(failed);
  CHUNKLOSS_CHECK(failures == 0, who,
                  ": the objective failed (threw or returned a non-finite value) on ", failures,
                  " other rank(s) of ",
                  group && vocab_group ? "the data_group x vocab_shard.group grid"
                  : group              ? "data_group"
                                       : "vocab_shard.group",
                  "; the gradient buffers, if any, hold unspecified values");
  CHUNKLOSS_CHECK(mismatches == 0, who,
                  ": the objective gave different values on the ranks of a vocab_shard.group (each "
                  "rank evaluates it on the same rows: it must be a pure function of its "
                  "arguments, the same on every rank); the gradient buffers, if any, hold "
                  "unspecified values");

  r.loss = sums[0] / divisor;
  r.valid_rows = static_cast<std::int64_t>(valid_rows);
  r.accuracy = valid_rows > 0 ? totals.correct / valid_rows : 0.0;
  for (std::size_t m = 0; m < extra_names.size(); ++m)
    r.metrics.emplace_back(extra_names[m], valid_rows > 0 ? sums[m + 1] / valid_rows : 0.0);
  return r;
}

}  // namespace chunkloss
