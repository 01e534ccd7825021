// The preference losses on the CPU (Dpo with every loss type, Orpo, Simpo, Cpo, Kto, and
// SequenceLogProbs) against the float64 oracle in fp32 and bf16, resident and recompute, one and
// several groups or chunks; finite-difference checks of the oracle and of the library's own
// loss; regime and budget invariance, bitwise reruns, P = 1, odd shapes, variable lengths,
// accumulation, forward only, KTO's KL point, and the errors raised on bad input.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/losses/preference.h>
#include <chunkloss/losses/sequence.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "preference_fixture.h"
#include "reference/preference_ref.h"
#include "support/bf16.h"
#include "support/compare.h"
#include "support/tolerance.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

using reference::PrefConfig;

constexpr DpoLoss kDpoLosses[] = {DpoLoss::kSigmoid, DpoLoss::kHinge,    DpoLoss::kIpo,
                                  DpoLoss::kRobust,  DpoLoss::kExoPair,  DpoLoss::kNcaPair,
                                  DpoLoss::kBcoPair, DpoLoss::kSppoHard, DpoLoss::kApoZero,
                                  DpoLoss::kApoDown, DpoLoss::kDiscoPop};
constexpr Regime kRegimes[] = {Regime::kResident, Regime::kRecompute};
constexpr RefMode kRefModes[] = {RefMode::kNone, RefMode::kHead, RefMode::kLogps};

Dpo make_loss(const DpoOptions& o) { return Dpo(o); }
Orpo make_loss(const OrpoOptions& o) { return Orpo(o); }
Simpo make_loss(const SimpoOptions& o) { return Simpo(o); }
Cpo make_loss(const CpoOptions& o) { return Cpo(o); }
Kto make_loss(const KtoOptions& o) { return Kto(o); }

std::string describe_engine(const SequenceOptions& e) {
  return "regime=" + std::string(regime_name(e.regime)) +
         " budget=" + std::to_string(e.memory_budget_bytes) +
         " order=" + std::string(loop_order_name(e.loop_order)) +
         " ignore_index=" + std::to_string(e.ignore_index);
}

std::string describe(const DpoOptions& o) {
  return "Dpo loss_type=" + std::string(dpo_loss_name(o.loss_type)) +
         " beta=" + std::to_string(o.beta) + " ls=" + std::to_string(o.label_smoothing) +
         " tau=" + std::to_string(o.discopop_tau) + " avg=" + std::to_string(o.average_log_prob) +
         " nll=" + std::to_string(o.nll) + " alpha=" + std::to_string(o.nll_alpha) + " " +
         describe_engine(o.engine);
}
std::string describe(const OrpoOptions& o) {
  return "Orpo beta=" + std::to_string(o.beta) + " " + describe_engine(o.engine);
}
std::string describe(const SimpoOptions& o) {
  return "Simpo beta=" + std::to_string(o.beta) + " gamma=" + std::to_string(o.gamma) +
         " ls=" + std::to_string(o.label_smoothing) + " alpha=" + std::to_string(o.nll_alpha) +
         " " + describe_engine(o.engine);
}
std::string describe(const CpoOptions& o) {
  return "Cpo beta=" + std::to_string(o.beta) + " alpha=" + std::to_string(o.alpha) +
         " ls=" + std::to_string(o.label_smoothing) + " " + describe_engine(o.engine);
}
std::string describe(const KtoOptions& o) {
  return "Kto beta=" + std::to_string(o.beta) + " wd=" + std::to_string(o.desirable_weight) +
         " wu=" + std::to_string(o.undesirable_weight) + " " + describe_engine(o.engine);
}

reference::PrefResult oracle(const PrefData& d, const PrefConfig& c, bool gradients = true) {
  return reference::preference(d.problem(), c, gradients);
}

// The smallest budget whose plan for `o` honours `regime` within the budget (binary search
// over what the planner accepts); the plan then has the most groups or chunks.
template <typename Options>
std::size_t min_budget(const PrefData& d, Options o, Regime regime, const PrefGradRequest& g) {
  PrefGradBuffers buffers(d, g);
  const PreferenceInputs in = d.inputs();
  const PreferenceGrads grads = buffers.views();
  o.engine.regime = regime;
  auto fits = [&](std::size_t budget) {
    o.engine.memory_budget_bytes = budget;
    try {
      const Plan p = make_loss(o).plan(in, grads);
      return !p.over_budget && p.regime == regime && p.workspace_bytes() <= budget;
    } catch (const Error&) {
      return false;
    }
  };
  std::size_t lo = 1, hi = std::size_t{1} << 30;
  REQUIRE(fits(hi));
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (fits(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// One loss setting against the oracle over input dtype {f32, bf16 with bf16 gradients, bf16
// with f32 gradients} x shape {one group/chunk, several (P = 3 pairs of T = 29, N = 174 rows)}
// x regime {resident, recompute, deferred where it applies}, checking that the plan honours the
// requested regime.
template <typename Options>
void check_matrix(const PrefSpec& base, const Options& base_opts) {
  const PrefConfig cfg = PrefConfig::from(base_opts);
  for (auto [dtype, grad_dtype] :
       {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kBF16},
        std::pair{DType::kBF16, DType::kF32}}) {
    for (bool multi : {false, true}) {
      PrefSpec s = base;
      s.dtype = dtype;
      if (multi) {
        s.t = 29;
        s.h = 24;
        s.v = 150;
      }
      const PrefData d(s);
      const reference::PrefResult ref = oracle(d, cfg);
      PrefGradRequest g;
      g.dtype = grad_dtype;
      for (Regime regime : regimes_for(base_opts, s)) {
        Options o = base_opts;
        o.engine.regime = regime;
        if (multi) o.engine.memory_budget_bytes = min_budget(d, o, regime, g);
        INFO(describe(s), " | ", describe(o), " grads=", dtype_name(grad_dtype));
        const PrefRun run = run_library(d, make_loss(o), g);
        INFO("plan: ", run.plan.str());
        CHECK(run.plan.regime == regime);
        const std::int64_t units = cfg.paired() ? s.s / 2 : s.s;
        if (multi && regime == Regime::kResident && units > 1) CHECK(run.plan.num_groups > 1);
        if (multi && regime != Regime::kResident && d.rows() > 64) CHECK(run.plan.num_chunks > 1);
        check_against_oracle(run, ref, PrefTol::of(dtype, grad_dtype), cfg.paired());
      }
    }
  }
}

// The oracle's loss differs between two settings: the option is not a no-op on this data.
void check_differs(const PrefData& a, const PrefConfig& ca, const PrefData& b,
                   const PrefConfig& cb) {
  const double x = oracle(a, ca, false).loss, y = oracle(b, cb, false).loss;
  CHECK_MESSAGE(std::abs(x - y) > 1e-4 * std::max(1.0, std::abs(y)),
                "the option does not change the loss: " << x << " vs " << y);
}

DpoOptions dpo(DpoLoss t) {
  DpoOptions o;
  o.loss_type = t;
  if (t == DpoLoss::kExoPair) o.label_smoothing = 1e-3f;  // TRL's default eps for exo_pair
  return o;
}

PrefSpec kto_spec() {
  PrefSpec s;
  s.s = 7;
  s.labels = true;
  return s;
}

// ---- the oracle itself -----------------------------------------------------------------------

TEST_CASE("oracle: the transcribed formulas on hand-picked sums") {
  using reference::log_sigmoid;
  using reference::sigmoid;
  CHECK(log_sigmoid(0.0) == doctest::Approx(-std::log(2.0)));
  CHECK(log_sigmoid(-800.0) == doctest::Approx(-800.0));
  CHECK(log_sigmoid(800.0) == 0.0);
  CHECK(sigmoid(-800.0) == 0.0);
  CHECK(sigmoid(2.0) == doctest::Approx(1 / (1 + std::exp(-2.0))));
  // One pair, sums c = -3, r = -5 over 2 and 4 tokens, reference sums -4, -4.5; S = 2, T = 4.
  reference::PrefProblem p;
  p.s = 2;
  p.t = 4;
  p.h = 1;
  p.v = 2;
  // V = 2, H = 1, weight (1, 0): logit difference 1 * h, so logp of class 0 = logsig(h).
  p.policy.weight = {1.0, 0.0};
  p.policy.hidden = {0.3, -1.0, 2.0, 0.0, 0.5, 0.5, -0.5, 1.5};
  p.targets = {0, 1, -100, -100, 0, 0, 1, 1};
  p.ref_logps = {-1.0, -2.0};
  const double c = log_sigmoid(0.3) + log_sigmoid(1.0);  // class 1: logsig(-h)
  const double r = log_sigmoid(0.5) + log_sigmoid(0.5) + log_sigmoid(0.5) + log_sigmoid(-1.5);
  PrefConfig cfg;
  cfg.beta = 0.5;
  const auto res = reference::preference(p, cfg, false);
  CHECK(res.logps[0] == doctest::Approx(c));
  CHECK(res.logps[1] == doctest::Approx(r));
  CHECK(res.tokens == std::vector<std::int64_t>{2, 4});
  const double d = 0.5 * ((c + 1.0) - (r + 2.0));
  CHECK(res.loss == doctest::Approx(-log_sigmoid(d)));
  CHECK(res.metrics.at("rewards/chosen") == doctest::Approx(0.5 * (c + 1.0)));
  CHECK(res.metrics.at("rewards/accuracies") == (0.5 * (c + 1.0) > 0.5 * (r + 2.0) ? 1.0 : 0.0));
  cfg.dpo_loss = DpoLoss::kIpo;
  const double D = (c / 2 + 0.5) - (r / 4 + 0.5);
  CHECK(reference::preference(p, cfg, false).loss == doctest::Approx((D - 1.0) * (D - 1.0)));
  cfg.kind = reference::PrefKind::kOrpo;
  p.ref_logps.clear();
  const double lo = (c / 2 - r / 4) - (std::log1p(-std::exp(c / 2)) - std::log1p(-std::exp(r / 4)));
  cfg.nll_weight = 1;
  CHECK(reference::preference(p, cfg, false).loss ==
        doctest::Approx(-c / 2 - 0.5 * log_sigmoid(lo)));
}

TEST_CASE("oracle: gradients agree with finite differences of the oracle's own loss") {
  // The oracle's dL/dS comes from differences in S; this checks the chain to the inputs (the
  // sign and the softmax Jacobian) against differences of the whole double computation.
  for (auto [name, make] : std::vector<std::pair<const char*, std::function<PrefConfig()>>>{
           {"dpo sigmoid ls nll",
            [] {
              DpoOptions o;
              o.label_smoothing = 0.2f;
              o.nll = true;
              return PrefConfig::from(o);
            }},
           {"orpo", [] { return PrefConfig::from(OrpoOptions{}); }},
           {"kto", [] { return PrefConfig::from(KtoOptions{}); }}}) {
    CAPTURE(name);
    PrefSpec s;
    s.s = 4;
    s.t = 5;
    s.h = 4;
    s.v = 7;
    s.bias = true;
    s.ref = RefMode::kHead;
    s.labels = true;
    const PrefConfig cfg = make();
    const PrefData d(s);
    reference::PrefProblem p = d.problem();
    const auto ref = reference::preference(p, cfg);
    auto check_all = [&](std::vector<double>& x, const std::vector<double>& grad,
                         const char* what) {
      double norm = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const double x0 = x[i], step = 1e-5;
        x[i] = x0 + step;
        const double up = reference::preference(p, cfg, false).loss;
        x[i] = x0 - step;
        const double down = reference::preference(p, cfg, false).loss;
        x[i] = x0;
        const double fd = (up - down) / (2 * step);
        norm += grad[i] * grad[i];
        CHECK_MESSAGE(std::abs(fd - grad[i]) <= 1e-8 + 1e-6 * std::abs(grad[i]),
                      what << "[" << i << "]: oracle " << grad[i] << ", central difference " << fd);
      }
      CHECK(norm > 1e-6);
    };
    check_all(p.policy.hidden, ref.grad_hidden, "grad_hidden");
    check_all(p.policy.weight, ref.grad_weight, "grad_weight");
    check_all(p.policy.bias, ref.grad_bias, "grad_bias");
  }
}

TEST_CASE("oracle: the sequence factor matches the analytic derivative of sigmoid DPO") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  const PrefData d(s);
  DpoOptions o;
  o.label_smoothing = 0.1f;
  const PrefConfig cfg = PrefConfig::from(o);
  const auto ref = oracle(d, cfg);
  const std::int64_t pairs = s.s / 2;
  for (std::int64_t i = 0; i < pairs; ++i) {
    const auto I = static_cast<std::size_t>(i), J = static_cast<std::size_t>(i + pairs);
    const double dd =
        cfg.beta * ((ref.logps[I] - ref.ref_logps[I]) - (ref.logps[J] - ref.ref_logps[J]));
    // dloss/dd = -(1-eps) sigma(-d) + eps sigma(d); dd/dc = beta; mean over P pairs.
    const double dl =
        (-(1 - cfg.eps) * reference::sigmoid(-dd) + cfg.eps * reference::sigmoid(dd)) * cfg.beta /
        static_cast<double>(pairs);
    CHECK(ref.dloss_dlogp[I] == doctest::Approx(dl).epsilon(1e-9));
    CHECK(ref.dloss_dlogp[J] == doctest::Approx(-dl).epsilon(1e-9));
  }
}

// ---- every loss type and option against the oracle -------------------------------------------

TEST_CASE("dpo: every loss type, with no reference, a reference head and precomputed sums") {
  for (DpoLoss t : kDpoLosses) {
    for (RefMode ref : kRefModes) {
      CAPTURE(dpo_loss_name(t));
      PrefSpec s;
      s.ref = ref;
      s.bias = ref == RefMode::kHead;
      check_matrix(s, dpo(t));
    }
  }
}

