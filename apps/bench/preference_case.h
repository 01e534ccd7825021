// The device-independent part of the preference-loss cases of chunkloss-bench: the [S, T] batch
// (targets with a prompt of ignored rows, KTO labels), the loss object a case asks for, and the
// naive sequence-level math that turns materialised per-sequence log-probs into the loss and the
// per-sequence gradient coefficients (dL/dz_t = coef[s(t)] (softmax(z_t) - onehot(y_t))).
#pragma once

#include <chunkloss/losses/sequence.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench.h"

namespace chunkloss::bench {

inline constexpr std::int64_t kPreferenceIgnoreIndex = -100;

/// A preference batch: S = 2P sequences of T rows, row s*T + t. Paired losses: chosen [0, P),
/// rejected [P, 2P). KTO: the same layout, sequence s desirable when s is even.
struct PreferenceBatch {
  std::int64_t pairs = 0, seq_len = 0, sequences = 0, rows = 0;
  std::int64_t prompt = 0;            ///< ignored targets at the start of every sequence
  bool paired = true;                 ///< false: KTO (unpaired, labels)
  std::vector<std::int32_t> targets;  ///< [S * T]: uniform in [0, V) after the prompt, else -100
  std::vector<std::int32_t> labels;   ///< [S] (KTO only): 1 desirable, 0 undesirable
  std::vector<std::int64_t> tokens;   ///< [S]: valid targets per sequence (T - prompt)
  std::int64_t valid_rows = 0;
};

/// The batch of a case: targets from a 64-bit LCG seeded by config.seed (the same on every
/// device). Throws chunkloss::Error when the prompt leaves a sequence without a valid target.
PreferenceBatch make_preference_batch(const CaseConfig& config, std::int64_t vocab);

/// The loss the case asks for (config.loss, dpo_loss, label smoothing defaults), with the case's
/// budget, regime, loop order and fp32 dW accumulator in its engine options.
SequenceLoss make_preference_loss(const CaseConfig& config);

/// Number of floor GEMMs: 4 with a reference head (policy logits, reference logits, dX, dW),
/// else 3.
int preference_floor_gemms(const CaseConfig& config);

/// Per-sequence sums of materialised row statistics: logp[s] = sum over the valid rows t of s of
/// zy[t] - lse[t], in double.
template <typename S>
std::vector<double> sequence_log_probs(const PreferenceBatch& b, const S* lse, const S* zy) {
  std::vector<double> logp(static_cast<std::size_t>(b.sequences), 0.0);
  for (std::int64_t t = 0; t < b.rows; ++t)
    if (b.targets[static_cast<std::size_t>(t)] != kPreferenceIgnoreIndex)
      logp[static_cast<std::size_t>(t / b.seq_len)] +=
          static_cast<double>(zy[t]) - static_cast<double>(lse[t]);
  return logp;
}

/// The naive computation's verdict on a batch: its loss and the per-sequence coefficients.
struct NaiveSequenceResult {
  double loss = 0;
  std::vector<double> coef;  ///< [S]
  std::string how;           ///< where the sequence-level math came from, in words
};

/// The loss and coefficients from per-sequence policy and reference log-prob sums (ref_logp all
/// zero without a reference). The default option sets of every loss are written out here from
/// ../shared/LOSSES.md; DPO loss types other than sigmoid use the library's objective for the
/// per-pair math (the engine's part, mean over units and the NLL term, stays written out here).
NaiveSequenceResult naive_sequence_objective(const CaseConfig& config, const SequenceLoss& loss,
                                             const PreferenceBatch& b,
                                             const std::vector<double>& logp,
                                             const std::vector<double>& ref_logp);

/// Row coefficients [N] of precision S from the per-sequence ones (0 for ignored rows).
template <typename S>
std::vector<S> row_coefficients(const PreferenceBatch& b, const std::vector<double>& coef) {
  std::vector<S> out(static_cast<std::size_t>(b.rows), S(0));
  for (std::int64_t t = 0; t < b.rows; ++t)
    if (b.targets[static_cast<std::size_t>(t)] != kPreferenceIgnoreIndex)
      out[static_cast<std::size_t>(t)] =
          static_cast<S>(coef[static_cast<std::size_t>(t / b.seq_len)]);
  return out;
}

/// Fills the case-description fields of `res` (ignored_rows, reduction, valid_rows) and the
/// result's metrics from the loss's first call.
void describe_preference_case(const CaseConfig& config, const PreferenceBatch& b,
                              const PreferenceResult& first, CaseResult& res);

}  // namespace chunkloss::bench
