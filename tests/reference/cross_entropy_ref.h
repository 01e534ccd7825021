// Naive dense float64 oracle of LinearCrossEntropy: materialise all [N, V] logits in double,
// softcap, softmax, the loss of every option, then the analytic gradients. No chunking, no
// shortcuts; it follows the dense formula of cross_entropy.h's class comment term by term.
#pragma once

#include <chunkloss/losses/cross_entropy.h>

#include <cstdint>
#include <vector>

namespace chunkloss::reference {

/// One cross-entropy problem in double. Optional vectors are empty when absent.
struct CeProblem {
  std::int64_t n = 0, h = 0, v = 0;
  std::vector<double> hidden;         ///< [N, H]
  std::vector<double> weight;         ///< [V, H]
  std::vector<double> bias;           ///< [V] or empty
  std::vector<std::int64_t> targets;  ///< [N], in [0, V) or ignore_index
  std::vector<double> class_weights;  ///< [V] or empty
  std::vector<double> token_weights;  ///< [N] or empty
  std::vector<double> grad_output;    ///< [N] or empty (reduction none; empty means all 1)
};

/// The options that change the math, in double.
struct CeConfig {
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::kMean;
  double label_smoothing = 0;
  double z_loss = 0;
  double softcap = 0;  ///< 0: none

  static CeConfig from(const CrossEntropyOptions& o);
};

struct CeResult {
  double loss = 0;    ///< reduced loss; the sum of row losses for reduction none
  double z_loss = 0;  ///< the z-loss part of `loss`
  double accuracy = 0;
  double entropy = 0;  ///< mean softmax entropy over valid rows
  std::int64_t valid_rows = 0;
  double weight_sum = 0;  ///< the mean's divisor
  /// sum_t grad_output_t * row_loss_t for reduction none, else `loss`: the function whose
  /// gradient grad_hidden/grad_weight/grad_bias are.
  double objective = 0;
  std::vector<double> row_loss;           ///< [N], 0 for ignored rows
  std::vector<double> lse;                ///< [N], every row
  std::vector<std::int32_t> predictions;  ///< [N], first argmax, -1 for ignored rows
  std::vector<double> grad_hidden;        ///< [N, H]
  std::vector<double> grad_weight;        ///< [V, H]
  std::vector<double> grad_bias;          ///< [V] (zeros when there is no bias)
};

/// Loss, metrics, per-row outputs and gradients of `p` under `c`.
CeResult cross_entropy(const CeProblem& p, const CeConfig& c);

/// Only `objective` of cross_entropy(p, c) (skips the gradients): for finite differences.
double cross_entropy_objective(const CeProblem& p, const CeConfig& c);

}  // namespace chunkloss::reference