TEST_CASE("dpo: average_log_prob for every loss type") {
  for (DpoLoss t : kDpoLosses) {
    CAPTURE(dpo_loss_name(t));
    PrefSpec s;
    s.ref = RefMode::kHead;
    DpoOptions o = dpo(t);
    o.average_log_prob = true;
    if (t != DpoLoss::kIpo)
      check_differs(PrefData(s), PrefConfig::from(o), PrefData(s), PrefConfig::from(dpo(t)));
    check_matrix(s, o);
  }
}

TEST_CASE("dpo: ipo averages whether or not average_log_prob is set") {
  PrefSpec s;
  s.ref = RefMode::kLogps;
  DpoOptions a = dpo(DpoLoss::kIpo), b = a;
  b.average_log_prob = true;
  const PrefData d(s);
  const PrefRun ra = run_library(d, Dpo(a), {}), rb = run_library(d, Dpo(b), {});
  check_runs_close(ra, rb, 1e-12);
}

TEST_CASE("dpo: label smoothing (conservative sigmoid, robust, exo_pair)") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  const PrefData d(s);
  for (auto [t, eps] : {std::pair{DpoLoss::kSigmoid, 0.1f}, std::pair{DpoLoss::kSigmoid, 0.5f},
                        std::pair{DpoLoss::kRobust, 0.2f}, std::pair{DpoLoss::kRobust, 0.49f},
                        std::pair{DpoLoss::kExoPair, 0.1f}, std::pair{DpoLoss::kExoPair, 0.9f}}) {
    CAPTURE(dpo_loss_name(t));
    CAPTURE(eps);
    DpoOptions o = dpo(t);
    o.label_smoothing = eps;
    check_differs(d, PrefConfig::from(o), d, PrefConfig::from(dpo(t)));
    check_matrix(s, o);
  }
}

TEST_CASE("dpo: beta and discopop's tau") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  for (DpoLoss t : {DpoLoss::kSigmoid, DpoLoss::kHinge, DpoLoss::kIpo, DpoLoss::kSppoHard,
                    DpoLoss::kDiscoPop, DpoLoss::kApoDown}) {
    CAPTURE(dpo_loss_name(t));
    DpoOptions o = dpo(t);
    o.beta = 0.7f;
    check_differs(PrefData(s), PrefConfig::from(o), PrefData(s), PrefConfig::from(dpo(t)));
    check_matrix(s, o);
  }
  DpoOptions o = dpo(DpoLoss::kDiscoPop);
  o.discopop_tau = 0.6f;
  check_differs(PrefData(s), PrefConfig::from(o), PrefData(s),
                PrefConfig::from(dpo(DpoLoss::kDiscoPop)));
  check_matrix(s, o);
}

TEST_CASE("dpo: discopop at margins where exp(-d) alone overflows") {
  // Chosen reference sums of +9000 put d = beta (dc - dr) near -900; the loss is about -d.
  PrefSpec s;
  s.ref = RefMode::kLogps;
  PrefData d(s);
  for (std::int64_t i = 0; i < s.s / 2; ++i) d.ref_logps[static_cast<std::size_t>(i)] = 9000.0f;
  const DpoOptions o = dpo(DpoLoss::kDiscoPop);
  const reference::PrefResult ref = oracle(d, PrefConfig::from(o));
  REQUIRE(std::isfinite(ref.loss));
  CHECK(ref.loss > 800);
  check_against_oracle(run_library(d, make_loss(o), {}), ref, PrefTol::of(DType::kF32, DType::kF32),
                       true);
}

TEST_CASE("dpo: the NLL term (RPO) over chosen tokens, alone and with every option") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  for (float alpha : {1.0f, 0.3f}) {
    CAPTURE(alpha);
    DpoOptions o;
    o.nll = true;
    o.nll_alpha = alpha;
    check_differs(PrefData(s), PrefConfig::from(o), PrefData(s), PrefConfig::from(DpoOptions{}));
    check_matrix(s, o);
  }
  // nll_alpha without nll is off.
  DpoOptions off;
  off.nll_alpha = 0.7f;
  const PrefData d(s);
  const PrefRun a = run_library(d, Dpo(off), {}), b = run_library(d, Dpo(DpoOptions{}), {});
  CHECK(runs_bitwise_equal(a, b));
  // Everything together: label smoothing, averages, NLL, bias, bf16 (in the matrix), i64.
  s.bias = true;
  s.targets_i64 = true;
  DpoOptions all;
  all.label_smoothing = 0.15f;
  all.average_log_prob = true;
  all.nll = true;
  all.nll_alpha = 0.5f;
  all.beta = 0.3f;
  check_matrix(s, all);
  s.ref = RefMode::kLogps;
  check_matrix(s, all);
}

TEST_CASE("orpo: beta, with and without bias") {
  for (float beta : {0.1f, 0.5f}) {
    for (bool bias : {false, true}) {
      CAPTURE(beta);
      CAPTURE(bias);
      PrefSpec s;
      s.bias = bias;
      OrpoOptions o;
      o.beta = beta;
      check_matrix(s, o);
    }
  }
}

TEST_CASE("orpo: chosen answers the model is certain of keep a finite loss and gradients") {
  // Each chosen target the argmax of logits of std 5000: an averaged log-prob above -1e-6, where
  // log(1 - exp(.)) is taken at -1e-6 (the oracle's unclamped form is infinite there).
  PrefSpec s;
  s.logit_scale = 5000.0f;
  PrefData d(s);
  const std::int64_t h = s.h, v = s.v, chosen_rows = s.s / 2 * s.t;
  for (std::int64_t row = 0; row < chosen_rows; ++row) {
    if (d.targets64[sz(row)] == s.ignore_index) continue;
    std::int64_t best = 0;
    double best_z = -INFINITY;
    for (std::int64_t j = 0; j < v; ++j) {
      double z = 0;
      for (std::int64_t k = 0; k < h; ++k)
        z += double{d.hidden[sz(row * h + k)]} * d.weight[sz(j * h + k)];
      if (z > best_z) best_z = z, best = j;
    }
    d.set_target(row, best);
  }
  d.sync();
  const PrefRun run = run_library(d, Orpo(OrpoOptions{}), PrefGradRequest{});
  for (std::int64_t k = 0; k < s.s / 2; ++k)
    CHECK(run.result.logps[sz(k)] / static_cast<double>(run.result.tokens[sz(k)]) > -1e-6);
  CHECK(std::isfinite(run.result.loss));
  for (const auto& [name, value] : run.result.metrics) {
    CAPTURE(name);
    CHECK(std::isfinite(value));
  }
  for (const std::vector<double>& g : {run.grads.hidden(), run.grads.weight()})
    CHECK(std::all_of(g.begin(), g.end(), [](double x) { return std::isfinite(x); }));
}

TEST_CASE("simpo: defaults, gamma, label smoothing, the NLL term") {
  PrefSpec s;
  SimpoOptions def;
  CHECK(def.beta == 2.0f);
  CHECK(def.gamma == 0.5f);
  check_matrix(s, def);
  SimpoOptions g0;
  g0.gamma = 0.0f;
  check_differs(PrefData(s), PrefConfig::from(g0), PrefData(s), PrefConfig::from(def));
  check_matrix(s, g0);
  SimpoOptions all;
  all.beta = 1.5f;
  all.gamma = 1.0f;
  all.label_smoothing = 0.1f;
  all.nll_alpha = 0.4f;
  check_differs(PrefData(s), PrefConfig::from(all), PrefData(s), PrefConfig::from(def));
  s.bias = true;
  check_matrix(s, all);
}

TEST_CASE("cpo: defaults, alpha 0, label smoothing, beta") {
  PrefSpec s;
  check_matrix(s, CpoOptions{});
  CpoOptions a0;
  a0.alpha = 0.0f;
  check_differs(PrefData(s), PrefConfig::from(a0), PrefData(s), PrefConfig::from(CpoOptions{}));
  check_matrix(s, a0);
  CpoOptions all;
  all.beta = 0.5f;
  all.alpha = 0.7f;
  all.label_smoothing = 0.2f;
  s.bias = true;
  check_matrix(s, all);
}

TEST_CASE("kto: reference modes, weights, and the KL point given (clamped at 0)") {
  for (RefMode ref : kRefModes) {
    for (std::optional<double> kl :
         {std::optional<double>{}, std::optional<double>{0.3}, std::optional<double>{-0.2}}) {
      CAPTURE(static_cast<int>(ref));
      CAPTURE(kl.value_or(-1e9));
      PrefSpec s = kto_spec();
      s.ref = ref;
      s.kl = kl;
      check_matrix(s, KtoOptions{});
      KtoOptions w;
      w.beta = 0.5f;
      w.desirable_weight = 1.33f;
      w.undesirable_weight = 0.5f;
      check_matrix(s, w);
    }
  }
  PrefSpec s = kto_spec();
  s.ref = RefMode::kHead;
  s.kl = 2.0;
  const PrefData d(s);
  CHECK(oracle(d, PrefConfig::from(KtoOptions{}), false).kl == 2.0);
  PrefSpec s0 = s;
  s0.kl.reset();
  check_differs(d, PrefConfig::from(KtoOptions{}), PrefData(s0), PrefConfig::from(KtoOptions{}));
  const PrefRun run = run_library(d, Kto(KtoOptions{}), {});
  CHECK(run.result.kl == 2.0);
  CHECK(run.result.metric("kl") == 2.0);
}

TEST_CASE("kto: the KL point computed from a mismatched batch") {
  for (RefMode kl_ref : {RefMode::kHead, RefMode::kLogps}) {
    for (RefMode ref : {RefMode::kHead, RefMode::kLogps}) {
      CAPTURE(static_cast<int>(kl_ref));
      CAPTURE(static_cast<int>(ref));
      PrefSpec s = kto_spec();
      s.ref = ref;
      s.kl_batch = true;
      s.kl_ref = kl_ref;
      s.bias = true;
      // The policy drifts from the reference so the estimate is positive (not clamped).
      s.ref_noise = 0.3f;
      const PrefData d(s);
      CHECK(oracle(d, PrefConfig::from(KtoOptions{}), false).kl > 0.0);
      check_matrix(s, KtoOptions{});
    }
  }
}

TEST_CASE("kto: a KL batch whose own plan exceeds the budget marks the call's plan over budget") {
  PrefSpec s = kto_spec();
  s.ref = RefMode::kHead;
  s.kl_batch = true;
  s.kl_s = 200;  // 12800 rows: their row statistics alone exceed the budget
  s.kl_t = 64;
  const PrefData d(s);
  KtoOptions o;
  o.engine.memory_budget_bytes = std::size_t{64} << 10;
  const Kto loss(o);
  const PreferenceInputs in = d.inputs();
  PrefGradBuffers g(d, {});
  const Plan p = loss.plan(in, g.views());
  INFO(p.str());
  CHECK(p.workspace_bytes() > o.engine.memory_budget_bytes);
  CHECK(p.over_budget);  // (it was not set: only the main batch's plan was)
  CHECK(p.reason.find("the KL batch's plan exceeds the budget") != std::string::npos);
}

TEST_CASE("precomputed reference sums give the reference head's results") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  s.bias = true;
  const PrefData head(s);
  s.ref = RefMode::kLogps;
  const PrefData logps(s);
  const PrefRun a = run_library(head, Dpo(DpoOptions{}), {}),
                b = run_library(logps, Dpo(DpoOptions{}), {});
  CHECK(a.plan.regime != Regime::kNone);
  // Only the f32 rounding of the given sums differs (~1e-7 of sums of ~-30, so ~1e-6 of the
  // O(0.1) rewards).
  check_runs_close(a, b, 1e-5);
  check_close("ref_logps", b.result.ref_logps, logps.ref_logps, 0.0);
}

TEST_CASE("metrics: names, per-sequence vectors, and values that are not trivially 0 or 1") {
  PrefSpec s;
  s.s = 10;
  s.ref = RefMode::kHead;
  s.ref_noise = 0.2f;
  const PrefData d(s);
  const auto ref = oracle(d, PrefConfig::from(DpoOptions{}), false);
  const double acc = ref.metrics.at("rewards/accuracies");
  CHECK(acc > 0.0);
  CHECK(acc < 1.0);
  const PrefRun run = run_library(d, Dpo(DpoOptions{}), {});
  for (const char* name :
       {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
        "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"})
    CHECK_MESSAGE(std::isfinite(run.result.metric(name)), name);
  CHECK_THROWS_AS(run.result.metric("nll_loss"), Error);
  CHECK_THROWS_AS(run.result.metric("no such metric"), Error);
  CHECK(run.result.logps.size() == 10);
  CHECK(run.result.rewards.size() == 10);
  CHECK(run.result.unit_losses.size() == 5);
  check_against_oracle(run, oracle(d, PrefConfig::from(DpoOptions{})),
                       PrefTol::of(DType::kF32, DType::kF32), true);
  DpoOptions nll;
  nll.nll = true;
  const PrefRun with_nll = run_library(d, Dpo(nll), {});
  check_scalar("nll_loss", with_nll.result.metric("nll_loss"),
               oracle(d, PrefConfig::from(nll), false).nll, 1e-5);
  const PrefRun orpo = run_library(PrefData(PrefSpec{}), Orpo(OrpoOptions{}), {});
  CHECK(std::isfinite(orpo.result.metric("log_odds_ratio")));
  CHECK(std::isfinite(orpo.result.metric("log_odds_chosen")));
  CHECK(std::isfinite(orpo.result.metric("nll_loss")));
}

// ---- finite differences of the library's own loss --------------------------------------------

