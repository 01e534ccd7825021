// SequenceLoss and SequenceLogProbs: validation at the boundary, the per-sequence statistics
// handed to the objective, the coefficients c_s it implies, the metrics, and the KL pass.
#include "chunkloss/losses/sequence.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "chunkloss/core/error.h"
#include "sequence_engine.h"
#include "validate.h"

namespace chunkloss {

double PreferenceResult::metric(std::string_view name) const {
  for (const auto& [k, v] : metrics)
    if (k == name) return v;
  std::string names;
  for (const auto& m : metrics) names += (names.empty() ? "" : ", ") + m.first;
  CHUNKLOSS_FAIL("PreferenceResult: no metric '", name, "'; it has: ", names);
}

namespace {

constexpr std::initializer_list<DType> kFloat = {DType::kF32, DType::kBF16};

// A head checked against the layout, as a token call's operands (hidden viewed as [N, H]).
struct HeadShape {
  std::int64_t n = 0, h = 0, v = 0;
  DType dtype = DType::kF32;
};

HeadShape check_head(const char* who, const std::string& name, const Head& head, Device dev,
                     std::int64_t s, std::int64_t t) {
  const std::string hn = name + ".hidden", wn = name + ".weight", bn = name + ".bias";
  const TensorView& x = head.hidden;
  CHUNKLOSS_CHECK(x.defined() && (x.ndim() == 2 || x.ndim() == 3), who, ": ", hn,
                  " must be [S*T, H] or [S, T, H] with S=", s, " T=", t, ", got ", x.str());
  const bool rows_ok = x.ndim() == 2 ? x.size(0) == s * t : x.size(0) == s && x.size(1) == t;
  CHUNKLOSS_CHECK(rows_ok, who, ": ", hn, " ", x.str(), " does not match targets [", s, ", ", t,
                  "] (S*T=", s * t, " rows)");
  HeadShape hs;
  hs.n = s * t;
  hs.h = x.size(x.ndim() - 1);
  hs.dtype = x.dtype();
  CHUNKLOSS_CHECK(head.weight.defined() && head.weight.ndim() == 2, who, ": ", wn,
                  " must be [V, H], got ", head.weight.str());
  hs.v = head.weight.size(0);
  CHUNKLOSS_CHECK(hs.h > 0 && hs.v > 0, who, ": empty head: ", hn, " ", x.str(), ", ", wn, " ",
                  head.weight.str());
  CHUNKLOSS_CHECK(hs.v <= INT32_MAX, who, ": vocab V=", hs.v, " exceeds 2^31-1");
  CHUNKLOSS_CHECK(head.weight.size(1) == hs.h, who, ": ", wn, " ", head.weight.str(),
                  " does not match ", hn, " ", x.str(), " (H differs)");
  bool ok = false;
  for (DType d : kFloat) ok = ok || x.dtype() == d;
  CHUNKLOSS_CHECK(ok, who, ": ", hn, " ", x.str(), " must be f32 or bf16");
  CHUNKLOSS_CHECK(x.device() == dev, who, ": ", hn, " ", x.str(),
                  " is not on the context's device (", device_name(dev), ")");
  detail::check_view(who, wn.c_str(), head.weight, dev, {hs.v, hs.h}, {x.dtype()});
  detail::check_optional(who, bn.c_str(), head.bias, dev, {hs.v}, {x.dtype()});
  return hs;
}

TensorView as_rows(const TensorView& x, std::int64_t n, std::int64_t h) {
  return {x.data(), x.dtype(), {n, h}, x.device(), x.device_index()};
}

// A forward-only (or policy) token call of a head under the plain rule: row loss = -log p(y).
detail::TokenCall head_call(const Head& head, const HeadShape& hs, const TensorView& targets_rows,
                            std::int64_t ignore_index, bool check_finite, Device dev) {
  detail::TokenCall k;
  k.rows = hs.n;
  k.hidden = hs.h;
  k.vocab = hs.v;
  k.x = as_rows(head.hidden, hs.n, hs.h);
  k.w = head.weight;
  k.bias = head.bias;
  k.targets = targets_rows;
  k.ignore_index = ignore_index;
  k.rule.cw_sum = static_cast<float>(hs.v);
  k.scale = detail::RowScale::kSum;
  k.check_finite = check_finite && dev == Device::kCuda;
  return k;
}

PlanRequest head_request(const HeadShape& hs, Device dev, const SequenceOptions& o) {
  PlanRequest q;
  q.rows = hs.n;
  q.hidden = hs.h;
  q.vocab = hs.v;
  q.device = dev;
  q.input_dtype = hs.dtype;
  q.logits_dtype = o.logits_dtype;
  q.fp32_weight_grad_accumulator = o.fp32_weight_grad_accumulator;
  q.budget_bytes = o.memory_budget_bytes;
  q.order = o.loop_order;
  return q;
}

// Host copies of the targets: validity per row, range checked, and tokens per sequence.
struct HostTargets {
  std::vector<std::uint8_t> valid;
  std::vector<std::int64_t> tokens;
};

HostTargets read_targets(const char* who, const std::string& name, Context& ctx,
                         const TensorView& targets, std::int64_t v, std::int64_t ignore_index) {
  const std::int64_t s = targets.size(0), t = targets.size(1), n = s * t;
  std::vector<std::int64_t> y(static_cast<std::size_t>(n));
  if (targets.dtype() == DType::kI64) {
    detail::read_to_host(ctx, targets, y.data());
  } else {
    std::vector<std::int32_t> y32(static_cast<std::size_t>(n));
    detail::read_to_host(ctx, targets, y32.data());
    std::copy(y32.begin(), y32.end(), y.begin());
  }
  HostTargets h;
  h.valid.assign(static_cast<std::size_t>(n), 0);
  h.tokens.assign(static_cast<std::size_t>(s), 0);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t yi = y[static_cast<std::size_t>(i)];
    if (yi == ignore_index) continue;
    CHUNKLOSS_CHECK(yi >= 0 && yi < v, who, ": ", name, "[", i / t, ", ", i % t, "] = ", yi,
                    " is outside [0, V=", v, ") and is not ignore_index (", ignore_index, ")");
    h.valid[static_cast<std::size_t>(i)] = 1;
    ++h.tokens[static_cast<std::size_t>(i / t)];
  }
  return h;
}

void check_targets_view(const char* who, const std::string& name, const TensorView& t, Device dev) {
  CHUNKLOSS_CHECK(t.defined() && t.ndim() == 2 && t.size(0) > 0 && t.size(1) > 0, who, ": ", name,
                  " must be [S, T] with S, T > 0, got ", t.str());
  detail::check_view(who, name.c_str(), t, dev, {t.size(0), t.size(1)}, {DType::kI32, DType::kI64});
}

// A small per-sequence vector (f32 or i32) from host or device memory, as doubles.
std::vector<double> read_vector(const char* who, const char* name, Context& ctx,
                                const TensorView& t, std::int64_t s, DType dtype) {
  CHUNKLOSS_CHECK(t.ndim() == 1 && t.size(0) == s && t.dtype() == dtype, who, ": ", name, " ",
                  t.str(), " must be [", s, "] ", dtype_name(dtype));
  CHUNKLOSS_CHECK(t.device() == Device::kCpu || t.device() == ctx.device(), who, ": ", name, " ",
                  t.str(), " must be in host memory or on the context's device");
  std::vector<double> out(static_cast<std::size_t>(s));
  if (dtype == DType::kF32) {
    std::vector<float> f(static_cast<std::size_t>(s));
    detail::read_to_host(ctx, t, f.data());
    std::copy(f.begin(), f.end(), out.begin());
  } else {
    std::vector<std::int32_t> f(static_cast<std::size_t>(s));
    detail::read_to_host(ctx, t, f.data());
    std::copy(f.begin(), f.end(), out.begin());
  }
  return out;
}

void check_finite_head(const char* who, const std::string& name, const Head& head) {
  detail::check_finite(who, (name + ".hidden").c_str(), head.hidden);
  detail::check_finite(who, (name + ".weight").c_str(), head.weight);
  detail::check_finite(who, (name + ".bias").c_str(), head.bias);
}

// Everything a call needs, checked. `calling`: also read and check the values (targets,
// labels, finiteness, reference log-probs); plan() checks shapes only.
struct Checked {
  detail::SequenceCall call;
  PlanRequest request;
  SequenceLayout layout;
  std::vector<std::int64_t> tokens;
  std::vector<double> labels;
  bool has_reference = false;
  // The KL batch (KTO): its heads' calls and plans.
  std::optional<detail::TokenCall> kl_policy, kl_reference;
  std::vector<double> kl_ref_logps;
  std::vector<std::uint8_t> kl_valid;
  std::int64_t kl_seq_len = 0, kl_sequences = 0;
  Plan kl_plan;
};

Checked check_call(const SequenceObjective& obj, const SequenceOptions& o, Context* ctx, Device dev,
                   const PreferenceInputs& in, const PreferenceGrads& gr) {
  const std::string who_s(obj.name());
  const char* who = who_s.c_str();
  check_targets_view(who, "targets", in.targets, dev);
  const std::int64_t s = in.targets.size(0), t = in.targets.size(1);
  const bool pairs = obj.unit() == Unit::kPair;
  CHUNKLOSS_CHECK(!pairs || s % 2 == 0, who,
                  ": a paired batch needs an even number of sequences"
                  " (P chosen then P rejected), targets is ",
                  in.targets.str());
  const HeadShape hs = check_head(who, "policy", in.policy, dev, s, t);
  const std::int64_t n = hs.n, h = hs.h, v = hs.v;

  Checked c;
  const bool ref_head = in.reference.hidden.defined() || in.reference.weight.defined();
  const bool ref_given = in.reference_logps.defined();
  CHUNKLOSS_CHECK(!(ref_head || ref_given) || obj.uses_reference(), who,
                  " is reference-free: reference and reference_logps must be absent");
  CHUNKLOSS_CHECK(!(ref_head && ref_given), who,
                  ": give either a reference head or reference_logps, not both (reference_logps ",
                  in.reference_logps.str(), ")");
  c.has_reference = ref_head || ref_given;
  if (ref_head) {
    const HeadShape rs = check_head(who, "reference", in.reference, dev, s, t);
    CHUNKLOSS_CHECK(rs.h == h && rs.v == v && rs.dtype == hs.dtype, who,
                    ": the reference head must match the policy head's H, V and dtype: reference."
                    "weight ",
                    in.reference.weight.str(), ", policy.weight ", in.policy.weight.str());
  }
  CHUNKLOSS_CHECK(pairs || in.labels.defined(), who, ": labels [", s,
                  "] i32 (1 desirable, 0 undesirable) are required");
  CHUNKLOSS_CHECK(!pairs || !in.labels.defined(), who, ": labels ", in.labels.str(),
                  " are only used by unpaired losses");
  const bool kl_batch = in.kl_batch.targets.defined() || in.kl_batch.policy.hidden.defined();
  CHUNKLOSS_CHECK(obj.uses_kl() || (!in.kl && !kl_batch), who,
                  ": kl and kl_batch are only used by KTO-style objectives");
  CHUNKLOSS_CHECK(!(in.kl && kl_batch), who, ": give either kl or kl_batch, not both");
  CHUNKLOSS_CHECK(!in.kl || std::isfinite(*in.kl), who, ": kl must be finite, got ",
                  in.kl ? *in.kl : 0.0);

  detail::check_optional(who, "grads.hidden", gr.hidden, dev, {n, h}, kFloat);
  detail::check_optional(who, "grads.weight", gr.weight, dev, {v, h}, kFloat);
  detail::check_optional(who, "grads.bias", gr.bias, dev, {v}, kFloat);
  CHUNKLOSS_CHECK(!gr.bias.defined() || in.policy.bias.defined(), who, ": grads.bias ",
                  gr.bias.str(), " given but policy.bias is absent");
  CHUNKLOSS_CHECK(o.logits_dtype == DType::kF32 || hs.dtype == DType::kBF16, who,
                  ": logits_dtype bf16 needs bf16 heads, got policy.hidden ",
                  in.policy.hidden.str());

  const TensorView targets_rows(in.targets.data(), in.targets.dtype(), {n}, in.targets.device(),
                                in.targets.device_index());
  auto& k = c.call;
  k.policy = head_call(in.policy, hs, targets_rows, o.ignore_index, o.check_finite, dev);
  k.policy.grad_x = gr.hidden;
  k.policy.grad_w = gr.weight;
  k.policy.grad_bias = gr.bias;
  k.policy.accumulate = gr.accumulate;
  k.policy.logit_sums = true;
  // A bf16 gradient tile on CUDA keeps per-sequence coefficients out of its rounding.
  k.policy.row_scales = dev == Device::kCuda && hs.dtype == DType::kBF16;
  if (ref_head)
    k.reference = head_call(in.reference, hs, targets_rows, o.ignore_index, o.check_finite, dev);
  k.sequences = s;
  k.seq_len = t;
  k.unit_sequences = pairs ? 2 : 1;

  c.request = head_request(hs, dev, o);
  c.request.grad_hidden = gr.hidden.defined();
  c.request.grad_weight = gr.weight.defined();
  c.request.grad_bias = gr.bias.defined();
  c.request.row_scales = k.policy.row_scales;
  if (c.request.grad_hidden) c.request.grad_hidden_dtype = gr.hidden.dtype();
  if (c.request.grad_weight) c.request.grad_weight_dtype = gr.weight.dtype();
  c.layout.sequences = s;
  c.layout.seq_len = t;
  c.layout.unit_sequences = k.unit_sequences;
  c.layout.reference_head = ref_head;
  c.layout.regime = o.regime;
  c.layout.deferrable = pairs && obj.pair_antisymmetric() && obj.nll_weight() == 0 &&
                        !gr.bias.defined() && !(gr.weight.defined() && gr.accumulate);

  if (kl_batch) {
    const auto& kb = in.kl_batch;
    check_targets_view(who, "kl_batch.targets", kb.targets, dev);
    c.kl_sequences = kb.targets.size(0);
    c.kl_seq_len = kb.targets.size(1);
    const HeadShape ks =
        check_head(who, "kl_batch.policy", kb.policy, dev, c.kl_sequences, c.kl_seq_len);
    CHUNKLOSS_CHECK(ks.h == h && ks.v == v && ks.dtype == hs.dtype, who,
                    ": kl_batch.policy must match the policy head's H, V and dtype");
    const bool kref_head = kb.reference.hidden.defined() || kb.reference.weight.defined();
    CHUNKLOSS_CHECK(kref_head != kb.reference_logps.defined(), who,
                    ": kl_batch needs exactly one of a reference head and reference_logps");
    const TensorView krows(kb.targets.data(), kb.targets.dtype(), {ks.n}, kb.targets.device(),
                           kb.targets.device_index());
    c.kl_policy = head_call(kb.policy, ks, krows, o.ignore_index, o.check_finite, dev);
    if (kref_head) {
      const HeadShape kr =
          check_head(who, "kl_batch.reference", kb.reference, dev, c.kl_sequences, c.kl_seq_len);
      CHUNKLOSS_CHECK(kr.h == h && kr.v == v && kr.dtype == hs.dtype, who,
                      ": kl_batch.reference must match the policy head's H, V and dtype");
      c.kl_reference = head_call(kb.reference, ks, krows, o.ignore_index, o.check_finite, dev);
    }
    c.kl_plan = plan_token_objective(head_request(ks, dev, o));
  }

  if (!ctx) return c;
  // Values: targets, labels, reference log-probs, finiteness (CPU; CUDA checks on the device).
  HostTargets ht = read_targets(who, "targets", *ctx, in.targets, v, o.ignore_index);
  for (std::int64_t i = 0; i < s; ++i)
    CHUNKLOSS_CHECK(ht.tokens[static_cast<std::size_t>(i)] > 0, who, ": sequence ", i,
                    " of targets ", in.targets.str(), " has no valid token (all ignore_index ",
                    o.ignore_index, ")");
  k.valid = std::move(ht.valid);
  c.tokens = std::move(ht.tokens);
  if (c.layout.deferrable) {
    k.objective = obj.name();
    for (std::int64_t i = 0; i < s; ++i) {
      const double n_i = static_cast<double>(c.tokens[static_cast<std::size_t>(i)]);
      k.kappa.push_back((i < s / 2 ? 1.0 : -1.0) / (obj.averages_log_probs() ? n_i : 1.0));
    }
  }
  if (!pairs) {
    c.labels = read_vector(who, "labels", *ctx, in.labels, s, DType::kI32);
    for (std::int64_t i = 0; i < s; ++i) {
      const double l = c.labels[static_cast<std::size_t>(i)];
      CHUNKLOSS_CHECK(l == 0 || l == 1, who, ": labels[", i, "] = ", l, " must be 0 or 1");
    }
  }
  if (ref_given) {
    k.ref_logps = read_vector(who, "reference_logps", *ctx, in.reference_logps, s, DType::kF32);
    for (std::int64_t i = 0; i < s; ++i)
      CHUNKLOSS_CHECK(std::isfinite(k.ref_logps[static_cast<std::size_t>(i)]), who,
                      ": reference_logps[", i, "] is not finite");
  }
  if (kl_batch) {
    const auto& kb = in.kl_batch;
    HostTargets kt = read_targets(who, "kl_batch.targets", *ctx, kb.targets, v, o.ignore_index);
    c.kl_valid = std::move(kt.valid);
    if (kb.reference_logps.defined())
      c.kl_ref_logps = read_vector(who, "kl_batch.reference_logps", *ctx, kb.reference_logps,
                                   c.kl_sequences, DType::kF32);
  }
  if (o.check_finite && dev == Device::kCpu) {
    check_finite_head(who, "policy", in.policy);
    if (ref_head) check_finite_head(who, "reference", in.reference);
    if (kl_batch) {
      check_finite_head(who, "kl_batch.policy", in.kl_batch.policy);
      check_finite_head(who, "kl_batch.reference", in.kl_batch.reference);
    }
  }
  return c;
}

// Per-sequence statistics for unit u: (chosen, rejected) for pairs, (u) alone otherwise.
std::size_t unit_stats(const Checked& c, const detail::SequenceSums& sums, std::int64_t u,
                       SequenceStats (&out)[2]) {
  const std::int64_t per = c.call.unit_sequences, units = c.call.sequences / per;
  for (std::int64_t k = 0; k < per; ++k) {
    const auto s = static_cast<std::size_t>(k * units + u);
    out[k].logp = sums.logp[s];
    out[k].ref_logp = sums.ref_logp[s];
    out[k].tokens = c.tokens[s];
    out[k].logit_sum = sums.logit_sum[s];
    out[k].label = per == 2 ? (k == 0 ? 1 : 0) : static_cast<int>(c.labels[s]);
  }
  return static_cast<std::size_t>(per);
}

// The metrics of ../shared/LOSSES.md from the per-unit results and per-sequence sums.
void add_metrics(PreferenceResult& r, const SequenceObjective& obj, const Checked& c,
                 const detail::SequenceSums& sums, const std::vector<UnitResult>& units,
                 const std::vector<std::vector<double>>& extras, double nll, std::int64_t vocab) {
  const bool pairs = obj.unit() == Unit::kPair;
  const auto s = static_cast<std::size_t>(c.call.sequences);
  // Group sums by label (pairs: chosen/rejected by position).
  double rw[2] = {0, 0}, lp[2] = {0, 0}, lg[2] = {0, 0}, cnt[2] = {0, 0}, tok[2] = {0, 0};
  for (std::size_t i = 0; i < s; ++i) {
    const int l = pairs ? (i < s / 2 ? 1 : 0) : static_cast<int>(c.labels[i]);
    const double n = static_cast<double>(c.tokens[i]);
    rw[l] += r.rewards[i];
    lp[l] += obj.averages_log_probs() ? sums.logp[i] / n : sums.logp[i];
    lg[l] += sums.logit_sum[i];
    tok[l] += n;
    cnt[l] += 1;
  }
  const auto mean = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  auto& m = r.metrics;
  m.emplace_back("rewards/chosen", mean(rw[1], cnt[1]));
  m.emplace_back("rewards/rejected", mean(rw[0], cnt[0]));
  if (pairs) {
    double acc = 0, margin = 0;
    for (const UnitResult& u : units) {
      acc += u.reward[0] > u.reward[1] ? 1.0 : 0.0;
      margin += u.reward[0] - u.reward[1];
    }
    const auto nu = static_cast<double>(units.size());
    m.emplace_back("rewards/accuracies", acc / nu);
    m.emplace_back("rewards/margins", margin / nu);
  } else {
    m.emplace_back("rewards/margins", mean(rw[1], cnt[1]) - mean(rw[0], cnt[0]));
  }
  m.emplace_back("logps/chosen", mean(lp[1], cnt[1]));
  m.emplace_back("logps/rejected", mean(lp[0], cnt[0]));
  const auto dv = static_cast<double>(vocab);
  m.emplace_back("logits/chosen", mean(lg[1], tok[1] * dv));
  m.emplace_back("logits/rejected", mean(lg[0], tok[0] * dv));
  if (obj.nll_weight() > 0) m.emplace_back("nll_loss", nll);
  const std::vector<std::string> names = obj.extra_metrics();
  for (std::size_t e = 0; e < names.size(); ++e) {
    double sum = 0;
    for (const auto& x : extras) sum += x[e];
    m.emplace_back(names[e], sum / static_cast<double>(extras.size()));
  }
  if (!pairs) {
    m.emplace_back("count/chosen", cnt[1]);
    m.emplace_back("count/rejected", cnt[0]);
  }
  if (obj.uses_kl()) m.emplace_back("kl", r.kl);
}

// KTO's KL reference point from the mismatched batch: max(0, mean(policy - reference)).
double kl_from_batch(Context& ctx, const Checked& c, const Workspace& ws) {
  const std::vector<double> pol =
      detail::sequence_log_probs(ctx, *c.kl_policy, c.kl_plan, ws, c.kl_seq_len, c.kl_valid);
  const std::vector<double> ref = c.kl_reference
                                      ? detail::sequence_log_probs(ctx, *c.kl_reference, c.kl_plan,
                                                                   ws, c.kl_seq_len, c.kl_valid)
                                      : c.kl_ref_logps;
  double sum = 0;
  for (std::size_t i = 0; i < pol.size(); ++i) sum += pol[i] - ref[i];
  return std::max(0.0, sum / static_cast<double>(pol.size()));
}

// The call's plan; with a KL batch, whose passes run first from the start of the same block,
// the layout is extended to hold their plan too.
Plan call_plan(const Checked& c) {
  Plan p = plan_sequence_objective(c.request, c.layout);
  const std::size_t kl = c.kl_policy ? c.kl_plan.workspace_bytes() : 0;
  if (kl > p.workspace_bytes()) p.layout.add(kl - p.workspace_bytes());
  return p;
}

}  // namespace

