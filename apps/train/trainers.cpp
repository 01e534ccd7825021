// The per-loss trainers of chunkloss-train (see trainers.h).
#include "trainers.h"

#include <chunkloss/data/jsonl.h>
#include <chunkloss/losses/cross_entropy.h>
#include <chunkloss/losses/preference.h>

#include <chunkloss/core/error.h>

#include <algorithm>
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

CrossEntropyOptions ce_options(const LossSettings& loss) {
  CrossEntropyOptions o;
  o.label_smoothing = static_cast<float>(loss.label_smoothing);
  o.z_loss = static_cast<float>(loss.z_loss);
  o.skip_ignored_rows = loss.skip_ignored_rows;
  o.memory_budget_bytes = loss.budget_bytes;
  return o;
}

class CeTrainer final : public Trainer {
 public:
  CeTrainer(const DataSettings& data, const LossSettings& loss, LossDevice& device) : dev_(device) {
    const data::ByteTokenizer tok;
    const std::vector<data::SftExample> examples = data::parse_sft_jsonl(data.text, data.file);
    seqs_ = data::encode_sft(tok, examples, data.encode);
    for (const data::SftExample& e : examples) lines_.push_back(e.line);
    ce_ = LinearCrossEntropy(ce_options(loss));
  }
  std::size_t size() const override { return seqs_.size(); }
  apps::Longest longest() const override {
    apps::Longest l;
    for (std::size_t i = 0; i < seqs_.size(); ++i) l.take(seqs_[i], lines_[i]);
    return l;
  }
  std::pair<const char*, const char*> accuracy_metric() const override {
    return {"token_accuracy", "token acc"};
  }

  double step_weight(std::span<const std::size_t> examples) const override {
    double targets = 0;
    for (const std::size_t i : examples) targets += static_cast<double>(seqs_[i].count_targets());
    return targets;
  }

  MicroStats step(model::LlamaModel& model, std::span<const std::size_t> examples,
                  double weight) override {
    const data::Batch batch = data::collate_sft(seqs_, own(examples));
    const TensorView hidden = model.forward(batch.tokens_view());
    const TensorView d_hidden = dh_.view(hidden);
    const VocabShard sh = shard(model);
    dev_.begin();
    CrossEntropyInputs in;
    in.hidden = dev_.in(hidden);
    in.weight = dev_.in(apps::lm_head_rows(model.lm_head_weight(), sh));
    in.targets = dev_.in(batch.targets_view());
    in.vocab_shard = sh;
    in.data_group = data_group_;
    if (weight != 1.0) {  // (every row's loss scaled; not part of the mean's divisor)
      weights_.assign(static_cast<std::size_t>(batch.targets_view().numel()),
                      static_cast<float>(weight));
      in.token_weights = dev_.in(TensorView::of(weights_.data(), {batch.targets_view().numel()}));
    }
    CrossEntropyGrads g;
    g.hidden = dev_.inout(d_hidden);
    g.weight = dev_.inout(apps::lm_head_rows(model.lm_head_weight_grad(), sh));
    g.accumulate = true;
    const CrossEntropyResult r =
        ce_.forward_backward(dev_.context(), in, g, {}, dev_.workspace(ce_.workspace_bytes(in, g)));
    dev_.end();
    if (runs_backward()) model.backward(d_hidden);
    MicroStats stats{r.loss / weight, {{"token_accuracy", r.accuracy}}, input_tokens(batch)};
    if (ce_.options().z_loss > 0) stats.metrics.emplace_back("z_loss", r.z_loss / weight);
    return stats;
  }

 private:
  LossDevice& dev_;
  std::vector<data::Sequence> seqs_;
  std::vector<float> weights_;      // token weights of a micro-batch of weight != 1
  std::vector<std::size_t> lines_;  // each example's line in the file
  LinearCrossEntropy ce_;
  HiddenGrad dh_;
};