template <typename Options>
double library_loss(const PrefData& d, const Options& o) {
  return run_library(d, make_loss(o), PrefGradRequest::none()).result.loss;
}

template <typename Options>
void check_fd(const PrefSpec& s, const Options& o) {
  INFO(describe(s), " | ", describe(o));
  const PrefData d(s);
  const PrefRun run = run_library(d, make_loss(o), {});
  const double step = 1e-2;
  auto check_entries = [&](std::vector<float> PrefData::*member, const std::vector<double>& grad,
                           std::vector<std::size_t> idx, const char* what) {
    double largest = 0;
    for (std::size_t i : idx) {
      largest = std::max(largest, std::abs(grad[i]));
      PrefData e = d;
      const float x0 = (d.*member)[i];
      (e.*member)[i] = x0 + static_cast<float>(step);
      e.sync();
      const double up = library_loss(e, o);
      (e.*member)[i] = x0 - static_cast<float>(step);
      e.sync();
      const double down = library_loss(e, o);
      const double fd = (up - down) / (2 * step);
      CHECK_MESSAGE(std::abs(fd - grad[i]) <= kFdAbs + kFdRel * std::abs(grad[i]),
                    what << "[" << i << "]: library gradient " << grad[i]
                         << ", central difference of the library's loss " << fd);
    }
    CHECK_MESSAGE(largest > 10 * kFdAbs, what << ": the checked entries are all near zero");
  };
  // Hidden entries spread over every sequence (valid or not), weight rows, bias entries.
  std::vector<std::size_t> hidx, widx, bidx;
  const auto n = static_cast<std::size_t>(d.rows() * s.h);
  for (std::size_t i = 0; i < n; i += 7) hidx.push_back(i);
  for (std::size_t i = 0; i < static_cast<std::size_t>(s.v * s.h); i += 5) widx.push_back(i);
  for (std::size_t i = 0; i < static_cast<std::size_t>(s.v); i += 2) bidx.push_back(i);
  check_entries(&PrefData::hidden, run.grads.hidden(), hidx, "grad_hidden");
  check_entries(&PrefData::weight, run.grads.weight(), widx, "grad_weight");
  check_entries(&PrefData::bias, run.grads.bias(), bidx, "grad_bias");
  // Rows whose target is ignored get exactly zero.
  const std::vector<double> gh = run.grads.hidden();
  for (std::int64_t row = 0; row < d.rows(); ++row)
    if (d.targets64[static_cast<std::size_t>(row)] == s.ignore_index)
      for (std::int64_t i = 0; i < s.h; ++i)
        CHECK(gh[static_cast<std::size_t>(row * s.h + i)] == 0.0);
}

PrefSpec fd_spec() {
  PrefSpec s;
  s.s = 4;
  s.t = 5;
  s.h = 6;
  s.v = 9;
  s.bias = true;
  s.ref = RefMode::kHead;
  s.logit_scale = 2.0f;
  s.ref_noise = 0.2f;
  s.seed = 11;
  return s;
}

TEST_CASE("finite differences: the library's fp32 gradients against its own fp32 loss") {
  for (DpoLoss t : kDpoLosses) {
    CAPTURE(dpo_loss_name(t));
    DpoOptions o = dpo(t);
    o.beta = 0.5f;
    if (t == DpoLoss::kSigmoid || t == DpoLoss::kRobust) o.label_smoothing = 0.1f;
    if (t == DpoLoss::kExoPair) o.label_smoothing = 0.2f;
    if (t == DpoLoss::kSigmoid) o.nll = true;
    if (t == DpoLoss::kApoZero) o.average_log_prob = true;
    if (t == DpoLoss::kHinge) o.average_log_prob = true;
    for (Regime r : regimes_for(o, fd_spec())) {
      o.engine.regime = r;
      check_fd(fd_spec(), o);
    }
  }
  PrefSpec free = fd_spec();
  free.ref = RefMode::kNone;
  check_fd(free, OrpoOptions{});
  SimpoOptions simpo;
  simpo.nll_alpha = 0.5f;
  simpo.label_smoothing = 0.1f;
  check_fd(free, simpo);
  CpoOptions cpo;
  cpo.beta = 0.5f;
  cpo.label_smoothing = 0.1f;
  check_fd(free, cpo);
  // A given KL point: one computed from a KL batch would move with the policy weight, which
  // finite differences see and the detached gradient rightly does not.
  PrefSpec kto = fd_spec();
  kto.labels = true;
  kto.kl = 0.4;
  KtoOptions ko;
  ko.beta = 0.5f;
  ko.desirable_weight = 1.5f;
  for (Regime r : kRegimes) {
    ko.engine.regime = r;
    check_fd(kto, ko);
  }
}

// ---- plans, regimes, budgets, determinism ------------------------------------------------------

PrefSpec big_spec() {
  PrefSpec s;
  s.s = 8;
  s.t = 37;
  s.h = 40;
  s.v = 300;
  s.bias = true;
  s.ref = RefMode::kHead;
  s.seed = 5;
  return s;
}

TEST_CASE("plan: the requested regime, whole units per group, workspace within the budget") {
  const PrefData d(big_spec());
  PrefGradBuffers g(d, {});
  const PreferenceInputs in = d.inputs();
  for (Regime r : kRegimes) {
    for (std::size_t budget : {std::size_t{0}, std::size_t{1} << 20, std::size_t{1} << 22}) {
      DpoOptions o;
      o.engine.regime = r;
      o.engine.memory_budget_bytes = budget;
      const Plan p = Dpo(o).plan(in, g.views());
      INFO(p.str());
      CHECK(p.regime == r);
      CHECK(p.workspace_bytes() == Dpo(o).workspace_bytes(in, g.views()));
      if (budget) CHECK(p.workspace_bytes() <= budget);
      if (r == Regime::kResident) {
        const std::int64_t units = d.spec.s / 2;
        CHECK(p.group_units >= 1);
        CHECK(p.group_units <= units);
        CHECK(p.num_groups == (units + p.group_units - 1) / p.group_units);
      }
      CHECK(p.chunk_rows >= 1);
      CHECK(p.num_chunks >= 1);
    }
  }
  // Auto picks one of the two and the plan says which.
  const Plan a = Dpo(DpoOptions{}).plan(in, g.views());
  CHECK((a.regime == Regime::kResident || a.regime == Regime::kRecompute));
  CHECK(!a.reason.empty());
  // KTO's units are single sequences.
  PrefSpec ks = big_spec();
  ks.labels = true;
  ks.s = 7;
  const PrefData kd(ks);
  PrefGradBuffers kg(kd, {});
  KtoOptions ko;
  ko.engine.regime = Regime::kResident;
  ko.engine.memory_budget_bytes = min_budget(kd, ko, Regime::kResident, {});
  const Plan kp = Kto(ko).plan(kd.inputs(), kg.views());
  INFO(kp.str());
  CHECK(kp.regime == Regime::kResident);
  CHECK(kp.num_groups == (7 + kp.group_units - 1) / kp.group_units);
  CHECK(kp.num_groups > 1);
  // Below one unit, a requested resident regime names the bytes it needs: the least budget.
  const std::size_t least = ko.engine.memory_budget_bytes;
  ko.engine.memory_budget_bytes = least - 1;
  const std::string needs = "needs " + std::to_string(least) + " bytes";
  CHECK_THROWS_WITH_AS(Kto(ko).plan(kd.inputs(), kg.views()), doctest::Contains(needs.c_str()),
                       Error);
}

TEST_CASE(
    "regime invariance: resident, recompute and deferred agree to rounding, and with the oracle") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = big_spec();
    s.dtype = dtype;
    const PrefData with_ref(s);
    s.labels = true;
    const PrefData labelled(s);
    s.labels = false;
    s.ref = RefMode::kNone;
    const PrefData no_ref(s);
    PrefGradRequest g;
    g.dtype = dtype;
    const double tol = tolerance(dtype).chunking;
    auto both = [&](const PrefData& d, auto o) {
      INFO(describe(d.spec), " | ", describe(o));
      std::vector<PrefRun> runs;
      for (Regime r : regimes_for(o, d.spec)) {
        CAPTURE(regime_name(r));
        o.engine.regime = r;
        runs.push_back(run_library(d, make_loss(o), g));
        CHECK(runs.back().plan.regime == r);
        check_against_oracle(runs.back(), oracle(d, PrefConfig::from(o)), PrefTol::of(dtype, dtype),
                             PrefConfig::from(o).paired());
        check_runs_close(runs[0], runs.back(), tol);
      }
    };
    DpoOptions dpo_o;
    dpo_o.nll = true;
    both(with_ref, dpo_o);
    both(with_ref, DpoOptions{});
    both(with_ref, dpo(DpoLoss::kIpo));
    both(no_ref, OrpoOptions{});
    both(no_ref, SimpoOptions{});
    both(labelled, KtoOptions{});
  }
}

TEST_CASE("budget invariance: several budgets give the same results to rounding") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = big_spec();
    s.dtype = dtype;
    const PrefData d(s);
    PrefGradRequest g;
    g.dtype = dtype;
    const DpoOptions base = dpo(DpoLoss::kSigmoid);
    const std::size_t res_min = min_budget(d, base, Regime::kResident, g);
    const std::size_t rec_min = min_budget(d, base, Regime::kRecompute, g);
    const PrefRun ref_run = run_library(d, Dpo(base), g);
    check_against_oracle(ref_run, oracle(d, PrefConfig::from(base)), PrefTol::of(dtype, dtype),
                         true);
    std::set<std::tuple<int, std::int64_t, std::int64_t, int>> plans;
    for (Regime r : {Regime::kAuto, Regime::kResident, Regime::kRecompute}) {
      for (std::size_t budget : {std::size_t{0}, res_min, rec_min, 2 * rec_min, 3 * res_min,
                                 std::size_t{1} << 20, std::size_t{1} << 24}) {
        DpoOptions o = base;
        o.engine.regime = r;
        o.engine.memory_budget_bytes = budget;
        if (r == Regime::kResident && budget && budget < res_min) continue;
        if (r == Regime::kRecompute && budget && budget < rec_min) continue;
        if (r == Regime::kAuto && budget && budget < std::min(res_min, rec_min)) continue;
        INFO(describe(s), " | ", describe(o));
        const PrefRun run = run_library(d, Dpo(o), g);
        INFO("plan: ", run.plan.str());
        if (r != Regime::kAuto) CHECK(run.plan.regime == r);
        if (budget) CHECK(run.plan.workspace_bytes() <= budget);
        plans.insert({static_cast<int>(run.plan.regime), run.plan.chunk_rows, run.plan.num_groups,
                      static_cast<int>(run.plan.order)});
        check_runs_close(run, ref_run, tolerance(dtype).chunking);
      }
    }
    CHECK(plans.size() >= 4);
  }
}

TEST_CASE("loop orders in the recompute regime agree") {
  const PrefData d(big_spec());
  DpoOptions o;
  o.engine.regime = Regime::kRecompute;
  std::vector<PrefRun> runs;
  for (LoopOrder order : {LoopOrder::kTokenChunk, LoopOrder::kVocabBlock}) {
    o.engine.loop_order = order;
    o.engine.memory_budget_bytes = std::size_t{1} << 18;
    CAPTURE(loop_order_name(order));
    runs.push_back(run_library(d, Dpo(o), {}));
    CHECK(runs.back().plan.order == order);
    check_against_oracle(runs.back(), oracle(d, PrefConfig::from(o)),
                         PrefTol::of(DType::kF32, DType::kF32), true);
  }
  check_runs_close(runs[0], runs[1], tolerance(DType::kF32).chunking);
}

TEST_CASE("bf16 gradients with the fp32 dW accumulator, every regime and order, reference head") {
  for (bool bias : {false, true}) {
    PrefSpec s = big_spec();
    s.dtype = DType::kBF16;
    s.bias = bias;
    const PrefData d(s);
    PrefGradRequest g;
    g.dtype = DType::kBF16;
    DpoOptions base;
    base.nll = true;
    const auto ref = oracle(d, PrefConfig::from(base));
    for (auto [regime, order] : {std::pair{Regime::kResident, LoopOrder::kAuto},
                                 std::pair{Regime::kRecompute, LoopOrder::kTokenChunk},
                                 std::pair{Regime::kRecompute, LoopOrder::kVocabBlock}}) {
      DpoOptions o = base;
      o.engine.fp32_weight_grad_accumulator = true;
      o.engine.regime = regime;
      o.engine.loop_order = order;
      o.engine.memory_budget_bytes = std::size_t{1} << 20;
      INFO(describe(s), " | ", describe(o));
      const PrefRun run = run_library(d, Dpo(o), g);
      INFO("plan: ", run.plan.str());
      CHECK(run.plan.regime == regime);
      CHECK(run.plan.dw_accum.bytes > 0);
      if (order != LoopOrder::kAuto) CHECK(run.plan.order == order);
      check_against_oracle(run, ref, PrefTol::of(DType::kBF16, DType::kBF16), true);
    }
  }
}

TEST_CASE("bitwise run-to-run equality in both regimes, i32 vs i64 targets, two threads") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = big_spec();
    s.dtype = dtype;
    const PrefData d(s);
    PrefSpec s64 = s;
    s64.targets_i64 = true;
    const PrefData d64(s64);
    PrefGradRequest g;
    g.dtype = dtype;
    for (Regime r : kRegimes) {
      for (bool smallest : {false, true}) {
        DpoOptions o;
        o.nll = true;
        o.engine.regime = r;
        if (smallest) o.engine.memory_budget_bytes = min_budget(d, o, r, g);
        CAPTURE(regime_name(r));
        CAPTURE(o.engine.memory_budget_bytes);
        const PrefRun a = run_library(d, Dpo(o), g), b = run_library(d, Dpo(o), g);
        CHECK(runs_bitwise_equal(a, b));
        CHECK(runs_bitwise_equal(a, run_library(d64, Dpo(o), g)));
        if (smallest) continue;
        // Two threads: bitwise run to run, and the same as one thread to rounding.
        const PrefRun c = run_library(d, Dpo(o), g, 2), e = run_library(d, Dpo(o), g, 2);
        CHECK(runs_bitwise_equal(c, e));
        check_runs_close(a, c, tolerance(dtype).chunking);
      }
    }
  }
}

