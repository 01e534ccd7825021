// AdamW, gradient-norm clipping and the warmup + cosine schedule.
#include "chunkloss/model/optim.h"

#include <algorithm>
#include <cmath>

#include "chunkloss/core/error.h"
#include "chunkloss/model/model.h"

namespace chunkloss::model {

AdamW::AdamW(std::size_t num_params, const AdamWOptions& options)
    : options_(options), m_(num_params, 0.0f), v_(num_params, 0.0f) {
  CHUNKLOSS_CHECK(options.beta1 >= 0 && options.beta1 < 1, "AdamW: beta1=", options.beta1,
                  " must lie in [0, 1)");
  CHUNKLOSS_CHECK(options.beta2 >= 0 && options.beta2 < 1, "AdamW: beta2=", options.beta2,
                  " must lie in [0, 1)");
  CHUNKLOSS_CHECK(options.eps > 0, "AdamW: eps=", options.eps, " must be > 0");
  CHUNKLOSS_CHECK(options.weight_decay >= 0, "AdamW: weight_decay=", options.weight_decay,
                  " must be >= 0");
}

void AdamW::step(std::span<float> params, std::span<const float> grads, double lr,
                 std::span<const std::uint8_t> decay_mask) {
  CHUNKLOSS_CHECK(params.size() == m_.size() && grads.size() == m_.size(),
                  "AdamW::step: ", params.size(), " params and ", grads.size(),
                  " grads for an optimizer of ", m_.size());
  CHUNKLOSS_CHECK(decay_mask.empty() || decay_mask.size() == m_.size(), "AdamW::step: decay mask ",
                  "of ", decay_mask.size(), " for ", m_.size(), " params");
  CHUNKLOSS_CHECK(std::isfinite(lr) && lr >= 0, "AdamW::step: lr=", lr, " must be >= 0");
  ++step_;
  const double t = static_cast<double>(step_);
  const float b1 = static_cast<float>(options_.beta1), b2 = static_cast<float>(options_.beta2);
  const float step_size = static_cast<float>(lr / (1.0 - std::pow(options_.beta1, t)));
  const float bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(options_.beta2, t)));
  const float eps = static_cast<float>(options_.eps);
  const float decay = static_cast<float>(1.0 - lr * options_.weight_decay);
  for (std::size_t j = 0; j < m_.size(); ++j) {
    const float g = grads[j];
    float p = params[j];
    if (decay_mask.empty() || decay_mask[j]) p *= decay;
    m_[j] = b1 * m_[j] + (1.0f - b1) * g;
    v_[j] = b2 * v_[j] + (1.0f - b2) * g * g;
    const float denom = std::sqrt(v_[j]) / bc2_sqrt + eps;
    params[j] = p - step_size * (m_[j] / denom);
  }
}

void AdamW::step(LlamaModel& model, double lr) {
  if (model_mask_.size() != model.params().size()) model_mask_ = model.decay_mask();
  step(model.params(), model.grads(), lr, model_mask_);
}

void AdamW::load_state(std::span<const float> exp_avg, std::span<const float> exp_avg_sq,
                       std::int64_t step) {
  CHUNKLOSS_CHECK(exp_avg.size() == m_.size() && exp_avg_sq.size() == v_.size(),
                  "AdamW::load_state: ", exp_avg.size(), " exp_avg and ", exp_avg_sq.size(),
                  " exp_avg_sq values for an optimizer of ", m_.size());
  CHUNKLOSS_CHECK(step >= 0, "AdamW::load_state: step=", step, " must be >= 0");
  for (std::size_t j = 0; j < m_.size(); ++j) {
    CHUNKLOSS_CHECK(std::isfinite(exp_avg[j]), "AdamW::load_state: exp_avg[", j, "] = ", exp_avg[j],
                    " is not finite");
    CHUNKLOSS_CHECK(std::isfinite(exp_avg_sq[j]) && exp_avg_sq[j] >= 0.0f,
                    "AdamW::load_state: exp_avg_sq[", j, "] = ", exp_avg_sq[j],
                    " is not a finite value >= 0 (a second moment)");
  }
  std::copy(exp_avg.begin(), exp_avg.end(), m_.begin());
  std::copy(exp_avg_sq.begin(), exp_avg_sq.end(), v_.begin());
  step_ = step;
}

double grad_norm(std::span<const float> grads) {
  double ss = 0;
  for (float g : grads) ss += static_cast<double>(g) * static_cast<double>(g);
  return std::sqrt(ss);
}

double clip_grad_norm(std::span<float> grads, double max_norm) {
  const double total = grad_norm(grads);
  if (max_norm <= 0 || !std::isfinite(total)) return total;
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    const float c = static_cast<float>(coef);
    for (float& g : grads) g *= c;
  }
  return total;
}

double learning_rate(const LrSchedule& s, std::int64_t step) {
  CHUNKLOSS_CHECK(step >= 0, "learning_rate: step=", step, " must be >= 0");
  CHUNKLOSS_CHECK(s.total_steps >= 1, "learning_rate: total_steps=", s.total_steps,
                  " must be >= 1");
  CHUNKLOSS_CHECK(s.warmup_steps >= 0, "learning_rate: warmup_steps=", s.warmup_steps,
                  " must be >= 0");
  CHUNKLOSS_CHECK(s.min_lr_ratio >= 0 && s.min_lr_ratio <= 1,
                  "learning_rate: min_lr_ratio=", s.min_lr_ratio, " must lie in [0, 1]");
  if (step < s.warmup_steps) {
    return s.lr * static_cast<double>(step) / static_cast<double>(s.warmup_steps);
  }
  const double span =
      static_cast<double>(std::max<std::int64_t>(1, s.total_steps - s.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / span);
  const double cosine = 0.5 * (1.0 + std::cos(3.14159265358979323846 * progress));
  return s.lr * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cosine);
}

}  // namespace chunkloss::model
