#include "ce_loss.h"

#include <chunkloss/core/error.h>

#include <memory>
#include <span>
#include <string_view>

namespace chunkloss::bench {
namespace {

// Cross-entropy as a token objective: loss -logp, d loss / d logp = -1.
class Nll final : public TokenObjective {
 public:
  std::string_view name() const override { return "Nll"; }
  TokenValue evaluate(const TokenStats& row, std::span<double>) const override {
    return {-row.logp, -1.0};
  }
};

TokenInputs token_inputs(const CrossEntropyInputs& in) {
  return {in.hidden, in.weight, in.bias, in.targets};
}

}  // namespace

CeLoss::CeLoss(const CaseConfig& c, const CrossEntropyOptions& o) : ce_(o) {
  CHUNKLOSS_CHECK(c.token_objective == "none" || c.token_objective == "nll",
                  "bench: --token-objective must be none or nll, got '", c.token_objective, "'");
  if (c.token_objective == "none") return;
  TokenOptions t;
  t.ignore_index = o.ignore_index;
  t.reduction = o.reduction;
  t.memory_budget_bytes = o.memory_budget_bytes;
  t.loop_order = o.loop_order;
  t.logits_dtype = o.logits_dtype;
  t.fp32_weight_grad_accumulator = o.fp32_weight_grad_accumulator;
  t.check_finite = o.check_finite;
  t.skip_ignored_rows = o.skip_ignored_rows;
  token_.emplace(std::make_shared<Nll>(), t);
}

Plan CeLoss::plan(const CrossEntropyInputs& in, const CrossEntropyGrads& grads) const {
  return token_ ? token_->plan(token_inputs(in), grads) : ce_.plan(in, grads);
}

double CeLoss::forward_backward(Context& ctx, const CrossEntropyInputs& in,
                                const CrossEntropyGrads& grads, const Workspace& ws) const {
  if (token_) return token_->forward_backward(ctx, token_inputs(in), grads, ws).loss;
  return ce_.forward_backward(ctx, in, grads, {}, ws).loss;
}

}  // namespace chunkloss::bench
