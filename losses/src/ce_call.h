// The validated call of a cross-entropy head, shared by LinearCrossEntropy and TokenLoss: the
// token engine's call and the scheduler's request.
#pragma once

#include <array>

#include "chunkloss/losses/cross_entropy.h"
#include "chunkloss/losses/plan.h"
#include "engine.h"

namespace chunkloss::detail {

struct CeCall {
  TokenCall call;
  PlanRequest request;
};

/// Checks the views of a call (shapes, dtypes, devices; with `calling` also the outputs and, on
/// the CPU, the values: targets' range, class weights, check_finite) and builds its token call
/// and plan request. Errors name `who`.
CeCall check_ce_call(const char* who, const CrossEntropyOptions& o, Device dev,
                     const CrossEntropyInputs& in, const CrossEntropyGrads& gr,
                     const CrossEntropyOutputs& out, bool calling);

/// Whether the call skips runs of ignored rows: skip_ignored_rows, in an order that skips (then
/// the caller sets k.row_ranges from the targets read on the host).
bool skips_rows(const CrossEntropyOptions& o, const Plan& plan, const TokenCall& k);

/// What the ranks of a vocabulary split compare before the first collective (their chunks'
/// collectives must match): the rows, the plan's chunks and the rows they compute, H, whether dH
/// is asked for (its rows are summed per chunk) and check_finite, and the vocabulary and the
/// options the rows' terms use (the rule digest).
constexpr std::size_t kVocabKind = 7;
std::array<double, kVocabKind> vocab_call_kind(const TokenCall& k, const Plan& plan,
                                               bool check_finite);

}  // namespace chunkloss::detail