TEST_CASE("deferred regime: one long pair beyond resident's budget, several pairs, reruns") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    // One pair of T = 301 at V = 300: its fp32 logits (722 KB) do not fit 384 KiB, so resident
    // cannot run and the cost model weighs deferred (3 GEMMs per token) against recompute (4).
    PrefSpec s;
    s.s = 2;
    s.t = 301;
    s.h = 40;
    s.v = 300;
    s.ref = RefMode::kHead;
    s.dtype = dtype;
    s.seed = 9;
    const PrefData one(s);
    s.s = 6;
    s.t = 97;
    const PrefData three(s);
    PrefGradRequest g;
    g.dtype = dtype;
    for (const PrefData* d : {&one, &three}) {
      // (the long pair's 602 rows in more than two chunks however the CPU caps them)
      const std::size_t budget = (d == &one ? std::size_t{384} : std::size_t{512}) << 10;
      for (DpoOptions o : {DpoOptions{}, dpo(DpoLoss::kIpo), dpo(DpoLoss::kHinge)}) {
        o.engine.memory_budget_bytes = budget;
        INFO(describe(d->spec), " | ", describe(o));
        const PrefRun run = run_library(*d, Dpo(o), g);
        INFO("plan: ", run.plan.str());
        if (d == &one) CHECK(run.plan.regime == Regime::kDeferred);  // auto's choice
        o.engine.regime = Regime::kDeferred;
        const PrefRun def = run_library(*d, Dpo(o), g);
        CHECK(def.plan.regime == Regime::kDeferred);
        CHECK(def.plan.num_chunks > 2);
        CHECK(def.plan.workspace_bytes() <= budget);
        CHECK(def.plan.reason.find("first pair") != std::string::npos);
        const reference::PrefResult ref = oracle(*d, PrefConfig::from(o));
        check_against_oracle(def, ref, PrefTol::of(dtype, dtype), true);
        CHECK(runs_bitwise_equal(def, run_library(*d, Dpo(o), g)));
        // Recompute's bf16 dW rounds at other chunk boundaries: both against the oracle.
        o.engine.regime = Regime::kRecompute;
        const PrefRun rec = run_library(*d, Dpo(o), g);
        check_against_oracle(rec, ref, PrefTol::of(dtype, dtype), true);
        if (dtype == DType::kF32) check_runs_close(def, rec, tolerance(dtype).chunking);
      }
    }
  }
}

TEST_CASE("auto regime: deferred only where its dH block fits a budget that recompute fits") {
  // One pair of T = 512 at H = 256: the deferred plan's fp32 [N, H] dH block alone is 1 MiB,
  // while recompute's chunks fit 256 KiB.
  PrefSpec s;
  s.s = 2;
  s.t = 512;
  s.h = 256;
  s.v = 64;
  const PrefData d(s);
  PrefGradBuffers g(d, {});
  for (std::size_t kib : {256, 512}) {
    DpoOptions o;
    o.engine.memory_budget_bytes = kib << 10;
    const Plan pick = Dpo(o).plan(d.inputs(), g.views());
    INFO(pick.str());
    CHECK(pick.regime == Regime::kRecompute);
    CHECK(pick.workspace_bytes() <= o.engine.memory_budget_bytes);
    CHECK(pick.reason.find("deferred does not fit") != std::string::npos);
    o.engine.regime = Regime::kDeferred;  // requested, it runs over the budget
    CHECK(Dpo(o).plan(d.inputs(), g.views()).workspace_bytes() > o.engine.memory_budget_bytes);
  }
}

// ---- shapes and edge cases ---------------------------------------------------------------------

TEST_CASE("P = 1: one pair of every loss type, and KTO with one sequence") {
  for (DpoLoss t : kDpoLosses) {
    CAPTURE(dpo_loss_name(t));
    PrefSpec s;
    s.s = 2;
    s.ref = RefMode::kHead;
    check_matrix(s, dpo(t));
  }
  PrefSpec s;
  s.s = 2;
  check_matrix(s, OrpoOptions{});
  check_matrix(s, SimpoOptions{});
  check_matrix(s, CpoOptions{});
  PrefSpec k;
  k.s = 1;
  k.labels = true;
  k.ref = RefMode::kLogps;
  check_matrix(k, KtoOptions{});
}

// Columns masked in both heads by a -inf bias (a vocabulary mask): every regime's loss and
// gradients equal, to rounding, those with a bias of -1e4 there (probability 0 in fp32 as well),
// and the masked columns get no gradient. The logit sums, and so the logits metrics, are -inf.
template <typename Options>
void check_masked_columns(const PrefSpec& s, const Options& base) {
  const PrefData masked = masked_columns_data(s, -std::numeric_limits<float>::infinity());
  const PrefData finite = masked_columns_data(s, -1e4f);
  for (Regime regime : regimes_for(base, masked.spec)) {
    Options o = base;
    o.engine.regime = regime;
    INFO(describe(masked.spec), " | ", describe(o));
    const PrefRun a = run_library(masked, make_loss(o), {}),
                  b = run_library(finite, make_loss(o), {});
    CHECK(std::isfinite(a.result.loss));
    check_scalar("loss", a.result.loss, b.result.loss, 1e-6);
    for (const auto& [name, value] : a.result.metrics)
      if (name.starts_with("logits/")) CHECK(value == -std::numeric_limits<double>::infinity());
    check_close("dH", a.grads.hidden(), b.grads.hidden(), 1e-6);
    check_close("dW", a.grads.weight(), b.grads.weight(), 1e-6);
    check_close("db", a.grads.bias(), b.grads.bias(), 1e-6);
    check_masked_columns_untouched(a, s.h);
  }
}

TEST_CASE("a -inf bias masks columns: finite losses, no gradient on them, every loss") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  check_masked_columns(s, dpo(DpoLoss::kSigmoid));
  s.ref = RefMode::kNone;
  check_masked_columns(s, OrpoOptions{});
  check_masked_columns(s, SimpoOptions{});
  check_masked_columns(s, CpoOptions{});
  PrefSpec k = kto_spec();
  k.ref = RefMode::kHead;
  check_masked_columns(k, KtoOptions{});
}

TEST_CASE("KTO with sequences of one label: that label's metrics alone, and no margin") {
  for (std::int32_t label : {0, 1}) {
    CAPTURE(label);
    PrefSpec k;
    k.s = 4;
    k.labels = true;
    k.ref = RefMode::kHead;
    PrefData d(k);
    std::fill(d.labels.begin(), d.labels.end(), label);
    const PrefRun run = run_library(d, Kto(KtoOptions{}), {});
    check_against_oracle(run, oracle(d, PrefConfig::from(KtoOptions{})),
                         PrefTol::of(DType::kF32, DType::kF32), false);
    const std::string has = label ? "chosen" : "rejected", lacks = label ? "rejected" : "chosen";
    for (const std::string m : {"rewards/", "logps/", "logits/"}) {
      CHECK_NOTHROW(run.result.metric(m + has));
      CHECK_THROWS_AS(run.result.metric(m + lacks), Error);
    }
    CHECK_THROWS_AS(run.result.metric("rewards/margins"), Error);
    CHECK(run.result.metric("count/" + has) == 4);
    CHECK(run.result.metric("count/" + lacks) == 0);
  }
}

TEST_CASE("odd shapes: T = 1, H = 1, V = 1, and odd T, H, V") {
  struct Shape {
    std::int64_t s, t, h, v;
  };
  for (Shape sh : {Shape{2, 1, 3, 5}, Shape{4, 3, 1, 7}, Shape{6, 7, 3, 5}, Shape{2, 17, 5, 3},
                   Shape{6, 9, 123, 507}}) {
    PrefSpec s;
    s.s = sh.s;
    s.t = sh.t;
    s.h = sh.h;
    s.v = sh.v;
    s.bias = true;
    s.ref = RefMode::kHead;
    CAPTURE(describe(s));
    check_matrix(s, DpoOptions{});
    PrefSpec k = s;
    k.labels = true;
    check_matrix(k, KtoOptions{});
    s.ref = RefMode::kNone;
    check_matrix(s, OrpoOptions{});
    check_matrix(s, CpoOptions{});
  }
  // V = 1: every log-prob is exactly 0 and every gradient exactly 0.
  PrefSpec s;
  s.s = 4;
  s.t = 5;
  s.h = 3;
  s.v = 1;
  s.bias = true;
  const PrefData d(s);
  for (Regime r : kRegimes) {
    DpoOptions o;
    o.engine.regime = r;
    const PrefRun run = run_library(d, Dpo(o), {});
    CHECK(run.result.loss == doctest::Approx(std::log(2.0)).epsilon(1e-12));
    check_all_equal("logps", run.result.logps, 0.0);
    check_all_equal("grad_hidden", run.grads.hidden(), 0.0);
    check_all_equal("grad_weight", run.grads.weight(), 0.0);
    check_all_equal("grad_bias", run.grads.bias(), 0.0);
  }
}

TEST_CASE("variable lengths through ignore_index: -100, -1, one inside the vocabulary, full") {
  for (std::int64_t ii : {std::int64_t{-100}, std::int64_t{-1}, std::int64_t{5}}) {
    CAPTURE(ii);
    PrefSpec s;
    s.ignore_index = ii;
    s.max_prompt_frac = 0.6;
    s.ref = RefMode::kHead;
    DpoOptions o;
    o.engine.ignore_index = ii;
    o.nll = true;
    check_matrix(s, o);
    KtoOptions k;
    k.engine.ignore_index = ii;
    PrefSpec ks = s;
    ks.labels = true;
    ks.s = 5;
    check_matrix(ks, k);
  }
  PrefSpec full;
  full.full = true;
  check_matrix(full, SimpoOptions{});
  // The lengths differ between sequences, and the same data with other padding gives the same
  // sums: a token's log-prob depends on its own row only.
  const PrefData d(PrefSpec{});
  const auto ref = oracle(d, PrefConfig::from(DpoOptions{}), false);
  CHECK(std::set<std::int64_t>(ref.tokens.begin(), ref.tokens.end()).size() > 2);
}

// Runs of ignored rows between consecutive sequences' valid tokens (padding, then the next
// prompt): their lengths.
std::vector<std::int64_t> ignored_gaps(const PrefData& d) {
  std::vector<std::int64_t> gaps;
  std::int64_t last_valid = -1;
  for (std::int64_t i = 0; i < d.rows(); ++i) {
    if (d.targets64[static_cast<std::size_t>(i)] == d.spec.ignore_index) continue;
    if (last_valid >= 0 && i - last_valid > 1) gaps.push_back(i - last_valid - 1);
    last_valid = i;
  }
  return gaps;
}

TEST_CASE("skipped rows: long prompts and padding, every regime, packed chunks, accumulate") {
  // T = 160 with prompts of up to 112 rows: the engine skips each sequence's leading and
  // trailing ignored rows, computes runs of fewer than 64 between two sequences' valid rows,
  // and packs the short spans into shared chunks at the smallest budgets.
  PrefSpec s;
  s.s = 6;
  s.t = 160;
  s.h = 24;
  s.v = 90;
  s.max_prompt_frac = 0.7;
  s.ref = RefMode::kHead;
  s.seed = 11;
  const std::vector<std::int64_t> gaps = ignored_gaps(PrefData(s));
  CHECK(std::any_of(gaps.begin(), gaps.end(), [](std::int64_t g) { return g >= 64; }));
  CHECK(std::any_of(gaps.begin(), gaps.end(), [](std::int64_t g) { return g < 64; }));
  PrefSpec ks = s;
  ks.s = 7;
  ks.labels = true;
  const auto run_all = [](const PrefSpec& base, const auto& opts) {
    const PrefConfig cfg = PrefConfig::from(opts);
    for (auto [dtype, grad_dtype] :
         {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kBF16}}) {
      PrefSpec sp = base;
      sp.dtype = dtype;
      const PrefData d(sp);
      const reference::PrefResult ref = oracle(d, cfg);
      PrefGradRequest g;
      g.dtype = grad_dtype;
      for (Regime regime : regimes_for(opts, sp)) {
        for (bool smallest : {false, true}) {
          auto o = opts;
          o.engine.regime = regime;
          if (smallest) o.engine.memory_budget_bytes = min_budget(d, o, regime, g);
          INFO(describe(sp), " | ", describe(o));
          const PrefRun run = run_library(d, make_loss(o), g);
          INFO("plan: ", run.plan.str());
          CHECK(run.plan.regime == regime);
          check_against_oracle(run, ref, PrefTol::of(dtype, grad_dtype), cfg.paired());
        }
      }
      // Accumulating leaves the skipped rows' pre-filled dH as it was.
      auto o = opts;
      o.engine.regime = Regime::kRecompute;
      o.engine.memory_budget_bytes = min_budget(d, o, Regime::kRecompute, g);
      PrefGradBuffers acc(d, g);
      acc.fill_random(3, 1e-3);
      const std::vector<double> h0 = acc.hidden(), w0 = acc.weight();
      AlignedBuffer ws(make_loss(o).workspace_bytes(d.inputs(), acc.views(true)));
      CpuContext ctx;
      make_loss(o).forward_backward(ctx, d.inputs(), acc.views(true), ws.workspace());
      std::vector<double> want_h = h0, want_w = w0;
      for (std::size_t i = 0; i < want_h.size(); ++i) want_h[i] += ref.grad_hidden[i];
      for (std::size_t i = 0; i < want_w.size(); ++i) want_w[i] += ref.grad_weight[i];
      check_close("accumulated grad_hidden", acc.hidden(), want_h, tolerance(grad_dtype).grad);
      check_close("accumulated grad_weight", acc.weight(), want_w, tolerance(grad_dtype).grad);
    }
  };
  run_all(s, DpoOptions{});
  DpoOptions avg;
  avg.average_log_prob = true;
  avg.loss_type = DpoLoss::kIpo;
  run_all(s, avg);
  PrefSpec free = s;
  free.ref = RefMode::kNone;
  run_all(free, OrpoOptions{});
  run_all(ks, KtoOptions{});
}

