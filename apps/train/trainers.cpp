// The per-loss trainers of chunkloss-train (see trainers.h).
#include "trainers.h"

#include <chunkloss/core/error.h>
#include <chunkloss/data/jsonl.h>
#include <chunkloss/data/sampler.h>
#include <chunkloss/losses/cross_entropy.h>
#include <chunkloss/losses/grpo.h>
#include <chunkloss/losses/preference.h>
#include <chunkloss/losses/token.h>
#include <chunkloss/model/generate.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
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

GrpoOptions grpo_options(const LossSettings& s) {
  GrpoOptions o;
  o.beta = s.beta;  // (its default is 0: no KL term)
  o.epsilon_low = s.epsilon_low;
  o.epsilon_high = s.epsilon_high < 0 ? s.epsilon_low : s.epsilon_high;
  o.delta = s.delta;
  o.importance_sampling_level = parse_importance_sampling_level(s.importance_sampling_level);
  return o;
}

// Online GRPO (see make_grpo_trainer).
class GrpoTrainer final : public Trainer {
 public:
  GrpoTrainer(const DataSettings& data, const LossSettings& loss, LossDevice& device,
              std::uint64_t seed, std::optional<model::LlamaModel> reference)
      : dev_(device),
        settings_(loss),
        seed_(seed),
        max_length_(data.encode.max_length),
        type_(parse_grpo_loss(loss.grpo_loss_type)),
        options_(grpo_options(loss)),
        reference_(std::move(reference)) {
    CHUNKLOSS_CHECK(reference_.has_value() == (loss.beta > 0), "--loss grpo ",
                    reference_ ? "takes no reference model without --beta"
                               : "with --beta > 0 needs a reference model");
    CHUNKLOSS_CHECK(loss.num_generations >= 2, "--num-generations ", loss.num_generations,
                    " must be >= 2 (a group's advantages are relative to each other)");
    examples_ = data::parse_sft_jsonl(data.text, data.file);
    // A prompt keeps its last --max-prompt-length bytes and, under --max-length, room for one
    // completion token (data::encode's rule).
    std::size_t keep = std::string::npos;
    if (data.encode.max_prompt_length > 0)
      keep = static_cast<std::size_t>(data.encode.max_prompt_length);
    if (max_length_ > 0) keep = std::min(keep, static_cast<std::size_t>(max_length_ - 1));
    std::size_t unmatchable = 0, worst = 0;
    for (std::size_t i = 0; i < examples_.size(); ++i) {
      const data::SftExample& e = examples_[i];
      CHUNKLOSS_CHECK(!e.prompt.empty(), data.file, ":", e.line,
                      ": grpo samples completions of a prompt, and this line has none ({\"text\"} "
                      "lines and empty prompts are for SFT)");
      std::string_view p = e.prompt;
      if (p.size() > keep) p.remove_prefix(p.size() - keep);
      prompts_.push_back(apps::prompt_ids(tok_, p));
      // (the answer's bytes and its EOS must fit in the new tokens for a reward of 1)
      if (static_cast<std::int64_t>(e.completion.size()) + 1 > new_tokens(i)) {
        if (unmatchable++ == 0 || e.completion.size() > examples_[worst].completion.size())
          worst = i;
      }
    }
    const bool any_fits = unmatchable < examples_.size();
    const std::string bound =
        "--max-completion-length " + std::to_string(loss.max_completion_length) +
        (max_length_ > 0 ? " under --max-length " + std::to_string(max_length_) : std::string());
    CHUNKLOSS_CHECK(any_fits, data.file,
                    ": no example's answer fits in the new tokens (its bytes and EOS; line ",
                    examples_[worst].line, " needs ", examples_[worst].completion.size() + 1, ", ",
                    bound, "), so every reward would be 0");
    if (unmatchable > 0)
      warning_ = std::to_string(unmatchable) + " of " + std::to_string(examples_.size()) +
                 " answers in " + data.file +
                 " need more new tokens than --max-completion-length (and --max-length) leave "
                 "(their bytes and EOS; line " +
                 std::to_string(examples_[worst].line) + " needs " +
                 std::to_string(examples_[worst].completion.size() + 1) +
                 "), so they can never score";
    CrossEntropyOptions ref;
    ref.reduction = Reduction::kNone;
    ref.skip_ignored_rows = true;
    ref.memory_budget_bytes = loss.budget_bytes;
    ref_ce_ = LinearCrossEntropy(ref);
  }
  std::size_t size() const override { return examples_.size(); }
  apps::Longest longest() const override {
    apps::Longest l;
    for (std::size_t i = 0; i < examples_.size(); ++i) {
      data::Sequence s;  // (only its length counts: the prompt's, then every new token's)
      s.tokens.resize(prompts_[i].size() - 1 + static_cast<std::size_t>(new_tokens(i)));
      l.take(s, examples_[i].line, "the prompt with --max-completion-length new tokens");
    }
    return l;
  }
  std::pair<const char*, const char*> accuracy_metric() const override {
    return {"reward", "reward"};
  }
  std::string warning() const override { return warning_; }

