// The float64 preference-loss oracle. Each loss is transcribed from ../shared/LOSSES.md on the
// per-sequence sums; the gradient's sequence factor dL/dS_s is a fourth-order central finite
// difference of that transcription (step 1e-4 in log-prob units, truncation error ~(1e-4 /
// feature scale)^4, far below the tolerances), so no analytic derivative is shared with the
// library. With L = F(S) + alpha NLL and d logp_t / d z_t = onehot_t - p_t:
//   dL/dz_t = dL/dS_s(t) * (onehot_t - p_t),  dH = dZ W, dW = dZ^T H, db = colsum(dZ).
#include "reference/preference_ref.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace chunkloss::reference {
namespace {

std::size_t sz(std::int64_t x) { return static_cast<std::size_t>(x); }

// Dense logits of a head, [N, V].
std::vector<double> logits_of(const PrefHead& head, std::int64_t n, std::int64_t h,
                              std::int64_t v) {
  if (head.hidden.size() != sz(n * h) || head.weight.size() != sz(v * h) ||
      (!head.bias.empty() && head.bias.size() != sz(v)))
    throw std::invalid_argument("reference::preference: inconsistent head sizes");
  std::vector<double> z(sz(n * v));
  for (std::int64_t t = 0; t < n; ++t)
    for (std::int64_t k = 0; k < v; ++k) {
      double acc = head.bias.empty() ? 0.0 : head.bias[sz(k)];
      for (std::int64_t i = 0; i < h; ++i)
        acc += head.hidden[sz(t * h + i)] * head.weight[sz(k * h + i)];
      z[sz(t * v + k)] = acc;
    }
  return z;
}

double row_lse(const double* z, std::int64_t v) {
  double m = z[0];
  for (std::int64_t k = 1; k < v; ++k) m = std::max(m, z[k]);
  double s = 0;
  for (std::int64_t k = 0; k < v; ++k) s += std::exp(z[k] - m);
  return m + std::log(s);
}

// Everything the loss needs besides the policy sums.
struct Fixed {
  std::int64_t s = 0;
  std::vector<double> ref;
  std::vector<std::int64_t> n;
  std::vector<int> labels;
  double z0 = 0;
};

struct Eval {
  double loss = 0, objective = 0, nll = 0;
  std::vector<double> unit_losses, rewards, policy_rewards;
  double extra_logsig_odds = 0, extra_log_odds = 0;  // ORPO, means over pairs
};

double pair_loss(const PrefConfig& c, double mc, double mr, double mc0, double mr0,
                 double* logsig_odds, double* log_odds) {
  const double b = c.beta, eps = c.eps;
  switch (c.kind) {
    case PrefKind::kDpo: {
      const double dc = mc - mc0, dr = mr - mr0, d = b * (dc - dr);
      switch (c.dpo_loss) {
        case DpoLoss::kSigmoid:
          return -(1 - eps) * log_sigmoid(d) - eps * log_sigmoid(-d);
        case DpoLoss::kHinge:
          return std::max(0.0, 1 - d);
        case DpoLoss::kIpo: {
          const double D = dc - dr, m = D - 1 / (2 * b);
          return m * m;
        }
        case DpoLoss::kRobust:
          return (-(1 - eps) * log_sigmoid(d) + eps * log_sigmoid(-d)) / (1 - 2 * eps);
        case DpoLoss::kExoPair:
          return sigmoid(d) * (log_sigmoid(d) - std::log(1 - eps)) +
                 sigmoid(-d) * (log_sigmoid(-d) - std::log(eps));
        case DpoLoss::kNcaPair:
          return -log_sigmoid(b * dc) - 0.5 * log_sigmoid(-b * dc) - 0.5 * log_sigmoid(-b * dr);
        case DpoLoss::kBcoPair:
          return -log_sigmoid(b * dc) - log_sigmoid(-b * dr);
        case DpoLoss::kSppoHard: {
          const double a = dc - 1 / (2 * b), r = dr + 1 / (2 * b);
          return a * a + r * r;
        }
        case DpoLoss::kApoZero:
          return (1 - sigmoid(b * dc)) + sigmoid(b * dr);
        case DpoLoss::kApoDown:
          return sigmoid(b * dc) + (1 - sigmoid(d));
        case DpoLoss::kDiscoPop: {
          // exp(-d) sigma(d / tau) in the log domain: each factor alone overflows or
          // underflows at d < -709.
          const double mod = sigmoid(d / c.tau);
          return -log_sigmoid(d) * (1 - mod) + std::exp(-d + log_sigmoid(d / c.tau));
        }
      }
      throw std::invalid_argument("reference::preference: unknown DPO loss type");
    }
    case PrefKind::kOrpo: {
      const double lo = (mc - mr) - (std::log1p(-std::exp(mc)) - std::log1p(-std::exp(mr)));
      *logsig_odds = log_sigmoid(lo);
      *log_odds = lo;
      return -b * log_sigmoid(lo);
    }
    case PrefKind::kSimpo: {
      const double z = b * (mc - mr) - c.gamma;
      return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z);
    }
    case PrefKind::kCpo: {
      const double z = b * (mc - mr);
      return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z);
    }
    case PrefKind::kKto:
      break;
  }
  throw std::invalid_argument("reference::preference: not a paired loss");
}

