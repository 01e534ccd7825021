// Token objectives for the tests (their math in double, used by the library and the oracle
// alike) and the float64 oracle of a token loss, built on the cross-entropy oracle: its row
// log-probs, the objective per valid row, and the gradient as the cross-entropy oracle's
// reduction-none gradient with upstream -dlogp_t / D, since dL/dz_t = dlogp_t/D * d logp_t/dz_t.
#pragma once

#include <chunkloss/losses/token.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "reference/cross_entropy_ref.h"

namespace chunkloss::reference {

/// loss = -logp: cross-entropy written as a token objective.
class NllObjective final : public TokenObjective {
 public:
  std::string_view name() const override { return "Nll"; }
  TokenValue evaluate(const TokenStats& row, std::span<double> extras) const override;
};

/// Focal loss, loss = -(1 - p)^gamma logp with p = exp(logp); extra metric "p_target" (mean p).
class FocalObjective final : public TokenObjective {
 public:
  explicit FocalObjective(double gamma) : gamma_(gamma) {}
  std::string_view name() const override { return "Focal"; }
  TokenValue evaluate(const TokenStats& row, std::span<double> extras) const override;
  std::vector<std::string> extra_metrics() const override { return {"p_target"}; }

 private:
  double gamma_;
};

/// A PPO/GRPO-style clipped ratio with per-row data: r = exp(logp - old_logps[row]),
/// loss = -min(r A, clip(r, 1 - eps, 1 + eps) A) with A = advantages[row]; extra metric
/// "clip_fraction" (rows whose clipped term is the smaller).
class ClippedRatioObjective final : public TokenObjective {
 public:
  ClippedRatioObjective(std::vector<double> advantages, std::vector<double> old_logps, double eps)
      : advantages_(std::move(advantages)), old_logps_(std::move(old_logps)), eps_(eps) {}
  std::string_view name() const override { return "ClippedRatio"; }
  TokenValue evaluate(const TokenStats& row, std::span<double> extras) const override;
  std::vector<std::string> extra_metrics() const override { return {"clip_fraction"}; }
  /// The objective of rows [r0, r0 + n) alone (a data parallel rank's), its row 0 their r0.
  std::shared_ptr<const ClippedRatioObjective> rows(std::int64_t r0, std::int64_t n) const;

 private:
  std::vector<double> advantages_, old_logps_;
  double eps_;
};

/// The engine options of `o` (ignore_index, reduction, budget, loop order, logits dtype, fp32 dW
/// accumulator, check_finite, skip_ignored_rows, dW summed over the data group) as a token
/// loss's, for tests that run a token loss where they run cross-entropy.
TokenOptions engine_options(const CrossEntropyOptions& o);

struct TokenOracle {
  double loss = 0;
  double accuracy = 0;
  std::int64_t valid_rows = 0;
  std::vector<double> metrics;      ///< the objective's extras, means over valid rows
  std::vector<double> logps;        ///< [N], NaN for ignored rows
  std::vector<double> grad_hidden;  ///< [N, H]
  std::vector<double> grad_weight;  ///< [V, H]
  std::vector<double> grad_bias;    ///< [V]
};

/// The token loss of `obj` on `p` (its class weights, token weights and upstream unused).
TokenOracle token_loss(const CeProblem& p, std::int64_t ignore_index, Reduction reduction,
                       const TokenObjective& obj);

/// Only the loss of token_loss (no gradients): for finite differences.
double token_loss_value(const CeProblem& p, std::int64_t ignore_index, Reduction reduction,
                        const TokenObjective& obj);

}  // namespace chunkloss::reference
