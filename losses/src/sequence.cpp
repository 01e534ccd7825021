// SequenceLoss and SequenceLogProbs: validation at the boundary, the per-sequence statistics
// handed to the objective, the coefficients c_s it implies, the metrics, and the KL pass.
#include "chunkloss/losses/sequence.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <exception>
#include <span>
#include <sstream>
#include <string>

#include "agreement.h"
#include "chunkloss/core/error.h"
#include "objective_call.h"
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

// Whether any view of the head is given: then all of hidden and weight must be.
bool given(const Head& head) {
  return head.hidden.defined() || head.weight.defined() || head.bias.defined();
}

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

// Refuses a head (`name`, checked as `got`) whose H, V or dtype differs from the policy head's.
void check_like_policy(const char* who, const std::string& name, const Head& head,
                       const HeadShape& got, const Head& policy, const HeadShape& ps) {
  CHUNKLOSS_CHECK(got.h == ps.h && got.v == ps.v && got.dtype == ps.dtype, who, ": ", name,
                  " must match the policy head's H, V and dtype: ", name, ".weight ",
                  head.weight.str(), ", policy.weight ", policy.weight.str());
}

TensorView as_rows(const TensorView& x, std::int64_t n, std::int64_t h) {
  return {x.data(), x.dtype(), {n, h}, x.device(), x.device_index()};
}

// A forward-only (or policy) token call of a head under the plain rule: row loss = -log p(y).
// check_finite is done before the call on either device (check_finite_head), not by the backend.
// With a vocabulary split the head is the rank's shard of a vocabulary of `v_total`.
detail::TokenCall head_call(const Head& head, const HeadShape& hs, const TensorView& targets_rows,
                            std::int64_t ignore_index, const VocabShard& shard = {},
                            std::int64_t v_total = 0) {
  detail::TokenCall k;
  k.rows = hs.n;
  k.hidden = hs.h;
  k.vocab = hs.v;
  k.x = as_rows(head.hidden, hs.n, hs.h);
  k.w = head.weight;
  k.bias = head.bias;
  k.targets = targets_rows;
  k.ignore_index = ignore_index;
  detail::split_vocabulary(shard, v_total, k);
  k.rule.cw_sum = static_cast<float>(k.total_vocab());
  k.scale = detail::RowScale::kSum;
  return k;
}

PlanRequest head_request(const HeadShape& hs, Device dev, const SequenceOptions& o,
                         const VocabShard& shard = {}, std::int64_t v_total = 0) {
  PlanRequest q;
  q.rows = hs.n;
  q.hidden = hs.h;
  q.vocab = hs.v;
  detail::split_vocabulary(shard, v_total, q);
  q.device = dev;
  q.input_dtype = hs.dtype;
  q.logits_dtype = o.logits_dtype;
  q.fp32_weight_grad_accumulator = o.fp32_weight_grad_accumulator;
  q.budget_bytes = o.memory_budget_bytes;
  q.order = o.loop_order;
  q.packed_pieces = true;  // (its sequences are trimmed to their valid rows)
  return q;
}

// Host copies of the targets: validity per row, range checked, and tokens per sequence.
struct HostTargets {
  std::vector<std::uint8_t> valid;
  std::vector<std::int64_t> tokens;
};