Eval evaluate(const PrefConfig& c, const Fixed& f, const std::vector<double>& logp) {
  Eval e;
  const std::int64_t s = f.s;
  const bool avg = c.averages();
  auto measure = [&](const std::vector<double>& x, std::int64_t i) {
    return avg ? x[sz(i)] / static_cast<double>(f.n[sz(i)]) : x[sz(i)];
  };
  e.rewards.assign(sz(s), 0.0);
  e.policy_rewards.assign(sz(s), 0.0);
  for (std::int64_t i = 0; i < s; ++i) {
    e.rewards[sz(i)] = c.beta * (measure(logp, i) - measure(f.ref, i));
    e.policy_rewards[sz(i)] = c.beta * measure(logp, i);
  }
  double sum = 0;
  if (c.paired()) {
    const std::int64_t pairs = s / 2;
    for (std::int64_t i = 0; i < pairs; ++i) {
      double ls = 0, lo = 0;
      const double l = pair_loss(c, measure(logp, i), measure(logp, i + pairs), measure(f.ref, i),
                                 measure(f.ref, i + pairs), &ls, &lo);
      e.unit_losses.push_back(l);
      sum += l;
      e.extra_logsig_odds += ls / static_cast<double>(pairs);
      e.extra_log_odds += lo / static_cast<double>(pairs);
    }
  } else {
    for (std::int64_t i = 0; i < s; ++i) {
      const double rho = logp[sz(i)] - f.ref[sz(i)];
      const double l = f.labels[sz(i)] == 1
                           ? c.desirable_weight * (1 - sigmoid(c.beta * (rho - f.z0)))
                           : c.undesirable_weight * (1 - sigmoid(c.beta * (f.z0 - rho)));
      e.unit_losses.push_back(l);
      sum += l;
    }
  }
  e.objective = sum / static_cast<double>(e.unit_losses.size());
  // NLL over the chosen (pairs: first half; unpaired: label 1) sequences' tokens.
  double nll_sum = 0;
  std::int64_t nll_tokens = 0;
  for (std::int64_t i = 0; i < s; ++i) {
    const bool chosen = c.paired() ? i < s / 2 : f.labels[sz(i)] == 1;
    if (!chosen) continue;
    nll_sum -= logp[sz(i)];
    nll_tokens += f.n[sz(i)];
  }
  e.nll = nll_tokens > 0 ? nll_sum / static_cast<double>(nll_tokens) : 0.0;
  e.loss = e.objective + c.nll_weight * e.nll;
  return e;
}

// Reference sums of a problem (head, precomputed, or zero).
std::vector<double> reference_sums(const PrefProblem& p, const PrefConfig& c) {
  if (p.reference.defined())
    return sequence_stats(p.reference, p.targets, p.s, p.t, p.h, p.v, c.ignore_index).logps;
  if (!p.ref_logps.empty()) return p.ref_logps;
  return std::vector<double>(sz(p.s), 0.0);
}

