// LlamaConfig: the decoder's hyperparameters under Hugging Face's LlamaConfig field names, with
// validation and the config.json (de)serialisation the checkpoints use.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace chunkloss::model {

/// Hyperparameters of the Llama-style decoder. Field names and meaning follow
/// transformers.LlamaConfig; the defaults here describe a tiny byte-level model (V = 259).
/// head_dim is hidden_size / num_attention_heads; query head h reads key/value head
/// h / (num_attention_heads / num_key_value_heads) (HF's repeat_kv).
struct LlamaConfig {
  std::int64_t vocab_size = 259;
  std::int64_t hidden_size = 64;
  std::int64_t intermediate_size = 176;
  std::int64_t num_hidden_layers = 2;
  std::int64_t num_attention_heads = 4;
  std::int64_t num_key_value_heads = 4;  ///< < num_attention_heads: grouped-query attention
  std::int64_t max_position_embeddings = 128;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double initializer_range = 0.02;   ///< std of the normal init of every weight matrix
  bool tie_word_embeddings = false;  ///< lm_head shares model.embed_tokens.weight
  std::int64_t bos_token_id = 256;
  std::int64_t eos_token_id = 257;
  std::optional<std::int64_t> pad_token_id = 258;  ///< recorded only; padding is never attended

  std::int64_t head_dim() const { return hidden_size / num_attention_heads; }
};

/// The most num_hidden_layers validate() takes (each layer is nine parameter records).
inline constexpr std::int64_t kMaxLayers = 4096;

/// The number of parameters `config` gives (a tied lm_head counted once), in double so that any
/// sizes can be asked about before validate() bounds them.
double parameter_count(const LlamaConfig& config);

/// Throws chunkloss::Error naming the field when a size is not in [1, 2^31 - 1],
/// num_hidden_layers is above kMaxLayers, the parameters number more than 2^36, hidden_size is
/// not a multiple of num_attention_heads, num_attention_heads not a multiple of
/// num_key_value_heads, head_dim is odd (RoPE rotates pairs), rms_norm_eps, rope_theta or
/// initializer_range are not positive and finite as floats (the model's precision), rope_theta
/// makes RoPE's angles overflow float within max_position_embeddings, or a token id lies
/// outside [0, vocab_size).
void validate(const LlamaConfig& config);

/// config.json text in Hugging Face's format: "architectures": ["LlamaForCausalLM"],
/// "model_type": "llama", every LlamaConfig field above, plus the fixed values this decoder
/// implements ("hidden_act": "silu", "attention_bias": false, "mlp_bias": false, "head_dim",
/// "rope_scaling": null, "torch_dtype": "float32"). `extra_fields` (a JSON object text, or empty)
/// is merged in at the top level.
std::string config_to_json(const LlamaConfig& config, std::string_view extra_fields = {});

/// Parses config.json text; `source` names it in messages. Required: vocab_size, hidden_size,
/// intermediate_size, num_hidden_layers, num_attention_heads; the rest default as in
/// transformers (num_key_value_heads = num_attention_heads, rms_norm_eps 1e-6, rope_theta 10000,
/// max_position_embeddings 2048, initializer_range 0.02, tie_word_embeddings false, bos 1,
/// eos 2, pad none). A token id field may be a non-empty list, as transformers allows for
/// eos_token_id: the first id is kept, and every item must be an integer in [0, vocab_size).
/// Fields this decoder cannot honour are rejected: model_type other than "llama", hidden_act
/// other than "silu", attention_bias or mlp_bias true, a non-null rope_scaling, a
/// rope_parameters.rope_type other than "default" (transformers 5 keeps RoPE's settings there;
/// its rope_theta is read), a head_dim other than hidden_size / num_attention_heads. Unknown
/// fields are ignored. Throws chunkloss::Error naming `source` and the field, then validate()s.
LlamaConfig config_from_json(std::string_view text, std::string_view source);

}  // namespace chunkloss::model