TEST_CASE("hidden given as [S, T, H] is the same as [S*T, H]") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  const PrefData d(s);
  const PrefRun flat = run_library(d, Dpo(DpoOptions{}), {});
  PreferenceInputs in = d.inputs();
  in.policy.hidden = TensorView::of(d.hidden.data(), {s.s, s.t, s.h});
  in.reference.hidden = TensorView::of(d.ref_hidden.data(), {s.s, s.t, s.h});
  PrefGradBuffers g(d, {});
  const Dpo loss{DpoOptions{}};
  AlignedBuffer ws(loss.workspace_bytes(in, g.views()));
  CpuContext ctx;
  PreferenceGrads views = g.views();
  const PreferenceResult r = loss.forward_backward(ctx, in, views, ws.workspace());
  CHECK(r.loss == flat.result.loss);
  CHECK(g.bitwise_equal(flat.grads));
  // grads.hidden may take the same [S, T, H] shape.
  PrefGradBuffers g3(d, {});
  views = g3.views();
  views.hidden = TensorView::of(views.hidden.data_as<float>(), {s.s, s.t, s.h});
  CHECK(loss.forward_backward(ctx, in, views, ws.workspace()).loss == flat.result.loss);
  CHECK(g3.bitwise_equal(flat.grads));
}

TEST_CASE("bf16 inputs match the oracle on the same bf16 values, not the fp32 ones") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  s.dtype = DType::kBF16;
  const PrefData bf(s);
  s.dtype = DType::kF32;
  const PrefData f32(s);
  const PrefConfig c = PrefConfig::from(DpoOptions{});
  const double gap = std::abs(oracle(bf, c, false).loss - oracle(f32, c, false).loss);
  CHECK(gap > 5 * tolerance(DType::kBF16).loss);
  PrefGradRequest g;
  g.dtype = DType::kBF16;
  check_against_oracle(run_library(bf, Dpo(DpoOptions{}), g), oracle(bf, c),
                       PrefTol::of(DType::kBF16, DType::kBF16), true);
}

TEST_CASE("only some gradients requested") {
  PrefSpec s;
  s.bias = true;
  s.ref = RefMode::kHead;
  const PrefData d(s);
  const auto ref = oracle(d, PrefConfig::from(DpoOptions{}));
  for (PrefGradRequest g : {PrefGradRequest{false, true, false, DType::kF32},
                            PrefGradRequest{true, false, false, DType::kF32},
                            PrefGradRequest{false, false, true, DType::kBF16},
                            PrefGradRequest{true, true, false, DType::kBF16}}) {
    for (Regime r : kRegimes) {
      CAPTURE(g.hidden);
      CAPTURE(g.weight);
      CAPTURE(g.bias);
      CAPTURE(regime_name(r));
      DpoOptions o;
      o.engine.regime = r;
      check_against_oracle(run_library(d, Dpo(o), g), ref, PrefTol::of(DType::kF32, g.dtype), true);
    }
  }
}

TEST_CASE("accumulate adds the gradients to pre-filled buffers, overwrite ignores them") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (Regime r : kRegimes) {
      PrefSpec s = big_spec();
      s.dtype = dtype;
      const PrefData d(s);
      DpoOptions o;
      o.nll = true;
      o.engine.regime = r;
      PrefGradRequest g;
      g.dtype = dtype;
      o.engine.memory_budget_bytes = min_budget(d, o, r, g);
      const auto ref = oracle(d, PrefConfig::from(o));
      CAPTURE(dtype_name(dtype));
      CAPTURE(regime_name(r));
      const Dpo loss(o);
      const PreferenceInputs in = d.inputs();
      // Pre-fill with values of about the gradients' size: a lost or doubled contribution shows.
      PrefGradBuffers acc(d, g);
      acc.fill_random(3, 1e-3);
      const std::vector<double> h0 = acc.hidden(), w0 = acc.weight(), b0 = acc.bias();
      {
        AlignedBuffer ws(loss.workspace_bytes(in, acc.views(true)));
        CpuContext ctx;
        loss.forward_backward(ctx, in, acc.views(true), ws.workspace());
      }
      auto plus = [](std::vector<double> a, const std::vector<double>& b) {
        for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
        return a;
      };
      const double tol = tolerance(dtype).grad;
      check_close("accumulated grad_hidden", acc.hidden(), plus(h0, ref.grad_hidden), tol);
      check_close("accumulated grad_weight", acc.weight(), plus(w0, ref.grad_weight), tol);
      check_close("accumulated grad_bias", acc.bias(), plus(b0, ref.grad_bias), tol);
      PrefGradBuffers over(d, g);
      over.fill_random(4, 1.0);
      {
        AlignedBuffer ws(loss.workspace_bytes(in, over.views()));
        CpuContext ctx;
        loss.forward_backward(ctx, in, over.views(), ws.workspace());
      }
      check_close("overwritten grad_hidden", over.hidden(), ref.grad_hidden, tol);
      check_close("overwritten grad_weight", over.weight(), ref.grad_weight, tol);
      check_close("overwritten grad_bias", over.bias(), ref.grad_bias, tol);
    }
  }
}

TEST_CASE("forward only: the same loss, metrics and vectors without gradient work") {
  for (Regime r : {Regime::kAuto, Regime::kResident, Regime::kRecompute}) {
    PrefSpec s = big_spec();
    const PrefData pairs(s);
    s.labels = true;
    const PrefData labelled(s);
    auto both = [&](const PrefData& d, auto o) {
      o.engine.regime = r;
      INFO(describe(o));
      const PrefRun fb = run_library(d, make_loss(o), {});
      const PrefRun f = run_library(d, make_loss(o), PrefGradRequest::none());
      check_runs_close(f, fb, tolerance(DType::kF32).chunking);
      check_against_oracle(f, oracle(d, PrefConfig::from(o), false),
                           PrefTol::of(DType::kF32, DType::kF32), PrefConfig::from(o).paired());
      CHECK(f.plan.workspace_bytes() <= fb.plan.workspace_bytes());
    };
    DpoOptions nll;
    nll.nll = true;
    both(pairs, nll);
    both(labelled, KtoOptions{});
  }
}

// ---- SequenceLogProbs
// ----------------------------------------------------------------------------

TEST_CASE("SequenceLogProbs: sums and counts against the oracle, empty sequences give 0, 0") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (std::size_t budget : {std::size_t{0}, std::size_t{1} << 16, std::size_t{1} << 18}) {
      PrefSpec s = big_spec();
      s.dtype = dtype;
      s.targets_i64 = budget == 0;
      PrefData d(s);
      for (std::int64_t j = 0; j < s.t; ++j) d.set_target(3 * s.t + j, s.ignore_index);
      const auto want = reference::sequence_stats(d.problem().policy, d.targets64, s.s, s.t, s.h,
                                                  s.v, s.ignore_index);
      CHECK(want.tokens[3] == 0);
      SequenceOptions o;
      o.memory_budget_bytes = budget;
      const SequenceLogProbs lp(o);
      const Head head = d.policy_head();
      const std::size_t bytes = lp.workspace_bytes(head, d.targets_view());
      const Plan plan = lp.plan(head, d.targets_view());
      INFO(plan.str());
      CHECK(bytes == plan.workspace_bytes());
      // Within the budget unless the smallest chunk does not fit (and the plan says so).
      if (budget) CHECK((bytes <= budget) != plan.over_budget);
      AlignedBuffer ws(bytes);
      CpuContext ctx;
      const SequenceLogProbResult r = lp.compute(ctx, head, d.targets_view(), ws.workspace());
      CAPTURE(dtype_name(dtype));
      CAPTURE(budget);
      check_close("logps", r.logps, want.logps, tolerance(dtype).rows);
      CHECK(r.tokens == want.tokens);
      CHECK(r.logps[3] == 0.0);
    }
  }
  // All sequences empty.
  PrefSpec s;
  PrefData d(s);
  for (std::int64_t i = 0; i < d.rows(); ++i) d.set_target(i, s.ignore_index);
  const SequenceLogProbs lp;
  AlignedBuffer ws(lp.workspace_bytes(d.policy_head(), d.targets_view()));
  CpuContext ctx;
  const auto r = lp.compute(ctx, d.policy_head(), d.targets_view(), ws.workspace());
  check_all_equal("logps", r.logps, 0.0);
  CHECK(r.tokens == std::vector<std::int64_t>(static_cast<std::size_t>(s.s), 0));
  // Its sums feed a DPO call as precomputed reference log-probs.
  PrefSpec hs;
  hs.ref = RefMode::kHead;
  const PrefData hd(hs);
  PreferenceInputs in = hd.inputs();
  AlignedBuffer ws2(lp.workspace_bytes(in.reference, in.targets));
  const auto ref = lp.compute(ctx, in.reference, in.targets, ws2.workspace());
  check_close("reference sums", ref.logps, hd.ref_logps, 1e-6);
}

TEST_CASE("SequenceLogProbs: bad input names the argument") {
  PrefData d(PrefSpec{});
  const SequenceLogProbs lp;
  CpuContext ctx;
  AlignedBuffer ws(std::size_t{1} << 20);
  Head head = d.policy_head();
  head.hidden = TensorView::of(d.hidden.data(), {d.rows() - 1, d.spec.h});
  CHECK_THROWS_WITH_AS(lp.compute(ctx, head, d.targets_view(), ws.workspace()),
                       doctest::Contains("hidden"), Error);
  d.set_target(4, d.spec.v);
  CHECK_THROWS_WITH_AS(lp.compute(ctx, d.policy_head(), d.targets_view(), ws.workspace()),
                       doctest::Contains("targets"), Error);
}

// ---- bad input
// -----------------------------------------------------------------------------------

template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a chunkloss::Error: ") + e.what() + ">";
  }
  return "<no exception>";
}

// A small valid problem that each case breaks in one place; the call must throw
// chunkloss::Error naming `needle`, and leave the sentinel-filled gradient buffers untouched.
struct BadCall {
  explicit BadCall(PrefSpec s = spec()) : d(s) {}
  static PrefSpec spec() {
    PrefSpec s;
    s.s = 4;
    s.t = 5;
    s.h = 8;
    s.v = 11;
    s.bias = true;
    return s;
  }
  template <typename Options>
  void expect(const Options& o, const PreferenceInputs& in, std::string_view needle,
              PrefGradRequest g = {}) {
    PrefGradBuffers grads(d, g, 3.25f), pristine(d, g, 3.25f);
    const std::string what = error_message([&] {
      const auto loss = make_loss(o);
      AlignedBuffer ws(std::size_t{1} << 22);
      CpuContext ctx;
      loss.forward_backward(ctx, in, grads.views(), ws.workspace());
    });
    CHECK_MESSAGE(what.find(needle) != std::string::npos,
                  "expected chunkloss::Error naming \"" << needle << "\", got: " << what);
    CHECK_MESSAGE(grads.bitwise_equal(pristine), "a failed call wrote into the gradients");
  }
  template <typename Options>
  void expect(const Options& o, std::string_view needle) {
    expect(o, d.inputs(), needle);
  }
  PrefData d;
};

TEST_CASE("bad input: the valid baseline calls succeed") {
  BadCall b;
  PrefGradBuffers g(b.d, {});
  AlignedBuffer ws(std::size_t{1} << 22);
  CpuContext ctx;
  CHECK_NOTHROW(Dpo().forward_backward(ctx, b.d.inputs(), g.views(), ws.workspace()));
  PrefSpec k = BadCall::spec();
  k.labels = true;
  BadCall kb(k);
  PrefGradBuffers kg(kb.d, {});
  CHECK_NOTHROW(Kto().forward_backward(ctx, kb.d.inputs(), kg.views(), ws.workspace()));
}

TEST_CASE("bad input: odd number of sequences for a paired loss") {
  PrefSpec s = BadCall::spec();
  s.s = 3;
  BadCall b(s);
  b.expect(DpoOptions{}, "targets");
  b.expect(OrpoOptions{}, "targets");
  b.expect(SimpoOptions{}, "targets");
  b.expect(CpoOptions{}, "targets");
}

