// The parameter layout and the float instantiation of the decoder (LlamaModel's).
#include "chunkloss/model/decoder_impl.h"

namespace chunkloss::model::detail {

std::vector<ParameterInfo> parameter_layout(const LlamaConfig& config) {
  validate(config);
  const Dims m(config);
  std::vector<ParameterInfo> out;
  std::size_t offset = 0;
  const auto add = [&](std::string name, std::vector<std::int64_t> shape, bool decay) {
    std::size_t numel = 1;
    for (std::int64_t s : shape) numel *= static_cast<std::size_t>(s);
    out.push_back({std::move(name), std::move(shape), offset, numel, decay});
    offset += numel;
  };
  add("model.embed_tokens.weight", {m.v, m.h}, true);
  for (std::int64_t l = 0; l < m.layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    add(p + "input_layernorm.weight", {m.h}, false);
    add(p + "self_attn.q_proj.weight", {m.heads * m.d, m.h}, true);
    add(p + "self_attn.k_proj.weight", {m.kv_heads * m.d, m.h}, true);
    add(p + "self_attn.v_proj.weight", {m.kv_heads * m.d, m.h}, true);
    add(p + "self_attn.o_proj.weight", {m.h, m.heads * m.d}, true);
    add(p + "post_attention_layernorm.weight", {m.h}, false);
    add(p + "mlp.gate_proj.weight", {m.i, m.h}, true);
    add(p + "mlp.up_proj.weight", {m.i, m.h}, true);
    add(p + "mlp.down_proj.weight", {m.h, m.i}, true);
  }
  add("model.norm.weight", {m.h}, false);
  if (!config.tie_word_embeddings) add("lm_head.weight", {m.v, m.h}, true);
  return out;
}

template class Decoder<float>;
template void init_parameters<float>(const LlamaConfig&, const std::vector<ParameterInfo>&,
                                     std::uint64_t, std::vector<float>&);

}  // namespace chunkloss::model::detail
