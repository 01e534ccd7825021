// AdamW against a float64 transcription of torch.optim.AdamW (decay mask, bias correction),
// gradient-norm clipping, and the warmup + cosine schedule's defining points.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/model/model.h>
#include <chunkloss/model/optim.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "data/expect_error.h"
#include "reference_decoder.h"

namespace chunkloss::test {
namespace {

using namespace chunkloss::model;

TEST_CASE("AdamW: matches the torch update rule over several steps, with a decay mask") {
  const std::size_t n = 37;
  AdamWOptions o;
  o.beta1 = 0.8;
  o.beta2 = 0.95;
  o.eps = 1e-6;
  o.weight_decay = 0.1;
  AdamW opt(n, o);
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal;
  std::vector<float> p(n);
  for (float& x : p) x = static_cast<float>(normal(rng));
  std::vector<std::uint8_t> mask(n);
  for (std::size_t j = 0; j < n; ++j) mask[j] = j % 3 != 0;
  std::vector<double> pd(p.begin(), p.end()), m(n, 0), v(n, 0);
  for (int t = 1; t <= 5; ++t) {
    std::vector<float> g(n);
    for (float& x : g) x = static_cast<float>(normal(rng));
    const double lr = 0.01 * t;
    opt.step(p, g, lr, mask);
    for (std::size_t j = 0; j < n; ++j) {
      if (mask[j]) pd[j] *= 1 - lr * o.weight_decay;
      m[j] = o.beta1 * m[j] + (1 - o.beta1) * g[j];
      v[j] = o.beta2 * v[j] + (1 - o.beta2) * double(g[j]) * g[j];
      const double mhat = m[j] / (1 - std::pow(o.beta1, t));
      const double vhat = v[j] / (1 - std::pow(o.beta2, t));
      pd[j] -= lr * mhat / (std::sqrt(vhat) + o.eps);
    }
    CHECK(opt.step_count() == t);
  }
  for (std::size_t j = 0; j < n; ++j) {
    CHECK(p[j] == doctest::Approx(pd[j]).epsilon(1e-5));
    CHECK(opt.exp_avg()[j] == doctest::Approx(m[j]).epsilon(1e-5));
    CHECK(opt.exp_avg_sq()[j] == doctest::Approx(v[j]).epsilon(1e-5));
  }
}

TEST_CASE("AdamW: the first step moves each parameter by about lr against its gradient") {
  AdamW opt(3);
  std::vector<float> p = {1, 2, 3}, g = {0.5f, -2, 0};
  opt.step(p, g, 0.1);
  CHECK(p[0] == doctest::Approx(0.9).epsilon(1e-6));
  CHECK(p[1] == doctest::Approx(2.1).epsilon(1e-6));
  CHECK(p[2] == 3.0f);
}

TEST_CASE("AdamW: the model overload skips decay on RMSNorm weights only") {
  const LlamaConfig c = tiny_config(false, true);
  LlamaModel m(c, 1);
  m.zero_grad();
  AdamWOptions o;
  o.weight_decay = 0.5;
  AdamW opt(m.params().size(), o);
  const std::vector<float> before(m.params().begin(), m.params().end());
  opt.step(m, 0.1);  // zero gradients: only the decay moves parameters
  for (const auto& info : m.parameters()) {
    const float want_factor = info.decay ? 0.95f : 1.0f;
    CAPTURE(info.name);
    CHECK(m.params()[info.offset] == doctest::Approx(before[info.offset] * want_factor));
  }
}

TEST_CASE("AdamW: argument errors") {
  AdamWOptions o;
  o.beta1 = 1.0;
  CHECK(contains(error_message([&] { AdamW a(3, o); }), "beta1=1"));
  AdamW opt(3);
  std::vector<float> p(3), g(2);
  CHECK(contains(error_message([&] { opt.step(p, g, 0.1); }), "3 params and 2 grads"));
  std::vector<float> m(2), v(3);
  CHECK(contains(error_message([&] { opt.load_state(m, v, 1); }), "2 exp_avg"));
  // Moments no update can produce are refused, and the state stays as it was.
  std::vector<float> m3 = {0, 0, INFINITY}, v3 = {0, 0, 0};
  CHECK(contains(error_message([&] { opt.load_state(m3, v3, 1); }), "exp_avg[2] = inf"));
  m3[2] = 0;
  v3[1] = -2;
  CHECK(contains(error_message([&] { opt.load_state(m3, v3, 1); }), "exp_avg_sq[1] = -2"));
  CHECK(opt.step_count() == 0);
}

TEST_CASE("clip_grad_norm: measures, scales above max_norm, leaves non-finite alone") {
  std::vector<float> g = {3, 4};
  CHECK(clip_grad_norm(g, 10.0) == doctest::Approx(5.0));
  CHECK(g == std::vector<float>{3, 4});
  CHECK(clip_grad_norm(g, 1.0) == doctest::Approx(5.0));
  CHECK(grad_norm(g) == doctest::Approx(1.0).epsilon(1e-5));
  CHECK(g[0] == doctest::Approx(0.6).epsilon(1e-5));
  std::vector<float> bad = {1, std::numeric_limits<float>::infinity()};
  CHECK(std::isinf(clip_grad_norm(bad, 1.0)));
  CHECK(bad[0] == 1.0f);
  std::vector<float> h = {3, 4};
  CHECK(clip_grad_norm(h, 0) == doctest::Approx(5.0));
  CHECK(h[0] == 3.0f);
}

TEST_CASE("learning_rate: linear warmup from 0, cosine to the floor, clamped after the end") {
  LrSchedule s;
  s.lr = 1.0;
  s.warmup_steps = 10;
  s.total_steps = 110;
  CHECK(learning_rate(s, 0) == 0.0);
  CHECK(learning_rate(s, 5) == doctest::Approx(0.5));
  CHECK(learning_rate(s, 10) == doctest::Approx(1.0));
  CHECK(learning_rate(s, 60) == doctest::Approx(0.5));
  CHECK(learning_rate(s, 110) == doctest::Approx(0.0));
  CHECK(learning_rate(s, 500) == doctest::Approx(0.0));
  double prev = 2;
  for (std::int64_t t = 10; t <= 110; ++t) {
    CHECK(learning_rate(s, t) <= prev);
    prev = learning_rate(s, t);
  }
  s.min_lr_ratio = 0.1;
  CHECK(learning_rate(s, 110) == doctest::Approx(0.1));
  CHECK(learning_rate(s, 60) == doctest::Approx(0.55));
  s.warmup_steps = 0;
  CHECK(learning_rate(s, 0) == doctest::Approx(1.0));
  CHECK(contains(error_message([&] { learning_rate(s, -1); }), "step=-1"));
  s.total_steps = 0;
  CHECK(contains(error_message([&] { learning_rate(s, 0); }), "total_steps=0"));
}

}  // namespace
}  // namespace chunkloss::test
