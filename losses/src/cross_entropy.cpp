// LinearCrossEntropy: option and argument validation, the cross-entropy row rule, and the call
// into the shared token engine.
#include "chunkloss/losses/cross_entropy.h"

#include <array>
#include <cmath>
#include <exception>
#include <limits>
#include <optional>
#include <vector>

#include "agreement.h"
#include "ce_call.h"
#include "chunkloss/core/error.h"
#include "engine.h"
#include "validate.h"

namespace chunkloss {

std::string_view reduction_name(Reduction r) {
  switch (r) {
    case Reduction::kMean:
      return "mean";
    case Reduction::kSum:
      return "sum";
    case Reduction::kNone:
      return "none";
  }
  return "?";
}

namespace {

constexpr const char* kWho = "LinearCrossEntropy";
constexpr std::initializer_list<DType> kFloat = {DType::kF32, DType::kBF16};

using Checked = detail::CeCall;

}  // namespace

// `calling`: also check the outputs and the values (targets' range, finiteness); plan() checks
// shapes and dtypes only and reads no data.
detail::CeCall detail::check_ce_call(const char* who, const CrossEntropyOptions& o, Device dev,
                                     const CrossEntropyInputs& in, const CrossEntropyGrads& gr,
                                     const CrossEntropyOutputs& out, bool calling) {
  CHUNKLOSS_CHECK(in.hidden.defined() && in.hidden.ndim() == 2, who,
                  ": hidden must be [N, H], got ", in.hidden.str());
  CHUNKLOSS_CHECK(in.weight.defined() && in.weight.ndim() == 2, who,
                  ": weight must be [V, H], got ", in.weight.str());
  const std::int64_t n = in.hidden.size(0), h = in.hidden.size(1), v = in.weight.size(0);
  CHUNKLOSS_CHECK(n > 0 && h > 0 && v > 0, who, ": empty problem: hidden ", in.hidden.str(),
                  ", weight ", in.weight.str());
  const VocabShard& shard = in.vocab_shard;
  const std::int64_t v_total = detail::check_vocab_shard(who, shard, v, in.weight, o.loop_order);
  CHUNKLOSS_CHECK(v_total <= INT32_MAX, who, ": vocab V=", v_total, " exceeds 2^31-1");
  check_view(who, "hidden", in.hidden, dev, {n, h}, kFloat);
  CHUNKLOSS_CHECK(in.weight.size(1) == h, who, ": weight ", in.weight.str(),
                  " does not match hidden ", in.hidden.str(), " (H differs)");
  check_view(who, "weight", in.weight, dev, {v, h}, {in.hidden.dtype()});
  check_optional(who, "bias", in.bias, dev, {v}, {in.hidden.dtype()});
  CHUNKLOSS_CHECK(o.logits_dtype == DType::kF32 || in.hidden.dtype() == DType::kBF16, who,
                  ": logits_dtype bf16 needs bf16 hidden and weight, got hidden ", in.hidden.str());
  check_view(who, "targets", in.targets, dev, {n}, {DType::kI32, DType::kI64});
  check_optional(who, "class_weights", in.class_weights, dev, {v_total}, {DType::kF32});
  check_optional(who, "token_weights", in.token_weights, dev, {n}, {DType::kF32});
  check_optional(who, "grad_hidden", gr.hidden, dev, {n, h}, kFloat);
  check_optional(who, "grad_weight", gr.weight, dev, {v, h}, kFloat);
  check_optional(who, "grad_bias", gr.bias, dev, {v}, kFloat);
  detail::check_grad_dtypes(
      who, dev, in.hidden,
      {{"grad_hidden", &gr.hidden}, {"grad_weight", &gr.weight}, {"grad_bias", &gr.bias}});
  CHUNKLOSS_CHECK(!gr.bias.defined() || in.bias.defined(), who, ": grad_bias ", gr.bias.str(),
                  " given but bias is absent");
  const bool grads = gr.hidden.defined() || gr.weight.defined() || gr.bias.defined();
  if (o.reduction == Reduction::kNone) {
    CHUNKLOSS_CHECK(!calling || out.row_loss.defined(), who,
                    ": reduction none needs outputs.row_loss [", n, "] f32");
    CHUNKLOSS_CHECK(!grads || in.grad_output.defined(), who,
                    ": reduction none with gradients needs grad_output [", n, "] f32");
  } else {
    CHUNKLOSS_CHECK(!in.grad_output.defined(), who, ": grad_output ", in.grad_output.str(),
                    " is only used with reduction none, reduction is ",
                    reduction_name(o.reduction));
  }
  check_optional(who, "grad_output", in.grad_output, dev, {n}, {DType::kF32});
  check_optional(who, "outputs.row_loss", out.row_loss, dev, {n}, {DType::kF32});
  check_optional(who, "outputs.lse", out.lse, dev, {n}, {DType::kF32});
  check_optional(who, "outputs.predictions", out.predictions, dev, {n}, {DType::kI32});
  check_optional(who, "outputs.scalars", out.scalars, dev, {7}, {DType::kF32});
  CHUNKLOSS_CHECK(!calling || o.copy_results_to_host || out.scalars.defined(), who,
                  ": copy_results_to_host = false needs outputs.scalars [7] f32");
  if (calling && dev == Device::kCpu) {
    detail::check_targets(who, in.targets, v_total, o.ignore_index);
    detail::check_class_weights(who, in.class_weights);
    if (o.check_finite) {
      detail::check_finite(who, "hidden", in.hidden);
      detail::check_finite(who, "weight", in.weight);
      detail::check_finite(who, "bias", in.bias);
      detail::check_finite(who, "token_weights", in.token_weights);
      detail::check_finite(who, "grad_output", in.grad_output);
    }
  }
  Checked c;
  auto& k = c.call;
  k.who = who;
  k.rows = n;
  k.hidden = h;
  k.vocab = v;
  detail::split_vocabulary(shard, v_total, k);
  k.data_group = in.data_group;
  if (o.reduce_weight_grad_over_data_group) k.weight_grad_group = in.data_group;
  k.x = in.hidden;
  k.w = in.weight;
  k.bias = in.bias;
  k.targets = in.targets;
  k.class_weights = in.class_weights;
  k.token_weights = in.token_weights;
  k.upstream = in.grad_output;
  k.grad_x = gr.hidden;
  k.grad_w = gr.weight;
  k.grad_bias = gr.bias;
  k.accumulate = gr.accumulate;
  k.out_row_loss = out.row_loss;
  k.out_lse = out.lse;
  k.out_pred = out.predictions;
  k.out_scalars = out.scalars;
  k.copy_results = o.copy_results_to_host;
  k.ignore_index = o.ignore_index;
  const float ls = o.label_smoothing;
  k.rule.one_minus_ls = 1.0f - ls;
  k.rule.eps = ls / static_cast<float>(v_total);
  k.rule.z_loss = o.z_loss;
  k.rule.cw_sum = static_cast<float>(v_total);
  if (calling && in.class_weights.defined() && dev == Device::kCpu) {
    double s = 0;
    for (std::int64_t j = 0; j < v_total; ++j) s += in.class_weights.data_as<const float>()[j];
    k.rule.cw_sum = static_cast<float>(s);
  }
  k.softcap = o.softcap ? *o.softcap : 0.0f;
  k.entropy = o.compute_entropy;
  k.check_finite = o.check_finite && dev == Device::kCuda;
  k.chunks_in_order = true;
  k.scale = o.reduction == Reduction::kMean  ? detail::RowScale::kMean
            : o.reduction == Reduction::kSum ? detail::RowScale::kSum
                                             : detail::RowScale::kUpstream;

  auto& q = c.request;
  q.rows = n;
  q.hidden = h;
  q.vocab = v;
  q.device = dev;
  q.input_dtype = in.hidden.dtype();
  q.logits_dtype = o.logits_dtype;
  q.grad_hidden = gr.hidden.defined();
  q.grad_weight = gr.weight.defined();
  q.grad_bias = gr.bias.defined();
  if (q.grad_hidden) q.grad_hidden_dtype = gr.hidden.dtype();
  if (q.grad_weight) q.grad_weight_dtype = gr.weight.dtype();
  q.fp32_weight_grad_accumulator =
      o.fp32_weight_grad_accumulator || (o.reduce_weight_grad_over_data_group && in.data_group);
  q.budget_bytes = o.memory_budget_bytes;
  q.order = o.loop_order;
  q.skip_ignored_rows = q.packed_pieces = o.skip_ignored_rows;
  detail::split_vocabulary(shard, v_total, q);
  return c;
}

bool detail::skips_rows(const CrossEntropyOptions& o, const Plan& plan, const TokenCall& k) {
  return o.skip_ignored_rows && !(plan.order == LoopOrder::kVocabBlock && k.any_grad());
}

std::array<double, detail::kVocabKind> detail::vocab_call_kind(const TokenCall& k, const Plan& plan,
                                                               bool check_finite) {
  const auto d = [](std::int64_t x) { return static_cast<double>(x); };
  const std::vector<RowRange> rows = computed_rows(k);
  return {d(k.rows),
          d(plan.chunk_rows),
          d(row_count(rows)),
          kind_digest(
              {reinterpret_cast<const std::uint8_t*>(rows.data()), rows.size() * sizeof(RowRange)}),
          d(k.hidden),
          (k.grad_x.defined() ? 1.0 : 0.0) + (check_finite ? 2.0 : 0.0),
          rule_digest(k)};
}

namespace {

// What the ranks of a data group compare before the first collective (a vocabulary split's:
// detail::vocab_call_kind): H, V, whether dW and db are summed in the call, and check_finite
// (on CUDA its ranks then read the group's counts at the start, and throw there together).
constexpr std::size_t kDataKind = 5;

// With skip_ignored_rows, in token-chunk order: the rows the call computes, from the targets
// read on the host (which checks their range there).
void find_rows_to_compute(Context& ctx, const CrossEntropyOptions& o, const Plan& plan,
                          detail::TokenCall& k) {
  if (!detail::skips_rows(o, plan, k)) return;
  const std::vector<std::uint8_t> valid =
      detail::read_valid_targets(ctx, kWho, "targets", k.targets, k.total_vocab(), o.ignore_index);
  k.row_ranges = detail::rows_to_compute(valid, plan.skip_gap_rows);
}

Plan call_plan(const Checked& c) { return plan_token_objective(c.request); }

}  // namespace

LinearCrossEntropy::LinearCrossEntropy(const CrossEntropyOptions& o) : options_(o) {
  CHUNKLOSS_CHECK(reduction_name(o.reduction) != "?", kWho,
                  ": reduction must be mean, sum or none, got the value ",
                  static_cast<int>(o.reduction));
  detail::check_loop_order(kWho, o.loop_order);
  CHUNKLOSS_CHECK(
      std::isfinite(o.label_smoothing) && o.label_smoothing >= 0.0f && o.label_smoothing <= 1.0f,
      kWho, ": label_smoothing must be in [0, 1], got ", o.label_smoothing);
  CHUNKLOSS_CHECK(std::isfinite(o.z_loss) && o.z_loss >= 0.0f, kWho,
                  ": z_loss must be finite and >= 0, got ", o.z_loss);
  CHUNKLOSS_CHECK(!o.softcap || (std::isfinite(*o.softcap) && *o.softcap > 0.0f), kWho,
                  ": softcap must be finite and > 0, got ", o.softcap ? *o.softcap : 0.0f);
  CHUNKLOSS_CHECK(o.logits_dtype == DType::kF32 || o.logits_dtype == DType::kBF16, kWho,
                  ": logits_dtype must be f32 or bf16, got ", dtype_name(o.logits_dtype));
}

Plan LinearCrossEntropy::plan(const CrossEntropyInputs& in, const CrossEntropyGrads& grads) const {
  const Device dev = in.hidden.defined() ? in.hidden.device() : Device::kCpu;
  return call_plan(detail::check_ce_call(kWho, options_, dev, in, grads, {}, false));
}

std::size_t LinearCrossEntropy::workspace_bytes(const CrossEntropyInputs& in,
                                                const CrossEntropyGrads& grads) const {
  return plan(in, grads).workspace_bytes();
}

CrossEntropyResult LinearCrossEntropy::forward_backward(Context& ctx, const CrossEntropyInputs& in,
                                                        const CrossEntropyGrads& grads,
                                                        const CrossEntropyOutputs& out,
                                                        const Workspace& ws) const {
  // With groups, everything checked before the call's first collective is agreed on by the
  // ranks: any rank's rejection, or calls whose collectives would not match, make every rank
  // throw instead of the others waiting for the one that threw.
  dist::Communicator* vocab_group = detail::vocab_split_group(in.vocab_shard);
  std::optional<Checked> c;
  Plan plan;
  std::exception_ptr rejected;
  try {
    c.emplace(detail::check_ce_call(kWho, options_, ctx.device(), in, grads, out, true));
    plan = call_plan(*c);
    CHUNKLOSS_CHECK(ws.device() == ctx.device(), kWho, ": workspace is on ",
                    device_name(ws.device()), ", the context on ", device_name(ctx.device()));
    detail::check_memory(kWho, ctx, ws,
                         {{"hidden", &in.hidden},
                          {"weight", &in.weight},
                          {"bias", &in.bias},
                          {"targets", &in.targets},
                          {"class_weights", &in.class_weights},
                          {"token_weights", &in.token_weights},
                          {"grad_output", &in.grad_output}},
                         {{"grad_hidden", &grads.hidden},
                          {"grad_weight", &grads.weight},
                          {"grad_bias", &grads.bias},
                          {"outputs.row_loss", &out.row_loss},
                          {"outputs.lse", &out.lse},
                          {"outputs.predictions", &out.predictions},
                          {"outputs.scalars", &out.scalars}});
    ws.require(plan.layout, kWho);
    find_rows_to_compute(ctx, options_, plan, c->call);
  } catch (...) {
    if (!vocab_group && !in.data_group) throw;
    rejected = std::current_exception();
  }
  if (vocab_group || in.data_group) {
    std::array<double, detail::kVocabKind> vocab_kind{};
    std::array<double, kDataKind> data_kind{};
    if (!rejected) {
      const detail::TokenCall& k = c->call;
      const bool sum = k.weight_grad_group != nullptr;
      const auto d = [](std::int64_t x) { return static_cast<double>(x); };
      vocab_kind = detail::vocab_call_kind(k, plan, options_.check_finite);
      data_kind = {d(k.hidden), d(k.vocab), sum && k.grad_w.defined() ? 1.0 : 0.0,
                   sum && k.grad_bias.defined() ? 1.0 : 0.0, options_.check_finite ? 1.0 : 0.0};
    }
    detail::agree_on_call(
        ctx, kWho, vocab_group, in.data_group, rejected,
        {vocab_kind,
         data_kind,
         {},
         "their rows, plans, rows computed, H, grad_hidden asked for, vocab_shard.size, "
         "or the options of the rows' terms (ignore_index, label_smoothing, "
         "z_loss, softcap, compute_entropy, reduction, class_weights)",
         "H, V, grad_weight or grad_bias summed in the call, or check_finite"});
  }
  const detail::TokenTotals t = detail::run_token_objective(ctx, c->call, plan, ws);
  CrossEntropyResult r;
  if (!options_.copy_results_to_host) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    r.loss = r.z_loss = r.accuracy = r.entropy = r.weight_sum = nan;
    r.valid_rows = -1;
    return r;
  }
  r.loss = t.loss;
  r.z_loss = t.z_loss;
  r.valid_rows = t.valid_rows;
  r.weight_sum = t.weight_sum;
  r.accuracy = t.valid_rows ? t.correct / static_cast<double>(t.valid_rows) : 0.0;
  r.entropy = t.valid_rows ? t.entropy / static_cast<double>(t.valid_rows) : 0.0;
  return r;
}

}  // namespace chunkloss
