// The cross-entropy loss object a ce case times: LinearCrossEntropy, or with --token-objective
// nll the same mean cross-entropy as a token objective on TokenLoss, which runs the objective on
// the host between each chunk's statistics and its gradient (the cost of that extension point).
#pragma once

#include <chunkloss/core/context.h>
#include <chunkloss/core/workspace.h>
#include <chunkloss/losses/cross_entropy.h>
#include <chunkloss/losses/token.h>

#include <optional>

#include "bench.h"

namespace chunkloss::bench {

class CeLoss {
 public:
  /// The case's options (budget, order, logits dtype, dW accumulator, skipping), the mean
  /// reduction.
  explicit CeLoss(const CaseConfig& c);

  Plan plan(const CrossEntropyInputs& in, const CrossEntropyGrads& grads) const;
  /// The call's loss (hidden, weight and targets of `in`; the token loss takes no other input).
  double forward_backward(Context& ctx, const CrossEntropyInputs& in,
                          const CrossEntropyGrads& grads, const Workspace& ws) const;

 private:
  LinearCrossEntropy ce_;
  std::optional<TokenLoss> token_;
};

}  // namespace chunkloss::bench