SequenceLoss::SequenceLoss(std::shared_ptr<const SequenceObjective> objective,
                           const SequenceOptions& options)
    : objective_(std::move(objective)), options_(options) {
  CHUNKLOSS_CHECK(objective_ != nullptr, "SequenceLoss: objective is null");
  CHUNKLOSS_CHECK(options_.logits_dtype == DType::kF32 || options_.logits_dtype == DType::kBF16,
                  objective_->name(), ": logits_dtype must be f32 or bf16, got ",
                  dtype_name(options_.logits_dtype));
  CHUNKLOSS_CHECK(options_.regime != Regime::kNone, objective_->name(),
                  ": regime none is for token objectives");
  const double w = objective_->nll_weight();
  CHUNKLOSS_CHECK(std::isfinite(w) && w >= 0, objective_->name(),
                  ": nll_weight must be finite and >= 0, got ", w);
}

Plan SequenceLoss::plan(const PreferenceInputs& in, const PreferenceGrads& grads) const {
  const Device dev = in.policy.hidden.defined() ? in.policy.hidden.device() : Device::kCpu;
  return call_plan(check_call(*objective_, options_, nullptr, dev, in, grads));
}

std::size_t SequenceLoss::workspace_bytes(const PreferenceInputs& in,
                                          const PreferenceGrads& grads) const {
  return plan(in, grads).workspace_bytes();
}

