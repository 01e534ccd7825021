#include "reference/token_ref.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace chunkloss::reference {

TokenValue NllObjective::evaluate(const TokenStats& row, std::span<double>) const {
  return {-row.logp, -1.0};
}

TokenValue FocalObjective::evaluate(const TokenStats& row, std::span<double> extras) const {
  const double p = std::exp(row.logp), q = 1.0 - p;
  extras[0] = p;
  // d/dlogp of -(1 - p)^g logp, with dp/dlogp = p.
  return {-std::pow(q, gamma_) * row.logp,
          gamma_ * std::pow(q, gamma_ - 1.0) * p * row.logp - std::pow(q, gamma_)};
}

TokenValue ClippedRatioObjective::evaluate(const TokenStats& row, std::span<double> extras) const {
  const auto i = static_cast<std::size_t>(row.row);
  const double a = advantages_.at(i), r = std::exp(row.logp - old_logps_.at(i));
  const double clipped = std::clamp(r, 1.0 - eps_, 1.0 + eps_);
  if (clipped * a < r * a) {  // the clipped term, constant in logp, is the smaller
    extras[0] = 1.0;
    return {-clipped * a, 0.0};
  }
  return {-r * a, -r * a};
}

std::shared_ptr<const ClippedRatioObjective> ClippedRatioObjective::rows(std::int64_t r0,
                                                                         std::int64_t n) const {
  const auto part = [&](const std::vector<double>& v) {
    return std::vector<double>(v.begin() + r0, v.begin() + r0 + n);
  };
  return std::make_shared<ClippedRatioObjective>(part(advantages_), part(old_logps_), eps_);
}

TokenOptions engine_options(const CrossEntropyOptions& o) {
  TokenOptions t;
  t.ignore_index = o.ignore_index;
  t.reduction = o.reduction;
  t.memory_budget_bytes = o.memory_budget_bytes;
  t.loop_order = o.loop_order;
  t.logits_dtype = o.logits_dtype;
  t.fp32_weight_grad_accumulator = o.fp32_weight_grad_accumulator;
  t.check_finite = o.check_finite;
  t.skip_ignored_rows = o.skip_ignored_rows;
  t.reduce_weight_grad_over_data_group = o.reduce_weight_grad_over_data_group;
  return t;
}

namespace {

struct RowValues {
  std::vector<double> logps, upstream, metrics;
  double loss = 0;
  std::int64_t valid_rows = 0;
  double accuracy = 0;
};

RowValues row_values(const CeProblem& p, std::int64_t ignore_index, Reduction reduction,
                     const TokenObjective& obj) {
  CeProblem plain = p;
  plain.class_weights.clear();
  plain.token_weights.clear();
  plain.grad_output.clear();
  CeConfig c;
  c.ignore_index = ignore_index;
  c.reduction = Reduction::kNone;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const CeResult ce = cross_entropy(plain, c);
  RowValues r;
  r.valid_rows = ce.valid_rows;
  r.accuracy = ce.accuracy;
  const double d =
      reduction == Reduction::kMean && ce.valid_rows ? static_cast<double>(ce.valid_rows) : 1.0;
  const std::vector<std::string> names = obj.extra_metrics();
  r.metrics.assign(names.size(), 0.0);
  std::vector<double> extras(names.size());
  for (std::int64_t t = 0; t < p.n; ++t) {
    const auto i = static_cast<std::size_t>(t);
    if (p.targets[i] == ignore_index) {
      r.logps.push_back(nan);
      r.upstream.push_back(0.0);
      continue;
    }
    std::fill(extras.begin(), extras.end(), 0.0);
    const TokenValue v = obj.evaluate({t, p.targets[i], -ce.row_loss[i]}, extras);
    r.logps.push_back(-ce.row_loss[i]);
    r.upstream.push_back(-v.dlogp / d);
    r.loss += v.loss / d;
    for (std::size_t m = 0; m < extras.size(); ++m) r.metrics[m] += extras[m];
  }
  for (double& m : r.metrics) m /= std::max<double>(1.0, static_cast<double>(r.valid_rows));
  return r;
}

}  // namespace

TokenOracle token_loss(const CeProblem& p, std::int64_t ignore_index, Reduction reduction,
                       const TokenObjective& obj) {
  const RowValues rows = row_values(p, ignore_index, reduction, obj);
  CeProblem g = p;
  g.class_weights.clear();
  g.token_weights.clear();
  g.grad_output = rows.upstream;
  CeConfig c;
  c.ignore_index = ignore_index;
  c.reduction = Reduction::kNone;
  const CeResult ce = cross_entropy(g, c);
  TokenOracle o;
  o.loss = rows.loss;
  o.accuracy = rows.accuracy;
  o.valid_rows = rows.valid_rows;
  o.metrics = rows.metrics;
  o.logps = rows.logps;
  o.grad_hidden = ce.grad_hidden;
  o.grad_weight = ce.grad_weight;
  o.grad_bias = ce.grad_bias;
  return o;
}

double token_loss_value(const CeProblem& p, std::int64_t ignore_index, Reduction reduction,
                        const TokenObjective& obj) {
  return row_values(p, ignore_index, reduction, obj).loss;
}

}  // namespace chunkloss::reference