  MicroStats step(model::LlamaModel& model, std::span<const std::size_t> examples,
                  double /*weight: 1, as step_weight gives*/) override {
    // The micro-batch's rollouts: sampled at the first step of each num_iterations, then reused
    // (with the micro-batches, which the main loop repeats).
    const std::int64_t iteration = step_ % settings_.num_iterations;
    const std::size_t micro = micro_++;
    if (iteration == 0) {
      if (micro == 0) cache_.clear();
      cache_.push_back(sample(model, examples, micro));
    }
    CHUNKLOSS_CHECK(
        micro < cache_.size() && cache_[micro].examples.size() == examples.size() &&
            std::equal(examples.begin(), examples.end(), cache_[micro].examples.begin()),
        "grpo: step ", step_ + 1, " is iteration ", iteration + 1, " of ", settings_.num_iterations,
        " on rollouts sampled at step ", step_ - iteration + 1,
        " that this process has not sampled (a run resumes at a multiple of "
        "--num-iterations), or its micro-batch differs");
    Rollouts& ro = cache_[micro];

    const VocabShard sh = shard(model);
    if (iteration == 0 && reference_) ro.ref_logps = token_logps(*reference_, ro.batch, sh);
    TokenOptions to;
    to.reduction = ro.norm.reduction;
    to.skip_ignored_rows = true;
    to.memory_budget_bytes = settings_.budget_bytes;

    const TensorView hidden = tempered(model.forward(ro.batch.tokens_view()));
    const TensorView d_hidden = dh_.view(hidden);
    dev_.begin();
    TokenInputs in;
    in.hidden = dev_.in(hidden);
    in.weight = dev_.in(apps::lm_head_rows(model.lm_head_weight(), sh));
    in.targets = dev_.in(ro.batch.targets_view());
    in.data_group = data_group_;
    in.vocab_shard = sh;
    GrpoRows rows{ro.advantages, ro.old_logps, ro.ref_logps, ro.norm.weights};
    std::vector<double> current;
    if (options_.importance_sampling_level == ImportanceSamplingLevel::kSequence &&
        !ro.old_logps.empty()) {
      // The completions' sequence ratios need the current policy's log-probs of every row: one
      // forward of the token-level loss (its values unused) before the step's call.
      const TokenLoss probe(
          std::make_shared<GrpoObjective>(GrpoOptions{}, GrpoRows{rows.advantages}), to);
      current = probe.forward(dev_.context(), in, dev_.workspace(probe.workspace_bytes(in))).logps;
      rows.completion = ro.completion;
      rows.current_logps = current;
    }
    const TokenLoss loss(std::make_shared<GrpoObjective>(options_, rows), to);
    CrossEntropyGrads g;
    g.hidden = dev_.inout(d_hidden);
    g.weight = dev_.inout(apps::lm_head_rows(model.lm_head_weight_grad(), sh));
    g.accumulate = true;
    TokenResult r =
        loss.forward_backward(dev_.context(), in, g, dev_.workspace(loss.workspace_bytes(in, g)));
    dev_.end();
    // (d logits/T / d hidden = W / T: the loss's dH is for the tempered hidden states)
    if (settings_.temperature != 1.0) {
      float* dh = d_hidden.data_as<float>();
      for (std::int64_t i = 0; i < d_hidden.numel(); ++i)
        dh[i] /= static_cast<float>(settings_.temperature);
    }
    if (runs_backward()) model.backward(d_hidden);
    // The sampling policy's log-probs for the later iterations (NaN at ignored rows).
    if (iteration == 0 && settings_.num_iterations > 1) ro.old_logps = std::move(r.logps);

    MicroStats stats{r.loss, ro.metrics, input_tokens(ro.batch)};
    stats.metrics.insert(stats.metrics.end(), r.metrics.begin(), r.metrics.end());
    return stats;
  }