TEST_CASE("bad input: shapes of hidden, weight, targets, reference, labels, gradients") {
  BadCall b;
  const std::int64_t n = b.d.rows(), h = b.d.spec.h, v = b.d.spec.v, s = b.d.spec.s;
  {
    PreferenceInputs in = b.d.inputs();
    in.policy.hidden = TensorView::of(b.d.hidden.data(), {n - 1, h});
    b.expect(DpoOptions{}, in, "hidden");
  }
  {
    PreferenceInputs in = b.d.inputs();
    in.policy.weight = TensorView::of(b.d.weight.data(), {v, h - 1});
    b.expect(DpoOptions{}, in, "weight");
  }
  {
    PreferenceInputs in = b.d.inputs();
    in.policy.bias = TensorView::of(b.d.bias.data(), {v - 1});
    b.expect(DpoOptions{}, in, "bias");
  }
  {
    PreferenceInputs in = b.d.inputs();
    in.targets = TensorView::of(b.d.targets32.data(), {s * b.d.spec.t});
    b.expect(DpoOptions{}, in, "targets");
    // [S, T - 1]: S*T no longer matches the hidden rows.
    in.targets = TensorView::of(b.d.targets32.data(), {s, b.d.spec.t - 1});
    b.expect(DpoOptions{}, in, "targets");
  }
  {
    PreferenceInputs in = b.d.inputs();
    std::vector<float> y(static_cast<std::size_t>(n), 1.0f);
    in.targets = TensorView::of(y.data(), {s, b.d.spec.t});
    b.expect(DpoOptions{}, in, "targets");
  }
  {
    PreferenceInputs in = b.d.inputs();
    std::vector<BFloat16> w(b.d.weight.size());
    in.policy.weight = TensorView::of(w.data(), {v, h});
    b.expect(DpoOptions{}, in, "weight");
  }
  {
    PrefSpec r = BadCall::spec();
    r.ref = RefMode::kHead;
    BadCall rb(r);
    PreferenceInputs in = rb.d.inputs();
    in.reference.hidden = TensorView::of(rb.d.ref_hidden.data(), {n - 1, h});
    rb.expect(DpoOptions{}, in, "reference");
    in = rb.d.inputs();
    in.reference.weight = TensorView::of(rb.d.ref_weight.data(), {v - 1, h});
    rb.expect(DpoOptions{}, in, "reference");
  }
  {
    PrefSpec r = BadCall::spec();
    r.ref = RefMode::kLogps;
    BadCall rb(r);
    PreferenceInputs in = rb.d.inputs();
    in.reference_logps = TensorView::of(rb.d.ref_logps.data(), {s - 1});
    rb.expect(DpoOptions{}, in, "reference_logps");
  }
  {
    PrefSpec k = BadCall::spec();
    k.labels = true;
    BadCall kb(k);
    PreferenceInputs in = kb.d.inputs();
    in.labels = TensorView::of(kb.d.labels.data(), {s - 1});
    kb.expect(KtoOptions{}, in, "labels");
    std::vector<float> fl(static_cast<std::size_t>(s), 1.0f);
    in.labels = TensorView::of(fl.data(), {s});
    kb.expect(KtoOptions{}, in, "labels");
    kb.d.labels[1] = 2;
    kb.expect(KtoOptions{}, kb.d.inputs(), "labels");
  }
  {
    // Gradient buffers of the wrong shape, and a bias gradient without a bias.
    PrefGradBuffers g(b.d, {}, 3.25f), pristine(b.d, {}, 3.25f);
    PreferenceGrads views = g.views();
    std::vector<float> small(static_cast<std::size_t>((n - 1) * h), 3.25f);
    views.hidden = TensorView::of(small.data(), {n - 1, h});
    AlignedBuffer ws(std::size_t{1} << 22);
    CpuContext ctx;
    CHECK_THROWS_WITH_AS(Dpo().forward_backward(ctx, b.d.inputs(), views, ws.workspace()),
                         doctest::Contains("hidden"), Error);
    CHECK(g.bitwise_equal(pristine));
    PrefSpec nb = BadCall::spec();
    nb.bias = false;
    BadCall bb(nb);
    PrefGradBuffers gb(bb.d, {}, 3.25f);
    PreferenceGrads gv = gb.views();
    std::vector<float> db(static_cast<std::size_t>(v), 3.25f);
    gv.bias = TensorView::of(db.data(), {v});
    CHECK_THROWS_WITH_AS(Dpo().forward_backward(ctx, bb.d.inputs(), gv, ws.workspace()),
                         doctest::Contains("bias"), Error);
    CHECK(std::all_of(db.begin(), db.end(), [](float x) { return x == 3.25f; }));
  }
}

TEST_CASE("bad input: targets out of range and a sequence with no valid tokens") {
  for (std::int64_t y :
       {std::int64_t{11}, std::int64_t{1000}, std::int64_t{-1}, std::int64_t{-101}}) {
    CAPTURE(y);
    BadCall b;
    b.d.set_target(7, y);
    b.expect(DpoOptions{}, "targets");
    b.d.spec.targets_i64 = true;
    b.expect(DpoOptions{}, "targets");
  }
  for (std::int64_t seq : {0, 3}) {
    CAPTURE(seq);
    BadCall b;
    for (std::int64_t j = 0; j < b.d.spec.t; ++j) b.d.set_target(seq * b.d.spec.t + j, -100);
    b.expect(DpoOptions{}, "targets");
    b.expect(OrpoOptions{}, "targets");
    PrefSpec k = BadCall::spec();
    k.labels = true;
    BadCall kb(k);
    for (std::int64_t j = 0; j < kb.d.spec.t; ++j) kb.d.set_target(seq * kb.d.spec.t + j, -100);
    kb.expect(KtoOptions{}, "targets");
  }
}

TEST_CASE("bad input: check_finite names the head's tensor, the KL batch's too") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  PrefSpec s = BadCall::spec();
  s.ref = RefMode::kHead;
  for (int where = 0; where < 4; ++where) {
    CAPTURE(where);
    BadCall b(s);
    std::vector<float>& x = where == 0   ? b.d.hidden
                            : where == 1 ? b.d.weight
                            : where == 2 ? b.d.bias
                                         : b.d.ref_weight;
    x[x.size() - 1] = where % 2 ? inf : nan;
    DpoOptions o;
    o.engine.check_finite = true;
    const char* names[] = {"policy.hidden", "policy.weight", "policy.bias", "reference.weight"};
    b.expect(o, std::string(names[where]) + " ");
  }
  PrefSpec k = BadCall::spec();
  k.labels = true;
  k.kl_batch = true;
  k.ref = k.kl_ref = RefMode::kHead;
  BadCall kb(k);
  kb.d.kl_ref_hidden[3] = nan;
  KtoOptions o;
  o.engine.check_finite = true;
  kb.expect(o, "kl_batch.reference.hidden ");
  // Without check_finite the NaN reaches the objective, and the message points at the inputs.
  BadCall unchecked(BadCall::spec());
  unchecked.d.weight[0] = nan;
  unchecked.expect(DpoOptions{}, "are not finite (logp nan, ref 0), so the inputs are not");
}

TEST_CASE("bad input: non-finite log-probs fail the call where the loss's own value hides them") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // DPO hinge: max(0, 1 - NaN) is 0, so the unit's log-probs alone must fail it.
  DpoOptions hinge;
  hinge.loss_type = DpoLoss::kHinge;
  BadCall policy;
  policy.d.weight[0] = nan;
  policy.expect(hinge, "the log-probs of sequence 0 (unit 0) are not finite (logp nan");
  // A reference head's NaN fails the call before any gradient is written, naming its sequence,
  // also where it lies in a later resident group than the first (sequence 3: pair 1's rejected).
  PrefSpec s = BadCall::spec();
  s.ref = RefMode::kHead;
  BadCall ref(s);
  std::fill_n(ref.d.ref_hidden.begin() + 3 * s.t * s.h, s.t * s.h, nan);
  for (DpoLoss type : {DpoLoss::kHinge, DpoLoss::kSigmoid}) {
    DpoOptions o;
    o.loss_type = type;
    o.engine.regime = Regime::kResident;
    o.engine.memory_budget_bytes = min_budget(ref.d, o, Regime::kResident, {});
    PrefGradBuffers g(ref.d, {});
    CHECK(Dpo(o).plan(ref.d.inputs(), g.views()).num_groups == 2);
    ref.expect(o, "the reference head's log-prob of sequence 3 is not finite (nan)");
  }
  // KTO: max(0, NaN) is 0, so a non-finite KL estimate must fail the call.
  PrefSpec k = BadCall::spec();
  k.labels = true;
  k.kl_batch = true;
  k.ref = k.kl_ref = RefMode::kHead;
  for (float bad : {nan, inf}) {
    CAPTURE(bad);
    BadCall policy_kl(k), reference_kl(k);
    std::fill(policy_kl.d.kl_hidden.begin(), policy_kl.d.kl_hidden.end(), bad);
    policy_kl.expect(KtoOptions{}, "the KL estimate from kl_batch");
    std::fill(reference_kl.d.kl_ref_hidden.begin(), reference_kl.d.kl_ref_hidden.end(), bad);
    reference_kl.expect(KtoOptions{}, "the KL estimate from kl_batch");
  }
}

TEST_CASE("bad input: references where none is allowed, both kinds at once, labels") {
  PrefSpec s = BadCall::spec();
  s.ref = RefMode::kHead;
  BadCall head(s);
  head.expect(OrpoOptions{}, "reference");
  head.expect(SimpoOptions{}, "reference");
  head.expect(CpoOptions{}, "reference");
  s.ref = RefMode::kLogps;
  BadCall logps(s);
  logps.expect(OrpoOptions{}, "reference_logps");
  logps.expect(SimpoOptions{}, "reference_logps");
  logps.expect(CpoOptions{}, "reference_logps");
  // Both a reference head and precomputed sums.
  PreferenceInputs both = head.d.inputs();
  both.reference_logps = TensorView::of(logps.d.ref_logps.data(), {s.s});
  head.expect(DpoOptions{}, both, "reference");
  PrefSpec ks = s;
  ks.labels = true;
  ks.ref = RefMode::kHead;
  BadCall kb(ks);
  PreferenceInputs kboth = kb.d.inputs();
  kboth.reference_logps = TensorView::of(logps.d.ref_logps.data(), {s.s});
  kb.expect(KtoOptions{}, kboth, "reference");
  // An incomplete reference head (a bias alone, or no weight) is refused, not dropped.
  PreferenceInputs partial = head.d.inputs();
  partial.reference.hidden = partial.reference.weight = {};
  head.expect(DpoOptions{}, partial, "reference.hidden");
  partial = head.d.inputs();
  partial.reference.weight = {};
  head.expect(DpoOptions{}, partial, "reference.weight");
  // KTO needs labels; paired losses take none.
  BadCall plain;
  plain.expect(KtoOptions{}, "labels");
  PrefSpec ls = BadCall::spec();
  ls.labels = true;
  BadCall labelled(ls);
  labelled.expect(DpoOptions{}, "labels");
}

TEST_CASE("bad input: invalid options name the option") {
  BadCall b;
  PrefSpec ks = BadCall::spec();
  ks.labels = true;
  BadCall kb(ks);
  for (float beta : {0.0f, -0.1f, std::numeric_limits<float>::quiet_NaN(),
                     std::numeric_limits<float>::infinity()}) {
    CAPTURE(beta);
    DpoOptions d;
    d.beta = beta;
    b.expect(d, "beta");
    OrpoOptions o;
    o.beta = beta;
    b.expect(o, "beta");
    SimpoOptions si;
    si.beta = beta;
    b.expect(si, "beta");
    CpoOptions c;
    c.beta = beta;
    b.expect(c, "beta");
    KtoOptions k;
    k.beta = beta;
    kb.expect(k, "beta");
  }
  auto dpo_ls = [](DpoLoss t, float eps) {
    DpoOptions o;
    o.loss_type = t;
    o.label_smoothing = eps;
    return o;
  };
  b.expect(dpo_ls(DpoLoss::kExoPair, 0.0f), "label_smoothing");
  b.expect(dpo_ls(DpoLoss::kExoPair, 1.0f), "label_smoothing");
  b.expect(dpo_ls(DpoLoss::kRobust, 0.5f), "label_smoothing");
  b.expect(dpo_ls(DpoLoss::kRobust, -0.1f), "label_smoothing");
  b.expect(dpo_ls(DpoLoss::kSigmoid, 0.6f), "label_smoothing");
  b.expect(dpo_ls(DpoLoss::kSigmoid, -0.1f), "label_smoothing");
  DpoOptions tau;
  tau.loss_type = DpoLoss::kDiscoPop;
  tau.discopop_tau = 0.0f;
  b.expect(tau, "discopop_tau");
  SimpoOptions gamma;
  gamma.gamma = -0.5f;
  b.expect(gamma, "gamma");
  CpoOptions alpha;
  alpha.alpha = -1.0f;
  b.expect(alpha, "alpha");
  KtoOptions wd;
  wd.desirable_weight = -1.0f;
  kb.expect(wd, "desirable_weight");
  KtoOptions wu;
  wu.undesirable_weight = -1.0f;
  kb.expect(wu, "undesirable_weight");
  // Enumerators out of range (a cast from a bad integer) are refused, not read as another one.
  DpoOptions type;
  type.loss_type = static_cast<DpoLoss>(42);
  b.expect(type, "value 42");
  DpoOptions regime;
  regime.engine.regime = static_cast<Regime>(9);
  b.expect(regime, "regime");
  DpoOptions order;
  order.engine.loop_order = static_cast<LoopOrder>(9);
  b.expect(order, "loop_order");
  CHECK_THROWS_WITH_AS(SequenceLogProbs(order.engine), doctest::Contains("loop_order"), Error);
}

