// Cross-entropy test fixture: data generation, buffers, one library call, oracle comparison.
#include "ce_fixture.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "support/bf16.h"
#include "support/compare.h"
#include "support/random.h"
#include "support/tolerance.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

std::vector<double> widen(const std::vector<float>& v) { return to_double(v); }

}  // namespace

CeData::CeData(const CeSpec& s) : spec(s) {
  const std::uint64_t seed = s.seed * 1000;
  hidden = normal_floats(sz(s.n * s.h), 1.0f, seed + 1);
  weight =
      normal_floats(sz(s.v * s.h), s.logit_scale / std::sqrt(static_cast<float>(s.h)), seed + 2);
  if (s.bias) bias = normal_floats(sz(s.v), 0.5f * s.logit_scale, seed + 3);
  if (s.class_weights) class_weights = uniform_floats(sz(s.v), 0.5f, 2.0f, seed + 4);
  if (s.token_weights) token_weights = uniform_floats(sz(s.n), 0.0f, 2.0f, seed + 5);
  grad_output = uniform_floats(sz(s.n), -1.0f, 2.0f, seed + 6);
  targets64 = random_targets(s.n, s.v, s.ignore_fraction, s.ignore_index, seed + 7);
  std::fill_n(targets64.begin(), std::min(s.ignored_prefix, s.n), s.ignore_index);
  for (std::int64_t t = s.ignored_run.first; t < std::min(s.ignored_run.second, s.n); ++t)
    targets64[sz(t)] = s.ignore_index;
  const auto masked = [&](std::int64_t k) {
    return (s.masked_every > 0 && k % s.masked_every == 0) || k >= s.v - s.masked_tail;
  };
  for (std::int64_t k = 0; k < s.v; ++k)
    if (masked(k)) bias.at(sz(k)) = -std::numeric_limits<float>::infinity();
  for (std::int64_t& y : targets64)
    while (y != s.ignore_index && masked(y)) y = (y + 1) % s.v;
  sync();
  if (s.hits) {
    // Every third valid row predicts its target: argmax of the (monotone-softcapped) logits.
    std::int64_t valid = 0;
    for (std::int64_t t = 0; t < s.n; ++t) {
      if (targets64[sz(t)] == s.ignore_index) continue;
      if (valid++ % 3 != 0) continue;
      std::int64_t arg = 0;
      double best = -std::numeric_limits<double>::infinity();
      for (std::int64_t k = 0; k < s.v; ++k) {
        double z = bias.empty() ? 0.0 : bias[sz(k)];
        for (std::int64_t i = 0; i < s.h; ++i)
          z += static_cast<double>(hidden[sz(t * s.h + i)]) * weight[sz(k * s.h + i)];
        if (z > best) {
          best = z;
          arg = k;
        }
      }
      targets64[sz(t)] = arg;
    }
  }
  targets32.assign(targets64.begin(), targets64.end());
}

void CeData::set_target(std::int64_t row, std::int64_t y) {
  targets64[sz(row)] = y;
  targets32[sz(row)] = static_cast<std::int32_t>(y);
}

void CeData::sync() {
  if (spec.dtype == DType::kBF16) {
    round_to_bf16_inplace(hidden);
    round_to_bf16_inplace(weight);
    round_to_bf16_inplace(bias);
    hidden_bf = to_bf16(hidden);
    weight_bf = to_bf16(weight);
    bias_bf = to_bf16(bias);
  }
}