 private:
  // A micro-batch's rollouts and what its iterations reuse.
  struct Rollouts {
    std::vector<std::size_t> examples;     // the micro-batch they were sampled for
    data::Batch batch;                     // this rank's completions, prompts first
    std::vector<double> advantages;        // [rows] the row's completion's (0: prompt, padding)
    std::vector<std::int64_t> completion;  // [rows] the row's completion's index, or -1
    GrpoNormalization norm;                // the loss type's weights and reduction
    std::vector<double> old_logps;         // [rows] the sampling policy's (iterations > 1)
    std::vector<double> ref_logps;         // [rows] the reference's (beta > 0)
    std::vector<std::pair<std::string, double>> metrics;  // the rollouts' (the whole batch's)
  };

  // The final hidden states divided by the temperature (a copy; the model's own unless the
  // temperature is 1), so that the lm_head gives logits / T, the distribution sampled from.
  TensorView tempered(const TensorView& hidden) {
    if (settings_.temperature == 1.0) return hidden;
    const float* h = hidden.data_as<float>();
    tempered_.assign(h, h + hidden.numel());
    for (float& x : tempered_) x /= static_cast<float>(settings_.temperature);
    return TensorView::of(tempered_.data(), {hidden.size(0), hidden.size(1)});
  }

  // Samples the completions of this rank's part of micro-batch `micro` (`examples`), rewards
  // them and lays them out.
  Rollouts sample(model::LlamaModel& model, std::span<const std::size_t> examples,
                  std::size_t micro) {
    const std::span<const std::size_t> mine = own(examples);
    const auto first = static_cast<std::size_t>(mine.data() - examples.data());
    const auto group = static_cast<std::size_t>(settings_.num_generations);
    // This rank's rollouts, group by group, with their rewards. Summed for the metrics: the
    // rewards, the groups' standard deviations, the groups of equal rewards, the completions'
    // lengths (EOS included) and those cut at the length bound.
    std::vector<data::Sequence> rollouts;
    std::vector<double> rewards, means, sds;  // (means and deviations: per completion)
    std::array<double, 5> sums{};
    for (const std::size_t e : mine) {
      model::GenerateOptions g;
      g.max_new_tokens = new_tokens(e);
      g.temperature = settings_.temperature;
      g.eos_id = tok_.eos_id();
      for (std::size_t k = 0; k < group; ++k) {
        std::uint64_t seed = seed_;
        for (const std::uint64_t x : {static_cast<std::uint64_t>(step_), std::uint64_t{micro},
                                      std::uint64_t{e}, std::uint64_t{k}})
          seed = data::BatchSampler::epoch_seed(seed, x);
        g.seed = seed;
        const model::GenerateResult out = model::generate(model, prompts_[e], g);
        rewards.push_back(apps::exact_match(tok_, out, examples_[e].completion) ? 1.0 : 0.0);
        rollouts.push_back(rollout(prompts_[e], out));
        // (TRL's mask_truncated_completions: a completion cut at the length bound keeps its
        // reward in the advantages but leaves the loss)
        if (settings_.mask_truncated_completions && !out.stopped_at_eos)
          std::fill(rollouts.back().targets.begin(), rollouts.back().targets.end(),
                    data::EncodeOptions{}.ignore_index);
        sums[3] += static_cast<double>(out.tokens.size() + (out.stopped_at_eos ? 1 : 0));
        sums[4] += out.stopped_at_eos ? 0 : 1;
      }
      const auto r = std::span(rewards).last(group);
      const double mean = std::accumulate(r.begin(), r.end(), 0.0) / static_cast<double>(group);
      double var = 0;
      for (const double x : r) var += (x - mean) * (x - mean);
      const double sd = std::sqrt(var / static_cast<double>(group - 1));  // (unbiased, as TRL)
      means.insert(means.end(), group, mean);
      sds.insert(sds.end(), group, sd);
      sums[0] += mean * static_cast<double>(group);
      sums[1] += sd;
      sums[2] += sd == 0 ? 1 : 0;
    }
    const auto completions = static_cast<double>(examples.size() * group),
               groups = static_cast<double>(examples.size());
    std::optional<double> batch_sd;
    if (settings_.scale_rewards == "batch") {
      // One deviation for the micro-batch's rewards (the data group's), unbiased. (TRL takes it
      // over the step's generation batch, all of its micro-batches: the same with --grad-accum
      // 1; here a step's micro-batches are sampled one at a time.)
      std::array<double, 2> moments{};  // (sum, sum of squares)
      for (const double x : rewards) moments[0] += x, moments[1] += x * x;
      if (data_group_) data_group_->all_reduce_sum(host_, moments.data(), 2);
      const double var = (moments[1] - moments[0] * moments[0] / completions) / (completions - 1);
      batch_sd = std::sqrt(std::max(var, 0.0));
      sds.assign(sds.size(), *batch_sd);
    }
    std::vector<double> advantages(rewards.size());
    for (std::size_t i = 0; i < rewards.size(); ++i)
      advantages[i] = settings_.scale_rewards == "none" ? rewards[i] - means[i]
                                                        : (rewards[i] - means[i]) / (sds[i] + 1e-4);
    std::vector<std::size_t> all(rollouts.size());
    std::iota(all.begin(), all.end(), std::size_t{0});
    Rollouts ro;
    ro.examples.assign(examples.begin(), examples.end());
    ro.batch = data::collate_sft(rollouts, all);

    // Per row: its completion's advantage and index among the micro-batch's completions (over
    // the data group), -1 for prompt and padding rows.
    const auto rows = static_cast<std::size_t>(ro.batch.rows * ro.batch.length);
    ro.advantages.assign(rows, 0.0);
    ro.completion.assign(rows, -1);
    for (std::size_t i = 0; i < rows; ++i) {
      if (ro.batch.targets[i] == data::EncodeOptions{}.ignore_index) continue;
      const std::size_t b = i / static_cast<std::size_t>(ro.batch.length);
      ro.advantages[i] = advantages[b];
      ro.completion[i] = static_cast<std::int64_t>(first * group + b);
    }
    ro.norm =
        grpo_normalization(type_, ro.completion, static_cast<std::int64_t>(examples.size() * group),
                           settings_.max_completion_length);

    if (data_group_)
      data_group_->all_reduce_sum(host_, sums.data(), static_cast<std::int64_t>(sums.size()));
    if (batch_sd) {  // (TRL's metrics report the deviation the advantages were scaled by)
      sums[1] = *batch_sd * groups;
      sums[2] = *batch_sd == 0 ? groups : 0;
    }
    ro.metrics = {{"reward", sums[0] / completions},
                  {"reward_std", sums[1] / groups},
                  {"frac_reward_zero_std", sums[2] / groups},
                  {"completions/mean_length", sums[3] / completions},
                  {"completions/clipped_ratio", sums[4] / completions}};
    return ro;
  }

