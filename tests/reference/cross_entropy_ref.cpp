// The float64 cross-entropy oracle. Per valid row t with z = softcap(W h_t + b):
//   loss_t = tw_t [(1-ls) cw_y (lse - z_y) + (ls/V) sum_j cw_j (lse - z_j) + zl lse^2]
// and its derivative, written out from that formula:
//   dloss_t/dz_k = tw_t [(1-ls) cw_y (p_k - [k=y]) + (ls/V) (sum_j cw_j p_k - cw_k)
//                        + 2 zl lse p_k],
// times 1/D (mean), 1 (sum) or grad_output_t (none), times softcap's d z/d raw = 1 - tanh^2.
#include "reference/cross_entropy_ref.h"

#include <cmath>
#include <stdexcept>

namespace chunkloss::reference {

CeConfig CeConfig::from(const CrossEntropyOptions& o) {
  CeConfig c;
  c.ignore_index = o.ignore_index;
  c.reduction = o.reduction;
  c.label_smoothing = o.label_smoothing;
  c.z_loss = o.z_loss;
  c.softcap = o.softcap ? static_cast<double>(*o.softcap) : 0.0;
  return c;
}

namespace {

CeResult compute(const CeProblem& p, const CeConfig& c, bool gradients) {
  const std::int64_t n = p.n, h = p.h, v = p.v;
  const auto sz = [](std::int64_t x) { return static_cast<std::size_t>(x); };
  if (p.hidden.size() != sz(n * h) || p.weight.size() != sz(v * h) || p.targets.size() != sz(n) ||
      (!p.bias.empty() && p.bias.size() != sz(v)) ||
      (!p.class_weights.empty() && p.class_weights.size() != sz(v)) ||
      (!p.token_weights.empty() && p.token_weights.size() != sz(n)) ||
      (!p.grad_output.empty() && p.grad_output.size() != sz(n)))
    throw std::invalid_argument("reference::cross_entropy: inconsistent problem sizes");
  const double ls = c.label_smoothing;
  const auto cw = [&](std::int64_t k) {
    return p.class_weights.empty() ? 1.0 : p.class_weights[sz(k)];
  };
  double cw_sum = 0;
  for (std::int64_t k = 0; k < v; ++k) cw_sum += cw(k);

  CeResult r;
  r.row_loss.assign(sz(n), 0.0);
  r.lse.assign(sz(n), 0.0);
  r.predictions.assign(sz(n), -1);

  // Dense logits: raw (before softcap) and z (after).
  std::vector<double> raw(sz(n * v)), z(sz(n * v));
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t k = 0; k < v; ++k) {
      double acc = p.bias.empty() ? 0.0 : p.bias[sz(k)];
      for (std::int64_t i = 0; i < h; ++i) acc += p.hidden[sz(t * h + i)] * p.weight[sz(k * h + i)];
      raw[sz(t * v + k)] = acc;
      z[sz(t * v + k)] = c.softcap > 0 ? c.softcap * std::tanh(acc / c.softcap) : acc;
    }
  }