CrossEntropyInputs CeData::inputs(const CrossEntropyOptions& o) const {
  CrossEntropyInputs in;
  const std::int64_t n = spec.n, h = spec.h, v = spec.v;
  if (spec.dtype == DType::kBF16) {
    in.hidden = TensorView::of(hidden_bf.data(), {n, h});
    in.weight = TensorView::of(weight_bf.data(), {v, h});
    if (spec.bias) in.bias = TensorView::of(bias_bf.data(), {v});
  } else {
    in.hidden = TensorView::of(hidden.data(), {n, h});
    in.weight = TensorView::of(weight.data(), {v, h});
    if (spec.bias) in.bias = TensorView::of(bias.data(), {v});
  }
  in.targets = spec.targets_i64 ? TensorView::of(targets64.data(), {n})
                                : TensorView::of(targets32.data(), {n});
  if (spec.class_weights) in.class_weights = TensorView::of(class_weights.data(), {v});
  if (spec.token_weights) in.token_weights = TensorView::of(token_weights.data(), {n});
  if (o.reduction == Reduction::kNone) in.grad_output = TensorView::of(grad_output.data(), {n});
  return in;
}

reference::CeProblem CeData::problem(const CrossEntropyOptions& o) const {
  reference::CeProblem p;
  p.n = spec.n;
  p.h = spec.h;
  p.v = spec.v;
  p.hidden = widen(hidden);
  p.weight = widen(weight);
  if (spec.bias) p.bias = widen(bias);
  p.targets = targets64;
  if (spec.class_weights) p.class_weights = widen(class_weights);
  if (spec.token_weights) p.token_weights = widen(token_weights);
  if (o.reduction == Reduction::kNone) p.grad_output = widen(grad_output);
  return p;
}

GradBuffers::GradBuffers(const CeData& d, const GradRequest& r, float fill)
    : GradStorage(r.dtype, r.hidden, r.weight, r.bias && d.spec.bias, d.spec.n, d.spec.h, d.spec.v,
                  fill) {}

OutBuffers::OutBuffers(std::int64_t n)
    : row_loss(sz(n), std::numeric_limits<float>::quiet_NaN()),
      lse(sz(n), 12345.0f),  // (finite: rows the library skips must be written NaN)
      predictions(sz(n), 12345) {}

CrossEntropyOutputs OutBuffers::views() {
  const auto n = static_cast<std::int64_t>(row_loss.size());
  CrossEntropyOutputs o;
  o.row_loss = TensorView::of(row_loss.data(), {n});
  o.lse = TensorView::of(lse.data(), {n});
  o.predictions = TensorView::of(predictions.data(), {n});
  return o;
}

LibRun run_library(const CeData& d, const CrossEntropyOptions& o, const GradRequest& g,
                   bool outputs, int threads) {
  const LinearCrossEntropy loss(o);
  CpuContext ctx(threads);
  LibRun run{{}, {}, GradBuffers(d, g), OutBuffers(d.spec.n)};
  const CrossEntropyInputs in = d.inputs(o);
  const CrossEntropyGrads grads = run.grads.views();
  run.plan = loss.plan(in, grads);
  CrossEntropyOutputs out;
  if (outputs) {
    out = run.out.views();
  } else if (o.reduction == Reduction::kNone) {
    out.row_loss = run.out.views().row_loss;
  }
  run.result = run_with_fresh_workspace(loss, ctx, in, grads, out);
  return run;
}

void check_against_oracle(const CeData& d, const CrossEntropyOptions& o, const GradRequest& g,
                          const LibRun& run, const reference::CeResult& ref, bool outputs) {
  const Tolerance tv = tolerance(d.spec.dtype);
  const Tolerance tg = tolerance(g.dtype);
  CHECK(run.result.valid_rows == ref.valid_rows);
  check_scalar("loss", run.result.loss, ref.loss, tv.loss);
  check_scalar("z_loss", run.result.z_loss, ref.z_loss, tv.loss);
  check_scalar("accuracy", run.result.accuracy, ref.accuracy, 1e-12);
  if (o.compute_entropy) check_scalar("entropy", run.result.entropy, ref.entropy, tv.loss);
  check_scalar("weight_sum", run.result.weight_sum, ref.weight_sum, 1e-6);
  if (outputs || o.reduction == Reduction::kNone)
    check_close("row_loss", run.out.row_loss, ref.row_loss, tv.rows);
  if (outputs) {
    check_close("lse", run.out.lse, ref.lse, tv.rows);
    std::int64_t bad = -1;
    for (std::size_t t = 0; t < ref.predictions.size() && bad < 0; ++t)
      if (run.out.predictions[t] != ref.predictions[t]) bad = static_cast<std::int64_t>(t);
    if (bad >= 0)
      FAIL_CHECK("predictions[" << bad << "] = " << run.out.predictions[sz(bad)] << ", want "
                                << ref.predictions[sz(bad)]);
  }
  if (run.grads.has_hidden())
    check_close("grad_hidden", run.grads.hidden(), ref.grad_hidden, tg.grad);
  if (run.grads.has_weight())
    check_close("grad_weight", run.grads.weight(), ref.grad_weight, tg.grad);
  if (run.grads.has_bias()) check_close("grad_bias", run.grads.bias(), ref.grad_bias, tg.grad);
}