// Per-sequence log-prob sums of a model on a batch as f32 (the loss's reference_logps dtype),
// from SequenceLogProbs on the loss's device.
class LogProbs {
 public:
  LogProbs(const LossSettings& loss, LossDevice& device)
      : dev_(device), budget_(loss.budget_bytes) {}
  std::vector<float> operator()(model::LlamaModel& m, const data::Batch& b,
                                const VocabShard& shard) {
    const SequenceLogProbResult r = apps::sequence_logps(dev_, m, b, budget_, shard);
    return {r.logps.begin(), r.logps.end()};
  }

 private:
  LossDevice& dev_;
  std::size_t budget_;
};

// One forward_backward of a sequence loss on the policy, then the model's backward (when
// `backward`). Of `host` the per-sequence inputs reference_logps, labels and kl are used (host
// views: the loss reads them on the host on either device), the data group and the vocabulary
// shard (the policy's lm_head rows the call holds).
MicroStats policy_step(LossDevice& dev, const SequenceLoss& loss, model::LlamaModel& model,
                       const data::Batch& batch, const PreferenceInputs& host, HiddenGrad& dh,
                       bool backward) {
  const TensorView hidden = model.forward(batch.tokens_view());
  const TensorView d_hidden = dh.view(hidden);
  const VocabShard& sh = host.vocab_shard;
  dev.begin();
  PreferenceInputs in;
  in.policy = {dev.in(hidden), dev.in(apps::lm_head_rows(model.lm_head_weight(), sh)), {}};
  in.targets = dev.in(apps::sequence_targets(batch));
  in.reference_logps = host.reference_logps;
  in.labels = host.labels;
  in.kl = host.kl;
  in.data_group = host.data_group;
  in.vocab_shard = sh;
  PreferenceGrads g;
  g.hidden = dev.inout(d_hidden);
  g.weight = dev.inout(apps::lm_head_rows(model.lm_head_weight_grad(), sh));
  g.accumulate = true;
  const PreferenceResult r =
      loss.forward_backward(dev.context(), in, g, dev.workspace(loss.workspace_bytes(in, g)));
  dev.end();
  if (backward) model.backward(d_hidden);
  return {r.loss, r.metrics, input_tokens(batch)};
}

float beta_or(double beta, float fallback) {
  return beta > 0 ? static_cast<float>(beta) : fallback;
}

SequenceLoss make_pair_loss(const LossSettings& s) {
  SequenceOptions engine;
  engine.memory_budget_bytes = s.budget_bytes;
  const auto ls = static_cast<float>(s.label_smoothing);
  if (s.loss == "dpo") {
    DpoOptions o;
    o.loss_type = parse_dpo_loss(s.dpo_loss_type);
    o.beta = beta_or(s.beta, o.beta);
    o.label_smoothing = ls;
    o.discopop_tau = static_cast<float>(s.discopop_tau);
    o.nll = s.rpo_alpha > 0;
    o.nll_alpha = o.nll ? static_cast<float>(s.rpo_alpha) : o.nll_alpha;
    o.engine = engine;
    return Dpo(o);
  }
  if (s.loss == "orpo") {
    OrpoOptions o;
    o.beta = beta_or(s.beta, o.beta);
    o.engine = engine;
    return Orpo(o);
  }
  if (s.loss == "simpo") {
    SimpoOptions o;
    o.beta = beta_or(s.beta, o.beta);
    o.gamma = static_cast<float>(s.gamma);
    o.nll_alpha = static_cast<float>(s.simpo_alpha);
    o.label_smoothing = ls;
    o.engine = engine;
    return Simpo(o);
  }
  CHUNKLOSS_CHECK(s.loss == "cpo", "make_pair_trainer: --loss ", s.loss, " is not a paired loss");
  CpoOptions o;
  o.beta = beta_or(s.beta, o.beta);
  o.alpha = static_cast<float>(s.cpo_alpha);
  o.label_smoothing = ls;
  o.engine = engine;
  return Cpo(o);
}

