// The device-independent part of the preference-loss cases (see preference_case.h).
#include "preference_case.h"

#include <chunkloss/core/error.h>
#include <chunkloss/losses/preference.h>

#include <cmath>
#include <span>

namespace chunkloss::bench {
namespace {

double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

double log_sigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}

// -(1 - eps) logsig(z) - eps logsig(-z) and its derivative in z.
void smoothed_logistic(double z, double eps, double& loss, double& dz) {
  loss = -(1.0 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z);
  dz = -(1.0 - eps) * sigmoid(-z) + eps * sigmoid(z);
}

bool chosen_sequence(const PreferenceBatch& b, std::int64_t s) {
  return b.paired ? s < b.pairs : b.labels[static_cast<std::size_t>(s)] == 1;
}

}  // namespace

PreferenceBatch make_preference_batch(const CaseConfig& c, std::int64_t vocab) {
  PreferenceBatch b;
  b.pairs = c.pairs;
  b.seq_len = c.seq_len;
  b.sequences = 2 * c.pairs;
  b.rows = b.sequences * c.seq_len;
  b.paired = c.loss != "kto";
  b.prompt = static_cast<std::int64_t>(std::floor(c.prompt_frac * static_cast<double>(c.seq_len)));
  CHUNKLOSS_CHECK(b.prompt < c.seq_len, "bench: --prompt-frac ", c.prompt_frac, " ignores all ",
                  c.seq_len, " targets of every sequence");
  CHUNKLOSS_CHECK(vocab <= INT32_MAX, "bench: V=", vocab, " does not fit i32 targets");
  b.targets.resize(static_cast<std::size_t>(b.rows));
  std::uint64_t state = c.seed * 0x9e3779b97f4a7c15ull + 12345;
  for (std::int64_t i = 0; i < b.rows; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const auto target =
        static_cast<std::int32_t>((state >> 33) % static_cast<std::uint64_t>(vocab));
    b.targets[static_cast<std::size_t>(i)] =
        i % c.seq_len < b.prompt ? static_cast<std::int32_t>(kPreferenceIgnoreIndex) : target;
  }
  b.tokens.assign(static_cast<std::size_t>(b.sequences), c.seq_len - b.prompt);
  b.valid_rows = b.sequences * (c.seq_len - b.prompt);
  if (!b.paired) {
    b.labels.resize(static_cast<std::size_t>(b.sequences));
    for (std::int64_t s = 0; s < b.sequences; ++s)
      b.labels[static_cast<std::size_t>(s)] = s % 2 == 0 ? 1 : 0;
  }
  return b;
}

SequenceLoss make_preference_loss(const CaseConfig& c) {
  SequenceOptions e;
  e.memory_budget_bytes = c.budget_bytes;
  e.regime = c.regime;
  e.loop_order = c.order;
  e.fp32_weight_grad_accumulator = c.fp32_weight_grad_accumulator;
  e.logits_dtype = c.logits_dtype;
  const auto eps = static_cast<float>(c.label_smoothing);
  if (c.loss == "dpo") {
    DpoOptions o;
    o.loss_type = parse_dpo_loss(c.dpo_loss);
    o.label_smoothing = eps;
    o.engine = e;
    return Dpo(o);
  }
  if (c.loss == "orpo") {
    OrpoOptions o;
    o.engine = e;
    return Orpo(o);
  }
  if (c.loss == "simpo") {
    SimpoOptions o;
    o.label_smoothing = eps;
    o.engine = e;
    return Simpo(o);
  }
  if (c.loss == "cpo") {
    CpoOptions o;
    o.label_smoothing = eps;
    o.engine = e;
    return Cpo(o);
  }
  CHUNKLOSS_CHECK(c.loss == "kto", "bench: '", c.loss, "' is not a preference loss");
  KtoOptions o;
  o.engine = e;
  return Kto(o);
}

