// libFuzzer target: the config.json parser on arbitrary bytes. Any input either parses or throws
// chunkloss::Error; a config that parses is valid and survives config_to_json ->
// config_from_json unchanged.
#include <chunkloss/core/error.h>
#include <chunkloss/model/config.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

namespace {

void require(bool ok) {
  if (!ok) std::abort();
}

bool same(const chunkloss::model::LlamaConfig& a, const chunkloss::model::LlamaConfig& b) {
  return a.vocab_size == b.vocab_size && a.hidden_size == b.hidden_size &&
         a.intermediate_size == b.intermediate_size && a.num_hidden_layers == b.num_hidden_layers &&
         a.num_attention_heads == b.num_attention_heads &&
         a.num_key_value_heads == b.num_key_value_heads &&
         a.max_position_embeddings == b.max_position_embeddings &&
         a.rms_norm_eps == b.rms_norm_eps && a.rope_theta == b.rope_theta &&
         a.initializer_range == b.initializer_range &&
         a.tie_word_embeddings == b.tie_word_embeddings && a.bos_token_id == b.bos_token_id &&
         a.eos_token_id == b.eos_token_id && a.pad_token_id == b.pad_token_id;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* bytes, std::size_t size) {
  using namespace chunkloss::model;
  const std::string_view text(reinterpret_cast<const char*>(bytes), size);
  LlamaConfig c;
  try {
    c = config_from_json(text, "<fuzz>");
  } catch (const chunkloss::Error&) {
    return 0;
  }
  validate(c);
  require(same(config_from_json(config_to_json(c), "<round trip>"), c));
  return 0;
}