class PairTrainer final : public Trainer {
 public:
  PairTrainer(const DataSettings& data, const LossSettings& loss, LossDevice& device,
              std::optional<model::LlamaModel> reference)
      : dev_(device),
        loss_(make_pair_loss(loss)),
        reference_(std::move(reference)),
        ref_logps_(loss, device) {
    CHUNKLOSS_CHECK(reference_.has_value() == loss_.objective().uses_reference(), "--loss ",
                    loss.loss, reference_ ? " takes no reference model" : " needs a reference");
    const data::ByteTokenizer tok;
    const std::vector<data::PreferenceExample> examples =
        data::parse_preference_jsonl(data.text, data.file);
    pairs_ = data::encode_preference(tok, examples, data.encode);
    for (const data::PreferenceExample& e : examples) lines_.push_back(e.line);
  }
  std::size_t size() const override { return pairs_.size(); }
  apps::Longest longest() const override {
    apps::Longest l;
    for (std::size_t i = 0; i < pairs_.size(); ++i) l.take(pairs_[i], lines_[i]);
    return l;
  }
  std::pair<const char*, const char*> accuracy_metric() const override {
    return {"rewards/accuracies", "reward acc"};
  }

  MicroStats step(model::LlamaModel& model, std::span<const std::size_t> examples,
                  double /*weight: 1, as step_weight gives*/) override {
    const data::Batch batch = data::collate_preference(pairs_, own(examples));
    PreferenceInputs in;
    in.data_group = data_group_;
    in.vocab_shard = shard(model);
    std::vector<float> ref;
    if (reference_) {
      ref = ref_logps_(*reference_, batch, in.vocab_shard);
      in.reference_logps = TensorView::of(ref.data(), {batch.rows});
    }
    return policy_step(dev_, loss_, model, batch, in, dh_, runs_backward());
  }

 private:
  LossDevice& dev_;
  SequenceLoss loss_;
  std::optional<model::LlamaModel> reference_;
  LogProbs ref_logps_;
  std::vector<data::PreferenceSequences> pairs_;
  std::vector<std::size_t> lines_;  // each pair's line in the file
  HiddenGrad dh_;
};

SequenceLoss make_kto_loss(const LossSettings& s) {
  KtoOptions o;
  o.beta = beta_or(s.beta, o.beta);
  o.desirable_weight = static_cast<float>(s.desirable_weight);
  o.undesirable_weight = static_cast<float>(s.undesirable_weight);
  o.engine.memory_budget_bytes = s.budget_bytes;
  return Kto(o);
}

class KtoTrainer final : public Trainer {
 public:
  KtoTrainer(const DataSettings& data, const LossSettings& loss, LossDevice& device,
             model::LlamaModel reference)
      : dev_(device),
        loss_(make_kto_loss(loss)),
        reference_(std::move(reference)),
        logps_(loss, device),
        encode_(data.encode) {
    examples_ = data::parse_unpaired_jsonl(data.text, data.file);
    seqs_ = data::encode_unpaired(tok_, examples_, encode_);
  }
  std::size_t size() const override { return seqs_.size(); }
  apps::Longest longest() const override {
    apps::Longest l;
    for (std::size_t i = 0; i < seqs_.size(); ++i) l.take(seqs_[i].sequence, examples_[i].line);
    // A mismatched pair's length grows with its prompt and its completion (truncation keeps
    // that order), so the longest prompt with the longest completion bounds them all.
    const auto by = [&](auto field) {
      return static_cast<std::size_t>(std::max_element(examples_.begin(), examples_.end(),
                                                       [&](const auto& a, const auto& b) {
                                                         return (a.*field).size() <
                                                                (b.*field).size();
                                                       }) -
                                      examples_.begin());
    };
    const std::size_t p = by(&data::UnpairedExample::prompt),
                      c = by(&data::UnpairedExample::completion);
    l.take(data::encode(tok_, examples_[p].prompt, examples_[c].completion, encode_), 0,
           "the KL pair of line " + std::to_string(examples_[p].line) + "'s prompt and line " +
               std::to_string(examples_[c].line) + "'s completion");
    return l;
  }
  std::pair<const char*, const char*> accuracy_metric() const override {
    return {"rewards/margins", "reward margin"};
  }

