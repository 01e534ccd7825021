// Objectives written outside the library, against its installed public headers only, each
// checked against a dense double oracle in this file:
// - a sequence objective, SLiC-HF's calibrated hinge (Zhao et al. 2023, arXiv 2305.10425) per
//   pair, loss = max(0, delta - beta (m(c) - m(r))) + nll_weight * NLL(chosen), with m the
//   log-prob sum or its length average, in every regime: loss, an extra metric, the rewards, and
//   the hidden and weight gradients;
// - a token objective, focal loss -(1 - p)^gamma log p (Lin et al. 2017, arXiv 1708.02002), in
//   both loop orders: loss, an extra metric, the log-probs and the gradients.
#include <chunkloss/losses/sequence.h>
#include <chunkloss/losses/token.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

namespace {

using namespace chunkloss;

class CalibratedHinge final : public SequenceObjective {
 public:
  CalibratedHinge(double delta, double beta, bool average, double nll)
      : delta_(delta), beta_(beta), average_(average), nll_(nll) {}
  std::string_view name() const override { return "CalibratedHinge"; }
  Unit unit() const override { return Unit::kPair; }
  UnitResult evaluate(std::span<const SequenceStats> seqs, const BatchConstants&,
                      std::span<double> extras) const override {
    const double sc = average_ ? 1.0 / static_cast<double>(seqs[0].tokens) : 1.0;
    const double sr = average_ ? 1.0 / static_cast<double>(seqs[1].tokens) : 1.0;
    const double margin = delta_ - beta_ * (seqs[0].logp * sc - seqs[1].logp * sr);
    UnitResult u;
    u.loss = std::max(0.0, margin);
    const double active = margin > 0 ? 1.0 : 0.0;
    u.dlogp = {-beta_ * active * sc, beta_ * active * sr};
    u.reward = {beta_ * seqs[0].logp * sc, beta_ * seqs[1].logp * sr};
    extras[0] = active;
    return u;
  }
  double nll_weight() const override { return nll_; }
  bool averages_log_probs() const override { return average_; }
  bool pair_antisymmetric() const override { return true; }  // a function of the margin
  std::vector<std::string> extra_metrics() const override { return {"hinge_active"}; }