double kl_point(const PrefProblem& p, const PrefConfig& c) {
  if (p.kl) return std::max(0.0, *p.kl);
  if (!p.kl_batch) return 0.0;
  const PrefKlBatch& k = *p.kl_batch;
  const SeqStats pol = sequence_stats(k.policy, k.targets, k.s, k.t, p.h, p.v, c.ignore_index);
  std::vector<double> ref(sz(k.s), 0.0);
  if (k.reference.defined())
    ref = sequence_stats(k.reference, k.targets, k.s, k.t, p.h, p.v, c.ignore_index).logps;
  else if (!k.ref_logps.empty())
    ref = k.ref_logps;
  double mean = 0;
  for (std::int64_t i = 0; i < k.s; ++i)
    mean += (pol.logps[sz(i)] - ref[sz(i)]) / static_cast<double>(k.s);
  return std::max(0.0, mean);
}

Fixed fixed_part(const PrefProblem& p, const PrefConfig& c, const SeqStats& pol) {
  Fixed f;
  f.s = p.s;
  f.ref = reference_sums(p, c);
  f.n = pol.tokens;
  f.labels = p.labels;
  if (!c.paired() && f.labels.size() != sz(p.s))
    throw std::invalid_argument("reference::preference: KTO needs labels");
  if (c.paired() && p.s % 2 != 0)
    throw std::invalid_argument("reference::preference: odd number of sequences");
  for (std::int64_t n : f.n)
    if (n == 0) throw std::invalid_argument("reference::preference: empty sequence");
  f.z0 = c.paired() ? 0.0 : kl_point(p, c);
  return f;
}

double mean_where(const std::vector<double>& x, const std::vector<bool>& mask) {
  double s = 0;
  std::int64_t n = 0;
  for (std::size_t i = 0; i < x.size(); ++i)
    if (mask[i]) {
      s += x[i];
      ++n;
    }
  return n ? s / static_cast<double>(n) : 0.0;
}

}  // namespace

double log_sigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}

double sigmoid(double x) {
  if (x >= 0) return 1 / (1 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1 + e);
}

bool PrefConfig::averages() const {
  switch (kind) {
    case PrefKind::kDpo:
      return average || dpo_loss == DpoLoss::kIpo;
    case PrefKind::kOrpo:
    case PrefKind::kSimpo:
      return true;
    case PrefKind::kCpo:
    case PrefKind::kKto:
      return false;
  }
  return false;
}

PrefConfig PrefConfig::from(const DpoOptions& o) {
  PrefConfig c;
  c.kind = PrefKind::kDpo;
  c.dpo_loss = o.loss_type;
  c.beta = o.beta;
  c.eps = o.label_smoothing;
  c.tau = o.discopop_tau;
  c.average = o.average_log_prob;
  c.nll_weight = o.nll ? static_cast<double>(o.nll_alpha) : 0.0;
  c.ignore_index = o.engine.ignore_index;
  return c;
}

PrefConfig PrefConfig::from(const OrpoOptions& o) {
  PrefConfig c;
  c.kind = PrefKind::kOrpo;
  c.beta = o.beta;
  c.nll_weight = 1;
  c.ignore_index = o.engine.ignore_index;
  return c;
}

PrefConfig PrefConfig::from(const SimpoOptions& o) {
  PrefConfig c;
  c.kind = PrefKind::kSimpo;
  c.beta = o.beta;
  c.gamma = o.gamma;
  c.eps = o.label_smoothing;
  c.nll_weight = o.nll_alpha;
  c.ignore_index = o.engine.ignore_index;
  return c;
}

PrefConfig PrefConfig::from(const CpoOptions& o) {
  PrefConfig c;
  c.kind = PrefKind::kCpo;
  c.beta = o.beta;
  c.eps = o.label_smoothing;
  c.nll_weight = o.alpha;
  c.ignore_index = o.engine.ignore_index;
  return c;
}

