// LlamaModel: a small Llama-style causal decoder on the CPU (fp32, Eigen inside) with a
// hand-written backward. It hands the final hidden states and the lm_head weight to any loss
// object and takes the hidden-state (and lm_head weight) gradient back.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "chunkloss/core/tensor.h"
#include "chunkloss/model/config.h"

namespace chunkloss::model {

/// One parameter tensor inside the model's flat parameter buffer.
struct ParameterInfo {
  std::string name;                 ///< Hugging Face Llama name, e.g. "model.norm.weight"
  std::vector<std::int64_t> shape;  ///< [out, in] for projections, [H] for norms
  std::size_t offset = 0;           ///< first element in params() / grads()
  std::size_t numel = 0;
  bool decay = true;  ///< AdamW weight decay applies (false for the RMSNorm weights)
};

namespace detail {
template <typename T>
class Decoder;
}

/// The decoder (transformers' LlamaForCausalLM without dropout, biases or rope scaling):
///   x_0 = E[tokens]
///   per layer: a = x + o_proj(Attn(RoPE(q_proj(n1)), RoPE(k_proj(n1)), v_proj(n1))),
///              n1 = RMSNorm_1(x);  x' = a + down_proj(silu(gate_proj(n2)) * up_proj(n2)),
///              n2 = RMSNorm_2(a)
///   hidden = RMSNorm_f(x_L);  logits = hidden @ lm_head^T (left to the loss)
/// RMSNorm(x) = g * x / sqrt(mean(x^2) + eps). RoPE is HF's rotate_half convention:
/// out = x * cos + rotate_half(x) * sin with angle t * theta^(-2i/head_dim) shared by dims i and
/// i + head_dim/2. Attention is causal softmax(q k^T / sqrt(head_dim)) v per head, query head h
/// using key/value head h / (heads / kv_heads).
///
/// All parameters live in one flat fp32 buffer (layout in parameters(), HF order), gradients in
/// a second of the same layout. The model owns its activations: forward() caches what
/// backward() needs and backward() uses the cache of the latest forward(). Not thread-safe;
/// a forward/backward uses OpenMP threads inside. Deterministic: same inputs, same thread count
/// -> bitwise same results. Copying copies parameters and gradients (not the activations).
class LlamaModel {
 public:
  /// Initialises every weight matrix from N(0, initializer_range^2) and every RMSNorm weight
  /// to 1, drawing from std::mt19937_64(seed) in parameters() order (Box-Muller on 53-bit
  /// uniforms, identical on every platform). Throws chunkloss::Error if the config is invalid.
  explicit LlamaModel(const LlamaConfig& config, std::uint64_t seed = 0);
  LlamaModel(const LlamaModel& other);
  LlamaModel& operator=(const LlamaModel& other);
  LlamaModel(LlamaModel&&) noexcept;
  LlamaModel& operator=(LlamaModel&&) noexcept;
  ~LlamaModel();

  const LlamaConfig& config() const;
  /// Parameter tensors in HF order: embed_tokens, per layer input_layernorm, q/k/v/o_proj,
  /// post_attention_layernorm, gate/up/down_proj, then model.norm, then lm_head (absent when
  /// tied).
  const std::vector<ParameterInfo>& parameters() const;
  /// Throws chunkloss::Error for an unknown name.
  const ParameterInfo& parameter(std::string_view name) const;
  /// Number of parameters (a tied lm_head counted once).
  std::int64_t parameter_count() const;
  /// One line: layers, sizes, heads, tying and the parameter count.
  std::string summary() const;

  /// The flat parameter and gradient buffers (parameters() gives the layout).
  std::span<float> params();
  std::span<const float> params() const;
  std::span<float> grads();
  std::span<const float> grads() const;
  /// Per-element AdamW weight-decay mask (1 = decay) in the flat layout.
  std::vector<std::uint8_t> decay_mask() const;

  /// Runs the decoder on tokens [B, T] (i32 or i64, ids in [0, V), T <= max_position_embeddings)
  /// and returns the final hidden states [B * T, H] f32 (row b * T + t), owned by the model and
  /// valid until the next forward(). Throws chunkloss::Error for a bad view or id.
  TensorView forward(const TensorView& tokens);
  /// The latest forward()'s hidden states (absent before the first).
  TensorView hidden() const;
  /// The lm_head weight [V, H] f32: model.embed_tokens.weight when tied.
  TensorView lm_head_weight() const;
  /// The lm_head slot of grads() [V, H] f32 (the embedding's gradient when tied). A loss may
  /// accumulate its weight gradient straight into it (CrossEntropyGrads::accumulate = true)
  /// and then call backward() without grad_lm_head.
  TensorView lm_head_weight_grad();

  /// Backpropagates through the latest forward(): `grad_hidden` [B * T, H] f32 is dL/dhidden;
  /// `grad_lm_head` [V, H] f32 (optional) is the loss's dL/dlm_head, added into the lm_head
  /// slot (the embedding's gradient when tied). Gradients are ADDED to grads(), so calling
  /// zero_grad() once and then forward/backward per micro-batch accumulates them.
  /// Throws chunkloss::Error before the first forward() or for shapes that do not match it.
  void backward(const TensorView& grad_hidden, const TensorView& grad_lm_head = {});

  /// Sets every gradient to zero.
  void zero_grad();
  /// Multiplies every gradient by `factor` (e.g. 1 / micro-batches after accumulation).
  void scale_grads(float factor);

 private:
  std::unique_ptr<detail::Decoder<float>> impl_;
};

}  // namespace chunkloss::model
