// The GRPO family's policy loss as a token objective (LOSSES.md, "Later"): the clipped importance
// ratio of PPO with per-sequence advantages, DAPO's asymmetric clip ("clip-higher"), the
// two-sided cap of the unclipped ratio, and the k3 estimate of the KL to a reference, at the
// token or the sequence level of importance sampling (GSPO), in TRL's GRPOTrainer conventions.
// The rollouts, rewards and advantages are the caller's; this is the loss of one optimisation
// step on them.
//
// Per valid row t (a completion token) with advantage A and importance ratio r:
//   loss_t = w_t (-min(r' A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A) + beta k3_t)
// with r' = min(r, delta) when delta is set (else r), k3_t = exp(ref - logp) - (ref - logp) - 1,
// and w_t the row's weight (1 without GrpoRows::weights). Token level: r = exp(logp - old_logp).
// Sequence level (GSPO): r = s_i exp(logp - stop_gradient(logp)), with s_i = exp(mean over the
// completion i's tokens of (logp - old_logp)), TRL's "sequence_token" form; its value is s_i (up to
// the rounding between the call and the forward that gave GrpoRows::current_logps), and its
// gradient is that of GSPO's (TRL's "sequence") wherever w_t is constant within each
// completion, as grpo_normalization's weights are. The batch loss is the TokenLoss's mean or
// sum of loss_t; grpo_normalization gives the weights and the reduction of TRL's loss types.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "chunkloss/losses/cross_entropy.h"
#include "chunkloss/losses/token.h"

namespace chunkloss {

/// Where the importance ratio is taken (TRL's importance_sampling_level).
enum class ImportanceSamplingLevel : std::uint8_t {
  kToken,     ///< each token's own ratio (GRPO, DAPO)
  kSequence,  ///< the completion's length-normalised ratio, for each of its tokens (GSPO)
};

struct GrpoOptions {
  double epsilon_low = 0.2;   ///< in [0, 1): ratios below 1 - epsilon_low are clipped
  double epsilon_high = 0.2;  ///< >= 0: ratios above 1 + epsilon_high (DAPO uses 0.28)
  /// > 1 + epsilon_high: the unclipped ratio is capped at delta (two-sided clipping, so a
  /// negative advantage's loss stays bounded); 0: no cap.
  double delta = 0;
  /// >= 0: weight of the k3 KL estimate to the reference (TRL's beta); > 0 needs ref_logps.
  double beta = 0;
  /// kSequence with old log-probs needs GrpoRows::completion and current_logps.
  ImportanceSamplingLevel importance_sampling_level = ImportanceSamplingLevel::kToken;
};

/// Per-row data of this rank's N rows (row t of hidden), copied by the objective. Values of
/// ignored rows (target == ignore_index) are not read: NaN may stand there, as in
/// TokenResult::logps. A valid row's non-finite value makes the call throw, naming the row.
struct GrpoRows {
  /// [N] each row's advantage (its completion's, for GRPO). Required: its size is N.
  std::span<const double> advantages = {};
  /// [N] logp of the row's token under the policy that sampled it. Empty: the current logp,
  /// detached (the first optimisation step on fresh rollouts: the ratio is 1, its gradient the
  /// current policy's).
  std::span<const double> old_logps = {};
  /// [N] logp of the row's token under the reference policy: required when beta > 0.
  std::span<const double> ref_logps = {};
  /// [N] each row's weight in the loss (>= 0); empty: 1. See grpo_normalization.
  std::span<const double> weights = {};
  /// Sequence level with old_logps: [N] the index of each row's completion (-1: none), as
  /// grpo_normalization takes it, and [N] the rows' log-probs under the current policy
  /// (TokenResult::logps of a forward() on the same inputs, NaN at ignored rows). s_i is the mean
  /// of current - old over the completion's rows that current_logps holds a value for (the
  /// valid ones). From another policy's log-probs, r is that policy's s_i times pi / pi_that.
  std::span<const std::int64_t> completion = {};
  std::span<const double> current_logps = {};
};

/// The GRPO policy loss per token. Extra metrics, means over the valid rows (TRL's names):
/// clip_ratio/low_mean (r < 1 - epsilon_low with A < 0), clip_ratio/high_mean (r > 1 +
/// epsilon_high with A > 0), clip_ratio/region_mean (either), and with beta > 0, kl (mean k3).
/// At the sequence level each token carries its completion's clip flags, so these are means
/// over tokens, where TRL's sequence-level clip ratios are means over completions.
/// Throws chunkloss::Error for options or rows out of their ranges (named, with the sizes).
class GrpoObjective final : public TokenObjective {
 public:
  GrpoObjective(const GrpoOptions& options, const GrpoRows& rows);

  std::string_view name() const override { return "Grpo"; }
  TokenValue evaluate(const TokenStats& row, std::span<double> extras) const override;
  std::vector<std::string> extra_metrics() const override;
  std::optional<std::int64_t> rows() const override {
    return static_cast<std::int64_t>(advantages_.size());
  }
  const GrpoOptions& options() const { return options_; }

 private:
  std::vector<double> sequence_shifts(const GrpoRows& rows) const;

  GrpoOptions options_;
  std::vector<double> advantages_, old_logps_, ref_logps_, weights_;
  /// Sequence level with old log-probs: per row, log s_i - current logp (NaN for rows of no
  /// completion), so that log r = this + logp.
  std::vector<double> sequence_shift_;
};

/// TRL's loss types: how the tokens' losses are summed into the batch's.
enum class GrpoLossType : std::uint8_t {
  kGrpo,    ///< the mean over completions of each completion's mean over its tokens
  kBnpo,    ///< the mean over all tokens (over a data group: DAPO's global token mean)
  kDrGrpo,  ///< the sum over all tokens / (completions x max_completion_length)
};

std::string_view grpo_loss_name(GrpoLossType t);
std::string_view importance_sampling_level_name(ImportanceSamplingLevel l);
/// Parses TRL's names "token" and "sequence"; throws chunkloss::Error listing them.
ImportanceSamplingLevel parse_importance_sampling_level(std::string_view name);
/// Parses a TRL name ("grpo", "bnpo", "dr_grpo"); throws chunkloss::Error listing the names.
GrpoLossType parse_grpo_loss(std::string_view name);

/// GrpoRows::weights and TokenOptions::reduction for a loss type.
struct GrpoNormalization {
  std::vector<double> weights;  ///< [N], or empty (kBnpo)
  Reduction reduction = Reduction::kMean;
};

/// The weights and reduction that make a token loss `type`'s. completion[t] is the index of the
/// completion row t belongs to, or -1 for a row of none (a prompt, padding after the end), whose
/// target must be ignore_index too (kBnpo and the metrics go by the targets alone). The rows a
/// completion's loss averages over are those of its index here (ignored rows among them count,
/// so mark only the completion's tokens, and keep a completion's rows on one rank of a data
/// group). completions: the number of completions the loss divides by (over a data group, the
/// group's; TRL divides by the batch's completions, those with no token left included); 0: the
/// indices that name a row here. max_completion_length (kDrGrpo only, > 0): the constant
/// divisor. Throws chunkloss::Error on completions < 0, a negative index other than -1, an index
/// >= completions, or a missing max_completion_length.
GrpoNormalization grpo_normalization(GrpoLossType type, std::span<const std::int64_t> completion,
                                     std::int64_t completions = 0,
                                     std::int64_t max_completion_length = 0);

}  // namespace chunkloss
