// GrpoObjective: the clipped-ratio policy loss with the k3 KL, per token, and the weights of
// TRL's loss types.
#include "chunkloss/losses/grpo.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <unordered_map>
#include <utility>

#include "chunkloss/core/error.h"
#include "loss_type_names.h"

namespace chunkloss {

namespace {

constexpr std::pair<GrpoLossType, std::string_view> kGrpoNames[] = {
    {GrpoLossType::kGrpo, "grpo"},
    {GrpoLossType::kBnpo, "bnpo"},
    {GrpoLossType::kDrGrpo, "dr_grpo"},
};
constexpr std::pair<ImportanceSamplingLevel, std::string_view> kLevelNames[] = {
    {ImportanceSamplingLevel::kToken, "token"},
    {ImportanceSamplingLevel::kSequence, "sequence"},
};

// Copies `values` (empty or one per row; with `nonnegative`, none below 0). Ignored rows' values
// are not read, so NaN may stand there (TokenResult::logps has NaN at ignored rows); a valid
// row's non-finite value makes the call throw, naming the row (the objective's value is then not
// finite).
std::vector<double> row_values(const char* what, std::span<const double> values, std::size_t rows,
                               bool nonnegative = false) {
  CHUNKLOSS_CHECK(values.empty() || values.size() == rows, "Grpo: rows.", what, " has ",
                  values.size(), " values, expected 0 or ", rows,
                  " (one per row, as rows.advantages)");
  for (std::size_t t = 0; nonnegative && t < values.size(); ++t)
    CHUNKLOSS_CHECK(!(values[t] < 0), "Grpo: rows.", what, "[", t, "] = ", values[t],
                    " must be >= 0");
  return {values.begin(), values.end()};
}

}  // namespace

GrpoObjective::GrpoObjective(const GrpoOptions& o, const GrpoRows& rows) : options_(o) {
  CHUNKLOSS_CHECK(o.epsilon_low >= 0 && o.epsilon_low < 1,
                  "Grpo: epsilon_low must be in [0, 1), got ", o.epsilon_low);
  CHUNKLOSS_CHECK(o.epsilon_high >= 0 && std::isfinite(o.epsilon_high),
                  "Grpo: epsilon_high must be finite and >= 0, got ", o.epsilon_high);
  CHUNKLOSS_CHECK(o.delta == 0 || (o.delta > 1 + o.epsilon_high && std::isfinite(o.delta)),
                  "Grpo: delta must be 0 (off) or finite and > 1 + epsilon_high = ",
                  1 + o.epsilon_high, ", got ", o.delta);
  CHUNKLOSS_CHECK(o.beta >= 0 && std::isfinite(o.beta), "Grpo: beta must be finite and >= 0, got ",
                  o.beta);
  CHUNKLOSS_CHECK(!rows.advantages.empty(), "Grpo: rows.advantages is empty (one per row)");
  const std::size_t n = rows.advantages.size();
  advantages_.assign(rows.advantages.begin(), rows.advantages.end());
  old_logps_ = row_values("old_logps", rows.old_logps, n);
  CHUNKLOSS_CHECK(o.beta == 0 || !rows.ref_logps.empty(), "Grpo: beta = ", o.beta,
                  " needs rows.ref_logps (the reference's log-probs)");
  ref_logps_ = row_values("ref_logps", rows.ref_logps, n);
  weights_ = row_values("weights", rows.weights, n, true);
  if (o.importance_sampling_level == ImportanceSamplingLevel::kSequence && !old_logps_.empty())
    sequence_shift_ = sequence_shifts(rows);
}

std::vector<double> GrpoObjective::sequence_shifts(const GrpoRows& rows) const {
  const std::size_t n = advantages_.size();
  CHUNKLOSS_CHECK(rows.completion.size() == n && rows.current_logps.size() == n,
                  "Grpo: the sequence level with old_logps needs rows.completion and "
                  "rows.current_logps, one per row (",
                  n, "), got ", rows.completion.size(), " and ", rows.current_logps.size());
  // The mean of current - old over each completion's rows that have a current log-prob.
  std::unordered_map<std::int64_t, std::pair<double, double>> sums;  // (sum, rows)
  for (std::size_t t = 0; t < n; ++t) {
    const double cur = rows.current_logps[t];
    if (std::isnan(cur)) continue;  // (an ignored row)
    const std::int64_t c = rows.completion[t];
    CHUNKLOSS_CHECK(c >= 0, "Grpo: row ", t, " has a current log-prob (", cur,
                    ") but completion -1: the sequence level needs its completion");
    CHUNKLOSS_CHECK(std::isfinite(cur) && std::isfinite(old_logps_[t]), "Grpo: row ", t,
                    " of completion ", c, ": current_logps ", cur, " and old_logps ", old_logps_[t],
                    " must be finite");
    auto& [sum, count] = sums[c];
    sum += cur - old_logps_[t];
    count += 1;
  }
  std::vector<double> shift(n, std::numeric_limits<double>::quiet_NaN());
  for (std::size_t t = 0; t < n; ++t) {
    const auto it = sums.find(rows.completion[t]);
    if (it == sums.end() || std::isnan(rows.current_logps[t])) continue;
    shift[t] = it->second.first / it->second.second - rows.current_logps[t];
  }
  return shift;
}

std::vector<std::string> GrpoObjective::extra_metrics() const {
  std::vector<std::string> names = {"clip_ratio/low_mean", "clip_ratio/high_mean",
                                    "clip_ratio/region_mean"};
  if (options_.beta > 0) names.emplace_back("kl");
  return names;
}

TokenValue GrpoObjective::evaluate(const TokenStats& row, std::span<double> extras) const {
  const auto t = static_cast<std::size_t>(row.row);
  const double a = advantages_[t];
  // The ratio, which is also d ratio / d logp: with no old log-probs, exp(logp -
  // stop_gradient(logp)); at the sequence level s_i exp(logp - current logp).
  double log_ratio = 0;
  if (!sequence_shift_.empty()) {
    CHUNKLOSS_CHECK(!std::isnan(sequence_shift_[t]), "Grpo: row ", t,
                    " is valid, but rows.current_logps has NaN there: the sequence level needs "
                    "the current log-probs of the call's valid rows");
    log_ratio = sequence_shift_[t] + row.logp;
  } else if (!old_logps_.empty()) {
    log_ratio = row.logp - old_logps_[t];
  }
  const double ratio = std::exp(log_ratio);
  const double lo = 1 - options_.epsilon_low, hi = 1 + options_.epsilon_high;
  // The unclipped term, capped at delta, and its d / d logp.
  const bool capped = options_.delta > 0 && ratio > options_.delta;
  const double unclipped = capped ? options_.delta : ratio, d_unclipped = capped ? 0.0 : ratio;
  // The clipped term is the smaller only where the ratio is outside [lo, hi] (inside, both terms
  // are equal), so there it is constant in logp.
  const double clipped = std::clamp(ratio, lo, hi);
  TokenValue v = clipped * a < unclipped * a ? TokenValue{-clipped * a, 0.0}
                                             : TokenValue{-unclipped * a, -d_unclipped * a};
  const bool low = ratio < lo && a < 0;
  const bool high = ratio > hi && a > 0;
  extras[0] = low ? 1.0 : 0.0;
  extras[1] = high ? 1.0 : 0.0;
  extras[2] = low || high ? 1.0 : 0.0;
  if (options_.beta > 0) {
    const double d = ref_logps_[t] - row.logp, e = std::exp(d);
    const double k3 = e - d - 1;
    v.loss += options_.beta * k3;
    v.dlogp += options_.beta * (1 - e);
    extras[3] = k3;
  }
  if (!weights_.empty()) {
    v.loss *= weights_[t];
    v.dlogp *= weights_[t];
  }
  return v;
}

std::string_view grpo_loss_name(GrpoLossType t) {
  return detail::loss_type_name<GrpoLossType>(kGrpoNames, t);
}

GrpoLossType parse_grpo_loss(std::string_view name) {
  return detail::parse_loss_type<GrpoLossType>(kGrpoNames, name, "Grpo");
}

std::string_view importance_sampling_level_name(ImportanceSamplingLevel l) {
  return detail::loss_type_name<ImportanceSamplingLevel>(kLevelNames, l);
}

ImportanceSamplingLevel parse_importance_sampling_level(std::string_view name) {
  return detail::parse_loss_type<ImportanceSamplingLevel>(kLevelNames, name, "Grpo",
                                                          "importance_sampling_level");
}

GrpoNormalization grpo_normalization(GrpoLossType type, std::span<const std::int64_t> completion,
                                     std::int64_t completions, std::int64_t max_completion_length) {
  CHUNKLOSS_CHECK(completions >= 0, "grpo_normalization: completions must be >= 0, got ",
                  completions);
  std::unordered_map<std::int64_t, std::int64_t> length;  // rows of each completion index
  for (std::size_t t = 0; t < completion.size(); ++t) {
    const std::int64_t c = completion[t];
    CHUNKLOSS_CHECK(
        c >= -1 && (completions == 0 || c < completions), "grpo_normalization: completion[", t,
        "] = ", c, " must be -1 (no completion) or in [0, ",
        completions == 0 ? std::string("completions") : std::to_string(completions), ")");
    if (c >= 0) ++length[c];
  }
  GrpoNormalization g;
  if (type == GrpoLossType::kBnpo) return g;
  CHUNKLOSS_CHECK(type == GrpoLossType::kGrpo || type == GrpoLossType::kDrGrpo,
                  "grpo_normalization: unknown loss type ", static_cast<int>(type));
  CHUNKLOSS_CHECK(type != GrpoLossType::kDrGrpo || max_completion_length > 0,
                  "grpo_normalization: dr_grpo needs max_completion_length > 0, got ",
                  max_completion_length);
  const double count =
      static_cast<double>(completions > 0 ? completions : static_cast<std::int64_t>(length.size()));
  g.reduction = Reduction::kSum;
  g.weights.assign(completion.size(), 0.0);
  for (std::size_t t = 0; t < completion.size(); ++t) {
    if (completion[t] < 0) continue;
    const double rows = type == GrpoLossType::kDrGrpo ? static_cast<double>(max_completion_length)
                                                      : static_cast<double>(length[completion[t]]);
    g.weights[t] = 1.0 / (count * rows);
  }
  return g;
}

}  // namespace chunkloss