  // New tokens example i may draw: --max-completion-length, and under --max-length the
  // positions its prompt leaves.
  std::int64_t new_tokens(std::size_t i) const {
    const auto prompt = static_cast<std::int64_t>(prompts_[i].size()) - 1;  // (bytes, no BOS)
    return max_length_ > 0 ? std::min(settings_.max_completion_length, max_length_ - prompt)
                           : settings_.max_completion_length;
  }

  // The training sequence of a rollout: [BOS] prompt completion [EOS when it stopped there],
  // shifted as data::encode lays it out (the prompt's targets ignored).
  data::Sequence rollout(std::span<const std::int32_t> prompt,
                         const model::GenerateResult& out) const {
    std::vector<std::int32_t> s(prompt.begin(), prompt.end());
    s.insert(s.end(), out.tokens.begin(), out.tokens.end());
    if (out.stopped_at_eos) s.push_back(tok_.eos_id());
    data::Sequence q;
    q.tokens.assign(s.begin(), s.end() - 1);
    for (std::size_t t = 1; t < s.size(); ++t)
      q.targets.push_back(t >= prompt.size() ? s[t] : data::EncodeOptions{}.ignore_index);
    return q;
  }

  // The reference's log-prob of each row's target at the temperature (NaN at ignored rows):
  // minus the per-row cross-entropy.
  std::vector<double> token_logps(model::LlamaModel& m, const data::Batch& batch,
                                  const VocabShard& sh) {
    const TensorView hidden = tempered(m.forward(batch.tokens_view()));
    row_loss_.assign(batch.targets.size(), 0.0f);
    dev_.begin();
    CrossEntropyInputs in;
    in.hidden = dev_.in(hidden);
    in.weight = dev_.in(apps::lm_head_rows(m.lm_head_weight(), sh));
    in.targets = dev_.in(batch.targets_view());
    in.vocab_shard = sh;
    CrossEntropyOutputs out;
    out.row_loss =
        dev_.inout(TensorView::of(row_loss_.data(), {static_cast<std::int64_t>(row_loss_.size())}));
    (void)ref_ce_.forward(dev_.context(), in, out, dev_.workspace(ref_ce_.workspace_bytes(in)));
    dev_.end();
    std::vector<double> logps(row_loss_.size(), std::numeric_limits<double>::quiet_NaN());
    for (std::size_t i = 0; i < logps.size(); ++i)
      if (batch.targets[i] != data::EncodeOptions{}.ignore_index)
        logps[i] = -static_cast<double>(row_loss_[i]);
    return logps;
  }

