// LlamaConfig validation and config.json (de)serialisation with nlohmann::json.
#include "chunkloss/model/config.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "chunkloss/core/error.h"
#include "chunkloss/core/strict_json.h"

namespace chunkloss::model {

using nlohmann::json;

double parameter_count(const LlamaConfig& c) {
  const double h = static_cast<double>(c.hidden_size);
  const double per_layer = 2 * h + 2 * h * h +
                           2 * static_cast<double>(c.num_key_value_heads * c.head_dim()) * h +
                           3 * static_cast<double>(c.intermediate_size) * h;
  return static_cast<double>(c.vocab_size) * h * (c.tie_word_embeddings ? 1 : 2) +
         static_cast<double>(c.num_hidden_layers) * per_layer + h;
}

void validate(const LlamaConfig& c) {
  const auto positive = [](const char* name, std::int64_t v) {
    CHUNKLOSS_CHECK(v > 0 && v <= std::numeric_limits<std::int32_t>::max(), "LlamaConfig: ", name,
                    "=", v, " is not in [1, 2^31 - 1]");
  };
  positive("vocab_size", c.vocab_size);
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  positive("num_key_value_heads", c.num_key_value_heads);
  positive("max_position_embeddings", c.max_position_embeddings);
  // Each layer is nine parameter records, however small: a bound far above any Llama's layers
  // keeps a hostile config.json from exhausting memory on them.
  CHUNKLOSS_CHECK(c.num_hidden_layers <= kMaxLayers,
                  "LlamaConfig: num_hidden_layers=", c.num_hidden_layers,
                  " is more than this model layer takes (", kMaxLayers, ")");
  CHUNKLOSS_CHECK(c.hidden_size % c.num_attention_heads == 0,
                  "LlamaConfig: hidden_size=", c.hidden_size,
                  " is not a multiple of num_attention_heads=", c.num_attention_heads);
  CHUNKLOSS_CHECK(c.num_attention_heads % c.num_key_value_heads == 0,
                  "LlamaConfig: num_attention_heads=", c.num_attention_heads,
                  " is not a multiple of num_key_value_heads=", c.num_key_value_heads);
  CHUNKLOSS_CHECK(c.head_dim() % 2 == 0, "LlamaConfig: head_dim=", c.head_dim(),
                  " (hidden_size / num_attention_heads) must be even for rotary embeddings");
  // Parameters, gradients and AdamW's moments are float vectors on the host: 2^36 parameters
  // would take 1 TiB; the bound also keeps every size product below 2^63.
  const double params = parameter_count(c);
  CHUNKLOSS_CHECK(params <= 0x1p36, "LlamaConfig: vocab_size=", c.vocab_size,
                  ", hidden_size=", c.hidden_size, ", intermediate_size=", c.intermediate_size,
                  ", num_hidden_layers=", c.num_hidden_layers, " give ", params,
                  " parameters, more than this CPU model layer holds (2^36)");
  // The model computes in float: each value must be positive and finite as a float too.
  const auto positive_real = [](const char* name, double v) {
    const auto f = static_cast<float>(v);
    CHUNKLOSS_CHECK(std::isfinite(v) && v > 0 && std::isfinite(f) && f > 0, "LlamaConfig: ", name,
                    "=", v, " must be positive and finite",
                    std::isfinite(v) && v > 0 ? " in float (the model's precision)" : "");
  };
  positive_real("rms_norm_eps", c.rms_norm_eps);
  positive_real("rope_theta", c.rope_theta);
  positive_real("initializer_range", c.initializer_range);
  // RoPE's largest angle, (max_position_embeddings - 1) theta^(-2i/d) over the frequencies i, as
  // the model computes it in float: an infinite one makes NaN (a theta far below 1).
  const auto theta = static_cast<float>(c.rope_theta);
  const float d = static_cast<float>(c.head_dim());
  const float least_power = std::min(1.0f, std::pow(theta, (d - 2) / d));
  CHUNKLOSS_CHECK(std::isfinite(static_cast<float>(c.max_position_embeddings - 1) / least_power),
                  "LlamaConfig: rope_theta=", c.rope_theta, " makes RoPE's angles at ",
                  c.max_position_embeddings, " positions overflow float");
  const auto token = [&](const char* name, std::int64_t id) {
    CHUNKLOSS_CHECK(id >= 0 && id < c.vocab_size, "LlamaConfig: ", name, "=", id,
                    " outside [0, vocab_size=", c.vocab_size, ")");
  };
  token("bos_token_id", c.bos_token_id);
  token("eos_token_id", c.eos_token_id);
  if (c.pad_token_id) token("pad_token_id", *c.pad_token_id);
}

std::string config_to_json(const LlamaConfig& c, std::string_view extra_fields) {
  validate(c);
  json j;
  j["architectures"] = json::array({"LlamaForCausalLM"});
  j["model_type"] = "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim();
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["rope_scaling"] = nullptr;
  j["initializer_range"] = c.initializer_range;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["mlp_bias"] = false;
  j["pretraining_tp"] = 1;
  j["use_cache"] = true;
  j["torch_dtype"] = "float32";
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  j["pad_token_id"] = c.pad_token_id ? json(*c.pad_token_id) : json(nullptr);
  if (!extra_fields.empty()) {
    json extra = json::parse(extra_fields.begin(), extra_fields.end(), nullptr, false);
    CHUNKLOSS_CHECK(extra.is_object(), "config_to_json: extra_fields is not a JSON object");
    j.update(extra);
  }
  return j.dump(2) + "\n";
}

namespace {

// Whether `v` is an integer in [0, n).
bool is_index(const json& v, std::int64_t n) {
  if (v.is_number_unsigned())
    return v.get<std::uint64_t>() < static_cast<std::uint64_t>(std::max<std::int64_t>(n, 0));
  return v.is_number_integer() && v.get<std::int64_t>() >= 0 && v.get<std::int64_t>() < n;
}

struct Reader {
  const json& j;
  std::string_view source;

