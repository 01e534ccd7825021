// Naive dense float64 oracle of the preference losses (../shared/LOSSES.md): every [S*T, V]
// logit materialised in double, token log-probs, per-sequence sums and counts, each loss written
// from its formula, TRL's metrics, and gradients whose sequence part dL/dS_s comes from central
// finite differences of the loss as a function of the sums (independent of any analytic
// derivative), then dL/dz_t = dL/dS_s(t) * (onehot_t - p_t) and the three products.
#pragma once

#include <chunkloss/losses/preference.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace chunkloss::reference {

/// A linear head in double: hidden [N, H], weight [V, H], bias [V] or empty.
struct PrefHead {
  std::vector<double> hidden;
  std::vector<double> weight;
  std::vector<double> bias;
  bool defined() const { return !hidden.empty(); }
};

/// Per-sequence statistics of a head on [S, T] targets.
struct SeqStats {
  std::vector<double> logps;         ///< [S] sum of log softmax(z_t)[y_t] over valid tokens
  std::vector<std::int64_t> tokens;  ///< [S] valid tokens
  std::vector<double> logit_sums;    ///< [S] sum of z_tv over valid tokens t and all v
};

/// Statistics of `head` on targets [S, T] (ignore_index skipped); shapes H, V.
SeqStats sequence_stats(const PrefHead& head, const std::vector<std::int64_t>& targets,
                        std::int64_t s, std::int64_t t, std::int64_t h, std::int64_t v,
                        std::int64_t ignore_index);

enum class PrefKind { kDpo, kOrpo, kSimpo, kCpo, kKto };

/// The options that change the math, in double (from the library's float options).
struct PrefConfig {
  PrefKind kind = PrefKind::kDpo;
  DpoLoss dpo_loss = DpoLoss::kSigmoid;
  double beta = 0.1;
  double eps = 0;         ///< label smoothing (DPO sigmoid/robust/exo_pair, SimPO, CPO)
  double tau = 0.05;      ///< discopop
  double gamma = 0;       ///< SimPO margin in reward units
  double nll_weight = 0;  ///< alpha of the NLL term over chosen (label 1) tokens; 0: none
  bool average = false;   ///< length-averaged log-probs
  double desirable_weight = 1, undesirable_weight = 1;  ///< KTO
  std::int64_t ignore_index = -100;

  static PrefConfig from(const DpoOptions& o);
  static PrefConfig from(const OrpoOptions& o);
  static PrefConfig from(const SimpoOptions& o);
  static PrefConfig from(const CpoOptions& o);
  static PrefConfig from(const KtoOptions& o);

  bool paired() const { return kind != PrefKind::kKto; }
  /// The loss works on averages (DPO with average_log_prob or ipo, ORPO, SimPO).
  bool averages() const;
};

/// KTO's mismatched batch: [S', T'] targets, the policy head on it and a reference head or
/// precomputed reference sums.
struct PrefKlBatch {
  std::int64_t s = 0, t = 0;
  PrefHead policy;
  std::vector<std::int64_t> targets;
  PrefHead reference;
  std::vector<double> ref_logps;
};

/// One preference problem in double. Pairs: S = 2P, (i, i + P) chosen/rejected.
struct PrefProblem {
  std::int64_t s = 0, t = 0, h = 0, v = 0;
  PrefHead policy;
  std::vector<std::int64_t> targets;  ///< [S*T]
  PrefHead reference;                 ///< or empty
  std::vector<double> ref_logps;      ///< [S] precomputed sums, or empty
  std::vector<int> labels;            ///< [S] KTO: 1 desirable, 0 undesirable
  std::optional<double> kl;           ///< KTO: given KL estimate (clamped at 0)
  std::optional<PrefKlBatch> kl_batch;
};

struct PrefResult {
  double loss = 0;            ///< mean over units + nll_weight * nll
  double objective_loss = 0;  ///< mean over units
  double nll = 0;             ///< mean CE over the chosen (label 1) tokens
  double kl = 0;              ///< KTO's z0 = max(0, KL estimate) used
  std::vector<double> logps, ref_logps, logit_sums;
  std::vector<std::int64_t> tokens;
  std::vector<double> rewards;         ///< [S] beta (m - m0), m the loss's measure (sum or avg)
  std::vector<double> policy_rewards;  ///< [S] beta m: the size of the terms rewards subtract
  std::vector<double> unit_losses;     ///< [units]
  std::map<std::string, double> metrics;
  std::vector<double> dloss_dlogp;  ///< [S] dL/dS_s of the whole loss, by finite differences
  std::vector<double> grad_hidden;  ///< [S*T, H]
  std::vector<double> grad_weight;  ///< [V, H]
  std::vector<double> grad_bias;    ///< [V]
};

/// Loss, metrics, per-sequence vectors and (when `gradients`) the policy gradients.
PrefResult preference(const PrefProblem& p, const PrefConfig& c, bool gradients = true);

/// The per-unit losses as a function of the policy sums (everything else fixed), for checks:
/// returns the batch loss L(S) = mean of units + nll_weight * NLL.
double preference_loss_of_sums(const PrefProblem& p, const PrefConfig& c,
                               const std::vector<double>& policy_logps);

/// Stable log(sigmoid(x)) and sigmoid(x).
double log_sigmoid(double x);
double sigmoid(double x);

}  // namespace chunkloss::reference
