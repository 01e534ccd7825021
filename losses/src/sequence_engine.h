// The shared engine for sequence objectives: pass 1 (row statistics, per-sequence sums of token
// log-probs and logits), the objective on the host between the passes, and pass 2 (the gradient
// epilogue with the per-sequence coefficients and the two gradient GEMMs), in the plan's regime.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "engine.h"

namespace chunkloss::detail {

/// A validated sequence call: the policy's token call (plain rule, sum scale, logit sums), the
/// reference's per-sequence sums and the host-side row layout.
struct SequenceCall {
  TokenCall policy;
  std::vector<double> ref_logps;  ///< [S] the reference's sums (empty: no reference, all 0)
  std::int64_t sequences = 0, seq_len = 0;
  std::int64_t unit_sequences = 1;  ///< 2: pairs (s, s + S/2)
  std::vector<std::uint8_t> valid;  ///< [S*T]: the row's target is not ignore_index
  /// Regime::kDeferred: each sequence's share kappa[s] of its pair's coefficient,
  /// coef[s] = gamma * kappa[s] (+-1, or +-1/tokens when averaging).
  std::vector<double> kappa;
};

/// Per-sequence sums from pass 1 over the policy (logp, logit_sum) and the reference (ref_logp).
struct SequenceSums {
  std::vector<double> logp, ref_logp, logit_sum;
};

/// Evaluates units [u0, u1) from the sums and writes coef[s] for each of their sequences s:
/// dL/dz_t = coef[s] (p_t - onehot_t) for the valid rows t of s. In the deferred regime the
/// first call is for the deferred pair alone (u0 = 0, u1 = 1), and the caller checks that its
/// coefficients are gamma * kappa.
using UnitsFn = std::function<void(std::int64_t u0, std::int64_t u1, const SequenceSums& sums,
                                   std::vector<double>& coef)>;

/// Runs pass 1, `on_units` per group (once for all units in the recompute regime) and, when the
/// policy call asks for gradients, pass 2.
SequenceSums run_sequence_objective(Context& ctx, const SequenceCall& call, const Plan& plan,
                                    const Workspace& ws, const UnitsFn& on_units);

/// Pass 1 only over one head: per-sequence sums of token log-probs (valid rows of `valid`).
std::vector<double> sequence_log_probs(Context& ctx, const TokenCall& head, const Plan& plan,
                                       const Workspace& ws, std::int64_t seq_len,
                                       const std::vector<std::uint8_t>& valid);

}  // namespace chunkloss::detail