PrefConfig PrefConfig::from(const KtoOptions& o) {
  PrefConfig c;
  c.kind = PrefKind::kKto;
  c.beta = o.beta;
  c.desirable_weight = o.desirable_weight;
  c.undesirable_weight = o.undesirable_weight;
  c.ignore_index = o.engine.ignore_index;
  return c;
}

SeqStats sequence_stats(const PrefHead& head, const std::vector<std::int64_t>& targets,
                        std::int64_t s, std::int64_t t, std::int64_t h, std::int64_t v,
                        std::int64_t ignore_index) {
  if (targets.size() != sz(s * t))
    throw std::invalid_argument("reference::sequence_stats: targets size is not S*T");
  const std::vector<double> z = logits_of(head, s * t, h, v);
  SeqStats r;
  r.logps.assign(sz(s), 0.0);
  r.tokens.assign(sz(s), 0);
  r.logit_sums.assign(sz(s), 0.0);
  for (std::int64_t row = 0; row < s * t; ++row) {
    const std::int64_t y = targets[sz(row)];
    if (y == ignore_index) continue;
    if (y < 0 || y >= v) throw std::invalid_argument("reference::sequence_stats: bad target");
    const double* zr = &z[sz(row * v)];
    const std::size_t seq = sz(row / t);
    r.logps[seq] += zr[y] - row_lse(zr, v);
    r.tokens[seq] += 1;
    for (std::int64_t k = 0; k < v; ++k) r.logit_sums[seq] += zr[k];
  }
  return r;
}

double preference_loss_of_sums(const PrefProblem& p, const PrefConfig& c,
                               const std::vector<double>& policy_logps) {
  const SeqStats pol = sequence_stats(p.policy, p.targets, p.s, p.t, p.h, p.v, c.ignore_index);
  return evaluate(c, fixed_part(p, c, pol), policy_logps).loss;
}

