// The per-loss trainers of chunkloss-train (see trainers.h).
#include "trainers.h"

#include <chunkloss/core/context.h>
#include <chunkloss/data/jsonl.h>
#include <chunkloss/losses/cross_entropy.h>

#include <numeric>

namespace chunkloss::train {
namespace {

double input_tokens(const data::Batch& b) {
  return std::accumulate(b.lengths.begin(), b.lengths.end(), 0.0);
}

// Gradient of the loss w.r.t. the final hidden states, reused across steps.
class HiddenGrad {
 public:
  TensorView view(const TensorView& hidden) {
    buf_.assign(static_cast<std::size_t>(hidden.numel()), 0.0f);
    return TensorView::of(buf_.data(), {hidden.size(0), hidden.size(1)});
  }

 private:
  std::vector<float> buf_;
};

class CeTrainer final : public Trainer {
 public:
  CeTrainer(const DataSettings& data, const LossSettings& loss, int threads) : ctx_(threads) {
    const data::ByteTokenizer tok;
    seqs_ = data::encode_sft(tok, data::read_sft_jsonl(data.file), data.encode);
    CrossEntropyOptions o;
    o.label_smoothing = static_cast<float>(loss.label_smoothing);
    o.memory_budget_bytes = loss.budget_bytes;
    ce_ = LinearCrossEntropy(o);
  }
  std::size_t size() const override { return seqs_.size(); }
  std::pair<const char*, const char*> accuracy_metric() const override {
    return {"token_accuracy", "token acc"};
  }

  MicroStats step(model::LlamaModel& model, std::span<const std::size_t> examples) override {
    const data::Batch batch = data::collate_sft(seqs_, examples);
    CrossEntropyInputs in;
    in.hidden = model.forward(batch.tokens_view());
    in.weight = model.lm_head_weight();
    in.targets = batch.targets_view();
    CrossEntropyGrads g;
    g.hidden = dh_.view(in.hidden);
    g.weight = model.lm_head_weight_grad();
    g.accumulate = true;
    const CrossEntropyResult r =
        ce_.forward_backward(ctx_, in, g, {}, ws_.get(ce_.workspace_bytes(in, g)));
    model.backward(g.hidden);
    return {r.loss, {{"token_accuracy", r.accuracy}}, input_tokens(batch)};
  }

 private:
  CpuContext ctx_;
  std::vector<data::Sequence> seqs_;
  LinearCrossEntropy ce_;
  apps::HostWorkspace ws_;
  HiddenGrad dh_;
};

}  // namespace

std::unique_ptr<Trainer> make_ce_trainer(const DataSettings& data, const LossSettings& loss,
                                         int threads) {
  return std::make_unique<CeTrainer>(data, loss, threads);
}

}  // namespace chunkloss::train
