// The decoder's forward against the naive float64 reference (GQA on/off, tied/untied), causality,
// batch independence, the repeat_kv head mapping, initialisation, parameter layout and errors.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/model/decoder.h>
#include <chunkloss/model/model.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "data/expect_error.h"
#include "reference_decoder.h"
#include "support/compare.h"

namespace chunkloss::test {
namespace {

using model::LlamaConfig;
using model::LlamaModel;

std::vector<std::int32_t> random_tokens(std::int64_t n, std::int64_t v, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (auto& x : t) x = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(v));
  return t;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = max_or_nan(m, std::abs(a[i] - b[i]));
  return m;
}

TEST_CASE("forward: float64 decoder matches the naive reference") {
  for (bool gqa : {false, true}) {
    for (bool tied : {false, true}) {
      CAPTURE(gqa);
      CAPTURE(tied);
      const LlamaConfig c = tiny_config(gqa, tied);
      model::detail::Decoder<double> dec(c);
      model::detail::init_parameters(c, dec.layout(), 5, dec.params());
      const std::int64_t b = 2, t = 7;
      const auto tokens = random_tokens(b * t, c.vocab_size, 11);
      const double* h = dec.forward(tokens.data(), b, t);
      const std::vector<double> got(h, h + b * t * c.hidden_size);
      const auto want = reference_forward(c, dec.layout(), dec.params(), tokens, b, t);
      REQUIRE(want.size() == got.size());
      CHECK(max_abs_diff(got, want) < 1e-12);
    }
  }
}

TEST_CASE("forward: the fp32 model matches the reference to fp32 rounding") {
  for (bool gqa : {false, true}) {
    CAPTURE(gqa);
    const LlamaConfig c = tiny_config(gqa, false);
    LlamaModel m(c, 3);
    const std::int64_t b = 3, t = 9;
    const auto tokens = random_tokens(b * t, c.vocab_size, 4);
    const TensorView h = m.forward(TensorView::of(tokens.data(), {b, t}));
    CHECK(h.size(0) == b * t);
    CHECK(h.size(1) == c.hidden_size);
    const std::vector<double> params(m.params().begin(), m.params().end());
    const auto want = reference_forward(c, m.parameters(), params, tokens, b, t);
    const float* hp = h.data_as<const float>();
    const std::vector<double> got(hp, hp + b * t * c.hidden_size);
    CHECK(max_abs_diff(got, want) < 2e-4);
    // i64 tokens give the same result.
    std::vector<std::int64_t> wide(tokens.begin(), tokens.end());
    const TensorView h64 = m.forward(TensorView::of(wide.data(), {b, t}));
    CHECK(std::memcmp(h64.data(), hp, got.size() * sizeof(float)) == 0);
  }
}

TEST_CASE("forward: causal (later tokens never change earlier rows) and batch-independent") {
  const LlamaConfig c = tiny_config(true, true);
  LlamaModel m(c, 9);
  const std::int64_t t = 8, h = c.hidden_size;
  auto tokens = random_tokens(2 * t, c.vocab_size, 1);
  std::vector<float> first(static_cast<std::size_t>(2 * t * h));
  std::memcpy(first.data(), m.forward(TensorView::of(tokens.data(), {2, t})).data(),
              first.size() * 4);
  tokens[t - 1] = (tokens[t - 1] + 1) % static_cast<std::int32_t>(c.vocab_size);
  const float* second = m.forward(TensorView::of(tokens.data(), {2, t})).data_as<const float>();
  CHECK(std::memcmp(first.data(), second, static_cast<std::size_t>((t - 1) * h) * 4) == 0);
  bool last_changed = false;
  for (std::int64_t j = (t - 1) * h; j < t * h; ++j) last_changed |= first[j] != second[j];
  CHECK(last_changed);
  CHECK(std::memcmp(first.data() + t * h, second + t * h, static_cast<std::size_t>(t * h) * 4) ==
        0);
  // Row 1 alone equals row 1 of the batch (up to GEMM blocking).
  const float* alone = m.forward(TensorView::of(tokens.data() + t, {1, t})).data_as<const float>();
  double worst = 0;
  for (std::int64_t j = 0; j < t * h; ++j)
    worst = max_or_nan(worst, std::abs(double(alone[j]) - first[t * h + j]));
  CHECK(worst < 1e-5);
}

TEST_CASE("forward: query head h reads kv head h / (heads / kv_heads), as HF repeat_kv") {
  LlamaConfig gqa = tiny_config(true, false);
  gqa.num_attention_heads = 4;
  gqa.num_key_value_heads = 2;
  gqa.hidden_size = 16;
  LlamaConfig mha = gqa;
  mha.num_key_value_heads = 4;
  model::detail::Decoder<double> a(gqa), b(mha);
  model::detail::init_parameters(gqa, a.layout(), 21, a.params());
  model::detail::init_parameters(mha, b.layout(), 22, b.params());
  const std::int64_t d = gqa.head_dim(), hsz = gqa.hidden_size;
  // Copy every tensor; k/v of the MHA model repeat the GQA heads: kv head j -> heads 2j, 2j+1.
  for (const auto& pa : a.layout()) {
    for (const auto& pb : b.layout()) {
      if (pa.name != pb.name) continue;
      const bool kv = pa.name.find("k_proj") != std::string::npos ||
                      pa.name.find("v_proj") != std::string::npos;
      if (!kv) {
        std::copy_n(a.params().begin() + pa.offset, pa.numel, b.params().begin() + pb.offset);
        continue;
      }
      for (std::int64_t head = 0; head < 4; ++head) {
        std::copy_n(a.params().begin() + pa.offset + (head / 2) * d * hsz, d * hsz,
                    b.params().begin() + pb.offset + head * d * hsz);
      }
    }
  }
  const auto tokens = random_tokens(2 * 6, gqa.vocab_size, 8);
  const double* ha = a.forward(tokens.data(), 2, 6);
  const double* hb = b.forward(tokens.data(), 2, 6);
  double worst = 0;
  for (std::int64_t j = 0; j < 12 * hsz; ++j) worst = max_or_nan(worst, std::abs(ha[j] - hb[j]));
  CHECK(worst < 1e-12);
}

TEST_CASE("model: deterministic init, N(0, std^2) matrices, unit norms, HF layout and counts") {
  for (bool tied : {false, true}) {
    CAPTURE(tied);
    LlamaConfig c = tiny_config(false, tied);
    c.initializer_range = 0.02;
    c.vocab_size = 259;
    c.hidden_size = 64;
    const LlamaModel a(c, 1), b(c, 1), other(c, 2);
    CHECK(std::equal(a.params().begin(), a.params().end(), b.params().begin()));
    CHECK(!std::equal(a.params().begin(), a.params().end(), other.params().begin()));
    const auto& emb = a.parameter("model.embed_tokens.weight");
    double s = 0, ss = 0;
    for (std::size_t j = 0; j < emb.numel; ++j) {
      const double v = a.params()[emb.offset + j];
      s += v;
      ss += v * v;
    }
    const double mean = s / emb.numel, sd = std::sqrt(ss / emb.numel - mean * mean);
    CHECK(std::abs(mean) < 0.002);
    CHECK(sd == doctest::Approx(0.02).epsilon(0.05));
    const auto& norm = a.parameter("model.layers.1.post_attention_layernorm.weight");
    CHECK(!norm.decay);
    for (std::size_t j = 0; j < norm.numel; ++j) CHECK(a.params()[norm.offset + j] == 1.0f);

    const std::int64_t v = c.vocab_size, h = c.hidden_size, i = c.intermediate_size;
    const std::int64_t qw = c.num_attention_heads * c.head_dim();
    const std::int64_t kw = c.num_key_value_heads * c.head_dim();
    const std::int64_t per_layer = 2 * h + h * qw + 2 * h * kw + qw * h + 3 * h * i;
    CHECK(a.parameter_count() == v * h + c.num_hidden_layers * per_layer + h + (tied ? 0 : v * h));
    CHECK(a.parameters().front().name == "model.embed_tokens.weight");
    CHECK(a.parameter("model.layers.0.self_attn.k_proj.weight").shape ==
          std::vector<std::int64_t>{kw, h});
    CHECK(a.parameter("model.layers.1.mlp.down_proj.weight").shape ==
          std::vector<std::int64_t>{h, i});
    const bool has_lm_head = a.parameters().back().name == "lm_head.weight";
    CHECK(has_lm_head == !tied);
    const float* lm = a.lm_head_weight().data_as<const float>();
    CHECK((lm == a.params().data() + emb.offset) == tied);
    CHECK(contains(a.summary(), std::to_string(a.parameter_count()) + " parameters"));
    CHECK(contains(error_message([&] { a.parameter("nope"); }), "no parameter named \"nope\""));
  }
}

TEST_CASE("model: invalid configs and inputs are errors naming the problem") {
  LlamaConfig c = tiny_config(false, false);
  c.num_key_value_heads = 3;
  CHECK(contains(error_message([&] { LlamaModel m(c); }), "num_key_value_heads=3"));
  c = tiny_config(false, false);
  c.hidden_size = 13;
  CHECK(contains(error_message([&] { LlamaModel m(c); }), "hidden_size=13"));
  c = tiny_config(false, false);
  c.hidden_size = 6;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  CHECK(contains(error_message([&] { LlamaModel m(c); }), "head_dim=3"));
  c = tiny_config(false, false);
  c.rms_norm_eps = 0;
  CHECK(contains(error_message([&] { LlamaModel m(c); }), "rms_norm_eps"));
  c = tiny_config(false, false);
  c.num_hidden_layers = model::kMaxLayers + 1;
  CHECK(contains(error_message([&] { LlamaModel m(c); }),
                 "num_hidden_layers=" + std::to_string(model::kMaxLayers + 1) + " is more than"));
  // Positive as doubles, 0 or Inf as floats (the model's precision: rope_theta 1e-300 gave NaN).
  using Field = std::tuple<const char*, double LlamaConfig::*, double>;
  for (const auto& [name, field, value] :
       {Field{"rms_norm_eps", &LlamaConfig::rms_norm_eps, 1e-300},
        Field{"rope_theta", &LlamaConfig::rope_theta, 1e-300},
        Field{"initializer_range", &LlamaConfig::initializer_range, 1e300}}) {
    c = tiny_config(false, false);
    c.*field = value;
    CHECK(contains(error_message([&] { LlamaModel m(c); }),
                   std::string(name) + "=" + (value > 1 ? "1e+300" : "1e-300") +
                       " must be positive and finite in float"));
  }
  // A float theta whose angles theta^(-(d-2)/d) (T - 1) overflow float at head_dim 64.
  c = tiny_config(false, false);
  c.hidden_size = 64;
  c.num_attention_heads = c.num_key_value_heads = 1;
  c.max_position_embeddings = 1 << 20;
  c.rope_theta = 1e-38;
  CHECK(contains(error_message([&] { LlamaModel m(c); }), "rope_theta=1e-38 makes RoPE's angles"));

  LlamaModel m(tiny_config(false, false));
  std::vector<float> g(100);
  CHECK(contains(error_message([&] {
                   m.backward(TensorView::of(g.data(), {1, 12}));
                 }),
                 "before forward"));
  std::vector<std::int32_t> bad = {1, 2, 11, 3};
  CHECK(contains(error_message([&] {
                   m.forward(TensorView::of(bad.data(), {2, 2}));
                 }),
                 "token id 11 at [1, 0]"));
  std::vector<std::int32_t> long_seq(17, 1);
  CHECK(contains(error_message([&] {
                   m.forward(TensorView::of(long_seq.data(), {1, 17}));
                 }),
                 "max_position_embeddings=16"));
  CHECK(contains(error_message([&] { m.forward(TensorView::of(bad.data(), {4})); }), "[B, T]"));
  std::vector<std::int32_t> ok = {1, 2, 3, 4};
  m.forward(TensorView::of(ok.data(), {2, 2}));
  CHECK(contains(error_message([&] {
                   m.backward(TensorView::of(g.data(), {3, 12}));
                 }),
                 "grad_hidden must be [4, 12]"));
  CHECK(contains(error_message([&] {
                   m.backward(TensorView::of(g.data(), {4, 12}), m.lm_head_weight_grad());
                 }),
                 "own lm_head gradient slot"));
}

}  // namespace
}  // namespace chunkloss::test