PrefResult preference(const PrefProblem& p, const PrefConfig& c, bool gradients) {
  const std::int64_t s = p.s, t = p.t, h = p.h, v = p.v, n = s * t;
  const SeqStats pol = sequence_stats(p.policy, p.targets, s, t, h, v, c.ignore_index);
  const Fixed f = fixed_part(p, c, pol);
  const Eval e = evaluate(c, f, pol.logps);

  PrefResult r;
  r.loss = e.loss;
  r.objective_loss = e.objective;
  r.nll = e.nll;
  r.kl = f.z0;
  r.logps = pol.logps;
  r.ref_logps = f.ref;
  r.logit_sums = pol.logit_sums;
  r.tokens = pol.tokens;
  r.rewards = e.rewards;
  r.policy_rewards = e.policy_rewards;
  r.unit_losses = e.unit_losses;

  // Metrics (TRL names). "chosen" is the first half for pairs and label 1 for KTO.
  std::vector<bool> chosen(sz(s)), rejected(sz(s));
  for (std::int64_t i = 0; i < s; ++i) {
    chosen[sz(i)] = c.paired() ? i < s / 2 : p.labels[sz(i)] == 1;
    rejected[sz(i)] = !chosen[sz(i)];
  }
  std::vector<double> measure(sz(s));
  for (std::int64_t i = 0; i < s; ++i)
    measure[sz(i)] =
        c.averages() ? pol.logps[sz(i)] / static_cast<double>(pol.tokens[sz(i)]) : pol.logps[sz(i)];
  auto logits_mean = [&](const std::vector<bool>& mask) {
    double sum = 0, count = 0;
    for (std::int64_t i = 0; i < s; ++i)
      if (mask[sz(i)]) {
        sum += pol.logit_sums[sz(i)];
        count += static_cast<double>(pol.tokens[sz(i)]) * static_cast<double>(v);
      }
    return count > 0 ? sum / count : 0.0;
  };
  auto& m = r.metrics;
  const bool any_chosen = std::find(chosen.begin(), chosen.end(), true) != chosen.end();
  const bool any_rejected = std::find(rejected.begin(), rejected.end(), true) != rejected.end();
  m["rewards/chosen"] = mean_where(e.rewards, chosen);
  m["rewards/rejected"] = mean_where(e.rewards, rejected);
  m["rewards/margins"] = m["rewards/chosen"] - m["rewards/rejected"];
  if (c.paired()) {
    const std::int64_t pairs = s / 2;
    double acc = 0, margins = 0;
    for (std::int64_t i = 0; i < pairs; ++i) {
      acc += e.rewards[sz(i)] > e.rewards[sz(i + pairs)] ? 1.0 : 0.0;
      margins += e.rewards[sz(i)] - e.rewards[sz(i + pairs)];
    }
    m["rewards/accuracies"] = acc / static_cast<double>(pairs);
    m["rewards/margins"] = margins / static_cast<double>(pairs);
  } else {
    // TRL's KTO also counts the sequences of each label.
    m["kl"] = f.z0;
    m["count/chosen"] = static_cast<double>(std::count(chosen.begin(), chosen.end(), true));
    m["count/rejected"] = static_cast<double>(std::count(rejected.begin(), rejected.end(), true));
  }
  m["logps/chosen"] = mean_where(measure, chosen);
  m["logps/rejected"] = mean_where(measure, rejected);
  m["logits/chosen"] = logits_mean(chosen);
  m["logits/rejected"] = logits_mean(rejected);
  // A label without sequences has no means, and then no margin either (as TRL's KTO).
  for (const auto& [any, label] :
       {std::pair{any_chosen, "chosen"}, std::pair{any_rejected, "rejected"}})
    if (!any) {
      for (const char* metric : {"rewards/", "logps/", "logits/"})
        m.erase(metric + std::string(label));
      m.erase("rewards/margins");
    }
  if (c.nll_weight > 0) m["nll_loss"] = e.nll;
  if (c.kind == PrefKind::kOrpo) {
    m["log_odds_ratio"] = e.extra_logsig_odds;
    m["log_odds_chosen"] = e.extra_log_odds;
  }
  if (!gradients) return r;

  // dL/dS_s by a fourth-order central difference of evaluate() in the sums.
  r.dloss_dlogp.assign(sz(s), 0.0);
  const double step = 1e-4;
  for (std::int64_t i = 0; i < s; ++i) {
    auto at = [&](double delta) {
      std::vector<double> x = pol.logps;
      x[sz(i)] += delta;
      return evaluate(c, f, x).loss;
    };
    r.dloss_dlogp[sz(i)] =
        (-at(2 * step) + 8 * at(step) - 8 * at(-step) + at(-2 * step)) / (12 * step);
  }

  // dL/dz for every policy logit, then the three products.
  const std::vector<double> z = logits_of(p.policy, n, h, v);
  r.grad_hidden.assign(sz(n * h), 0.0);
  r.grad_weight.assign(sz(v * h), 0.0);
  r.grad_bias.assign(sz(v), 0.0);
  std::vector<double> dz(sz(v));
  for (std::int64_t row = 0; row < n; ++row) {
    const std::int64_t y = p.targets[sz(row)];
    if (y == c.ignore_index) continue;
    const double g = r.dloss_dlogp[sz(row / t)];
    const double* zr = &z[sz(row * v)];
    const double lse = row_lse(zr, v);
    for (std::int64_t k = 0; k < v; ++k)
      dz[sz(k)] = g * ((k == y ? 1.0 : 0.0) - std::exp(zr[k] - lse));
    for (std::int64_t k = 0; k < v; ++k) {
      const double d = dz[sz(k)];
      for (std::int64_t i = 0; i < h; ++i) {
        r.grad_hidden[sz(row * h + i)] += d * p.policy.weight[sz(k * h + i)];
        r.grad_weight[sz(k * h + i)] += d * p.policy.hidden[sz(row * h + i)];
      }
      r.grad_bias[sz(k)] += d;
    }
  }
  return r;
}

}  // namespace chunkloss::reference
