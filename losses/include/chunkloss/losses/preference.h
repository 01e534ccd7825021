// The preference losses as sequence objectives on the shared engine: DPO (every loss type),
// ORPO, SimPO, CPO and KTO, in TRL's conventions. Each is a SequenceLoss built from its options.
// Notation: rows [0, P) of a paired batch are the chosen sequences, [P, 2P) the rejected ones
// (pair i is (i, i + P)); c, r are the policy's log-probs of chosen and rejected (sums over the
// valid tokens, or averages where said), c0, r0 the reference's (0 without a reference);
// sigma = sigmoid, logsig = log sigmoid. Every pairwise loss is the mean over pairs.
#pragma once

#include <cstdint>
#include <string_view>

#include "chunkloss/losses/sequence.h"

namespace chunkloss {

/// DPO's loss types (TRL's names), per pair, with dc = c - c0, dr = r - r0, d = beta (dc - dr)
/// and eps = label_smoothing.
enum class DpoLoss : std::uint8_t {
  kSigmoid,   ///< -(1 - eps) logsig(d) - eps logsig(-d)
  kHinge,     ///< relu(1 - d)
  kIpo,       ///< (D - 1 / (2 beta))^2, D = (c - r) - (c0 - r0) on averaged log-probs
  kRobust,    ///< (-(1 - eps) logsig(d) + eps logsig(-d)) / (1 - 2 eps)
  kExoPair,   ///< sigma(d) (logsig(d) - log(1 - eps)) + sigma(-d) (logsig(-d) - log eps)
  kNcaPair,   ///< -logsig(beta dc) - logsig(-beta dc) / 2 - logsig(-beta dr) / 2
  kBcoPair,   ///< -logsig(beta dc) - logsig(-beta dr) (TRL also subtracts a running mean of
              ///< the rewards, state kept across steps; this per-call loss leaves it out)
  kSppoHard,  ///< (dc - 1 / (2 beta))^2 + (dr + 1 / (2 beta))^2
  kApoZero,   ///< (1 - sigma(beta dc)) + sigma(beta dr)
  kApoDown,   ///< sigma(beta dc) + (1 - sigma(d))
  kDiscoPop,  ///< -logsig(d) (1 - sigma(d / tau)) + exp(-d) sigma(d / tau)
};

std::string_view dpo_loss_name(DpoLoss t);
/// Parses a TRL name ("sigmoid", "exo_pair", ...); throws chunkloss::Error listing the names.
DpoLoss parse_dpo_loss(std::string_view name);

/// DPO (Rafailov et al. 2023) and its variants. d = beta ((c - c0) - (r - r0)). Without a
/// reference (neither PreferenceInputs::reference nor reference_logps) c0 = r0 = 0: the
/// reference-free form, so pass the reference unless that is what you want.
struct DpoOptions {
  DpoLoss loss_type = DpoLoss::kSigmoid;
  float beta = 0.1f;             ///< > 0
  float label_smoothing = 0.0f;  ///< eps: sigmoid [0, 0.5], robust [0, 0.5), exo_pair (0, 1)
  float discopop_tau = 0.05f;    ///< > 0
  /// Length-averaged log-probs instead of sums (ipo always averages).
  bool average_log_prob = false;
  /// The RPO NLL term: nll_alpha * mean CE over chosen tokens, when nll is on.
  bool nll = false;
  float nll_alpha = 1.0f;
  SequenceOptions engine;
};

/// ORPO (Hong et al. 2024): NLL(chosen) - beta * mean logsig(log odds ratio), on averages.
/// Reference-free. Extra metrics: log_odds_ratio (mean logsig), log_odds_chosen (mean log odds).
/// An averaged log-prob above -1e-6 (a sequence the model is all but certain of) counts as
/// -1e-6 in log(1 - exp(.)), value and derivative, so that the log odds and the gradient stay
/// finite (TRL's log1p(-exp(.)) has none at 0).
struct OrpoOptions {
  float beta = 0.1f;
  SequenceOptions engine;
};

/// SimPO (Meng et al. 2024): z = beta (avg(c) - avg(r)) - gamma, with gamma a margin in reward
/// units. TRL's CPO trainer (loss_type "simpo") writes the same z as
/// beta (avg(c) - avg(r) - simpo_gamma / beta), with simpo_gamma = gamma. Defaults are the
/// paper's beta = 2, gamma = 0.5 (TRL's CPOConfig: beta 0.1 and an NLL term, cpo_alpha 1).
/// Reference-free.
struct SimpoOptions {
  float beta = 2.0f;
  float gamma = 0.5f;  ///< >= 0
  float label_smoothing = 0.0f;
  float nll_alpha = 0.0f;  ///< optional NLL term over chosen tokens (0: off)
  SequenceOptions engine;
};

/// CPO (Xu et al. 2024): alpha NLL(chosen) + mean(-(1-eps) logsig(z) - eps logsig(-z)),
/// z = beta (c - r) on sums. Reference-free.
struct CpoOptions {
  float beta = 0.1f;
  float alpha = 1.0f;  ///< >= 0
  float label_smoothing = 0.0f;
  SequenceOptions engine;
};

/// KTO (Ethayarajh et al. 2024), unpaired: needs PreferenceInputs::labels; rho = logp - logp0;
/// z0 = max(0, KL) from PreferenceInputs::kl, or from kl_batch, else 0.
struct KtoOptions {
  float beta = 0.1f;
  float desirable_weight = 1.0f;
  float undesirable_weight = 1.0f;
  SequenceOptions engine;
};

class Dpo : public SequenceLoss {
 public:
  explicit Dpo(const DpoOptions& options = {});
};
class Orpo : public SequenceLoss {
 public:
  explicit Orpo(const OrpoOptions& options = {});
};
class Simpo : public SequenceLoss {
 public:
  explicit Simpo(const SimpoOptions& options = {});
};
class Cpo : public SequenceLoss {
 public:
  explicit Cpo(const CpoOptions& options = {});
};
class Kto : public SequenceLoss {
 public:
  explicit Kto(const KtoOptions& options = {});
};

}  // namespace chunkloss