int preference_floor_gemms(const CaseConfig& c) { return c.reference == "head" ? 4 : 3; }

NaiveSequenceResult naive_sequence_objective(const CaseConfig& c, const SequenceLoss& loss,
                                             const PreferenceBatch& b,
                                             const std::vector<double>& logp,
                                             const std::vector<double>& ref_logp) {
  const std::int64_t s_count = b.sequences, p = b.pairs;
  const auto at = [](const std::vector<double>& x, std::int64_t i) {
    return x[static_cast<std::size_t>(i)];
  };
  const auto n_tok = [&](std::int64_t s) {
    return static_cast<double>(b.tokens[static_cast<std::size_t>(s)]);
  };
  NaiveSequenceResult r;
  r.coef.assign(static_cast<std::size_t>(s_count), 0.0);
  // dL/dlogp_s accumulated here; coef = -dL/dlogp (d logp_t / d z_t = onehot - p).
  std::vector<double> g(static_cast<std::size_t>(s_count), 0.0);
  double nll_weight = 0;
  const double eps = c.label_smoothing;
  const double units = b.paired ? static_cast<double>(p) : static_cast<double>(s_count);
  if (c.loss == "dpo" && c.dpo_loss == "sigmoid") {
    // d = beta ((c - c0) - (r - r0)) on sums; -(1-eps) logsig(d) - eps logsig(-d).
    const double beta = DpoOptions{}.beta;
    for (std::int64_t i = 0; i < p; ++i) {
      const double d =
          beta * ((at(logp, i) - at(ref_logp, i)) - (at(logp, i + p) - at(ref_logp, i + p)));
      double l = 0, dd = 0;
      smoothed_logistic(d, eps, l, dd);
      r.loss += l / units;
      g[static_cast<std::size_t>(i)] += beta * dd / units;
      g[static_cast<std::size_t>(i + p)] -= beta * dd / units;
    }
    r.how = "DPO sigmoid written out (beta " + fmt("%g", beta) + ", sums)";
  } else if (c.loss == "orpo") {
    // NLL(chosen) - beta mean logsig(lo), lo = (a_c - a_r) - (log(1 - e^a_c) - log(1 - e^a_r)).
    const double beta = OrpoOptions{}.beta;
    for (std::int64_t i = 0; i < p; ++i) {
      const double ac = at(logp, i) / n_tok(i), ar = at(logp, i + p) / n_tok(i + p);
      const double lo = (ac - ar) - (std::log1p(-std::exp(ac)) - std::log1p(-std::exp(ar)));
      r.loss += -beta * log_sigmoid(lo) / units;
      const double dlo = -beta * sigmoid(-lo) / units;
      g[static_cast<std::size_t>(i)] += dlo / (1.0 - std::exp(ac)) / n_tok(i);
      g[static_cast<std::size_t>(i + p)] -= dlo / (1.0 - std::exp(ar)) / n_tok(i + p);
    }
    nll_weight = 1.0;
    r.how = "ORPO written out (beta " + fmt("%g", beta) + ", averages, NLL weight 1)";
  } else if (c.loss == "simpo" || c.loss == "cpo") {
    // z = beta (c - r) - gamma: SimPO on averages with gamma, CPO on sums with the NLL term.
    const bool simpo = c.loss == "simpo";
    const double beta = simpo ? SimpoOptions{}.beta : CpoOptions{}.beta;
    const double gamma = simpo ? SimpoOptions{}.gamma : 0.0;
    nll_weight = simpo ? SimpoOptions{}.nll_alpha : CpoOptions{}.alpha;
    for (std::int64_t i = 0; i < p; ++i) {
      const double kc = simpo ? 1.0 / n_tok(i) : 1.0, kr = simpo ? 1.0 / n_tok(i + p) : 1.0;
      const double z = beta * (at(logp, i) * kc - at(logp, i + p) * kr) - gamma;
      double l = 0, dz = 0;
      smoothed_logistic(z, eps, l, dz);
      r.loss += l / units;
      g[static_cast<std::size_t>(i)] += beta * dz * kc / units;
      g[static_cast<std::size_t>(i + p)] -= beta * dz * kr / units;
    }
    r.how = std::string(simpo ? "SimPO" : "CPO") + " written out (beta " + fmt("%g", beta) +
            (simpo ? ", gamma " + fmt("%g", gamma) + ", averages" : ", sums") + ", NLL weight " +
            fmt("%g", nll_weight) + ")";
  } else if (c.loss == "kto") {
    // rho = logp - ref; desirable 1 - sigmoid(beta rho), undesirable 1 - sigmoid(-beta rho)
    // (KL reference point 0: no kl or kl_batch given), weights 1, mean over sequences.
    const double beta = KtoOptions{}.beta;
    for (std::int64_t s = 0; s < s_count; ++s) {
      const double rho = at(logp, s) - at(ref_logp, s);
      const double sign = b.labels[static_cast<std::size_t>(s)] == 1 ? 1.0 : -1.0;
      const double sg = sigmoid(sign * beta * rho);
      r.loss += (1.0 - sg) / units;
      g[static_cast<std::size_t>(s)] += -sign * beta * sg * (1.0 - sg) / units;
    }
    r.how = "KTO written out (beta " + fmt("%g", beta) + ", weights 1, KL point 0)";
  } else {
    // Other DPO loss types: the library's per-pair math, the rest written out here.
    const SequenceObjective& obj = loss.objective();
    nll_weight = obj.nll_weight();
    std::vector<double> extras(obj.extra_metrics().size());
    for (std::int64_t i = 0; i < p; ++i) {
      SequenceStats st[2];
      for (int k = 0; k < 2; ++k) {
        const std::int64_t s = i + k * p;
        st[k].logp = at(logp, s);
        st[k].ref_logp = at(ref_logp, s);
        st[k].tokens = b.tokens[static_cast<std::size_t>(s)];
        st[k].label = k == 0 ? 1 : 0;
      }
      const UnitResult u = obj.evaluate(std::span<const SequenceStats>(st, 2), {}, extras);
      r.loss += u.loss / units;
      g[static_cast<std::size_t>(i)] += u.dlogp[0] / units;
      g[static_cast<std::size_t>(i + p)] += u.dlogp[1] / units;
    }
    r.how = "DPO " + c.dpo_loss + ": per-pair math from the library's objective";
  }
  if (nll_weight > 0) {
    double chosen_tokens = 0, nll = 0;
    for (std::int64_t s = 0; s < s_count; ++s)
      if (chosen_sequence(b, s)) {
        chosen_tokens += n_tok(s);
        nll -= at(logp, s);
      }
    r.loss += nll_weight * nll / chosen_tokens;
    for (std::int64_t s = 0; s < s_count; ++s)
      if (chosen_sequence(b, s)) g[static_cast<std::size_t>(s)] -= nll_weight / chosen_tokens;
  }
  for (std::int64_t s = 0; s < s_count; ++s)
    r.coef[static_cast<std::size_t>(s)] = -g[static_cast<std::size_t>(s)];
  return r;
}

void describe_preference_case(const CaseConfig& c, const PreferenceBatch& b,
                              const PreferenceResult& first, CaseResult& res) {
  res.ignored_rows = "the first " + std::to_string(b.prompt) + " of each sequence's " +
                     std::to_string(b.seq_len) + " targets (prompt, --prompt-frac " +
                     fmt("%g", c.prompt_frac) + ")";
  res.reduction = b.paired ? "mean over pairs (+ the loss's NLL term over chosen tokens)"
                           : "mean over sequences; labels alternate desirable/undesirable";
  res.valid_rows = b.valid_rows;
  res.metrics = first.metrics;
}

}  // namespace chunkloss::bench