PreferenceResult SequenceLoss::forward_backward(Context& ctx, const PreferenceInputs& in,
                                                const PreferenceGrads& grads,
                                                const Workspace& ws) const {
  const SequenceObjective& obj = *objective_;
  const std::string who(obj.name());
  Checked c = check_call(obj, options_, &ctx, ctx.device(), in, grads);
  const Plan plan = call_plan(c);
  CHUNKLOSS_CHECK(ws.device() == ctx.device(), who, ": workspace is on ", device_name(ws.device()),
                  ", the context on ", device_name(ctx.device()));
  ws.require(plan.layout, who.c_str());
  if (c.kl_policy) ws.require(c.kl_plan.layout, who.c_str());

  PreferenceResult r;
  r.kl = c.kl_policy ? kl_from_batch(ctx, c, ws) : in.kl ? std::max(0.0, *in.kl) : 0.0;
  const BatchConstants batch{r.kl};
  const std::int64_t s = c.call.sequences, per = c.call.unit_sequences, units = s / per;
  const double inv_units = 1.0 / static_cast<double>(units);
  // NLL over the chosen (label 1) sequences' tokens.
  double chosen_tokens = 0;
  for (std::int64_t i = 0; i < s; ++i) {
    const bool chosen = per == 2 ? i < units : c.labels[static_cast<std::size_t>(i)] == 1;
    if (chosen) chosen_tokens += static_cast<double>(c.tokens[static_cast<std::size_t>(i)]);
  }
  const double nll_coef = chosen_tokens > 0 ? obj.nll_weight() / chosen_tokens : 0.0;
  const std::size_t num_extras = obj.extra_metrics().size();
  std::vector<UnitResult> results(static_cast<std::size_t>(units));
  std::vector<std::vector<double>> extras(static_cast<std::size_t>(units),
                                          std::vector<double>(num_extras, 0.0));

  detail::UnitsFn on_units = [&](std::int64_t u0, std::int64_t u1, const detail::SequenceSums& sums,
                                 std::vector<double>& coef) {
    for (std::int64_t u = u0; u < u1; ++u) {
      SequenceStats st[2];
      const std::size_t m = unit_stats(c, sums, u, st);
      const auto ui = static_cast<std::size_t>(u);
      results[ui] = obj.evaluate(std::span<const SequenceStats>(st, m), batch, extras[ui]);
      for (std::size_t k = 0; k < m; ++k) {
        const UnitResult& res = results[ui];
        CHUNKLOSS_CHECK(std::isfinite(res.loss) && std::isfinite(res.dlogp[k]), who,
                        ": the objective returned a non-finite loss or derivative for unit ", u,
                        " (logp ", st[k].logp, ", ref ", st[k].ref_logp, ")",
                        u0 > 0 ? "; earlier resident groups' gradients were already written, so "
                                 "the gradient buffers hold unspecified values"
                               : "");
        const auto seq = static_cast<std::size_t>(static_cast<std::int64_t>(k) * units + u);
        coef[seq] = -res.dlogp[k] * inv_units + (st[k].label == 1 ? nll_coef : 0.0);
      }
    }
  };
  const detail::SequenceSums sums = detail::run_sequence_objective(ctx, c.call, plan, ws, on_units);

  r.logps = sums.logp;
  r.ref_logps = sums.ref_logp;
  r.tokens = c.tokens;
  r.rewards.assign(static_cast<std::size_t>(s), 0.0);
  double loss = 0;
  for (std::int64_t u = 0; u < units; ++u) {
    const UnitResult& res = results[static_cast<std::size_t>(u)];
    loss += res.loss;
    r.unit_losses.push_back(res.loss);
    for (std::int64_t k = 0; k < per; ++k)
      r.rewards[static_cast<std::size_t>(k * units + u)] = res.reward[static_cast<std::size_t>(k)];
  }
  double nll = 0;
  for (std::int64_t i = 0; i < s; ++i) {
    const bool chosen = per == 2 ? i < units : c.labels[static_cast<std::size_t>(i)] == 1;
    if (chosen) nll -= sums.logp[static_cast<std::size_t>(i)];
  }
  nll = chosen_tokens > 0 ? nll / chosen_tokens : 0.0;
  r.loss = loss * inv_units + obj.nll_weight() * nll;
  add_metrics(r, obj, c, sums, results, extras, nll, c.call.policy.vocab);
  return r;
}

