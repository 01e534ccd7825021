// The per-loss halves of chunkloss-train: each Trainer owns its encoded data set and runs one
// micro-batch (model forward, the loss's forward_backward, model backward) on given examples.
#pragma once

#include <chunkloss/apps/loss_device.h>
#include <chunkloss/apps/tuning.h>
#include <chunkloss/data/batch.h>
#include <chunkloss/dist/communicator.h>
#include <chunkloss/losses/vocab_shard.h>
#include <chunkloss/model/model.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace chunkloss::train {

using apps::LossDevice;

/// The result of one micro-batch.
struct MicroStats {
  double loss = 0;
  std::vector<std::pair<std::string, double>> metrics;  ///< TRL names
  double tokens = 0;                                    ///< input tokens (padding excluded)
};

/// Loss options from the command line (each loss reads the ones it has).
struct LossSettings {
  std::string loss = "ce";
  double beta = 0;  ///< 0: the loss's default
  double label_smoothing = 0;
  double z_loss = 0;              ///< ce: CrossEntropyOptions::z_loss
  bool skip_ignored_rows = true;  ///< ce: CrossEntropyOptions::skip_ignored_rows
  std::string dpo_loss_type = "sigmoid";
  double discopop_tau = 0.05;  ///< DPO's discopop type: DpoOptions::discopop_tau
  double rpo_alpha = 0;        ///< DPO's NLL term weight (0: off)
  double gamma = 0.5;          ///< SimPO
  double simpo_alpha = 0;      ///< SimPO's NLL term weight (0: off)
  double cpo_alpha = 1;        ///< CPO
  double desirable_weight = 1, undesirable_weight = 1;  ///< KTO
  /// GRPO: completions sampled per prompt (>= 2), their sampling temperature (> 0) and length
  /// bound (new tokens, EOS included), TRL's loss type, and how advantages are scaled: "group"
  /// (by the group's reward standard deviation), "batch" (by the micro-batch's) or "none" (Dr.
  /// GRPO).
  std::int64_t num_generations = 8;
  double temperature = 1.0;
  std::int64_t max_completion_length = 16;
  std::string grpo_loss_type = "grpo";
  std::string scale_rewards = "group";
  /// GRPO: completions cut at the length bound (no EOS) leave the loss, their rewards still in
  /// their groups' advantages (TRL's mask_truncated_completions, DAPO's overlong filtering).
  bool mask_truncated_completions = false;
  /// GRPO: optimizer steps on each batch of rollouts (TRL's num_iterations, >= 1), and from the
  /// second on, the clip range of the importance ratio and its cap (GrpoOptions; epsilon_high
  /// < 0: epsilon_low's value; delta 0: no cap).
  std::int64_t num_iterations = 1;
  double epsilon_low = 0.2, epsilon_high = -1, delta = 0;
  /// GRPO: "token" (each token's ratio) or "sequence" (GSPO: the completion's, whose later
  /// iterations take one more forward of the loss for the current log-probs).
  std::string importance_sampling_level = "token";
  std::size_t budget_bytes = 0;
};

/// Builds the loss object `loss` describes, as a trainer would, and drops it: throws the loss's
/// chunkloss::Error for a value it refuses, so that option parsing finds it before any work.
void check_loss_settings(const LossSettings& loss);

class Trainer {
 public:
  virtual ~Trainer() = default;
  /// Number of examples (pairs for the paired losses) an epoch draws from.
  virtual std::size_t size() const = 0;
  /// Adds `weight` times the gradients of the mean loss over `examples` (a micro-batch) into
  /// model.grads(); MicroStats holds the micro-batch's own loss and metrics (unweighted). Only a
  /// token-mean loss gets a weight other than 1 (see step_weight).
  virtual MicroStats step(model::LlamaModel& model, std::span<const std::size_t> examples,
                          double weight) = 0;
  /// The micro-batch's weight in a step of several (--grad-accum): its valid targets for a loss
  /// that is a mean over tokens (cross-entropy), so that the step's loss is the mean over all of
  /// its tokens, as one micro-batch as large would give (transformers' num_items_in_batch);
  /// 1 for the preference losses, whose micro-batch means count equally, as in TRL.
  virtual double step_weight(std::span<const std::size_t> /*examples*/) const { return 1.0; }
  /// The longest sequence step() can give the model (KTO: its mismatched pairs too).
  virtual apps::Longest longest() const = 0;
  /// A warning about the data to print once before training ("" when none).
  virtual std::string warning() const { return {}; }
  /// The metric shown as the progress line's accuracy, and its short label.
  virtual std::pair<const char*, const char*> accuracy_metric() const = 0;
  /// Makes this trainer one rank of a data group: every rank's step() gets the whole
  /// micro-batch and computes on its own part (own()), and its loss, metrics and gradients are
  /// those of the whole micro-batch (the gradients as this rank's share: sum model.grads() over
  /// the group afterwards). Every rank must step together. null: alone.
  void set_data_group(dist::Communicator* group) { data_group_ = group; }
  /// Makes this trainer one rank of a vocabulary split of the lm_head: every rank of the group
  /// steps on the same examples, and its loss calls hold rows [V r / K, V (r + 1) / K) of the
  /// lm_head (PreferenceInputs::vocab_shard, CrossEntropyInputs::vocab_shard). Rank 0 of the
  /// group runs the model's backward; the others only add their rows' lm_head gradient. So
  /// model.grads() summed over the group is the whole gradient, with a tied lm_head too. With a
  /// data group as well, the two form a grid. Every rank must step together. null: alone.
  void set_vocab_group(dist::Communicator* group) { vocab_group_ = group; }
  /// The optimizer step the next step() calls belong to (0-based), each call one micro-batch of
  /// it in order: GRPO seeds its sampling with it, so that a resumed run draws the same
  /// completions, and counts its iterations on a batch of rollouts by it.
  void set_step(std::int64_t step) {
    step_ = step;
    micro_ = 0;
  }

