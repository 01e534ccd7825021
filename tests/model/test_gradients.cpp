// The hand-written backward against central finite differences of
//   L = sum(hidden * R) + sum(lm_head * S)
// (R: the hidden-state gradient a loss would hand back, S: its lm_head gradient), for every
// parameter in float64 and for sampled parameters of the public fp32 model, with GQA on and off
// (over one and two KV heads) and tied and untied embeddings; plus accumulation, zero_grad and
// scale_grads.
#include <doctest/doctest.h>

#include <chunkloss/model/decoder.h>
#include <chunkloss/model/model.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "reference_decoder.h"
#include "support/compare.h"

namespace chunkloss::test {
namespace {

using model::LlamaConfig;
using model::LlamaModel;

struct Problem {
  std::int64_t b = 2, t = 5;
  std::vector<std::int32_t> tokens;
  std::vector<double> r, s;  // dL/dhidden [B*T, H], dL/dlm_head [V, H]
};

Problem make_problem(const LlamaConfig& c, std::uint64_t seed) {
  Problem p;
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal;
  for (std::int64_t i = 0; i < p.b * p.t; ++i) {
    p.tokens.push_back(static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(c.vocab_size)));
  }
  p.r.resize(static_cast<std::size_t>(p.b * p.t * c.hidden_size));
  p.s.resize(static_cast<std::size_t>(c.vocab_size * c.hidden_size));
  for (double& x : p.r) x = normal(rng);
  for (double& x : p.s) x = normal(rng);
  return p;
}

template <typename T>
double objective(model::detail::Decoder<T>& dec, const Problem& p) {
  const T* h = dec.forward(p.tokens.data(), p.b, p.t);
  double l = 0;
  for (std::size_t j = 0; j < p.r.size(); ++j) l += static_cast<double>(h[j]) * p.r[j];
  const T* w = dec.params().data() + dec.lm_head_offset();
  for (std::size_t j = 0; j < p.s.size(); ++j) l += static_cast<double>(w[j]) * p.s[j];
  return l;
}

// tiny_config's configurations (MHA and GQA over one KV head, untied and tied), and 4 query heads
// over 2 KV heads: one KV head cannot tell the query-to-KV mapping apart from any other.
std::vector<LlamaConfig> gradient_configs() {
  std::vector<LlamaConfig> all;
  for (bool gqa : {false, true})
    for (bool tied : {false, true}) all.push_back(tiny_config(gqa, tied));
  LlamaConfig four_over_two = tiny_config(true, false);
  four_over_two.hidden_size = 16;
  four_over_two.num_attention_heads = 4;
  four_over_two.num_key_value_heads = 2;
  all.push_back(four_over_two);
  return all;
}

TEST_CASE("gradients: float64 backward equals central differences for every parameter") {
  for (const LlamaConfig& c : gradient_configs()) {
    CAPTURE(c.num_attention_heads);
    CAPTURE(c.num_key_value_heads);
    CAPTURE(c.tie_word_embeddings);
    model::detail::Decoder<double> dec(c);
    model::detail::init_parameters(c, dec.layout(), 17, dec.params());
    const Problem p = make_problem(c, 3);
    dec.forward(p.tokens.data(), p.b, p.t);
    dec.backward(p.r.data(), p.s.data());
    const std::vector<double> analytic = dec.grads();
    const double step = 1e-5;
    for (const auto& info : dec.layout()) {
      double worst = 0, scale = 0;
      for (std::size_t j = 0; j < info.numel; ++j) {
        double& x = dec.params()[info.offset + j];
        const double saved = x;
        x = saved + step;
        const double up = objective(dec, p);
        x = saved - step;
        const double down = objective(dec, p);
        x = saved;
        const double fd = (up - down) / (2 * step);
        worst = max_or_nan(worst, std::abs(fd - analytic[info.offset + j]));
        scale = std::max(scale, std::abs(fd));
      }
      CAPTURE(info.name);
      CHECK(scale > 1e-3);  // every tensor gets a real gradient
      CHECK(worst <= 1e-6 * std::max(1.0, scale));
    }
  }
}

TEST_CASE("gradients: the fp32 model agrees with float64 and with fp32 finite differences") {
  for (bool gqa : {false, true}) {
    for (bool tied : {false, true}) {
      CAPTURE(gqa);
      CAPTURE(tied);
      const LlamaConfig c = tiny_config(gqa, tied);
      LlamaModel m(c, 23);
      const Problem p = make_problem(c, 4);
      std::vector<float> r(p.r.begin(), p.r.end()), s(p.s.begin(), p.s.end());
      m.zero_grad();
      m.forward(TensorView::of(p.tokens.data(), {p.b, p.t}));
      m.backward(TensorView::of(r.data(), {p.b * p.t, c.hidden_size}),
                 TensorView::of(s.data(), {c.vocab_size, c.hidden_size}));

      // The same parameters (and float-rounded R, S) in float64.
      model::detail::Decoder<double> dec(c);
      std::copy(m.params().begin(), m.params().end(), dec.params().begin());
      Problem pd = p;
      pd.r.assign(r.begin(), r.end());
      pd.s.assign(s.begin(), s.end());
      dec.forward(pd.tokens.data(), pd.b, pd.t);
      dec.backward(pd.r.data(), pd.s.data());
      double diff = 0, norm = 0;
      for (std::size_t j = 0; j < dec.grads().size(); ++j) {
        diff = max_or_nan(diff, std::abs(m.grads()[j] - dec.grads()[j]));
        norm = std::max(norm, std::abs(dec.grads()[j]));
      }
      CHECK(diff <= 1e-4 * norm);

      // fp32 central differences on 4 entries of each tensor, through the public API.
      std::mt19937_64 rng(7);
      for (const auto& info : m.parameters()) {
        for (int k = 0; k < 4; ++k) {
          const std::size_t j = info.offset + rng() % info.numel;
          const auto eval = [&] {
            const float* h =
                m.forward(TensorView::of(p.tokens.data(), {p.b, p.t})).data_as<const float>();
            double l = 0;
            for (std::size_t u = 0; u < r.size(); ++u) l += double(h[u]) * r[u];
            const float* w = m.lm_head_weight().data_as<const float>();
            for (std::size_t u = 0; u < s.size(); ++u) l += double(w[u]) * s[u];
            return l;
          };
          const float saved = m.params()[j];
          const float step = 1e-2f * std::max(1.0f, std::abs(saved));
          m.params()[j] = saved + step;
          const double up = eval();
          m.params()[j] = saved - step;
          const double down = eval();
          m.params()[j] = saved;
          const double fd = (up - down) / (double(saved + step) - double(saved - step));
          CAPTURE(info.name);
          CHECK(std::abs(fd - m.grads()[j]) <= 2e-2 * std::abs(dec.grads()[j]) + 2e-3 * norm);
        }
      }
    }
  }
}

TEST_CASE("gradients: backward accumulates, zero_grad and scale_grads") {
  const LlamaConfig c = tiny_config(true, false);
  LlamaModel m(c, 2);
  const Problem p1 = make_problem(c, 10), p2 = make_problem(c, 11);
  const auto run = [&](const Problem& p) {
    std::vector<float> r(p.r.begin(), p.r.end());
    m.forward(TensorView::of(p.tokens.data(), {p.b, p.t}));
    m.backward(TensorView::of(r.data(), {p.b * p.t, c.hidden_size}));
  };
  m.zero_grad();
  run(p1);
  const std::vector<float> g1(m.grads().begin(), m.grads().end());
  m.zero_grad();
  run(p2);
  const std::vector<float> g2(m.grads().begin(), m.grads().end());
  m.zero_grad();
  run(p1);
  run(p2);
  // Equal up to the order of the fp32 additions.
  double worst = 0, scale = 0;
  for (std::size_t j = 0; j < g1.size(); ++j) {
    worst = max_or_nan(worst, std::abs(double(m.grads()[j]) - (double(g1[j]) + g2[j])));
    scale = std::max(scale, std::abs(double(g1[j]) + g2[j]));
  }
  CHECK(scale > 0);
  CHECK(worst <= 1e-5 * scale);
  const std::vector<float> acc(m.grads().begin(), m.grads().end());
  m.scale_grads(0.5f);
  for (std::size_t j = 0; j < acc.size(); ++j) CHECK(m.grads()[j] == acc[j] * 0.5f);
  m.zero_grad();
  for (float g : m.grads()) CHECK(g == 0.0f);
  // Same inputs, same gradients, bitwise.
  run(p1);
  CHECK(std::equal(g1.begin(), g1.end(), m.grads().begin()));
}

}  // namespace
}  // namespace chunkloss::test