SequenceLogProbs::SequenceLogProbs(const SequenceOptions& options) : options_(options) {
  CHUNKLOSS_CHECK(options_.logits_dtype == DType::kF32 || options_.logits_dtype == DType::kBF16,
                  "SequenceLogProbs: logits_dtype must be f32 or bf16, got ",
                  dtype_name(options_.logits_dtype));
}

namespace {

constexpr const char* kLogProbs = "SequenceLogProbs";

std::pair<HeadShape, PlanRequest> check_log_probs(const SequenceOptions& o, Device dev,
                                                  const Head& head, const TensorView& targets) {
  check_targets_view(kLogProbs, "targets", targets, dev);
  const HeadShape hs = check_head(kLogProbs, "head", head, dev, targets.size(0), targets.size(1));
  CHUNKLOSS_CHECK(o.logits_dtype == DType::kF32 || hs.dtype == DType::kBF16, kLogProbs,
                  ": logits_dtype bf16 needs a bf16 head, got head.hidden ", head.hidden.str());
  return {hs, head_request(hs, dev, o)};
}

}  // namespace

Plan SequenceLogProbs::plan(const Head& head, const TensorView& targets) const {
  const Device dev = head.hidden.defined() ? head.hidden.device() : Device::kCpu;
  return plan_token_objective(check_log_probs(options_, dev, head, targets).second);
}