  // Softmax statistics and the loss of every row.
  std::vector<double> prob(sz(n * v));
  double denom = 0, loss_sum = 0, zloss_sum = 0, entropy_sum = 0;
  std::int64_t correct = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    const double* zt = &z[sz(t * v)];
    std::int64_t arg = 0;
    for (std::int64_t k = 1; k < v; ++k)
      if (zt[k] > zt[arg]) arg = k;
    double s = 0;
    for (std::int64_t k = 0; k < v; ++k) s += std::exp(zt[k] - zt[arg]);
    const double lse = zt[arg] + std::log(s);
    r.lse[sz(t)] = lse;
    double ent = 0;
    for (std::int64_t k = 0; k < v; ++k) {
      const double pk = std::exp(zt[k] - lse);
      prob[sz(t * v + k)] = pk;
      if (pk > 0) ent -= pk * std::log(pk);
    }
    const std::int64_t y = p.targets[sz(t)];
    if (y == c.ignore_index) continue;
    if (y < 0 || y >= v)
      throw std::invalid_argument("reference::cross_entropy: target out of range");
    ++r.valid_rows;
    r.predictions[sz(t)] = static_cast<std::int32_t>(arg);
    if (arg == y) ++correct;
    entropy_sum += ent;
    denom += cw(y);
    double smooth = 0;
    for (std::int64_t k = 0; k < v; ++k) smooth += cw(k) * (lse - zt[k]);
    const double tw = p.token_weights.empty() ? 1.0 : p.token_weights[sz(t)];
    // (without smoothing, a masked column's infinite lse - z_k must not reach the loss as 0 * inf)
    const double ce =
        (1 - ls) * cw(y) * (lse - zt[y]) + (ls != 0 ? ls / static_cast<double>(v) * smooth : 0.0);
    const double zl = c.z_loss * cw(y) * lse * lse;
    r.row_loss[sz(t)] = tw * (ce + zl);
    loss_sum += tw * (ce + zl);
    zloss_sum += tw * zl;
  }
  const bool mean = c.reduction == Reduction::kMean;
  r.weight_sum = denom;
  r.loss = mean ? (denom > 0 ? loss_sum / denom : 0.0) : loss_sum;
  r.z_loss = mean ? (denom > 0 ? zloss_sum / denom : 0.0) : zloss_sum;
  r.accuracy =
      r.valid_rows ? static_cast<double>(correct) / static_cast<double>(r.valid_rows) : 0.0;
  r.entropy = r.valid_rows ? entropy_sum / static_cast<double>(r.valid_rows) : 0.0;
  if (c.reduction == Reduction::kNone) {
    r.objective = 0;
    for (std::int64_t t = 0; t < n; ++t)
      r.objective += (p.grad_output.empty() ? 1.0 : p.grad_output[sz(t)]) * r.row_loss[sz(t)];
  } else {
    r.objective = r.loss;
  }
  if (!gradients) return r;

  // dL/dz for every logit, then the three products.
  std::vector<double> dz(sz(n * v), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t y = p.targets[sz(t)];
    if (y == c.ignore_index) continue;
    const double tw = p.token_weights.empty() ? 1.0 : p.token_weights[sz(t)];
    double scale = tw;
    if (mean) scale = denom > 0 ? tw / denom : 0.0;
    if (c.reduction == Reduction::kNone)
      scale *= p.grad_output.empty() ? 1.0 : p.grad_output[sz(t)];
    const double lse = r.lse[sz(t)];
    for (std::int64_t k = 0; k < v; ++k) {
      const double pk = prob[sz(t * v + k)];
      double d = (1 - ls) * cw(y) * (pk - (k == y ? 1.0 : 0.0)) +
                 ls / static_cast<double>(v) * (cw_sum * pk - cw(k)) +
                 2 * c.z_loss * cw(y) * lse * pk;
      if (c.softcap > 0) {
        const double th = std::tanh(raw[sz(t * v + k)] / c.softcap);
        d *= 1 - th * th;
      }
      dz[sz(t * v + k)] = scale * d;
    }
  }
  r.grad_hidden.assign(sz(n * h), 0.0);
  r.grad_weight.assign(sz(v * h), 0.0);
  r.grad_bias.assign(sz(v), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    for (std::int64_t k = 0; k < v; ++k) {
      const double d = dz[sz(t * v + k)];
      if (d == 0) continue;
      for (std::int64_t i = 0; i < h; ++i) {
        r.grad_hidden[sz(t * h + i)] += d * p.weight[sz(k * h + i)];
        r.grad_weight[sz(k * h + i)] += d * p.hidden[sz(t * h + i)];
      }
      r.grad_bias[sz(k)] += d;
    }
  }
  return r;
}

}  // namespace

CeResult cross_entropy(const CeProblem& p, const CeConfig& c) { return compute(p, c, true); }

double cross_entropy_objective(const CeProblem& p, const CeConfig& c) {
  return compute(p, c, false).objective;
}

}  // namespace chunkloss::reference