TEST_CASE("bad input: the KL batch") {
  PrefSpec s = BadCall::spec();
  s.labels = true;
  s.kl_batch = true;
  s.ref = s.kl_ref = RefMode::kHead;
  BadCall b(s);
  PreferenceInputs in = b.d.inputs();
  in.kl_batch.policy.hidden = TensorView::of(b.d.kl_hidden.data(), {s.kl_s * s.kl_t - 1, s.h});
  b.expect(KtoOptions{}, in, "kl_batch");
  // A KL head whose vocabulary differs from the policy head's, named with both weights' shapes.
  for (const char* name : {"kl_batch.policy", "kl_batch.reference"}) {
    in = b.d.inputs();
    Head& head =
        name == std::string("kl_batch.policy") ? in.kl_batch.policy : in.kl_batch.reference;
    const TensorView w = head.weight;
    head.weight = TensorView(w.data(), w.dtype(), {s.v - 1, s.h}, w.device(), w.device_index());
    head.bias = {};
    b.expect(KtoOptions{}, in,
             std::string(name) + " must match the policy head's H, V and dtype: " + name +
                 ".weight " + head.weight.str() + ", policy.weight " + in.policy.weight.str());
  }
  // A KL batch without a reference (head or sums), or with both; and one for a batch without a
  // reference, whose KL point would be max(0, a mean log-prob) = 0 whatever the batch.
  in = b.d.inputs();
  in.kl_batch.reference = {};
  b.expect(KtoOptions{}, in, "kl_batch needs exactly one of a reference head and reference_logps");
  in = b.d.inputs();
  in.kl_batch.reference_logps = TensorView::of(b.d.kl_ref_logps.data(), {s.kl_s});
  b.expect(KtoOptions{}, in, "kl_batch needs exactly one of a reference head and reference_logps");
  in = b.d.inputs();
  in.reference = {};
  b.expect(KtoOptions{}, in, "kl_batch needs the batch to have a reference too");
  in = b.d.inputs();
  b.d.kl_targets32[2] = static_cast<std::int32_t>(s.v);
  b.expect(KtoOptions{}, in, "kl_batch");
  b.d.kl_targets32[2] = 0;
  // A KL sequence with no valid token, and non-finite precomputed reference sums.
  for (std::int64_t j = 0; j < s.kl_t; ++j) b.d.kl_targets32[s.kl_t + j] = -100;
  b.expect(KtoOptions{}, in, "sequence 1 of kl_batch.targets");
  for (std::int64_t j = 0; j < s.kl_t; ++j) b.d.kl_targets32[s.kl_t + j] = 0;
  PrefSpec sums = s;
  sums.kl_ref = RefMode::kLogps;
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    BadCall bs(sums);
    bs.d.kl_ref_logps[1] = bad;
    bs.expect(KtoOptions{}, "kl_batch.reference_logps[1] is not finite");
  }
  // Parts of a KL batch without its targets and policy head are refused, not dropped.
  PreferenceInputs part = b.d.inputs();
  part.kl_batch.targets = {};
  part.kl_batch.policy = {};
  b.expect(KtoOptions{}, part, "kl_batch.targets");
  PrefSpec only_sums = sums;
  only_sums.kl_batch = false;
  BadCall os(only_sums);
  part = os.d.inputs();
  BadCall full(sums);
  part.kl_batch.reference_logps = TensorView::of(full.d.kl_ref_logps.data(), {s.kl_s});
  os.expect(KtoOptions{}, part, "kl_batch.targets");
  // Both a given KL point and a KL batch; a non-finite KL point; KL inputs for a paired loss.
  in = b.d.inputs();
  in.kl = 0.5;
  b.expect(KtoOptions{}, in, "kl");
  PrefSpec given = BadCall::spec();
  given.labels = true;
  given.kl = std::numeric_limits<double>::quiet_NaN();
  BadCall g(given);
  g.expect(KtoOptions{}, "kl");
  PrefSpec paired = BadCall::spec();
  paired.kl = 0.5;
  BadCall p(paired);
  p.expect(DpoOptions{}, "kl");
}

TEST_CASE("bad input: a gradient sharing memory with an input, another gradient or the workspace") {
  PrefSpec s;
  s.ref = RefMode::kHead;
  s.bias = true;
  PrefData d(s);
  const PreferenceInputs in = d.inputs();
  const Dpo loss{DpoOptions{}};
  PrefGradBuffers g(d, {});
  AlignedBuffer ws(loss.workspace_bytes(in, g.views()));
  CpuContext ctx;
  const auto expect = [&](const PreferenceGrads& views, const std::string& needle) {
    const std::vector<float> hidden = d.hidden;
    const std::string what =
        error_message([&] { loss.forward_backward(ctx, in, views, ws.workspace()); });
    CHECK_MESSAGE(what.find(needle) != std::string::npos, what);
    CHECK(d.hidden == hidden);
  };
  PreferenceGrads v = g.views();
  v.hidden = TensorView::of(d.hidden.data(), {s.s * s.t, s.h});
  expect(v, "grads.hidden [" + std::to_string(s.s * s.t) + ", " + std::to_string(s.h) +
                "] f32 cpu shares memory with policy.hidden");
  v = g.views();
  v.hidden = TensorView::of(d.ref_hidden.data() + 1, {s.s * s.t, s.h});  // partly overlapping
  expect(v, "shares memory with reference.hidden");
  v = g.views();
  v.bias = TensorView::of(v.weight.data_as<float>() + s.v, {s.v});
  expect(v, "grads.weight");
  v = g.views();
  v.weight = TensorView::of(ws.workspace().at<float>({0, 4}), {s.v, s.h});
  expect(v, "grads.weight [");
  expect(v, "shares memory with the workspace");
  // An input inside the workspace would be overwritten while the call reads it.
  auto* in_ws = ws.workspace().at<std::int32_t>({0, 4});
  REQUIRE(ws.workspace().bytes() >= d.targets32.size() * 4 + 4);
  std::copy(d.targets32.begin(), d.targets32.end(), in_ws);
  PreferenceInputs moved = in;
  moved.targets = TensorView::of(in_ws, {s.s, s.t});
  const std::string what =
      error_message([&] { loss.forward_backward(ctx, moved, g.views(), ws.workspace()); });
  CHECK_MESSAGE(what.find("targets [" + std::to_string(s.s) + ", " + std::to_string(s.t) +
                          "] i32 cpu shares memory with the workspace") != std::string::npos,
                what);
  // The small inputs too: precomputed reference sums inside a gradient buffer.
  PrefSpec ls = s;
  ls.ref = RefMode::kLogps;
  PrefData ld(ls);
  PreferenceInputs lin = ld.inputs();
  PrefGradBuffers lg(ld, {});
  const PreferenceGrads lv = lg.views();
  REQUIRE(lv.bias.defined());
  REQUIRE(lv.bias.numel() >= ls.s);
  auto* sums = lv.bias.data_as<float>();
  std::copy(ld.ref_logps.begin(), ld.ref_logps.end(), sums);
  lin.reference_logps = TensorView::of(sums, {ls.s});
  AlignedBuffer lws(loss.workspace_bytes(lin, lv));
  const std::string aliased =
      error_message([&] { loss.forward_backward(ctx, lin, lv, lws.workspace()); });
  CHECK_MESSAGE(aliased.find("shares memory with reference_logps") != std::string::npos, aliased);
}

TEST_CASE("bad input: non-finite precomputed reference sums, smoothing where a type has none") {
  PrefSpec s = BadCall::spec();
  s.ref = RefMode::kLogps;
  BadCall b(s);
  b.d.ref_logps[1] = std::numeric_limits<float>::quiet_NaN();
  b.expect(DpoOptions{}, "reference_logps");
  BadCall plain;
  for (DpoLoss t : {DpoLoss::kHinge, DpoLoss::kIpo, DpoLoss::kSppoHard}) {
    CAPTURE(dpo_loss_name(t));
    DpoOptions o;
    o.loss_type = t;
    o.label_smoothing = 0.1f;
    plain.expect(o, "label_smoothing");
  }
}

// ---- the extension point inside the suite: a per-sequence objective and a failing one ----------

// Unit::kSequence: each sequence's loss is -weight(label) * avg logp, reward = avg logp, an extra
// metric with the label, and an NLL term over the label-1 sequences.
class WeightedAverageNll final : public SequenceObjective {
 public:
  std::string_view name() const override { return "WeightedAverageNll"; }
  Unit unit() const override { return Unit::kSequence; }
  UnitResult evaluate(std::span<const SequenceStats> seqs, const BatchConstants&,
                      std::span<double> extras) const override {
    const SequenceStats& q = seqs[0];
    const double w = q.label == 1 ? 2.0 : 0.5, n = static_cast<double>(q.tokens);
    UnitResult u;
    u.loss = -w * q.logp / n;
    u.dlogp = {-w / n, 0.0};
    u.reward = {q.logp / n, 0.0};
    extras[0] = q.label;
    return u;
  }
  double nll_weight() const override { return 0.25; }
  std::vector<std::string> extra_metrics() const override { return {"desirable_fraction"}; }
};

// Sigmoid DPO without reference, except a NaN loss for the pair whose chosen log-prob is
// `poison` (as a log1p(-exp(0)) would give on real data).
// How BrokenObjective fails on its pair: a NaN loss, a std::exception, or another exception.
enum class Breaks { kNaN, kStd, kOther };

// On the pair whose chosen log-prob is `poison`: fails as `breaks` says.
class BrokenObjective final : public SequenceObjective {
 public:
  BrokenObjective(double poison, Breaks breaks, bool antisymmetric = false)
      : poison_(poison), breaks_(breaks), antisymmetric_(antisymmetric) {}
  std::string_view name() const override { return "BrokenObjective"; }
  Unit unit() const override { return Unit::kPair; }
  bool pair_antisymmetric() const override { return antisymmetric_; }  // (it is, as DPO)
  UnitResult evaluate(std::span<const SequenceStats> seqs, const BatchConstants&,
                      std::span<double>) const override {
    const double d = 0.1 * (seqs[0].logp - seqs[1].logp);
    const bool poisoned = std::abs(seqs[0].logp - poison_) < 1e-3;
    if (poisoned && breaks_ == Breaks::kStd) throw std::invalid_argument("a poisoned pair");
    if (poisoned && breaks_ == Breaks::kOther) throw 42;
    UnitResult u;
    u.loss = poisoned ? std::numeric_limits<double>::quiet_NaN() : -reference::log_sigmoid(d);
    u.dlogp = {-0.1 * reference::sigmoid(-d), 0.1 * reference::sigmoid(-d)};
    return u;
  }

 private:
  double poison_;
  Breaks breaks_;
  bool antisymmetric_;
};

TEST_CASE("extension point: a user objective on single sequences with extras and an NLL term") {
  PrefSpec s = kto_spec();
  s.bias = true;
  const PrefData d(s);
  const auto stats = reference::sequence_stats(d.problem().policy, d.targets64, s.s, s.t, s.h, s.v,
                                               s.ignore_index);
  double loss = 0, nll = 0, desirable = 0;
  std::int64_t nll_tokens = 0;
  std::vector<double> rewards;
  for (std::int64_t i = 0; i < s.s; ++i) {
    const auto I = static_cast<std::size_t>(i);
    const double n = static_cast<double>(stats.tokens[I]);
    const bool good = d.labels[I] == 1;
    loss += -(good ? 2.0 : 0.5) * stats.logps[I] / n / static_cast<double>(s.s);
    rewards.push_back(stats.logps[I] / n);
    desirable += good ? 1.0 / static_cast<double>(s.s) : 0.0;
    if (good) {
      nll -= stats.logps[I];
      nll_tokens += stats.tokens[I];
    }
  }
  nll /= static_cast<double>(nll_tokens);
  for (Regime r : kRegimes) {
    SequenceOptions o;
    o.regime = r;
    const SequenceLoss user(std::make_shared<WeightedAverageNll>(), o);
    const PrefRun run = run_library(d, user, {});
    CHECK(run.plan.regime == r);
    check_scalar("loss", run.result.loss, loss + 0.25 * nll, 1e-5);
    check_scalar("desirable_fraction", run.result.metric("desirable_fraction"), desirable, 1e-12);
    check_scalar("nll_loss", run.result.metric("nll_loss"), nll, 1e-5);
    check_close("rewards", run.result.rewards, rewards, 1e-5);
    // The gradient is that of KTO-free per-sequence weights: compare with finite differences
    // of the user loss in a few hidden entries (f32, step 1e-2).
    const std::vector<double> gh = run.grads.hidden();
    for (std::size_t i : {std::size_t{3}, std::size_t{100}, std::size_t{555}}) {
      PrefData e = d;
      e.hidden[i] += 1e-2f;
      const double up = run_library(e, user, PrefGradRequest::none()).result.loss;
      e.hidden[i] -= 2e-2f;
      const double down = run_library(e, user, PrefGradRequest::none()).result.loss;
      const double fd = (up - down) / 2e-2;
      CHECK_MESSAGE(std::abs(fd - gh[i]) <= kFdAbs + kFdRel * std::abs(gh[i]),
                    "grad_hidden[" << i << "] " << gh[i] << " vs central difference " << fd);
    }
  }
}

