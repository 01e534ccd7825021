// Glue shared by the training and evaluation apps (see tuning.h).
#include "chunkloss/apps/tuning.h"

#include <memory>

namespace chunkloss::apps {

Workspace HostWorkspace::get(std::size_t bytes) {
  if (bytes > capacity_ || !storage_) {
    storage_ = std::make_unique<std::byte[]>(bytes + kWorkspaceAlignment);
    capacity_ = bytes;
  }
  void* p = storage_.get();
  std::size_t space = capacity_ + kWorkspaceAlignment;
  return Workspace(std::align(kWorkspaceAlignment, capacity_, p, space), bytes);
}

std::string bundled_data(const std::string& name) {
  return std::string(CHUNKLOSS_BUNDLED_DATA_DIR) + "/" + name;
}

CrossEntropyResult batch_cross_entropy(Context& ctx, model::LlamaModel& model,
                                       const data::Batch& batch, std::size_t budget_bytes,
                                       HostWorkspace& workspace) {
  CrossEntropyOptions o;
  o.memory_budget_bytes = budget_bytes;
  const LinearCrossEntropy ce(o);
  CrossEntropyInputs in;
  in.hidden = model.forward(batch.tokens_view());
  in.weight = model.lm_head_weight();
  in.targets = batch.targets_view();
  return ce.forward(ctx, in, {}, workspace.get(ce.workspace_bytes(in)));
}

TensorView sequence_targets(const data::Batch& batch) {
  return TensorView::of(batch.targets.data(), {batch.rows, batch.length});
}

SequenceLogProbResult sequence_logps(Context& ctx, model::LlamaModel& model,
                                     const data::Batch& batch, std::size_t budget_bytes,
                                     HostWorkspace& workspace) {
  SequenceOptions o;
  o.memory_budget_bytes = budget_bytes;
  const SequenceLogProbs utility(o);
  const Head head{model.forward(batch.tokens_view()), model.lm_head_weight(), {}};
  const TensorView targets = sequence_targets(batch);
  return utility.compute(ctx, head, targets, workspace.get(utility.workspace_bytes(head, targets)));
}

}  // namespace chunkloss::apps