 private:
  double delta_, beta_;
  bool average_;
  double nll_;
};

struct Oracle {
  double loss = 0, active = 0;
  std::vector<double> rewards, dh, dw;
};

double rel_err(const std::vector<float>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// softmax(x w^T) of n rows, [n, v], in double.
std::vector<double> softmax_rows(const std::vector<float>& x, const std::vector<float>& w, int n,
                                 int h, int v) {
  std::vector<double> p(static_cast<std::size_t>(n) * v);
  for (int r = 0; r < n; ++r) {
    double* row = p.data() + static_cast<std::size_t>(r) * v;
    double mx = -1e300;
    for (int k = 0; k < v; ++k) {
      double z = 0;
      for (int i = 0; i < h; ++i) z += static_cast<double>(x[r * h + i]) * w[k * h + i];
      row[k] = z;
      mx = std::max(mx, z);
    }
    double sum = 0;
    for (int k = 0; k < v; ++k) sum += std::exp(row[k] - mx);
    const double lse = mx + std::log(sum);
    for (int k = 0; k < v; ++k) row[k] = std::exp(row[k] - lse);
  }
  return p;
}

// dH and dW of a loss with dL/dz_r = g[r] (onehot_r - p_r) for the valid rows: dH = dZ W,
// dW = dZ^T X.
void dense_gradients(const std::vector<double>& p, const std::vector<double>& g,
                     const std::vector<float>& x, const std::vector<float>& w,
                     const std::vector<std::int32_t>& y, int n, int h, int v,
                     std::vector<double>& dh, std::vector<double>& dw) {
  dh.assign(static_cast<std::size_t>(n) * h, 0.0);
  dw.assign(static_cast<std::size_t>(v) * h, 0.0);
  for (int r = 0; r < n; ++r) {
    if (y[r] < 0) continue;
    for (int k = 0; k < v; ++k) {
      const double dz = g[r] * ((k == y[r] ? 1.0 : 0.0) - p[static_cast<std::size_t>(r) * v + k]);
      for (int i = 0; i < h; ++i) {
        dh[static_cast<std::size_t>(r) * h + i] += dz * w[k * h + i];
        dw[static_cast<std::size_t>(k) * h + i] += dz * x[r * h + i];
      }
    }
  }
}

// Dense double computation of the same loss and its gradients: S = 2P sequences of T rows.
Oracle oracle(const std::vector<float>& x, const std::vector<float>& w,
              const std::vector<std::int32_t>& y, int s, int t, int h, int v, double delta,
              double beta, bool average, double nll) {
  const int n = s * t, pairs = s / 2;
  const std::vector<double> p = softmax_rows(x, w, n, h, v);
  std::vector<double> logp(s, 0.0), cnt(s, 0.0);
  for (int r = 0; r < n; ++r) {
    if (y[r] < 0) continue;
    logp[r / t] += std::log(p[static_cast<std::size_t>(r) * v + y[r]]);
    cnt[r / t] += 1;
  }
  Oracle o;
  std::vector<double> g(s, 0.0);  // dL/dS_s
  double chosen_tokens = 0, nll_sum = 0;
  for (int i = 0; i < pairs; ++i) {
    chosen_tokens += cnt[i];
    nll_sum -= logp[i];
  }
  for (int i = 0; i < s; ++i) o.rewards.push_back(beta * logp[i] / (average ? cnt[i] : 1.0));
  for (int i = 0; i < pairs; ++i) {
    const double mc = logp[i] / (average ? cnt[i] : 1.0);
    const double mr = logp[i + pairs] / (average ? cnt[i + pairs] : 1.0);
    const double margin = delta - beta * (mc - mr);
    o.loss += std::max(0.0, margin) / pairs;
    if (margin > 0) {
      o.active += 1.0 / pairs;
      g[i] -= beta / (average ? cnt[i] : 1.0) / pairs;
      g[i + pairs] += beta / (average ? cnt[i + pairs] : 1.0) / pairs;
    }
  }
  o.loss += nll * nll_sum / chosen_tokens;
  for (int i = 0; i < pairs; ++i) g[i] -= nll / chosen_tokens;
  std::vector<double> g_rows(n);  // dL/dz_r = g_s (onehot - p) for the rows r of sequence s
  for (int r = 0; r < n; ++r) g_rows[r] = g[r / t];
  dense_gradients(p, g_rows, x, w, y, n, h, v, o.dh, o.dw);
  return o;
}

class Focal final : public TokenObjective {
 public:
  explicit Focal(double gamma) : gamma_(gamma) {}
  std::string_view name() const override { return "Focal"; }
  TokenValue evaluate(const TokenStats& row, std::span<double> extras) const override {
    const double p = std::exp(row.logp), q = 1.0 - p;
    extras[0] = p;
    return {-std::pow(q, gamma_) * row.logp,
            gamma_ * std::pow(q, gamma_ - 1.0) * p * row.logp - std::pow(q, gamma_)};
  }
  std::vector<std::string> extra_metrics() const override { return {"p_target"}; }

 private:
  double gamma_;
};

struct FocalOracle {
  double loss = 0, p_target = 0;
  std::vector<double> logp, dh, dw;
};

// Dense double focal loss, the mean over valid rows, and its gradients: dL/dz_r =
// f'(logp_r) / valid (onehot - p_r) with f(l) = -(1 - e^l)^gamma l.
FocalOracle focal_oracle(const std::vector<float>& x, const std::vector<float>& w,
                         const std::vector<std::int32_t>& y, int n, int h, int v, double gamma) {
  const std::vector<double> p = softmax_rows(x, w, n, h, v);
  FocalOracle o;
  std::vector<double> g(n, 0.0);
  double valid = 0;
  for (int r = 0; r < n; ++r) valid += y[r] >= 0 ? 1 : 0;
  for (int r = 0; r < n; ++r) {
    o.logp.push_back(y[r] < 0 ? NAN : std::log(p[static_cast<std::size_t>(r) * v + y[r]]));
    if (y[r] < 0) continue;
    const double l = o.logp.back(), pt = std::exp(l), q = 1.0 - pt;
    o.loss -= std::pow(q, gamma) * l / valid;
    o.p_target += pt / valid;
    g[r] = (gamma * std::pow(q, gamma - 1.0) * pt * l - std::pow(q, gamma)) / valid;
  }
  dense_gradients(p, g, x, w, y, n, h, v, o.dh, o.dw);
  return o;
}

// The focal token loss in both loop orders against focal_oracle.
bool check_focal(const std::vector<float>& x, const std::vector<float>& w,
                 const std::vector<std::int32_t>& y, int n, int h, int v) {
  const FocalOracle want = focal_oracle(x, w, y, n, h, v, 2.0);
  bool ok = true;
  for (LoopOrder order : {LoopOrder::kTokenChunk, LoopOrder::kVocabBlock}) {
    TokenOptions opts;
    opts.loop_order = order;
    const TokenLoss loss(std::make_shared<Focal>(2.0), opts);
    std::vector<float> dx(n * h, 7.0f), dw(v * h, 7.0f);
    const TokenInputs in{TensorView::of(x.data(), {n, h}),
                         TensorView::of(w.data(), {v, h}),
                         {},
                         TensorView::of(y.data(), {n})};
    CrossEntropyGrads g;
    g.hidden = TensorView::of(dx.data(), {n, h});
    g.weight = TensorView::of(dw.data(), {v, h});
    const std::size_t bytes = loss.workspace_bytes(in, g);
    void* block = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    CpuContext ctx(1);
    TokenResult r;
    try {
      r = loss.forward_backward(ctx, in, g, Workspace(block, bytes));
    } catch (const std::exception& e) {
      std::printf("objective: focal forward_backward threw: %s\n", e.what());
      std::free(block);
      return false;
    }
    std::free(block);
    double logp_err = 0;
    for (int i = 0; i < n; ++i)
      logp_err = std::isnan(want.logp[i])
                     ? (std::isnan(r.logps[i]) ? logp_err : INFINITY)
                     : std::max(logp_err, std::fabs(r.logps[i] - want.logp[i]));
    const double ex = rel_err(dx, want.dh), ew = rel_err(dw, want.dw);
    const double pt = r.metrics.at(0).second;
    const bool pass = std::fabs(r.loss - want.loss) <= 1e-5 * std::max(1.0, want.loss) &&
                      std::fabs(pt - want.p_target) < 1e-6 && logp_err < 1e-5 && ex < 1e-5 &&
                      ew < 1e-5 && loss.plan(in, g).order == order;
    std::printf(
        "objective: focal %s: loss %.8f (oracle %.8f), p_target %.6f (%.6f), |dlogp| %.2g, "
        "dH err %.2g, dW err %.2g: %s\n",
        std::string(loop_order_name(order)).c_str(), r.loss, want.loss, pt, want.p_target, logp_err,
        ex, ew, pass ? "ok" : "FAIL");
    ok = ok && pass;
  }
  return ok;
}

}  // namespace

int main() {
  const int s = 6, t = 7, h = 5, v = 13, n = s * t;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(n * h), w(v * h);
  for (float& a : x) a = normal(rng);
  for (float& a : w) a = normal(rng) * 0.8f;
  // Per sequence: 0-2 prompt tokens, then 2-5 completion tokens, then padding.
  std::vector<std::int32_t> y(n, -100);
  for (int i = 0; i < s; ++i) {
    const int prompt = static_cast<int>(rng() % 3), len = 2 + static_cast<int>(rng() % 4);
    for (int j = prompt; j < prompt + len; ++j) y[i * t + j] = static_cast<std::int32_t>(rng() % v);
  }
  bool ok = true;
  struct Config {
    double delta, beta;
    bool average;
    double nll;
  };
  for (const Config c : {Config{1.0, 0.5, false, 0.3}, Config{0.4, 1.5, true, 0.0}}) {
    const Oracle want = oracle(x, w, y, s, t, h, v, c.delta, c.beta, c.average, c.nll);
    std::vector<Regime> regimes = {Regime::kResident, Regime::kRecompute};
    if (c.nll == 0) regimes.push_back(Regime::kDeferred);  // no NLL term: deferred applies
    for (Regime regime : regimes) {
      SequenceOptions opts;
      opts.regime = regime;
      const SequenceLoss loss(std::make_shared<CalibratedHinge>(c.delta, c.beta, c.average, c.nll),
                              opts);
      std::vector<float> dx(n * h, 7.0f), dw(v * h, 7.0f);
      PreferenceInputs in;
      in.policy.hidden = TensorView::of(x.data(), {n, h});
      in.policy.weight = TensorView::of(w.data(), {v, h});
      in.targets = TensorView::of(y.data(), {s, t});
      PreferenceGrads g;
      g.hidden = TensorView::of(dx.data(), {n, h});
      g.weight = TensorView::of(dw.data(), {v, h});
      const std::size_t bytes = loss.workspace_bytes(in, g);
      void* block = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
      CpuContext ctx(1);
      PreferenceResult r;
      try {
        r = loss.forward_backward(ctx, in, g, Workspace(block, bytes));
      } catch (const std::exception& e) {
        std::printf("objective: forward_backward threw: %s\n", e.what());
        std::free(block);
        return 1;
      }
      std::free(block);
      double reward_err = 0;
      for (int i = 0; i < s; ++i)
        reward_err = std::max(reward_err, std::fabs(r.rewards[i] - want.rewards[i]));
      const double ex = rel_err(dx, want.dh), ew = rel_err(dw, want.dw);
      const double active = r.metric("hinge_active");
      const bool pass = std::fabs(r.loss - want.loss) <= 1e-5 * std::max(1.0, want.loss) &&
                        std::fabs(active - want.active) < 1e-12 && reward_err < 1e-5 && ex < 1e-5 &&
                        ew < 1e-5 && loss.plan(in, g).regime == regime && want.active > 0 &&
                        want.active < 1;
      std::printf(
          "objective: %s %s: loss %.8f (oracle %.8f), active %.3f (%.3f), |dreward| %.2g, "
          "dH err %.2g, dW err %.2g: %s\n",
          c.average ? "averages" : "sums", std::string(regime_name(regime)).c_str(), r.loss,
          want.loss, active, want.active, reward_err, ex, ew, pass ? "ok" : "FAIL");
      ok = ok && pass;
    }
  }
  return check_focal(x, w, y, n, h, v) && ok ? 0 : 1;
}
