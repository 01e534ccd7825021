// Glue shared by chunkloss-train and chunkloss-eval: a reusable aligned host workspace, the
// bundled data files, and the model + loss passes both apps run (token cross-entropy of a batch,
// per-sequence log-probs).
#pragma once

#include <chunkloss/core/context.h>
#include <chunkloss/core/workspace.h>
#include <chunkloss/data/batch.h>
#include <chunkloss/losses/cross_entropy.h>
#include <chunkloss/losses/sequence.h>
#include <chunkloss/model/model.h>

#include <cstddef>
#include <memory>
#include <string>

namespace chunkloss::apps {

/// A host block for loss workspaces, aligned to kWorkspaceAlignment, grown on demand and reused.
class HostWorkspace {
 public:
  Workspace get(std::size_t bytes);

 private:
  std::unique_ptr<std::byte[]> storage_;
  std::size_t capacity_ = 0;
};

/// A file of the bundled data set (apps/data in the source tree), e.g. "sft_train.jsonl".
std::string bundled_data(const std::string& name);

/// The mean token cross-entropy of `model` over the batch's trained targets (forward only), with
/// the number of those targets and the token accuracy.
CrossEntropyResult batch_cross_entropy(Context& ctx, model::LlamaModel& model,
                                       const data::Batch& batch, std::size_t budget_bytes,
                                       HostWorkspace& workspace);

/// The [S, T] target view of a batch, as the sequence losses take it.
TensorView sequence_targets(const data::Batch& batch);

/// Per-sequence sums of the token log-probs of `model` on the batch's trained targets (forward
/// only), from the library's SequenceLogProbs on the final hidden states and the lm_head.
SequenceLogProbResult sequence_logps(Context& ctx, model::LlamaModel& model,
                                     const data::Batch& batch, std::size_t budget_bytes,
                                     HostWorkspace& workspace);

}  // namespace chunkloss::apps