 protected:
  /// This rank's examples of a micro-batch of n: [n r / K, n (r + 1) / K) for rank r of K.
  std::span<const std::size_t> own(std::span<const std::size_t> examples) const {
    if (!data_group_) return examples;
    const auto n = examples.size(), r = static_cast<std::size_t>(data_group_->rank()),
               k = static_cast<std::size_t>(data_group_->size());
    return examples.subspan(n * r / k, n * (r + 1) / k - n * r / k);
  }

  /// The shard of `model`'s lm_head this rank's loss calls hold (none without a split).
  VocabShard shard(const model::LlamaModel& model) const {
    return VocabShard::of(vocab_group_, model.lm_head_weight().size(0));
  }
  /// Whether this rank runs the model's backward (rank 0 of a vocabulary split, or alone).
  bool runs_backward() const { return !vocab_group_ || vocab_group_->rank() == 0; }

  dist::Communicator* data_group_ = nullptr;
  dist::Communicator* vocab_group_ = nullptr;
  std::int64_t step_ = 0;
  std::size_t micro_ = 0;  ///< step() calls since set_step (advanced by the trainer that counts)
};

/// Encoding options shared by every data set.
struct DataSettings {
  std::string file;  ///< JSONL in the loss's convention (named in messages)
  /// The file's bytes, read once (data::read_text_file) so that a pipe (--train-file <(...),
  /// /dev/stdin from a pipe or a file; not a terminal, a device) works and the data trained on is
  /// the data digested for --resume.
  std::string text;
  data::EncodeOptions encode;
};

/// SFT with LinearCrossEntropy on {"prompt", "completion"} / {"text"} lines.
std::unique_ptr<Trainer> make_ce_trainer(const DataSettings& data, const LossSettings& loss,
                                         LossDevice& device);

/// DPO, ORPO, SimPO or CPO (loss.loss) on {"prompt", "chosen", "rejected"} lines. DPO needs the
/// frozen `reference` (its log-probs come from SequenceLogProbs on each batch); the others are
/// reference-free and get none.
std::unique_ptr<Trainer> make_pair_trainer(const DataSettings& data, const LossSettings& loss,
                                           LossDevice& device,
                                           std::optional<model::LlamaModel> reference);

/// KTO on {"prompt", "completion", "label"} lines with the frozen `reference`. The KL reference
/// point of each micro-batch is the mean policy-minus-reference log-prob of its mismatched pairs
/// (prompt i with completion i + 1), detached, as TRL computes it.
std::unique_ptr<Trainer> make_kto_trainer(const DataSettings& data, const LossSettings& loss,
                                          LossDevice& device, model::LlamaModel reference);

/// Online GRPO on {"prompt", "completion"} lines (the SFT format, with a prompt): for each prompt
/// of a micro-batch, loss.num_generations completions sampled from the policy at
/// loss.temperature (seeded by `seed`, the step, the micro-batch and the example, so a resumed
/// or split run draws the same ones), each rewarded 1 when it is the line's completion exactly
/// (as chunkloss-eval's exact match), else 0; advantages normalised within each prompt's group;
/// the loss GrpoObjective on TokenLoss, its log-probs (the reference's too) those of the logits
/// divided by the temperature, as sampled. Each batch of
/// rollouts serves loss.num_iterations optimizer steps (the main loop gives their steps the same
/// micro-batches): the first on-policy (ratio 1), the others with the sampling policy's
/// log-probs, from the first step's call, as the old ones. With loss.beta > 0 the k3 KL to the
/// frozen `reference` (per-token log-probs from LinearCrossEntropy on it), then required.
std::unique_ptr<Trainer> make_grpo_trainer(const DataSettings& data, const LossSettings& loss,
                                           LossDevice& device, std::uint64_t seed,
                                           std::optional<model::LlamaModel> reference);

}  // namespace chunkloss::train