LibRun check_case(const CeSpec& s, const CrossEntropyOptions& o, const GradRequest& g) {
  INFO(describe(s, o, g));
  const CeData d(s);
  const reference::CeResult ref =
      reference::cross_entropy(d.problem(o), reference::CeConfig::from(o));
  LibRun run = run_library(d, o, g);
  INFO("plan: " << run.plan.str());
  check_against_oracle(d, o, g, run, ref);
  return run;
}

std::size_t budget_for_chunk_rows(const CeData& d, const CrossEntropyOptions& o,
                                  const GradRequest& g, std::int64_t rows) {
  GradBuffers buffers(d, g);
  const CrossEntropyInputs in = d.inputs(o);
  const CrossEntropyGrads grads = buffers.views();
  auto enough = [&](std::size_t budget) {
    CrossEntropyOptions q = o;
    q.memory_budget_bytes = budget;
    try {
      const Plan p = LinearCrossEntropy(q).plan(in, grads);
      return !p.over_budget && p.chunk_rows >= rows;
    } catch (const Error&) {
      return false;
    }
  };
  std::size_t lo = 1, hi = std::size_t{1} << 32;  // enough(hi) holds for every test shape
  while (lo < hi) {
    const std::size_t mid = lo + (hi - lo) / 2;
    if (enough(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

TensorView rows_of(const CeData& d, const std::vector<float>& f, const std::vector<BFloat16>& b,
                   std::int64_t o, std::int64_t rows, std::int64_t width) {
  if (d.spec.dtype == DType::kBF16)
    return width ? TensorView::of(b.data() + o * width, {rows, width})
                 : TensorView::of(b.data() + o, {rows});
  return width ? TensorView::of(f.data() + o * width, {rows, width})
               : TensorView::of(f.data() + o, {rows});
}

std::string describe(const CeSpec& s, const CrossEntropyOptions& o, const GradRequest& g) {
  std::ostringstream os;
  os << "N=" << s.n << " H=" << s.h << " V=" << s.v << " in=" << dtype_name(s.dtype)
     << " grads=" << dtype_name(g.dtype) << (g.hidden ? " dH" : "") << (g.weight ? " dW" : "")
     << (g.bias && s.bias ? " db" : "") << (s.bias ? " bias" : "")
     << (s.class_weights ? " class_weights" : "") << (s.token_weights ? " token_weights" : "")
     << (s.targets_i64 ? " i64" : " i32") << " ignore_frac=" << s.ignore_fraction
     << " ignore_index=" << s.ignore_index << " ignored_prefix=" << s.ignored_prefix
     << " ignored_run=[" << s.ignored_run.first << ", " << s.ignored_run.second << ")"
     << " seed=" << s.seed << " | reduction=" << reduction_name(o.reduction)
     << " ls=" << o.label_smoothing << " z_loss=" << o.z_loss
     << " softcap=" << (o.softcap ? *o.softcap : 0.0f) << " entropy=" << o.compute_entropy
     << " order=" << loop_order_name(o.loop_order) << " fp32_acc=" << o.fp32_weight_grad_accumulator
     << " skip=" << o.skip_ignored_rows << " budget=" << o.memory_budget_bytes;
  return os.str();
}

}  // namespace chunkloss::test