  MicroStats step(model::LlamaModel& model, std::span<const std::size_t> examples,
                  double /*weight: 1, as step_weight gives*/) override {
    CHUNKLOSS_CHECK(examples.size() >= 2, "kto: a micro-batch of ", examples.size(),
                    " example has no mismatched pairs for the KL estimate; use --batch-size >= 2");
    // The rank's examples, and their mismatched pairs: prompt i with completion i + 1 over the
    // whole micro-batch, so the pairs do not depend on how it is split.
    const std::span<const std::size_t> mine = own(examples);
    const data::Batch batch = data::collate_unpaired(seqs_, mine);
    std::vector<data::Sequence> mismatched;
    const auto first = static_cast<std::size_t>(mine.data() - examples.data());
    for (std::size_t i = first; i < first + mine.size(); ++i) {
      const data::UnpairedExample& p = examples_[examples[i]];
      const data::UnpairedExample& c = examples_[examples[(i + 1) % examples.size()]];
      mismatched.push_back(data::encode(tok_, p.prompt, c.completion, encode_));
    }
    std::vector<std::size_t> all(mismatched.size());
    for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
    const data::Batch kl_batch = data::collate_sft(mismatched, all);
    const VocabShard sh = shard(model);
    const std::vector<float> kl_ref = logps_(reference_, kl_batch, sh);
    const std::vector<float> kl_policy = logps_(model, kl_batch, sh);
    // The mean over the group's mismatched pairs, as TRL gathers them.
    double kl[2] = {0, static_cast<double>(kl_ref.size())};
    for (std::size_t i = 0; i < kl_ref.size(); ++i)
      kl[0] += static_cast<double>(kl_policy[i]) - static_cast<double>(kl_ref[i]);
    if (data_group_) data_group_->all_reduce_sum(host_, kl, 2);

    PreferenceInputs in;
    in.data_group = data_group_;
    in.vocab_shard = sh;
    const std::vector<float> ref = logps_(reference_, batch, sh);
    in.reference_logps = TensorView::of(ref.data(), {batch.rows});
    std::vector<std::int32_t> labels(batch.labels.begin(), batch.labels.end());
    in.labels = TensorView::of(labels.data(), {batch.rows});
    in.kl = std::max(0.0, kl[0] / kl[1]);
    return policy_step(dev_, loss_, model, batch, in, dh_, runs_backward());
  }

 private:
  LossDevice& dev_;
  SequenceLoss loss_;
  model::LlamaModel reference_;
  LogProbs logps_;
  data::EncodeOptions encode_;
  data::ByteTokenizer tok_;
  std::vector<data::UnpairedExample> examples_;
  std::vector<data::LabeledSequence> seqs_;
  HiddenGrad dh_;
  CpuContext host_;  // the KL sums' collective (host memory)
};

}  // namespace

void check_loss_settings(const LossSettings& loss) {
  if (loss.loss == "ce") {
    (void)LinearCrossEntropy(ce_options(loss));
  } else if (loss.loss == "kto") {
    (void)make_kto_loss(loss);
  } else {
    (void)make_pair_loss(loss);
  }
}

std::unique_ptr<Trainer> make_pair_trainer(const DataSettings& data, const LossSettings& loss,
                                           LossDevice& device,
                                           std::optional<model::LlamaModel> reference) {
  return std::make_unique<PairTrainer>(data, loss, device, std::move(reference));
}

std::unique_ptr<Trainer> make_kto_trainer(const DataSettings& data, const LossSettings& loss,
                                          LossDevice& device, model::LlamaModel reference) {
  return std::make_unique<KtoTrainer>(data, loss, device, std::move(reference));
}

std::unique_ptr<Trainer> make_ce_trainer(const DataSettings& data, const LossSettings& loss,
                                         LossDevice& device) {
  return std::make_unique<CeTrainer>(data, loss, device);
}

}  // namespace chunkloss::train