  const json* find(const char* name) const {
    const auto it = j.find(name);
    return it == j.end() ? nullptr : &*it;
  }
  std::int64_t integer(const char* name, std::optional<std::int64_t> fallback) const {
    const json* v = find(name);
    if (!v) {
      CHUNKLOSS_CHECK(fallback.has_value(), source, ": missing field \"", name, "\"");
      return *fallback;
    }
    CHUNKLOSS_CHECK(v->is_number_integer(), source, ": field \"", name,
                    "\" must be an integer, got ", v->type_name(), " ", v->dump());
    if (v->is_number_unsigned()) {
      CHUNKLOSS_CHECK(v->get<std::uint64_t>() <= static_cast<std::uint64_t>(INT64_MAX), source,
                      ": field \"", name, "\" is out of range");
    }
    return v->get<std::int64_t>();
  }
  double real(const char* name, double fallback) const {
    const json* v = find(name);
    if (!v) return fallback;
    CHUNKLOSS_CHECK(v->is_number(), source, ": field \"", name, "\" must be a number, got ",
                    v->type_name());
    return v->get<double>();
  }
  bool boolean(const char* name, bool fallback) const {
    const json* v = find(name);
    if (!v) return fallback;
    CHUNKLOSS_CHECK(v->is_boolean(), source, ": field \"", name, "\" must be a boolean, got ",
                    v->type_name());
    return v->get<bool>();
  }
  // A token id, or the first of a list (transformers allows a list of eos ids; this decoder
  // stops on one), every item of which must be an id in [0, vocab_size).
  std::optional<std::int64_t> token(const char* name, std::optional<std::int64_t> fallback,
                                    std::int64_t vocab_size) const {
    const json* v = find(name);
    if (!v) return fallback;
    if (v->is_null()) return std::nullopt;
    if (v->is_array()) {
      CHUNKLOSS_CHECK(!v->empty(), source, ": field \"", name,
                      "\" must be an integer or a non-empty list of integers");
      for (std::size_t i = 0; i < v->size(); ++i)
        CHUNKLOSS_CHECK(is_index((*v)[i], vocab_size), source, ": field \"", name, "\" item ", i,
                        " is ", (*v)[i].dump(), ", not a token id in [0, vocab_size=", vocab_size,
                        ")");
      return (*v)[0].get<std::int64_t>();
    }
    return integer(name, std::nullopt);
  }
  void require_string(const char* name, const char* expected, bool required) const {
    const json* v = find(name);
    if (!v) {
      CHUNKLOSS_CHECK(!required, source, ": missing field \"", name, "\"");
      return;
    }
    CHUNKLOSS_CHECK(v->is_string() && v->get<std::string>() == expected, source, ": field \"", name,
                    "\" is ", v->dump(), ", this decoder supports only \"", expected, "\"");
  }
};

}  // namespace

LlamaConfig config_from_json(std::string_view text, std::string_view source) {
  const json j = chunkloss::detail::parse_strict_json(text, std::string(source) + ": bad JSON");
  CHUNKLOSS_CHECK(j.is_object(), source, ": expected a JSON object, got ", j.type_name());
  const Reader r{j, source};
  r.require_string("model_type", "llama", false);
  r.require_string("hidden_act", "silu", false);
  CHUNKLOSS_CHECK(!r.boolean("attention_bias", false), source,
                  ": attention_bias true is not supported");
  CHUNKLOSS_CHECK(!r.boolean("mlp_bias", false), source, ": mlp_bias true is not supported");
  if (const json* v = r.find("rope_scaling")) {
    CHUNKLOSS_CHECK(v->is_null(), source, ": rope_scaling ", v->dump(),
                    " is not supported (only null)");
  }
  LlamaConfig c;
  c.vocab_size = r.integer("vocab_size", std::nullopt);
  c.hidden_size = r.integer("hidden_size", std::nullopt);
  c.intermediate_size = r.integer("intermediate_size", std::nullopt);
  c.num_hidden_layers = r.integer("num_hidden_layers", std::nullopt);
  c.num_attention_heads = r.integer("num_attention_heads", std::nullopt);
  c.num_key_value_heads = r.integer("num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = r.integer("max_position_embeddings", 2048);
  c.rms_norm_eps = r.real("rms_norm_eps", 1e-6);
  c.rope_theta = r.real("rope_theta", 10000.0);
  // transformers 5 writes RoPE's settings as rope_parameters {"rope_type", "rope_theta", ...}
  // (4 wrote rope_theta and rope_scaling); only the default RoPE is supported either way.
  if (const json* v = r.find("rope_parameters"); v && !v->is_null()) {
    const std::string where = std::string(source) + ": rope_parameters";
    CHUNKLOSS_CHECK(v->is_object(), where, " must be an object, got ", v->type_name());
    const Reader p{*v, where};
    p.require_string("rope_type", "default", false);
    const double theta = p.real("rope_theta", c.rope_theta);
    CHUNKLOSS_CHECK(!r.find("rope_theta") || theta == c.rope_theta, where, ": rope_theta ", theta,
                    " differs from the top-level rope_theta ", c.rope_theta);
    c.rope_theta = theta;
  }
  c.initializer_range = r.real("initializer_range", 0.02);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  const std::optional<std::int64_t> bos = r.token("bos_token_id", 1, c.vocab_size);
  const std::optional<std::int64_t> eos = r.token("eos_token_id", 2, c.vocab_size);
  CHUNKLOSS_CHECK(bos.has_value(), source, ": bos_token_id must not be null");
  CHUNKLOSS_CHECK(eos.has_value(), source, ": eos_token_id must not be null");
  c.bos_token_id = *bos;
  c.eos_token_id = *eos;
  c.pad_token_id = r.token("pad_token_id", std::nullopt, c.vocab_size);
  if (c.num_attention_heads > 0) {
    const std::int64_t head_dim = r.integer("head_dim", c.head_dim());
    CHUNKLOSS_CHECK(head_dim == c.head_dim(), source, ": head_dim=", head_dim,
                    " differs from hidden_size / num_attention_heads = ", c.head_dim(),
                    " (not supported)");
  }
  try {
    validate(c);
  } catch (const Error& e) {
    CHUNKLOSS_FAIL(source, ": ", e.what());
  }
  return c;
}

}  // namespace chunkloss::model
