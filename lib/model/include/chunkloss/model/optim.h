// Optimisation: AdamW (decoupled weight decay, bias correction, PyTorch's update rule), global
// gradient-norm clipping and the warmup + cosine learning-rate schedule of transformers.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace chunkloss::model {

class LlamaModel;

/// AdamW hyperparameters (the learning rate is passed per step, from the schedule).
struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  ///< transformers' default; torch.optim.AdamW defaults to 0.01
};

/// torch.optim.AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", 2019), with
/// the update, for step t = 1, 2, ... and each element where the decay mask is 1 (or no mask):
///   p <- p * (1 - lr * weight_decay)
///   m <- beta1 m + (1 - beta1) g;   v <- beta2 v + (1 - beta2) g^2
///   p <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// Elements with mask 0 skip only the decay. State m, v is fp32, one pair per parameter; the
/// update runs sequentially (bitwise reproducible).
class AdamW {
 public:
  /// State for `num_params` parameters; throws chunkloss::Error for betas outside [0, 1),
  /// eps <= 0 or a negative weight_decay.
  explicit AdamW(std::size_t num_params, const AdamWOptions& options = {});

  /// One update of `params` with `grads` (both num_params long) and learning rate `lr`.
  /// `decay_mask` empty: decay every element. Throws chunkloss::Error for size mismatches.
  void step(std::span<float> params, std::span<const float> grads, double lr,
            std::span<const std::uint8_t> decay_mask = {});
  /// step() over model.params() with model.grads() and the model's decay mask (no decay for
  /// RMSNorm weights).
  void step(LlamaModel& model, double lr);

  const AdamWOptions& options() const { return options_; }
  std::size_t size() const { return m_.size(); }
  /// Steps taken so far (t of the last update).
  std::int64_t step_count() const { return step_; }
  std::span<const float> exp_avg() const { return m_; }
  std::span<const float> exp_avg_sq() const { return v_; }

  /// Restores a saved state (the checkpoint loader's entry point). Throws chunkloss::Error for
  /// sizes other than size(), a negative step, a non-finite moment or a negative second moment
  /// (which would turn the next update into NaN); the state is unchanged then.
  void load_state(std::span<const float> exp_avg, std::span<const float> exp_avg_sq,
                  std::int64_t step);

 private:
  AdamWOptions options_;
  std::vector<float> m_, v_;
  std::vector<std::uint8_t> model_mask_;
  std::int64_t step_ = 0;
};

/// The L2 norm of all gradients, summed in double in index order.
double grad_norm(std::span<const float> grads);

/// torch.nn.utils.clip_grad_norm_: with total = grad_norm(grads), scales every gradient by
/// max_norm / (total + 1e-6) when that is < 1. Returns total (before clipping). A non-finite
/// total leaves the gradients unchanged (the caller should skip the step). max_norm <= 0
/// disables clipping and only measures.
double clip_grad_norm(std::span<float> grads, double max_norm);

/// Warmup + cosine decay, transformers' get_cosine_schedule_with_warmup (num_cycles 0.5) with
/// an optional floor: for the optimizer step index s (0 for the first update),
///   s < warmup:  lr * s / warmup
///   otherwise:   lr * (f + (1 - f) * 0.5 * (1 + cos(pi * min(1, (s - warmup) / (total -
///   warmup)))))
/// with f = min_lr_ratio. Note the transformers convention: with warmup > 0 the first update
/// uses lr 0.
struct LrSchedule {
  double lr = 1e-3;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 1;
  double min_lr_ratio = 0.0;
};

/// The learning rate of optimizer step `step` (>= 0). Throws chunkloss::Error for a negative
/// step, total_steps < 1, warmup_steps < 0 or min_lr_ratio outside [0, 1].
double learning_rate(const LrSchedule& schedule, std::int64_t step);

}  // namespace chunkloss::model