  LossDevice& dev_;
  LossSettings settings_;
  std::uint64_t seed_;
  std::int64_t max_length_;
  GrpoLossType type_;
  GrpoOptions options_;
  std::optional<model::LlamaModel> reference_;
  data::ByteTokenizer tok_;
  std::vector<data::SftExample> examples_;
  std::vector<std::vector<std::int32_t>> prompts_;  // BOS and the kept prompt bytes
  std::vector<Rollouts> cache_;                     // the current step's micro-batches' rollouts
  LinearCrossEntropy ref_ce_;
  std::vector<float> row_loss_;
  std::vector<float> tempered_;  // hidden states / temperature
  std::string warning_;          // answers that can never score
  HiddenGrad dh_;
  CpuContext host_;  // the metric sums' collective (host memory)
};

}  // namespace

void check_loss_settings(const LossSettings& loss) {
  if (loss.loss == "ce") {
    (void)LinearCrossEntropy(ce_options(loss));
  } else if (loss.loss == "grpo") {
    (void)parse_grpo_loss(loss.grpo_loss_type);
    const std::array<double, 1> row{};  // (the options are checked on one row)
    (void)GrpoObjective(
        grpo_options(loss),
        {row, {}, loss.beta > 0 ? std::span<const double>(row) : std::span<const double>(), {}});
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

std::unique_ptr<Trainer> make_grpo_trainer(const DataSettings& data, const LossSettings& loss,
                                           LossDevice& device, std::uint64_t seed,
                                           std::optional<model::LlamaModel> reference) {
  return std::make_unique<GrpoTrainer>(data, loss, device, seed, std::move(reference));
}

std::unique_ptr<Trainer> make_ce_trainer(const DataSettings& data, const LossSettings& loss,
                                         LossDevice& device) {
  return std::make_unique<CeTrainer>(data, loss, device);
}

}  // namespace chunkloss::train
