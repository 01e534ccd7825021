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

// The case's engine options, which CrossEntropyOptions and TokenOptions name alike.
template <typename Options>
Options case_options(const CaseConfig& c) {
  Options o;
  o.memory_budget_bytes = c.budget_bytes;
  o.loop_order = c.order;
  o.logits_dtype = c.logits_dtype;
  o.fp32_weight_grad_accumulator = c.fp32_weight_grad_accumulator;
  o.skip_ignored_rows = c.skip_ignored_rows;
  return o;
}

TokenInputs token_inputs(const CrossEntropyInputs& in) {
  return {in.hidden, in.weight, in.bias, in.targets};
}

}  // namespace

CeLoss::CeLoss(const CaseConfig& c) : ce_(case_options<CrossEntropyOptions>(c)) {
  CHUNKLOSS_CHECK(c.token_objective == "none" || c.token_objective == "nll",
                  "bench: --token-objective must be none or nll, got '", c.token_objective, "'");
  if (c.token_objective == "none") return;
  token_.emplace(std::make_shared<Nll>(), case_options<TokenOptions>(c));
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
