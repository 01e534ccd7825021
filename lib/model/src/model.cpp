// LlamaModel: argument checks and TensorView plumbing around detail::Decoder<float>.
#include "chunkloss/model/model.h"

#include <sstream>

#include "chunkloss/core/error.h"
#include "chunkloss/model/decoder.h"

namespace chunkloss::model {

LlamaModel::LlamaModel(const LlamaConfig& config, std::uint64_t seed)
    : impl_(std::make_unique<detail::Decoder<float>>(config)) {
  detail::init_parameters(config, impl_->layout(), seed, impl_->params());
}

LlamaModel::LlamaModel(const LlamaModel& other)
    : impl_(std::make_unique<detail::Decoder<float>>(*other.impl_)) {}

LlamaModel& LlamaModel::operator=(const LlamaModel& other) {
  if (this != &other) impl_ = std::make_unique<detail::Decoder<float>>(*other.impl_);
  return *this;
}

LlamaModel::LlamaModel(LlamaModel&&) noexcept = default;
LlamaModel& LlamaModel::operator=(LlamaModel&&) noexcept = default;
LlamaModel::~LlamaModel() = default;

const LlamaConfig& LlamaModel::config() const { return impl_->config(); }

const std::vector<ParameterInfo>& LlamaModel::parameters() const { return impl_->layout(); }

const ParameterInfo& LlamaModel::parameter(std::string_view name) const {
  for (const ParameterInfo& p : impl_->layout()) {
    if (p.name == name) return p;
  }
  CHUNKLOSS_FAIL("LlamaModel: no parameter named \"", name, "\"");
}

std::int64_t LlamaModel::parameter_count() const {
  return static_cast<std::int64_t>(impl_->params().size());
}

std::string LlamaModel::summary() const {
  const LlamaConfig& c = config();
  std::ostringstream os;
  os << "Llama decoder: " << c.num_hidden_layers << " layers, hidden " << c.hidden_size
     << ", intermediate " << c.intermediate_size << ", heads " << c.num_attention_heads << " (kv "
     << c.num_key_value_heads << ", head_dim " << c.head_dim() << "), vocab " << c.vocab_size
     << ", max positions " << c.max_position_embeddings
     << (c.tie_word_embeddings ? ", tied lm_head" : ", untied lm_head") << "; " << parameter_count()
     << " parameters";
  return os.str();
}

std::span<float> LlamaModel::params() { return impl_->params(); }
std::span<const float> LlamaModel::params() const { return impl_->params(); }
std::span<float> LlamaModel::grads() { return impl_->grads(); }
std::span<const float> LlamaModel::grads() const { return impl_->grads(); }

std::vector<std::uint8_t> LlamaModel::decay_mask() const {
  std::vector<std::uint8_t> mask(impl_->params().size(), 0);
  for (const ParameterInfo& p : impl_->layout()) {
    std::fill_n(mask.begin() + static_cast<std::ptrdiff_t>(p.offset), p.numel, p.decay ? 1 : 0);
  }
  return mask;
}

TensorView LlamaModel::forward(const TensorView& tokens) {
  CHUNKLOSS_CHECK(tokens.defined() && tokens.ndim() == 2, "LlamaModel::forward: tokens must be ",
                  "[B, T], got ", tokens.str());
  CHUNKLOSS_CHECK(tokens.device() == Device::kCpu, "LlamaModel::forward: tokens ", tokens.str(),
                  " must be on the cpu");
  const std::int64_t b = tokens.size(0), t = tokens.size(1);
  const float* hidden = nullptr;
  if (tokens.dtype() == DType::kI32) {
    hidden = impl_->forward(tokens.data_as<const std::int32_t>(), b, t);
  } else {
    CHUNKLOSS_CHECK(tokens.dtype() == DType::kI64, "LlamaModel::forward: tokens ", tokens.str(),
                    " must be i32 or i64");
    const std::int64_t* src = tokens.data_as<const std::int64_t>();
    std::vector<std::int32_t> ids(static_cast<std::size_t>(b * t));
    for (std::size_t j = 0; j < ids.size(); ++j) {
      CHUNKLOSS_CHECK(src[j] >= 0 && src[j] < config().vocab_size, "LlamaModel::forward: token id ",
                      src[j], " at flat position ", j,
                      " outside [0, vocab_size=", config().vocab_size, ")");
      ids[j] = static_cast<std::int32_t>(src[j]);
    }
    hidden = impl_->forward(ids.data(), b, t);
  }
  return TensorView::of(hidden, {b * t, config().hidden_size});
}

TensorView LlamaModel::hidden() const {
  if (!impl_->has_forward()) return {};
  return TensorView::of(impl_->hidden(), {impl_->batch() * impl_->length(), config().hidden_size});
}

TensorView LlamaModel::lm_head_weight() const {
  return TensorView::of(impl_->params().data() + impl_->lm_head_offset(),
                        {config().vocab_size, config().hidden_size});
}

TensorView LlamaModel::lm_head_weight_grad() {
  return TensorView::of(impl_->grads().data() + impl_->lm_head_offset(),
                        {config().vocab_size, config().hidden_size});
}

void LlamaModel::backward(const TensorView& grad_hidden, const TensorView& grad_lm_head) {
  CHUNKLOSS_CHECK(impl_->has_forward(), "LlamaModel::backward: called before forward");
  const std::int64_t n = impl_->batch() * impl_->length(), h = config().hidden_size;
  const auto check = [&](const char* name, const TensorView& v, std::int64_t rows) {
    CHUNKLOSS_CHECK(v.ndim() == 2 && v.size(0) == rows && v.size(1) == h &&
                        v.dtype() == DType::kF32 && v.device() == Device::kCpu,
                    "LlamaModel::backward: ", name, " must be [", rows, ", ", h, "] f32 cpu, got ",
                    v.str());
  };
  check("grad_hidden", grad_hidden, n);
  if (grad_lm_head.defined()) {
    check("grad_lm_head", grad_lm_head, config().vocab_size);
    CHUNKLOSS_CHECK(grad_lm_head.data() != lm_head_weight_grad().data(),
                    "LlamaModel::backward: grad_lm_head is the model's own lm_head gradient slot; "
                    "a loss that accumulated into lm_head_weight_grad() passes no grad_lm_head");
  }
  impl_->backward(grad_hidden.data_as<const float>(),
                  grad_lm_head.defined() ? grad_lm_head.data_as<const float>() : nullptr);
}

void LlamaModel::zero_grad() { std::fill(impl_->grads().begin(), impl_->grads().end(), 0.0f); }

void LlamaModel::scale_grads(float factor) {
  for (float& g : impl_->grads()) g *= factor;
}

}  // namespace chunkloss::model
