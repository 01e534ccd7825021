// Internal: the decoder's forward and hand-written backward, templated on the scalar type.
// LlamaModel wraps Decoder<float> (decoder.cpp); the tests instantiate Decoder<double> from
// decoder_impl.h to check the backward against finite differences to near double precision.
// No Eigen in this header.
#pragma once

#include <cstdint>
#include <vector>

#include "chunkloss/model/config.h"
#include "chunkloss/model/model.h"

namespace chunkloss::model::detail {

/// The HF-ordered parameter layout of a config (offsets into one flat buffer).
std::vector<ParameterInfo> parameter_layout(const LlamaConfig& config);

/// Fills `out` (layout order) with N(0, initializer_range^2) for matrices and 1 for norms,
/// from std::mt19937_64(seed), Box-Muller on 53-bit uniforms.
template <typename T>
void init_parameters(const LlamaConfig& config, const std::vector<ParameterInfo>& layout,
                     std::uint64_t seed, std::vector<T>& out);

/// Activations of one layer cached by forward() for backward(). N = B * T rows.
template <typename T>
struct LayerCache {
  std::vector<T> x;      ///< [N, H] layer input (residual stream)
  std::vector<T> inv1;   ///< [N] 1 / rms of x
  std::vector<T> xn1;    ///< [N, H] input_layernorm output
  std::vector<T> q;      ///< [N, heads * D] after RoPE
  std::vector<T> k;      ///< [N, kv_heads * D] after RoPE
  std::vector<T> v;      ///< [N, kv_heads * D]
  std::vector<T> probs;  ///< [B, heads, T, T] causal softmax
  std::vector<T> attn;   ///< [N, heads * D] attention output before o_proj
  std::vector<T> mid;    ///< [N, H] residual after attention
  std::vector<T> inv2;   ///< [N]
  std::vector<T> xn2;    ///< [N, H] post_attention_layernorm output
  std::vector<T> gate;   ///< [N, I]
  std::vector<T> up;     ///< [N, I]
  std::vector<T> act;    ///< [N, I] silu(gate) * up
};

template <typename T>
class Decoder {
 public:
  explicit Decoder(const LlamaConfig& config);

  const LlamaConfig& config() const { return config_; }
  const std::vector<ParameterInfo>& layout() const { return layout_; }
  std::vector<T>& params() { return params_; }
  const std::vector<T>& params() const { return params_; }
  std::vector<T>& grads() { return grads_; }
  const std::vector<T>& grads() const { return grads_; }
  /// Offset of the lm_head weight [V, H] in params()/grads() (the embedding's when tied).
  std::size_t lm_head_offset() const { return lm_head_offset_; }

  /// tokens [batch, length] with ids in [0, V) (checked); returns hidden [batch * length, H].
  const T* forward(const std::int32_t* tokens, std::int64_t batch, std::int64_t length);
  /// Adds the gradients of the latest forward into grads(); grad_lm_head may be null.
  void backward(const T* grad_hidden, const T* grad_lm_head);

  bool has_forward() const { return rows_ > 0; }
  std::int64_t batch() const { return batch_; }
  std::int64_t length() const { return length_; }
  const T* hidden() const { return hidden_.data(); }

  /// Copies parameters and gradients; the activation cache starts empty.
  Decoder(const Decoder& other);
  Decoder& operator=(const Decoder& other);

 private:
  void ensure_rope(std::int64_t length);

  LlamaConfig config_;
  std::vector<ParameterInfo> layout_;
  std::vector<T> params_;
  std::vector<T> grads_;
  std::size_t lm_head_offset_ = 0;
  std::size_t layer_offset_ = 0;  ///< offset of layer 0's first tensor
  std::size_t layer_stride_ = 0;  ///< elements per layer
  std::size_t norm_offset_ = 0;   ///< model.norm.weight

  std::int64_t batch_ = 0, length_ = 0, rows_ = 0;
  std::vector<std::int32_t> tokens_;
  std::vector<LayerCache<T>> layers_;
  std::vector<T> final_x_;    ///< [N, H] last layer output
  std::vector<T> final_inv_;  ///< [N]
  std::vector<T> hidden_;     ///< [N, H]
  std::vector<T> cos_, sin_;  ///< [rope_len, D / 2]
  std::int64_t rope_len_ = 0;

  // Backward scratch, reused across calls.
  std::vector<T> dx_, dxn_, dattn_, dq_, dk_, dv_, dact_, dgate_, dup_;
};

}  // namespace chunkloss::model::detail