TEST_CASE("extension point: an objective returning NaN or throwing raises Error naming it") {
  // The NaN or the throw comes from the last pair. The recompute regime evaluates every pair
  // before pass 2 and writes nothing; with one pair per resident group the earlier groups'
  // gradients are already written, and the message must say the buffers are unspecified.
  PrefSpec s = big_spec();
  s.ref = RefMode::kNone;
  const PrefData d(s);
  const std::int64_t pairs = d.spec.s / 2;
  const double poison =
      oracle(d, PrefConfig::from(DpoOptions{}), false).logps[static_cast<std::size_t>(pairs - 1)];
  for (Regime r : kRegimes) {
    for (bool accumulate : {false, true}) {
      for (Breaks breaks : {Breaks::kNaN, Breaks::kStd, Breaks::kOther}) {
        SequenceOptions o;
        o.regime = r;
        const PrefGradRequest req;
        DpoOptions as_dpo;
        as_dpo.engine.regime = r;
        o.memory_budget_bytes = min_budget(d, as_dpo, r, req);
        const SequenceLoss broken(std::make_shared<BrokenObjective>(poison, breaks), o);
        PrefGradBuffers g(d, req, 3.25f), pristine(d, req, 3.25f);
        AlignedBuffer ws(broken.workspace_bytes(d.inputs(), g.views()));
        CpuContext ctx;
        CAPTURE(regime_name(r));
        CAPTURE(accumulate);
        CAPTURE(static_cast<int>(breaks));
        INFO(broken.plan(d.inputs(), g.views()).str());
        const std::string what = error_message(
            [&] { broken.forward_backward(ctx, d.inputs(), g.views(accumulate), ws.workspace()); });
        CHECK_MESSAGE(what.find("BrokenObjective") != std::string::npos, what);
        const std::string threw = "the objective threw for unit " + std::to_string(pairs - 1);
        if (breaks == Breaks::kStd)
          CHECK_MESSAGE(what.find(threw + ": a poisoned pair") != std::string::npos, what);
        if (breaks == Breaks::kOther)
          CHECK_MESSAGE(what.find(threw + " (not a std::exception)") != std::string::npos, what);
        const Plan p = broken.plan(d.inputs(), g.views());
        if (p.regime == Regime::kResident && p.num_groups > 1)
          CHECK_MESSAGE(what.find("unspecified") != std::string::npos, what);
        else
          CHECK_MESSAGE(g.bitwise_equal(pristine), "a failed call wrote into the gradients");
      }
    }
  }
  CHECK_THROWS_AS(SequenceLoss(nullptr), Error);
}

// Sets d's targets: row r (of S x T) valid where `valid(r)`, with a fixed id, else ignored.
template <typename Valid>
void set_targets(PrefData& d, Valid valid) {
  for (std::size_t i = 0; i < d.targets64.size(); ++i) {
    const auto row = static_cast<std::int64_t>(i);
    d.targets64[i] = valid(row) ? (row * 7919) % d.spec.v : d.spec.ignore_index;
    d.targets32[i] = static_cast<std::int32_t>(d.targets64[i]);
  }
}

TEST_CASE("resident groups fill their logits with the units' computed rows") {
  // Every sequence: 192 prompt rows, then 64 valid ones. The smallest resident budget holds one
  // unit of T = 256 rows per group (4 groups by the shapes). The CPU gathers a group's X rows
  // for one GEMM in 256 rows of staging, and 2 units' computed rows (2 x 64 each) fill it: the
  // call runs 2 groups. So an objective failing on the second pair fails before any gradient is
  // written; with a group per unit the first would have been. The same grouping gives the
  // oracle's loss and gradients.
  PrefSpec s = big_spec();
  s.t = 256;
  s.ref = RefMode::kNone;
  PrefData d(s);
  set_targets(d, [&](std::int64_t row) { return row % s.t >= 192; });
  const std::int64_t pairs = s.s / 2;
  const PrefGradRequest req;
  DpoOptions dpo;
  dpo.engine.regime = Regime::kResident;
  dpo.engine.memory_budget_bytes = min_budget(d, dpo, Regime::kResident, req);
  PrefGradBuffers plan_buffers(d, req);
  const Plan p = make_loss(dpo).plan(d.inputs(), plan_buffers.views());
  REQUIRE(p.group_units == 1);
  REQUIRE(p.num_groups == pairs);
  check_against_oracle(run_library(d, make_loss(dpo), req), oracle(d, PrefConfig::from(dpo)),
                       PrefTol::of(DType::kF32, DType::kF32), true);

  // Pair 1 fails in the first group, pair 3 in the second (the groups stay within the gather).
  const std::vector<double> logps = oracle(d, PrefConfig::from(DpoOptions{}), false).logps;
  for (std::int64_t unit : {std::int64_t{1}, pairs - 1}) {
    CAPTURE(unit);
    const SequenceLoss broken(
        std::make_shared<BrokenObjective>(logps[static_cast<std::size_t>(unit)], Breaks::kStd),
        dpo.engine);
    PrefGradBuffers g(d, req, 3.25f), pristine(d, req, 3.25f);
    AlignedBuffer ws(broken.workspace_bytes(d.inputs(), g.views()));
    CpuContext ctx;
    const std::string what =
        error_message([&] { broken.forward_backward(ctx, d.inputs(), g.views(), ws.workspace()); });
    CHECK_MESSAGE(
        what.find("the objective threw for unit " + std::to_string(unit)) != std::string::npos,
        what);
    const bool first_group = unit == 1;
    CHECK_MESSAGE((what.find("unspecified") == std::string::npos) == first_group, what);
    CHECK(g.bitwise_equal(pristine) == first_group);
  }
}

TEST_CASE("a grown resident group keeps each range within a chunk's rows (bf16 on the CPU)") {
  // Chosen sequences: 32 prompt rows, then 96 valid; rejected: 32 prompt rows, 40 valid, then
  // padding. Gaps under 64 rows merge, so growing a group of 2 pairs would make the chosen side
  // one range longer than a chunk, and the CPU stages an ungathered range's bf16 X rows in a
  // chunk's rows: the group stops growing first. With dW alone in an fp32 accumulator nothing
  // follows that staging in the workspace (the fixture's guard region sees any write past it).
  PrefSpec s = big_spec();
  s.t = 128;
  s.dtype = DType::kBF16;
  s.bias = false;
  s.ref = RefMode::kNone;
  PrefData d(s);
  set_targets(d, [&](std::int64_t row) {
    const std::int64_t pos = row % s.t;
    return pos >= 32 && (row / s.t < s.s / 2 || pos < 72);  // chosen, or rejected's 40 rows
  });
  for (bool dw_only : {false, true}) {
    CAPTURE(dw_only);
    PrefGradRequest req;
    req.dtype = DType::kBF16;
    req.hidden = !dw_only;
    DpoOptions dpo;
    dpo.engine.regime = Regime::kResident;
    dpo.engine.fp32_weight_grad_accumulator = dw_only;
    PrefGradBuffers buffers(d, req);
    const auto units_per_group = [&](std::size_t budget) {
      dpo.engine.memory_budget_bytes = budget;
      try {
        return make_loss(dpo).plan(d.inputs(), buffers.views()).group_units;
      } catch (const Error&) {
        return std::int64_t{0};
      }
    };
    std::size_t lo = 1, hi = std::size_t{1} << 30;  // the smallest budget of 2 pairs a group
    while (lo < hi) {
      const std::size_t mid = lo + (hi - lo) / 2;
      if (units_per_group(mid) >= 2)
        hi = mid;
      else
        lo = mid + 1;
    }
    dpo.engine.memory_budget_bytes = lo;
    REQUIRE(make_loss(dpo).plan(d.inputs(), buffers.views()).group_units == 2);
    check_against_oracle(run_library(d, make_loss(dpo), req), oracle(d, PrefConfig::from(dpo)),
                         PrefTol::of(DType::kBF16, DType::kBF16), true);
  }
}

TEST_CASE(
    "extension point: an objective failing on the deferred pair says the buffers are "
    "unspecified") {
  // The deferred regime writes the first pair's dH and (all but its last chunk's) dW before
  // the objective sees that pair: a failure there cannot leave the buffers as they were.
  PrefSpec s = big_spec();
  s.ref = RefMode::kNone;
  s.bias = false;
  const PrefData d(s);
  const double poison = oracle(d, PrefConfig::from(DpoOptions{}), false).logps[0];
  PrefGradRequest req;
  req.bias = false;
  for (Breaks breaks : {Breaks::kNaN, Breaks::kStd, Breaks::kOther}) {
    SequenceOptions o;
    o.regime = Regime::kDeferred;
    DpoOptions as_dpo;
    as_dpo.engine.regime = o.regime;
    o.memory_budget_bytes = min_budget(d, as_dpo, o.regime, req);
    const SequenceLoss broken(std::make_shared<BrokenObjective>(poison, breaks, true), o);
    PrefGradBuffers g(d, req, 3.25f), pristine(d, req, 3.25f);
    const Plan p = broken.plan(d.inputs(), g.views());
    REQUIRE(p.regime == Regime::kDeferred);
    REQUIRE(p.num_chunks > 2);  // (the first pair spans several chunks)
    AlignedBuffer ws(broken.workspace_bytes(d.inputs(), g.views()));
    CpuContext ctx;
    CAPTURE(static_cast<int>(breaks));
    const std::string what =
        error_message([&] { broken.forward_backward(ctx, d.inputs(), g.views(), ws.workspace()); });
    CHECK_MESSAGE(what.find("for unit 0") != std::string::npos, what);
    CHECK_MESSAGE(what.find("gradient buffers hold unspecified values") != std::string::npos, what);
    CHECK_FALSE(g.bitwise_equal(pristine));  // (why the message must say so)
  }
}

// Declares pair_antisymmetric() but weighs the rejected sequence twice.
class LopsidedObjective final : public SequenceObjective {
 public:
  std::string_view name() const override { return "LopsidedObjective"; }
  Unit unit() const override { return Unit::kPair; }
  bool pair_antisymmetric() const override { return true; }
  UnitResult evaluate(std::span<const SequenceStats> seqs, const BatchConstants&,
                      std::span<double>) const override {
    const double d = 0.1 * (seqs[0].logp - 2.0 * seqs[1].logp);
    UnitResult u;
    u.loss = -reference::log_sigmoid(d);
    u.dlogp = {-0.1 * reference::sigmoid(-d), 0.2 * reference::sigmoid(-d)};
    return u;
  }
};

TEST_CASE("bad input: the deferred regime where it does not apply") {
  PrefSpec s = big_spec();
  s.bias = false;
  s.ref = RefMode::kNone;
  const PrefData d(s);
  s.labels = true;
  s.s = 7;
  const PrefData labelled(s);
  PrefGradBuffers g(d, {}), kg(labelled, {});
  auto refused = [](const SequenceLoss& loss, const PrefData& data, const PreferenceGrads& gr) {
    CHECK_THROWS_WITH_AS(loss.plan(data.inputs(), gr), doctest::Contains("regime deferred"), Error);
  };
  auto deferred = [](auto o) {
    o.engine.regime = Regime::kDeferred;
    return o;
  };
  DpoOptions with_nll;
  with_nll.nll = true;
  refused(Dpo(deferred(with_nll)), d, g.views());
  refused(Dpo(deferred(dpo(DpoLoss::kNcaPair))), d, g.views());
  refused(Orpo(deferred(OrpoOptions{})), d, g.views());
  refused(Cpo(deferred(CpoOptions{})), d, g.views());  // alpha 1: an NLL term
  refused(Kto(deferred(KtoOptions{})), labelled, kg.views());
  refused(Dpo(deferred(DpoOptions{})), d, g.views(true));  // dW accumulated
  PrefSpec b = big_spec();
  b.ref = RefMode::kNone;
  const PrefData biased(b);
  PrefGradBuffers bg(biased, {});
  refused(Dpo(deferred(DpoOptions{})), biased, bg.views());  // a bias gradient
  PrefGradRequest no_bias;
  no_bias.bias = false;
  PrefGradBuffers nb(biased, no_bias);
  CHECK(Dpo(deferred(DpoOptions{})).plan(biased.inputs(), nb.views()).regime == Regime::kDeferred);
  CpoOptions cpo;
  cpo.alpha = 0.0f;
  CHECK(Cpo(deferred(cpo)).plan(d.inputs(), g.views()).regime == Regime::kDeferred);

  // A user objective whose declaration is wrong is caught on the deferred pair, by name.
  SequenceOptions o;
  o.regime = Regime::kDeferred;
  const SequenceLoss lopsided(std::make_shared<LopsidedObjective>(), o);
  AlignedBuffer ws(lopsided.workspace_bytes(d.inputs(), g.views()));
  CpuContext ctx;
  const std::string what =
      error_message([&] { lopsided.forward_backward(ctx, d.inputs(), g.views(), ws.workspace()); });
  CHECK_MESSAGE(what.find("LopsidedObjective") != std::string::npos, what);
  CHECK_MESSAGE(what.find("pair_antisymmetric") != std::string::npos, what);
}

TEST_CASE("bad input: a too-small workspace, and a failed call in the middle writes nothing") {
  PrefSpec s = big_spec();
  const PrefData good(s);
  for (Regime r : kRegimes) {
    DpoOptions o;
    o.engine.regime = r;
    const Dpo loss(o);
    PrefGradBuffers g(good, {}, 3.25f), pristine(good, {}, 3.25f);
    const std::size_t need = loss.workspace_bytes(good.inputs(), g.views());
    AlignedBuffer small(need - 256);
    CpuContext ctx;
    CHECK_THROWS_AS(loss.forward_backward(ctx, good.inputs(), g.views(), small.workspace()), Error);
    CHECK(g.bitwise_equal(pristine));
    // An out-of-range target in the last sequence: found before anything is written.
    PrefData bad = good;
    bad.set_target(bad.rows() - 1, s.v);
    AlignedBuffer ws(need);
    CHECK_THROWS_WITH_AS(loss.forward_backward(ctx, bad.inputs(), g.views(true), ws.workspace()),
                         doctest::Contains("targets"), Error);
    CHECK(g.bitwise_equal(pristine));
  }
}

TEST_CASE("dpo_loss_name and parse_dpo_loss round-trip TRL's names") {
  const char* names[] = {"sigmoid",  "hinge",     "ipo",      "robust",   "exo_pair", "nca_pair",
                         "bco_pair", "sppo_hard", "apo_zero", "apo_down", "discopop"};
  for (std::size_t i = 0; i < std::size(kDpoLosses); ++i) {
    CHECK(dpo_loss_name(kDpoLosses[i]) == names[i]);
    CHECK(parse_dpo_loss(names[i]) == kDpoLosses[i]);
  }
  CHECK_THROWS_WITH_AS(parse_dpo_loss("sigmoidd"), doctest::Contains("exo_pair"), Error);
}

}  // namespace
}  // namespace chunkloss::test