std::size_t SequenceLogProbs::workspace_bytes(const Head& head, const TensorView& targets) const {
  return plan(head, targets).workspace_bytes();
}

SequenceLogProbResult SequenceLogProbs::compute(Context& ctx, const Head& head,
                                                const TensorView& targets,
                                                const Workspace& ws) const {
  const auto [hs, q] = check_log_probs(options_, ctx.device(), head, targets);
  const Plan plan = plan_token_objective(q);
  CHUNKLOSS_CHECK(ws.device() == ctx.device(), kLogProbs, ": workspace is on ",
                  device_name(ws.device()), ", the context on ", device_name(ctx.device()));
  ws.require(plan.layout, kLogProbs);
  HostTargets ht = read_targets(kLogProbs, "targets", ctx, targets, hs.v, options_.ignore_index);
  if (options_.check_finite && ctx.device() == Device::kCpu)
    check_finite_head(kLogProbs, "head", head);
  const TensorView rows(targets.data(), targets.dtype(), {hs.n}, targets.device(),
                        targets.device_index());
  const detail::TokenCall call =
      head_call(head, hs, rows, options_.ignore_index, options_.check_finite, ctx.device());
  SequenceLogProbResult r;
  r.logps = detail::sequence_log_probs(ctx, call, plan, ws, targets.size(1), ht.valid);
  r.tokens = std::move(ht.tokens);
  return r;
}

}  // namespace chunkloss