HostTargets read_targets(const char* who, const std::string& name, Context& ctx,
                         const TensorView& targets, std::int64_t v, std::int64_t ignore_index) {
  const std::int64_t s = targets.size(0), t = targets.size(1);
  HostTargets h;
  h.valid = detail::read_valid_targets(ctx, who, name.c_str(), targets, v, ignore_index);
  h.tokens.assign(static_cast<std::size_t>(s), 0);
  for (std::size_t i = 0; i < h.valid.size(); ++i)
    h.tokens[i / static_cast<std::size_t>(t)] += h.valid[i];
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

// A CUDA plan's scalars slice, where check_finite counts device views (null on the CPU).
double* device_scalars(const Plan& plan, const Workspace& ws) {
  return plan.scalars.bytes ? ws.at<double>(plan.scalars) : nullptr;
}

// `scalars`: device_scalars(), where device views are counted.
void check_finite_head(Context& ctx, double* scalars, const char* who, const std::string& name,
                       const Head& head) {
  detail::check_finite(ctx, scalars, who, (name + ".hidden").c_str(), head.hidden);
  detail::check_finite(ctx, scalars, who, (name + ".weight").c_str(), head.weight);
  detail::check_finite(ctx, scalars, who, (name + ".bias").c_str(), head.bias);
}

// Everything a call needs, checked: check_call checks the shapes (all plan() does), check_values
// reads and checks the values.
struct Checked {
  detail::SequenceCall call;
  PlanRequest request;
  SequenceLayout layout;
  std::vector<std::int64_t> tokens;
  std::vector<double> labels;
  bool has_reference = false;
  // The reference head, run before pass 1 into call.ref_logps.
  std::optional<detail::TokenCall> reference;
  // The KL batch (KTO): its heads' calls and plans.
  std::optional<detail::TokenCall> kl_policy, kl_reference;
  std::vector<double> kl_ref_logps;
  std::vector<std::uint8_t> kl_valid;
  std::int64_t kl_seq_len = 0, kl_sequences = 0;
  Plan kl_plan;
  dist::Communicator* data_group = nullptr;
  std::int64_t v_total = 0;                   ///< the whole vocabulary
  dist::Communicator* vocab_group = nullptr;  ///< split over more than one rank
};

Checked check_call(const SequenceObjective& obj, const SequenceOptions& o, Device dev,
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
  const bool ref_head = given(in.reference);
  const bool ref_given = in.reference_logps.defined();
  CHUNKLOSS_CHECK(!(ref_head || ref_given) || obj.uses_reference(), who,
                  " is reference-free: reference and reference_logps must be absent");
  CHUNKLOSS_CHECK(!(ref_head && ref_given), who,
                  ": give either a reference head or reference_logps, not both (reference_logps ",
                  in.reference_logps.str(), ")");
  c.has_reference = ref_head || ref_given;
  if (ref_head) {
    const HeadShape rs = check_head(who, "reference", in.reference, dev, s, t);
    check_like_policy(who, "reference", in.reference, rs, in.policy, hs);
  }
  CHUNKLOSS_CHECK(pairs || in.labels.defined(), who, ": labels [", s,
                  "] i32 (1 desirable, 0 undesirable) are required");
  CHUNKLOSS_CHECK(!pairs || !in.labels.defined(), who, ": labels ", in.labels.str(),
                  " are only used by unpaired losses");
  const bool kl_batch = in.kl_batch.targets.defined() || given(in.kl_batch.policy) ||
                        given(in.kl_batch.reference) || in.kl_batch.reference_logps.defined();
  CHUNKLOSS_CHECK(obj.uses_kl() || (!in.kl && !kl_batch), who,
                  ": kl and kl_batch are only used by KTO-style objectives");
  CHUNKLOSS_CHECK(!(in.kl && kl_batch), who, ": give either kl or kl_batch, not both");
  CHUNKLOSS_CHECK(!in.kl || std::isfinite(*in.kl), who, ": kl must be finite, got ",
                  in.kl ? *in.kl : 0.0);

  // grads.hidden is [S*T, H], or [S, T, H] like policy.hidden may be.
  if (gr.hidden.defined() && gr.hidden.ndim() == 3)
    detail::check_optional(who, "grads.hidden", gr.hidden, dev, {s, t, h}, kFloat);
  else
    detail::check_optional(who, "grads.hidden", gr.hidden, dev, {n, h}, kFloat);
  detail::check_optional(who, "grads.weight", gr.weight, dev, {v, h}, kFloat);
  detail::check_optional(who, "grads.bias", gr.bias, dev, {v}, kFloat);
  detail::check_grad_dtypes(
      who, dev, in.policy.hidden,
      {{"grads.hidden", &gr.hidden}, {"grads.weight", &gr.weight}, {"grads.bias", &gr.bias}});
  CHUNKLOSS_CHECK(!gr.bias.defined() || in.policy.bias.defined(), who, ": grads.bias ",
                  gr.bias.str(), " given but policy.bias is absent");
  CHUNKLOSS_CHECK(o.logits_dtype == DType::kF32 || hs.dtype == DType::kBF16, who,
                  ": logits_dtype bf16 needs bf16 heads, got policy.hidden ",
                  in.policy.hidden.str());

  const TensorView targets_rows(in.targets.data(), in.targets.dtype(), {n}, in.targets.device(),
                                in.targets.device_index());
  c.data_group = in.data_group;
  auto& k = c.call;
  const VocabShard& shard = in.vocab_shard;
  c.v_total = detail::check_vocab_shard(who, shard, v, in.policy.weight, o.loop_order);
  CHUNKLOSS_CHECK(c.v_total <= INT32_MAX, who, ": vocab V=", c.v_total, " exceeds 2^31-1");
  c.vocab_group = detail::vocab_split_group(shard);
  CHUNKLOSS_CHECK(!c.vocab_group || o.regime != Regime::kDeferred, who,
                  ": regime deferred is not available with vocab_shard");
  k.policy = head_call(in.policy, hs, targets_rows, o.ignore_index, shard, c.v_total);
  k.policy.grad_x = gr.hidden.defined() ? as_rows(gr.hidden, n, h) : gr.hidden;
  k.policy.grad_w = gr.weight;
  k.policy.grad_bias = gr.bias;
  k.policy.accumulate = gr.accumulate;
  k.policy.logit_sums = true;
  if (o.reduce_weight_grad_over_data_group) k.policy.weight_grad_group = in.data_group;
  // A bf16 gradient tile on CUDA keeps per-sequence coefficients out of its rounding.
  k.policy.row_scales = dev == Device::kCuda && hs.dtype == DType::kBF16;
  if (ref_head)
    c.reference = head_call(in.reference, hs, targets_rows, o.ignore_index, shard, c.v_total);
  k.sequences = s;
  k.seq_len = t;
  k.unit_sequences = pairs ? 2 : 1;

  c.request = head_request(hs, dev, o, shard, c.v_total);
  c.request.grad_hidden = gr.hidden.defined();
  c.request.grad_weight = gr.weight.defined();
  c.request.grad_bias = gr.bias.defined();
  c.request.row_scales = k.policy.row_scales;
  c.request.fp32_weight_grad_accumulator |= k.policy.weight_grad_group != nullptr;
  if (c.request.grad_hidden) c.request.grad_hidden_dtype = gr.hidden.dtype();
  if (c.request.grad_weight) c.request.grad_weight_dtype = gr.weight.dtype();
  c.layout.sequences = s;
  c.layout.seq_len = t;
  c.layout.unit_sequences = k.unit_sequences;
  c.layout.regime = o.regime;
  c.layout.deferrable = !c.vocab_group && pairs && obj.pair_antisymmetric() &&
                        obj.nll_weight() == 0 && !gr.bias.defined() &&
                        !(gr.weight.defined() && gr.accumulate);

  if (kl_batch) {
    const auto& kb = in.kl_batch;
    check_targets_view(who, "kl_batch.targets", kb.targets, dev);
    c.kl_sequences = kb.targets.size(0);
    c.kl_seq_len = kb.targets.size(1);
    const HeadShape ks =
        check_head(who, "kl_batch.policy", kb.policy, dev, c.kl_sequences, c.kl_seq_len);
    check_like_policy(who, "kl_batch.policy", kb.policy, ks, in.policy, hs);
    const bool kref_head = given(kb.reference);
    CHUNKLOSS_CHECK(kref_head != kb.reference_logps.defined(), who,
                    ": kl_batch needs exactly one of a reference head and reference_logps");
    CHUNKLOSS_CHECK(c.has_reference, who,
                    ": kl_batch needs the batch to have a reference too (a head or "
                    "reference_logps): the KL point and the rewards measure against the same "
                    "reference, and without one the point max(0, a mean log-prob) is always 0");
    const TensorView krows(kb.targets.data(), kb.targets.dtype(), {ks.n}, kb.targets.device(),
                           kb.targets.device_index());
    c.kl_policy = head_call(kb.policy, ks, krows, o.ignore_index, shard, c.v_total);
    if (kref_head) {
      const HeadShape kr =
          check_head(who, "kl_batch.reference", kb.reference, dev, c.kl_sequences, c.kl_seq_len);
      check_like_policy(who, "kl_batch.reference", kb.reference, kr, in.policy, hs);
      c.kl_reference = head_call(kb.reference, ks, krows, o.ignore_index, shard, c.v_total);
    }
    c.kl_plan = plan_token_objective(head_request(ks, dev, o, shard, c.v_total));
  }
  return c;
}

// The values of a call checked by check_call: targets, labels, reference log-probs, and with
// check_finite every head (`scalars`: the plan's, for device views).
void check_values(const SequenceObjective& obj, const SequenceOptions& o, Context& ctx,
                  double* scalars, const PreferenceInputs& in, Checked& c) {
  const std::string who_s(obj.name());
  const char* who = who_s.c_str();
  const std::int64_t s = in.targets.size(0);
  const bool pairs = obj.unit() == Unit::kPair;
  auto& k = c.call;
  // Every sequence has a valid token, and log-probs given by the caller are finite.
  const auto read_sequences = [&](const char* name, const TensorView& targets) {
    HostTargets ht = read_targets(who, name, ctx, targets, c.v_total, o.ignore_index);
    for (std::size_t i = 0; i < ht.tokens.size(); ++i)
      CHUNKLOSS_CHECK(ht.tokens[i] > 0, who, ": sequence ", i, " of ", name, " ", targets.str(),
                      " has no valid token (all ignore_index ", o.ignore_index, ")");
    return ht;
  };
  const auto read_logps = [&](const char* name, const TensorView& logps, std::int64_t n) {
    std::vector<double> out = read_vector(who, name, ctx, logps, n, DType::kF32);
    for (std::size_t i = 0; i < out.size(); ++i)
      CHUNKLOSS_CHECK(std::isfinite(out[i]), who, ": ", name, "[", i, "] is not finite");
    return out;
  };
  HostTargets ht = read_sequences("targets", in.targets);
  k.valid = std::move(ht.valid);
  c.tokens = std::move(ht.tokens);
  if (c.layout.deferrable) {
    for (std::int64_t i = 0; i < s; ++i) {
      const double n_i = static_cast<double>(c.tokens[static_cast<std::size_t>(i)]);
      k.kappa.push_back((i < s / 2 ? 1.0 : -1.0) / (obj.averages_log_probs() ? n_i : 1.0));
    }
  }
  if (!pairs) {
    c.labels = read_vector(who, "labels", ctx, in.labels, s, DType::kI32);
    for (std::int64_t i = 0; i < s; ++i) {
      const double l = c.labels[static_cast<std::size_t>(i)];
      CHUNKLOSS_CHECK(l == 0 || l == 1, who, ": labels[", i, "] = ", l, " must be 0 or 1");
    }
  }
  if (in.reference_logps.defined())
    k.ref_logps = read_logps("reference_logps", in.reference_logps, s);
  if (c.kl_policy) {
    const auto& kb = in.kl_batch;
    c.kl_valid = read_sequences("kl_batch.targets", kb.targets).valid;
    if (kb.reference_logps.defined())
      c.kl_ref_logps = read_logps("kl_batch.reference_logps", kb.reference_logps, c.kl_sequences);
  }
  if (o.check_finite) {
    check_finite_head(ctx, scalars, who, "policy", in.policy);
    if (c.reference) check_finite_head(ctx, scalars, who, "reference", in.reference);
    if (c.kl_policy) {
      check_finite_head(ctx, scalars, who, "kl_batch.policy", in.kl_batch.policy);
      check_finite_head(ctx, scalars, who, "kl_batch.reference", in.kl_batch.reference);
    }
  }
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

// Whether sequence i is chosen: the first half of a paired batch, label 1 unpaired.
bool is_chosen(const Checked& c, std::int64_t i) {
  return c.call.unit_sequences == 2 ? i < c.call.sequences / 2
                                    : c.labels[static_cast<std::size_t>(i)] == 1;
}

// The sums behind the loss and the metrics of ../shared/LOSSES.md, one vector of doubles so that
// a data group adds them over its ranks in one call. Pairs of entries are indexed by label (0
// rejected, 1 chosen); the objective's extras follow kNumTally.
constexpr std::size_t kFailed = 0;          // ranks whose objective returned a non-finite value
constexpr std::size_t kLoss = 1, kNll = 2;  // the units' losses; -logp of the chosen sequences
constexpr std::size_t kReward = 3, kLogp = 5, kLogit = 7, kCount = 9, kTokens = 11;
constexpr std::size_t kAccuracy = 13, kMargin = 14, kNumTally = 15;  // pairs only

std::vector<double> tally(const SequenceObjective& obj, const Checked& c,
                          const detail::SequenceSums& sums, const std::vector<double>& rewards,
                          const std::vector<UnitResult>& units,
                          const std::vector<std::vector<double>>& extras, bool failed) {
  std::vector<double> t(kNumTally + obj.extra_metrics().size(), 0.0);
  t[kFailed] = failed ? 1.0 : 0.0;
  for (std::int64_t i = 0; i < c.call.sequences; ++i) {
    const auto si = static_cast<std::size_t>(i);
    const std::size_t l = is_chosen(c, i) ? 1 : 0;
    const double n = static_cast<double>(c.tokens[si]);
    t[kReward + l] += rewards[si];
    t[kLogp + l] += obj.averages_log_probs() ? sums.logp[si] / n : sums.logp[si];
    t[kLogit + l] += sums.logit_sum[si];
    t[kCount + l] += 1;
    t[kTokens + l] += n;
    if (l == 1) t[kNll] -= sums.logp[si];
  }
  for (std::size_t u = 0; u < units.size(); ++u) {
    t[kLoss] += units[u].loss;
    t[kAccuracy] += units[u].reward[0] > units[u].reward[1] ? 1.0 : 0.0;
    t[kMargin] += units[u].reward[0] - units[u].reward[1];
    for (std::size_t e = 0; e < extras[u].size(); ++e) t[kNumTally + e] += extras[u][e];
  }
  return t;
}

// The loss and the metrics from the tally of `units` units (the group's, with a data group).
void set_results(PreferenceResult& r, const SequenceObjective& obj, const std::vector<double>& t,
                 double units, std::int64_t vocab) {
  const auto mean = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  const double nll = mean(t[kNll], t[kTokens + 1]);
  r.loss = t[kLoss] * (1.0 / units) + (obj.nll_weight() > 0 ? obj.nll_weight() * nll : 0.0);
  auto& m = r.metrics;
  // A label without sequences (an unpaired batch of one label) has no means: its metrics and
  // the margin are left out, as TRL's KTO does.
  const bool chosen = t[kCount + 1] > 0, rejected = t[kCount] > 0;
  if (chosen) m.emplace_back("rewards/chosen", mean(t[kReward + 1], t[kCount + 1]));
  if (rejected) m.emplace_back("rewards/rejected", mean(t[kReward], t[kCount]));
  const bool pairs = obj.unit() == Unit::kPair;
  if (pairs) {
    m.emplace_back("rewards/accuracies", t[kAccuracy] / units);
    m.emplace_back("rewards/margins", t[kMargin] / units);
  } else if (chosen && rejected) {
    m.emplace_back("rewards/margins",
                   mean(t[kReward + 1], t[kCount + 1]) - mean(t[kReward], t[kCount]));
  }
  if (chosen) m.emplace_back("logps/chosen", mean(t[kLogp + 1], t[kCount + 1]));
  if (rejected) m.emplace_back("logps/rejected", mean(t[kLogp], t[kCount]));
  const auto dv = static_cast<double>(vocab);
  if (chosen) m.emplace_back("logits/chosen", mean(t[kLogit + 1], t[kTokens + 1] * dv));
  if (rejected) m.emplace_back("logits/rejected", mean(t[kLogit], t[kTokens] * dv));
  if (obj.nll_weight() > 0) m.emplace_back("nll_loss", nll);
  const std::vector<std::string> names = obj.extra_metrics();
  for (std::size_t e = 0; e < names.size(); ++e) m.emplace_back(names[e], t[kNumTally + e] / units);
  if (!pairs) {
    m.emplace_back("count/chosen", t[kCount + 1]);
    m.emplace_back("count/rejected", t[kCount]);
  }
  if (obj.uses_kl()) m.emplace_back("kl", r.kl);
}

// KTO's KL reference point from the mismatched batch (every rank's, with a data group):
// max(0, mean(policy - reference)).
double kl_from_batch(Context& ctx, const char* who, const Checked& c, const Workspace& ws,
                     const detail::GroupSum& sum) {
  const std::vector<double> pol =
      detail::sequence_log_probs(ctx, *c.kl_policy, c.kl_plan, ws, c.kl_seq_len, c.kl_valid);
  const std::vector<double> ref = c.kl_reference
                                      ? detail::sequence_log_probs(ctx, *c.kl_reference, c.kl_plan,
                                                                   ws, c.kl_seq_len, c.kl_valid)
                                      : c.kl_ref_logps;
  double t[2] = {0, static_cast<double>(pol.size())};
  for (std::size_t i = 0; i < pol.size(); ++i) t[0] += pol[i] - ref[i];
  sum(t, 2);
  const double mean = t[0] / t[1];
  // (max(0, NaN) would give a KL point of 0 without a word)
  CHUNKLOSS_CHECK(std::isfinite(mean), who,
                  ": the KL estimate from kl_batch, mean(policy - reference log-probs) over ", t[1],
                  " sequences, is not finite (", mean,
                  "), so its heads' inputs are not: check_finite names the tensor");
  return std::max(0.0, mean);
}

// The reference head's per-sequence log-prob sums, run before the policy's pass 1 into
// call.ref_logps. Without a data group a sequence whose sum is not finite fails the call here,
// before any gradient is written (the ranks of a vocabulary split see the same sums, so they
// all fail); a data group's ranks instead fail its units at the end, as one.
void run_reference(Context& ctx, const char* who, Checked& c, const Plan& plan,
                   const Workspace& ws) {
  if (!c.reference) return;
  detail::SequenceCall& k = c.call;
  k.ref_logps = detail::sequence_log_probs(ctx, *c.reference, plan, ws, k.seq_len, k.valid);
  if (c.data_group) return;
  for (std::size_t i = 0; i < k.ref_logps.size(); ++i)
    CHUNKLOSS_CHECK(std::isfinite(k.ref_logps[i]), who,
                    ": the reference head's log-prob of sequence ", i, " is not finite (",
                    k.ref_logps[i], "), so its inputs are not: check_finite names the tensor");
}

// The deferred regime's first pair: its coefficients must be gamma * kappa, as the objective's
// pair_antisymmetric() declares (the engine scales the pair's gradient by gamma alone).
// The message gives the objective's derivatives in the two values it declares to see.
void check_deferred_pair(const SequenceObjective& obj, const Checked& c,
                         const std::vector<double>& coef, const UnitResult& res,
                         const SequenceStats* st) {
  const auto rejected = static_cast<std::size_t>(c.call.sequences / 2);
  const double expect = coef[0] / c.call.kappa[0] * c.call.kappa[rejected];
  const bool avg = obj.averages_log_probs();
  const auto in_value = [&](std::size_t k) {
    return res.dlogp[k] * (avg ? static_cast<double>(st[k].tokens) : 1.0);
  };
  CHUNKLOSS_CHECK(std::abs(coef[rejected] - expect) <= 1e-9 * std::abs(expect) + 1e-300, obj.name(),
                  " declares pair_antisymmetric() but on the deferred pair its derivatives in "
                  "value(chosen) and value(rejected), the log-prob ",
                  avg ? "length averages (averages_log_probs() is true)"
                      : "sums (averages_log_probs() is false)",
                  ", are ", in_value(0), " and ", in_value(1),
                  ", not equal and opposite; the gradient buffers hold unspecified values");
}

// The values vocab_call_kind and data_call_kind compare, and the two sums (units and chosen
// tokens) of the data group's first exchange.
constexpr std::size_t kVocabKind = 14, kDataKind = 4, kDataSums = 2;

// The call's plan; with a KL batch, whose passes run first from the start of the same block,
// the layout is extended to hold their plan too.
Plan call_plan(const Checked& c) {
  Plan p = plan_sequence_objective(c.request, c.layout);
  if (c.kl_policy) {
    detail::reserve_workspace(p, c.kl_plan.workspace_bytes());
    if (c.kl_plan.over_budget) {  // its smallest chunk alone exceeds the budget
      p.over_budget = true;
      p.reason += "; the KL batch's plan exceeds the budget: " + c.kl_plan.str();
    }
  }
  return p;
}

// The objective as far as the library can see it: its name, unit, averaging, NLL weight, use of
// the KL point and extra metrics (not its own options, such as beta).
double objective_digest(const SequenceObjective& obj) {
  std::ostringstream s;
  s << obj.name() << '|' << static_cast<int>(obj.unit()) << '|' << obj.averages_log_probs() << '|'
    << obj.nll_weight() << '|' << obj.uses_kl();
  for (const std::string& m : obj.extra_metrics()) s << '|' << m;
  const std::string t = s.str();
  return detail::kind_digest({reinterpret_cast<const std::uint8_t*>(t.data()), t.size()});
}

// What every rank of a data group must have alike for their collectives to match or for their
// sums to mean one loss: the KL batch, the sums of dW and db in the call, the heads' H and V,
// and the objective (its objective_digest).
std::array<double, kDataKind> data_call_kind(double objective, const Checked& c) {
  const auto& k = c.call.policy;
  const bool sum = k.weight_grad_group != nullptr;
  return {(c.kl_policy ? 1.0 : 0.0) + (sum && k.grad_w.defined() ? 2.0 : 0.0) +
              (sum && k.grad_bias.defined() ? 4.0 : 0.0),
          static_cast<double>(k.hidden), static_cast<double>(k.vocab), objective};
}

// What every rank of a vocabulary split must have alike for their collectives (in the passes)
// to match, and for their coefficients to be the same: the heads run, dH, the plans' regime,
// chunks and groups, H, V, the rows and which of them count (the policy's and the KL batch's),
// the objective (its objective_digest) and the values it reads besides the sums
// (reference_logps, labels, kl and the KL batch's reference_logps).
std::array<double, kVocabKind> vocab_call_kind(double objective, const Checked& c, const Plan& p,
                                               const PreferenceInputs& in) {
  std::vector<double> given = c.call.ref_logps;
  given.insert(given.end(), c.labels.begin(), c.labels.end());
  given.insert(given.end(), c.kl_ref_logps.begin(), c.kl_ref_logps.end());
  if (in.kl) given.push_back(*in.kl);
  const auto& k = c.call.policy;
  const double heads = (c.reference ? 1 : 0) + (c.kl_policy ? 2 : 0) + (c.kl_reference ? 4 : 0) +
                       (k.grad_x.defined() ? 8 : 0) + (k.any_grad() ? 16 : 0) +
                       32.0 * static_cast<double>(p.regime);
  const auto d = [](std::int64_t x) { return static_cast<double>(x); };
  return {heads,
          d(p.chunk_rows),
          d(p.group_units),
          d(c.call.sequences),
          d(c.call.seq_len),
          d(c.kl_sequences),
          d(c.kl_seq_len),
          d(c.kl_plan.chunk_rows),
          d(k.hidden),
          d(c.v_total),
          detail::kind_digest(c.call.valid),
          detail::kind_digest(c.kl_valid),
          objective,
          detail::kind_digest(given)};
}

}  // namespace

SequenceLoss::SequenceLoss(std::shared_ptr<const SequenceObjective> objective,
                           const SequenceOptions& options)
    : objective_(std::move(objective)), options_(options) {
  CHUNKLOSS_CHECK(objective_ != nullptr, "SequenceLoss: objective is null");
  CHUNKLOSS_CHECK(options_.logits_dtype == DType::kF32 || options_.logits_dtype == DType::kBF16,
                  objective_->name(), ": logits_dtype must be f32 or bf16, got ",
                  dtype_name(options_.logits_dtype));
  CHUNKLOSS_CHECK(options_.regime != Regime::kNone && regime_name(options_.regime) != "?",
                  objective_->name(),
                  ": regime must be auto, resident, recompute or deferred, got the value ",
                  static_cast<int>(options_.regime));
  detail::check_loop_order(objective_->name(), options_.loop_order);
  const double w = objective_->nll_weight();
  CHUNKLOSS_CHECK(std::isfinite(w) && w >= 0, objective_->name(),
                  ": nll_weight must be finite and >= 0, got ", w);
}

Plan SequenceLoss::plan(const PreferenceInputs& in, const PreferenceGrads& grads) const {
  const Device dev = in.policy.hidden.defined() ? in.policy.hidden.device() : Device::kCpu;
  return call_plan(check_call(*objective_, options_, dev, in, grads));
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
  // Everything checked before the first collective: with a data group or a vocabulary split the
  // ranks first agree whether any rank rejected its call and whether they all make the same kind
  // of call, so that all of them throw instead of the others waiting for one that threw.
  dist::Communicator* vocab_group = detail::vocab_split_group(in.vocab_shard);
  std::optional<Checked> checked;
  Plan plan;
  std::exception_ptr rejected;
  std::array<double, kVocabKind> vocab_kind{};
  std::array<double, kDataKind> data_kind{};
  try {
    checked.emplace(check_call(obj, options_, ctx.device(), in, grads));
    plan = call_plan(*checked);
    CHUNKLOSS_CHECK(ws.device() == ctx.device(), who, ": workspace is on ",
                    device_name(ws.device()), ", the context on ", device_name(ctx.device()));
    const auto& kb = in.kl_batch;
    detail::check_memory(who.c_str(), ctx, ws,
                         {{"policy.hidden", &in.policy.hidden},
                          {"policy.weight", &in.policy.weight},
                          {"policy.bias", &in.policy.bias},
                          {"targets", &in.targets},
                          {"reference.hidden", &in.reference.hidden},
                          {"reference.weight", &in.reference.weight},
                          {"reference.bias", &in.reference.bias},
                          {"kl_batch.policy.hidden", &kb.policy.hidden},
                          {"kl_batch.policy.weight", &kb.policy.weight},
                          {"kl_batch.policy.bias", &kb.policy.bias},
                          {"kl_batch.targets", &kb.targets},
                          {"kl_batch.reference.hidden", &kb.reference.hidden},
                          {"kl_batch.reference.weight", &kb.reference.weight},
                          {"kl_batch.reference.bias", &kb.reference.bias},
                          {"reference_logps", &in.reference_logps},
                          {"labels", &in.labels},
                          {"kl_batch.reference_logps", &kb.reference_logps}},
                         {{"grads.hidden", &grads.hidden},
                          {"grads.weight", &grads.weight},
                          {"grads.bias", &grads.bias}});
    ws.require(plan.layout, who.c_str());
    if (checked->kl_policy) ws.require(checked->kl_plan.layout, who.c_str());
    check_values(obj, options_, ctx, device_scalars(plan, ws), in, *checked);
    // The kinds ask the objective (a user's may throw): a rank that fails here is rejected too.
    const double objective = detail::call_objective(
        who, [] { return "while describing itself"; }, "", [&] { return objective_digest(obj); });
    vocab_kind = vocab_call_kind(objective, *checked, plan, in);
    data_kind = data_call_kind(objective, *checked);
  } catch (...) {
    if (!in.data_group && !vocab_group) throw;
    rejected = std::current_exception();
    vocab_kind = {};
    data_kind = {};
  }
  // Units and tokens of the chosen sequences (the NLL term's divisor), summed over the data group.
  double counts[kDataSums] = {0, 0};
  if (!rejected) {
    const Checked& c = *checked;
    counts[0] = static_cast<double>(c.call.sequences / c.call.unit_sequences);
    for (std::int64_t i = 0; i < c.call.sequences; ++i)
      if (is_chosen(c, i)) counts[1] += static_cast<double>(c.tokens[static_cast<std::size_t>(i)]);
  }
  detail::agree_on_call(
      ctx, who.c_str(), vocab_group, in.data_group, rejected,
      {vocab_kind, data_kind, counts,
       "a reference head, a KL batch, dH asked for, H, vocab_shard.size, their rows or targets, "
       "their plans, the objective, or reference_logps, labels or kl",
       "a KL batch, dW or db summed in the call, H or V, or the objective"});
  const detail::GroupSum group_sum{ctx, in.data_group};
  Checked& c = *checked;
  const std::int64_t s = c.call.sequences, per = c.call.unit_sequences, units = s / per;
  const double all_units = counts[0], inv_units = 1.0 / all_units, chosen_tokens = counts[1];
  const double nll_coef = chosen_tokens > 0 ? obj.nll_weight() / chosen_tokens : 0.0;

  PreferenceResult r;
  r.kl = c.kl_policy ? kl_from_batch(ctx, who.c_str(), c, ws, group_sum)
         : in.kl     ? std::max(0.0, *in.kl)
                     : 0.0;
  run_reference(ctx, who.c_str(), c, plan, ws);
  const BatchConstants batch{r.kl};
  const std::size_t num_extras = obj.extra_metrics().size();
  std::vector<UnitResult> results(static_cast<std::size_t>(units));
  std::vector<std::vector<double>> extras(static_cast<std::size_t>(units),
                                          std::vector<double>(num_extras, 0.0));
  const bool deferred = plan.regime == Regime::kDeferred && c.call.policy.any_grad();
  // With a data group or a vocabulary split the objective's failure is thrown at the end, once
  // the ranks know of it: the failed units' coefficients are 0 and the passes' collectives go on.
  // (The ranks of a vocabulary split see the same sums and agreed on the objective's other
  // inputs, so they fail alike unless their objectives differ in what the library cannot see.)
  const bool defer = in.data_group || vocab_group;
  std::exception_ptr failed;

  detail::UnitsFn on_units = [&](std::int64_t u0, std::int64_t u1, const detail::SequenceSums& sums,
                                 std::vector<double>& coef) {
    for (std::int64_t u = u0; u < u1; ++u) {
      SequenceStats st[2];
      const std::size_t m = unit_stats(c, sums, u, st);
      const auto ui = static_cast<std::size_t>(u);
      // (the deferred regime writes its first pair's gradients before evaluating it)
      const char* written = u0 > 0 || defer || deferred
                                ? "; gradients were already written, so the gradient buffers "
                                  "hold unspecified values"
                                : "";
      try {
        results[ui] = detail::call_objective(
            who, [u] { return "for unit " + std::to_string(u); }, written,
            [&] { return obj.evaluate(std::span<const SequenceStats>(st, m), batch, extras[ui]); });
        const UnitResult& res = results[ui];
        // A unit with non-finite log-probs fails even where the objective's value stays finite
        // (a hinge's max(0, NaN) is 0).
        for (std::size_t k = 0; k < m; ++k) {
          const auto seq = static_cast<std::int64_t>(k) * units + u;
          CHUNKLOSS_CHECK(std::isfinite(st[k].logp) && std::isfinite(st[k].ref_logp), who,
                          ": the log-probs of sequence ", seq, " (unit ", u,
                          ") are not finite (logp ", st[k].logp, ", ref ", st[k].ref_logp,
                          "), so the inputs are not: check_finite names the tensor", written);
        }
        for (std::size_t k = 0; k < m; ++k) {
          CHUNKLOSS_CHECK(std::isfinite(res.loss) && std::isfinite(res.dlogp[k]), who,
                          ": the objective returned a non-finite loss or derivative for unit ", u,
                          " (logp ", st[k].logp, ", ref ", st[k].ref_logp, ")", written);
          const auto seq = static_cast<std::size_t>(static_cast<std::int64_t>(k) * units + u);
          coef[seq] = -res.dlogp[k] * inv_units + (st[k].label == 1 ? nll_coef : 0.0);
        }
        if (deferred && u == 0) check_deferred_pair(obj, c, coef, res, st);
      } catch (...) {
        if (!defer) throw;
        if (!failed) failed = std::current_exception();
        for (std::size_t k = 0; k < m; ++k)
          coef[static_cast<std::size_t>(static_cast<std::int64_t>(k) * units + u)] = 0.0;
      }
    }
  };
  const detail::SequenceSums sums = detail::run_sequence_objective(ctx, c.call, plan, ws, on_units);

  r.logps = sums.logp;
  r.ref_logps = sums.ref_logp;
  r.tokens = c.tokens;
  r.rewards.assign(static_cast<std::size_t>(s), 0.0);
  for (std::int64_t u = 0; u < units; ++u) {
    const UnitResult& res = results[static_cast<std::size_t>(u)];
    r.unit_losses.push_back(res.loss);
    for (std::int64_t k = 0; k < per; ++k)
      r.rewards[static_cast<std::size_t>(k * units + u)] = res.reward[static_cast<std::size_t>(k)];
  }
  std::vector<double> t = tally(obj, c, sums, r.rewards, results, extras, failed != nullptr);
  group_sum(t.data(), t.size());
  // The data group's failed ranks, then (in a grid, each data group's) over the vocabulary split.
  double failures = t[kFailed];
  if (vocab_group) detail::GroupSum{ctx, vocab_group}(&failures, 1);
  if (failed) std::rethrow_exception(failed);
  CHUNKLOSS_CHECK(failures == 0, who,
                  ": the objective failed (threw or returned a non-finite value) on ", failures,
                  " other rank(s) of data_group or vocab_shard.group; the gradient buffers hold "
                  "unspecified values");
  set_results(r, obj, t, all_units, c.v_total);
  return r;
}

SequenceLogProbs::SequenceLogProbs(const SequenceOptions& options) : options_(options) {
  detail::check_loop_order("SequenceLogProbs", options_.loop_order);
  CHUNKLOSS_CHECK(options_.logits_dtype == DType::kF32 || options_.logits_dtype == DType::kBF16,
                  "SequenceLogProbs: logits_dtype must be f32 or bf16, got ",
                  dtype_name(options_.logits_dtype));
}

namespace {

constexpr const char* kLogProbs = "SequenceLogProbs";

// A log-probs call, checked: the head's shape, the plan's request and the whole vocabulary.
struct LogProbCall {
  HeadShape hs;
  PlanRequest request;
  std::int64_t v_total = 0;
};

LogProbCall check_log_probs(const SequenceOptions& o, Device dev, const Head& head,
                            const TensorView& targets, const VocabShard& shard) {
  check_targets_view(kLogProbs, "targets", targets, dev);
  const HeadShape hs = check_head(kLogProbs, "head", head, dev, targets.size(0), targets.size(1));
  CHUNKLOSS_CHECK(o.logits_dtype == DType::kF32 || hs.dtype == DType::kBF16, kLogProbs,
                  ": logits_dtype bf16 needs a bf16 head, got head.hidden ", head.hidden.str());
  const std::int64_t v_total =
      detail::check_vocab_shard(kLogProbs, shard, hs.v, head.weight, o.loop_order);
  CHUNKLOSS_CHECK(v_total <= INT32_MAX, kLogProbs, ": vocab V=", v_total, " exceeds 2^31-1");
  return {hs, head_request(hs, dev, o, shard, v_total), v_total};
}

// What the ranks of a vocabulary split compare in their one exchange: the plan's chunks, S, T,
// H, and which rows have valid targets.
constexpr std::size_t kLogProbKind = 6;

}  // namespace

Plan SequenceLogProbs::plan(const Head& head, const TensorView& targets,
                            const VocabShard& shard) const {
  const Device dev = head.hidden.defined() ? head.hidden.device() : Device::kCpu;
  return plan_token_objective(check_log_probs(options_, dev, head, targets, shard).request);
}

std::size_t SequenceLogProbs::workspace_bytes(const Head& head, const TensorView& targets,
                                              const VocabShard& shard) const {
  return plan(head, targets, shard).workspace_bytes();
}

SequenceLogProbResult SequenceLogProbs::compute(Context& ctx, const Head& head,
                                                const TensorView& targets, const Workspace& ws,
                                                const VocabShard& shard) const {
  // With a vocabulary split, everything is checked before the ranks' one exchange, in which they
  // agree whether any rank rejected its call, so that all of them throw.
  dist::Communicator* group = detail::vocab_split_group(shard);
  std::optional<LogProbCall> c;
  Plan plan;
  HostTargets ht;
  std::exception_ptr rejected;
  try {
    c.emplace(check_log_probs(options_, ctx.device(), head, targets, shard));
    plan = plan_token_objective(c->request);
    CHUNKLOSS_CHECK(ws.device() == ctx.device(), kLogProbs, ": workspace is on ",
                    device_name(ws.device()), ", the context on ", device_name(ctx.device()));
    detail::check_memory(kLogProbs, ctx, ws,
                         {{"head.hidden", &head.hidden},
                          {"head.weight", &head.weight},
                          {"head.bias", &head.bias},
                          {"targets", &targets}},
                         {});
    ws.require(plan.layout, kLogProbs);
    ht = read_targets(kLogProbs, "targets", ctx, targets, c->v_total, options_.ignore_index);
    if (options_.check_finite)
      check_finite_head(ctx, device_scalars(plan, ws), kLogProbs, "head", head);
  } catch (...) {
    if (!group) throw;
    rejected = std::current_exception();
  }
  if (group) {
    const auto d = [](std::int64_t x) { return static_cast<double>(x); };
    std::array<double, kLogProbKind> kind{};
    if (!rejected)
      kind = {d(plan.chunk_rows),
              d(targets.size(0)),
              d(targets.size(1)),
              d(c->hs.h),
              detail::kind_digest(ht.valid),
              d(c->v_total)};
    detail::agree_on_call(ctx, kLogProbs, group, nullptr, rejected,
                          {kind,
                           {},
                           {},
                           "their rows, H, which targets are valid, their plans, or "
                           "vocab_shard.size",
                           ""});
  }
  const TensorView rows(targets.data(), targets.dtype(), {c->hs.n}, targets.device(),
                        targets.device_index());
  const detail::TokenCall call =
      head_call(head, c->hs, rows, options_.ignore_index, shard, c->v_total);
  SequenceLogProbResult r;
  r.logps = detail::sequence_log_probs(ctx, call, plan, ws, targets.size(1), ht.valid);
  r.tokens = std::move(ht.tokens);
  return r;
}

}  // namespace chunkloss
