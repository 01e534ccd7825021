// The preference objectives of ../shared/LOSSES.md: each is the loss of one unit and its
// derivatives with respect to the per-sequence log-prob sums, in double precision.
#include "chunkloss/losses/preference.h"

#include <array>
#include <cmath>
#include <string>

#include "chunkloss/core/error.h"
#include "loss_type_names.h"

namespace chunkloss {

namespace {

constexpr std::array<std::pair<DpoLoss, std::string_view>, 11> kDpoNames = {{
    {DpoLoss::kSigmoid, "sigmoid"},
    {DpoLoss::kHinge, "hinge"},
    {DpoLoss::kIpo, "ipo"},
    {DpoLoss::kRobust, "robust"},
    {DpoLoss::kExoPair, "exo_pair"},
    {DpoLoss::kNcaPair, "nca_pair"},
    {DpoLoss::kBcoPair, "bco_pair"},
    {DpoLoss::kSppoHard, "sppo_hard"},
    {DpoLoss::kApoZero, "apo_zero"},
    {DpoLoss::kApoDown, "apo_down"},
    {DpoLoss::kDiscoPop, "discopop"},
}};

double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}
// log sigmoid(x), stable for large |x|.
double logsig(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
// d/dx sigmoid(x).
double dsigmoid(double x) {
  const double s = sigmoid(x);
  return s * (1.0 - s);
}

// -(1-eps) logsig(z) - eps logsig(-z) and its derivative in z (DPO sigmoid, CPO, SimPO).
std::pair<double, double> smoothed_logistic(double z, double eps) {
  return {-(1.0 - eps) * logsig(z) - eps * logsig(-z),
          -(1.0 - eps) * sigmoid(-z) + eps * sigmoid(z)};
}

void check_beta(const char* who, float beta) {
  CHUNKLOSS_CHECK(std::isfinite(beta) && beta > 0.0f, who, ": beta must be finite and > 0, got ",
                  beta);
}

void check_unit_interval(const char* who, const char* name, float x, bool open_hi) {
  CHUNKLOSS_CHECK(std::isfinite(x) && x >= 0.0f && (open_hi ? x < 0.5f : x <= 0.5f), who, ": ",
                  name, " must be in [0, 0.5", open_hi ? ")" : "]", ", got ", x);
}

// Per-sequence value the objective works on: the sum, or the length average.
struct Values {
  double c, r, c0, r0;  // policy chosen/rejected, reference chosen/rejected
  double kc, kr;        // d value / d sum
};
Values pair_values(std::span<const SequenceStats> s, bool average) {
  const double nc = average ? static_cast<double>(s[0].tokens) : 1.0;
  const double nr = average ? static_cast<double>(s[1].tokens) : 1.0;
  return {s[0].logp / nc,     s[1].logp / nr, s[0].ref_logp / nc,
          s[1].ref_logp / nr, 1.0 / nc,       1.0 / nr};
}

class DpoObjective final : public SequenceObjective {
 public:
  explicit DpoObjective(const DpoOptions& o) : o_(o) {
    constexpr const char* kWho = "Dpo";
    CHUNKLOSS_CHECK(dpo_loss_name(o.loss_type) != "?", kWho,
                    ": loss_type is not a DpoLoss, got the value ", static_cast<int>(o.loss_type));
    check_beta(kWho, o.beta);
    const float eps = o.label_smoothing;
    switch (o.loss_type) {
      case DpoLoss::kSigmoid:
        check_unit_interval(kWho, "label_smoothing", eps, false);
        break;
      case DpoLoss::kRobust:
        check_unit_interval(kWho, "label_smoothing", eps, true);
        break;
      case DpoLoss::kExoPair:
        CHUNKLOSS_CHECK(std::isfinite(eps) && eps > 0.0f && eps < 1.0f, kWho,
                        ": exo_pair needs label_smoothing in (0, 1), got ", eps,
                        " (TRL takes 1e-3 where it is 0)");
        break;
      default:
        CHUNKLOSS_CHECK(eps == 0.0f, kWho, ": label_smoothing ", eps,
                        " is only used by the sigmoid, robust and exo_pair losses, not ",
                        dpo_loss_name(o.loss_type));
    }
    CHUNKLOSS_CHECK(std::isfinite(o.discopop_tau) && o.discopop_tau > 0.0f, kWho,
                    ": discopop_tau must be finite and > 0, got ", o.discopop_tau);
    CHUNKLOSS_CHECK(std::isfinite(o.nll_alpha) && o.nll_alpha >= 0.0f, kWho,
                    ": nll_alpha must be finite and >= 0, got ", o.nll_alpha);
  }
  std::string_view name() const override { return "Dpo"; }
  Unit unit() const override { return Unit::kPair; }
  double nll_weight() const override { return o_.nll ? o_.nll_alpha : 0.0; }
  bool averages_log_probs() const override {
    return o_.average_log_prob || o_.loss_type == DpoLoss::kIpo;
  }
  bool uses_reference() const override { return true; }
  // The losses written through the margin d (and ipo's, on the averages).
  bool pair_antisymmetric() const override {
    switch (o_.loss_type) {
      case DpoLoss::kSigmoid:
      case DpoLoss::kHinge:
      case DpoLoss::kIpo:
      case DpoLoss::kRobust:
      case DpoLoss::kExoPair:
      case DpoLoss::kDiscoPop:
        return true;
      default:
        return false;
    }
  }

  UnitResult evaluate(std::span<const SequenceStats> s, const BatchConstants&,
                      std::span<double>) const override {
    const Values x = pair_values(s, averages_log_probs());
    const double beta = o_.beta, eps = o_.label_smoothing;
    const double dc = x.c - x.c0, dr = x.r - x.r0, d = beta * (dc - dr);
    double loss = 0, g_dc = 0, g_dr = 0;  // d loss / d dc, d dr
    auto through_d = [&](double l, double dl_dd) {
      loss = l;
      g_dc = beta * dl_dd;
      g_dr = -beta * dl_dd;
    };
    switch (o_.loss_type) {
      case DpoLoss::kSigmoid: {
        const auto [l, g] = smoothed_logistic(d, eps);
        through_d(l, g);
        break;
      }
      case DpoLoss::kHinge:
        through_d(std::max(0.0, 1.0 - d), d < 1.0 ? -1.0 : 0.0);
        break;
      case DpoLoss::kIpo: {
        const double m = (dc - dr) - 1.0 / (2.0 * beta);
        loss = m * m;
        g_dc = 2.0 * m;
        g_dr = -2.0 * m;
        break;
      }
      case DpoLoss::kRobust:
        through_d((-(1.0 - eps) * logsig(d) + eps * logsig(-d)) / (1.0 - 2.0 * eps),
                  (-(1.0 - eps) * sigmoid(-d) - eps * sigmoid(d)) / (1.0 - 2.0 * eps));
        break;
      case DpoLoss::kExoPair: {
        const double sd = sigmoid(d);
        const double le = std::log(eps), l1e = std::log1p(-eps);
        through_d(sd * (logsig(d) - l1e) + sigmoid(-d) * (logsig(-d) - le),
                  sd * (1.0 - sd) * (d + le - l1e));
        break;
      }
      case DpoLoss::kNcaPair:
        loss = -logsig(beta * dc) - 0.5 * logsig(-beta * dc) - 0.5 * logsig(-beta * dr);
        g_dc = -beta * sigmoid(-beta * dc) + 0.5 * beta * sigmoid(beta * dc);
        g_dr = 0.5 * beta * sigmoid(beta * dr);
        break;
      case DpoLoss::kBcoPair:
        loss = -logsig(beta * dc) - logsig(-beta * dr);
        g_dc = -beta * sigmoid(-beta * dc);
        g_dr = beta * sigmoid(beta * dr);
        break;
      case DpoLoss::kSppoHard: {
        const double a = dc - 1.0 / (2.0 * beta), b = dr + 1.0 / (2.0 * beta);
        loss = a * a + b * b;
        g_dc = 2.0 * a;
        g_dr = 2.0 * b;
        break;
      }
      case DpoLoss::kApoZero:
        loss = (1.0 - sigmoid(beta * dc)) + sigmoid(beta * dr);
        g_dc = -beta * dsigmoid(beta * dc);
        g_dr = beta * dsigmoid(beta * dr);
        break;
      case DpoLoss::kApoDown:
        loss = sigmoid(beta * dc) + (1.0 - sigmoid(d));
        g_dc = beta * dsigmoid(beta * dc) - beta * dsigmoid(d);
        g_dr = beta * dsigmoid(d);
        break;
      case DpoLoss::kDiscoPop: {
        const double tau = o_.discopop_tau, m = sigmoid(d / tau), dm = dsigmoid(d / tau) / tau;
        // exp(-d) m and exp(-d) dm in the log domain: at d < -709, exp(-d) overflows while
        // m underflows, and the products tend to 0 (for tau < 1).
        const double em = std::exp(-d + logsig(d / tau));
        const double edm = std::exp(-d + logsig(d / tau) + logsig(-d / tau)) / tau;
        through_d(-logsig(d) * (1.0 - m) + em,
                  -sigmoid(-d) * (1.0 - m) + logsig(d) * dm - em + edm);
        break;
      }
    }
    UnitResult r;
    r.loss = loss;
    r.dlogp = {g_dc * x.kc, g_dr * x.kr};
    r.reward = {beta * dc, beta * dr};
    return r;
  }

 private:
  DpoOptions o_;
};

// log(1 - exp(x)) for x < 0 and its derivative; x is clamped below -1e-6 so that a sequence
// the model is certain of keeps a finite log-odds.
std::pair<double, double> log1m_exp(double x) {
  x = std::min(x, -1e-6);
  return {std::log(-std::expm1(x)), -1.0 / std::expm1(-x)};
}

class OrpoObjective final : public SequenceObjective {
 public:
  explicit OrpoObjective(const OrpoOptions& o) : beta_(o.beta) { check_beta("Orpo", o.beta); }
  std::string_view name() const override { return "Orpo"; }
  Unit unit() const override { return Unit::kPair; }
  double nll_weight() const override { return 1.0; }
  bool averages_log_probs() const override { return true; }
  std::vector<std::string> extra_metrics() const override {
    return {"log_odds_ratio", "log_odds_chosen"};
  }
  UnitResult evaluate(std::span<const SequenceStats> s, const BatchConstants&,
                      std::span<double> extras) const override {
    const Values x = pair_values(s, true);
    const auto [fc, dfc] = log1m_exp(x.c);
    const auto [fr, dfr] = log1m_exp(x.r);
    const double lo = (x.c - x.r) - (fc - fr);
    const double g = -beta_ * sigmoid(-lo);  // d loss / d lo
    UnitResult r;
    r.loss = -beta_ * logsig(lo);
    r.dlogp = {g * (1.0 - dfc) * x.kc, g * (dfr - 1.0) * x.kr};
    r.reward = {beta_ * x.c, beta_ * x.r};
    extras[0] = logsig(lo);
    extras[1] = lo;
    return r;
  }

 private:
  double beta_;
};

// Reference-free logistic losses on z = beta (c - r) - margin: CPO (sums) and SimPO (averages).
class MarginLogisticObjective final : public SequenceObjective {
 public:
  MarginLogisticObjective(const char* name, double beta, double margin, double eps, double nll,
                          bool average)
      : name_(name), beta_(beta), margin_(margin), eps_(eps), nll_(nll), average_(average) {}
  std::string_view name() const override { return name_; }
  Unit unit() const override { return Unit::kPair; }
  double nll_weight() const override { return nll_; }
  bool averages_log_probs() const override { return average_; }
  bool pair_antisymmetric() const override { return true; }
  UnitResult evaluate(std::span<const SequenceStats> s, const BatchConstants&,
                      std::span<double>) const override {
    const Values x = pair_values(s, average_);
    const auto [loss, g] = smoothed_logistic(beta_ * (x.c - x.r) - margin_, eps_);
    UnitResult r;
    r.loss = loss;
    r.dlogp = {beta_ * g * x.kc, -beta_ * g * x.kr};
    r.reward = {beta_ * x.c, beta_ * x.r};
    return r;
  }

 private:
  const char* name_;
  double beta_, margin_, eps_, nll_;
  bool average_;
};

class KtoObjective final : public SequenceObjective {
 public:
  explicit KtoObjective(const KtoOptions& o) : o_(o) {
    check_beta("Kto", o.beta);
    CHUNKLOSS_CHECK(std::isfinite(o.desirable_weight) && o.desirable_weight >= 0.0f &&
                        std::isfinite(o.undesirable_weight) && o.undesirable_weight >= 0.0f,
                    "Kto: desirable_weight and undesirable_weight must be finite and >= 0, got ",
                    o.desirable_weight, " and ", o.undesirable_weight);
  }
  std::string_view name() const override { return "Kto"; }
  Unit unit() const override { return Unit::kSequence; }
  bool uses_reference() const override { return true; }
  bool uses_kl() const override { return true; }
  UnitResult evaluate(std::span<const SequenceStats> s, const BatchConstants& batch,
                      std::span<double>) const override {
    const double beta = o_.beta, rho = s[0].logp - s[0].ref_logp;
    UnitResult r;
    if (s[0].label == 1) {
      const double z = beta * (rho - batch.kl);
      r.loss = o_.desirable_weight * (1.0 - sigmoid(z));
      r.dlogp[0] = -o_.desirable_weight * beta * dsigmoid(z);
    } else {
      const double z = beta * (batch.kl - rho);
      r.loss = o_.undesirable_weight * (1.0 - sigmoid(z));
      r.dlogp[0] = o_.undesirable_weight * beta * dsigmoid(z);
    }
    r.reward[0] = beta * rho;
    return r;
  }

 private:
  KtoOptions o_;
};

}  // namespace

std::string_view dpo_loss_name(DpoLoss t) { return detail::loss_type_name<DpoLoss>(kDpoNames, t); }

DpoLoss parse_dpo_loss(std::string_view name) {
  return detail::parse_loss_type<DpoLoss>(kDpoNames, name, "Dpo");
}

Dpo::Dpo(const DpoOptions& o) : SequenceLoss(std::make_shared<DpoObjective>(o), o.engine) {}

Orpo::Orpo(const OrpoOptions& o) : SequenceLoss(std::make_shared<OrpoObjective>(o), o.engine) {}

namespace {
std::shared_ptr<const SequenceObjective> simpo_objective(const SimpoOptions& o) {
  check_beta("Simpo", o.beta);
  check_unit_interval("Simpo", "label_smoothing", o.label_smoothing, false);
  CHUNKLOSS_CHECK(std::isfinite(o.gamma) && o.gamma >= 0.0f,
                  "Simpo: gamma must be finite and "
                  ">= 0, got ",
                  o.gamma);
  CHUNKLOSS_CHECK(std::isfinite(o.nll_alpha) && o.nll_alpha >= 0.0f,
                  "Simpo: nll_alpha must be finite and >= 0, got ", o.nll_alpha);
  return std::make_shared<MarginLogisticObjective>("Simpo", o.beta, o.gamma, o.label_smoothing,
                                                   o.nll_alpha, true);
}
std::shared_ptr<const SequenceObjective> cpo_objective(const CpoOptions& o) {
  check_beta("Cpo", o.beta);
  check_unit_interval("Cpo", "label_smoothing", o.label_smoothing, false);
  CHUNKLOSS_CHECK(std::isfinite(o.alpha) && o.alpha >= 0.0f,
                  "Cpo: alpha must be finite and >= 0, got ", o.alpha);
  return std::make_shared<MarginLogisticObjective>("Cpo", o.beta, 0.0, o.label_smoothing, o.alpha,
                                                   false);
}
}  // namespace

Simpo::Simpo(const SimpoOptions& o) : SequenceLoss(simpo_objective(o), o.engine) {}
Cpo::Cpo(const CpoOptions& o) : SequenceLoss(cpo_objective(o), o.engine) {}
Kto::Kto(const KtoOptions& o) : SequenceLoss(std::make_shared<KtoObjective>(o), o.engine) {}

}  // namespace chunkloss
