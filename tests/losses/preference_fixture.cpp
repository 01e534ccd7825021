// Preference-loss test fixture: data generation, buffers, one library call, oracle comparison.
#include "preference_fixture.h"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <sstream>

#include "support/bf16.h"
#include "support/compare.h"
#include "support/random.h"
#include "support/tolerance.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

// Targets [s, t]: per sequence a prompt, a completion of at least one valid token, padding.
std::vector<std::int64_t> sequence_targets(std::int64_t s, std::int64_t t, std::int64_t v,
                                           bool full, double max_prompt_frac,
                                           std::int64_t ignore_index, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> tok(0, v - 1);
  std::vector<std::int64_t> y(sz(s * t), ignore_index);
  const auto max_prompt = static_cast<std::int64_t>(max_prompt_frac * static_cast<double>(t));
  for (std::int64_t i = 0; i < s; ++i) {
    std::int64_t prompt = 0, len = t;
    if (!full) {
      prompt = std::uniform_int_distribution<std::int64_t>(0, std::min(max_prompt, t - 1))(rng);
      len = std::uniform_int_distribution<std::int64_t>(1, t - prompt)(rng);
    }
    for (std::int64_t j = prompt; j < prompt + len; ++j) {
      std::int64_t x = tok(rng);
      if (x == ignore_index) x = (x + 1) % v;  // an ignore_index inside the vocabulary
      y[sz(i * t + j)] = x;
    }
  }
  return y;
}

std::vector<float> plus_noise(const std::vector<float>& x, float stddev, std::uint64_t seed) {
  std::vector<float> n = normal_floats(x.size(), stddev, seed);
  for (std::size_t i = 0; i < x.size(); ++i) n[i] += x[i];
  return n;
}

std::vector<double> widen(const std::vector<float>& v) { return to_double(v); }

double norm(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

reference::PrefHead ref_head_of(const std::vector<float>& x, const std::vector<float>& w,
                                const std::vector<float>& b) {
  return {widen(x), widen(w), widen(b)};
}

std::vector<float> rounded_sums(const std::vector<double>& x) {
  return std::vector<float>(x.begin(), x.end());
}

}  // namespace

PrefData::PrefData(const PrefSpec& s) : spec(s) {
  const std::uint64_t seed = s.seed * 1000 + 17;
  const float wscale = s.logit_scale / std::sqrt(static_cast<float>(s.h));
  hidden = normal_floats(sz(s.s * s.t * s.h), 1.0f, seed + 1);
  weight = normal_floats(sz(s.v * s.h), wscale, seed + 2);
  if (s.bias) bias = normal_floats(sz(s.v), 0.5f * s.logit_scale, seed + 3);
  if (s.ref != RefMode::kNone || (s.kl_batch && s.kl_ref != RefMode::kNone)) {
    ref_hidden = plus_noise(hidden, s.ref_noise, seed + 4);
    ref_weight = plus_noise(weight, s.ref_noise * wscale, seed + 5);
    if (s.bias) ref_bias = plus_noise(bias, s.ref_noise, seed + 6);
  }
  targets64 = sequence_targets(s.s, s.t, s.v, s.full, s.max_prompt_frac, s.ignore_index, seed + 7);
  targets32.assign(targets64.begin(), targets64.end());
  if (s.labels) {
    labels.resize(sz(s.s));
    for (std::int64_t i = 0; i < s.s; ++i) labels[sz(i)] = i % 2 == 0 ? 1 : 0;
    std::mt19937_64 rng(seed + 8);
    std::shuffle(labels.begin(), labels.end(), rng);
  }
  if (s.kl_batch) {
    kl_hidden = normal_floats(sz(s.kl_s * s.kl_t * s.h), 1.0f, seed + 9);
    kl_ref_hidden = plus_noise(kl_hidden, s.ref_noise, seed + 10);
    kl_targets64 =
        sequence_targets(s.kl_s, s.kl_t, s.v, false, s.max_prompt_frac, s.ignore_index, seed + 11);
    // The mismatched completions are the policy's greedy tokens, so the policy rates them
    // above the (noisier) reference and the KL estimate is positive.
    for (std::int64_t row = 0; row < s.kl_s * s.kl_t; ++row) {
      if (kl_targets64[sz(row)] == s.ignore_index) continue;
      std::int64_t arg = 0;
      double best = -1e300;
      for (std::int64_t k = 0; k < s.v; ++k) {
        double z = bias.empty() ? 0.0 : bias[sz(k)];
        for (std::int64_t i = 0; i < s.h; ++i)
          z += static_cast<double>(kl_hidden[sz(row * s.h + i)]) * weight[sz(k * s.h + i)];
        if (z > best && k != s.ignore_index) {
          best = z;
          arg = k;
        }
      }
      kl_targets64[sz(row)] = arg;
    }
    kl_targets32.assign(kl_targets64.begin(), kl_targets64.end());
  }
  sync();
}

void PrefData::set_target(std::int64_t row, std::int64_t y) {
  targets64[sz(row)] = y;
  targets32[sz(row)] = static_cast<std::int32_t>(y);
}

void PrefData::sync() {
  if (spec.dtype == DType::kBF16) {
    for (auto* v :
         {&hidden, &weight, &bias, &ref_hidden, &ref_weight, &ref_bias, &kl_hidden, &kl_ref_hidden})
      round_to_bf16_inplace(*v);
    hidden_bf = to_bf16(hidden);
    weight_bf = to_bf16(weight);
    bias_bf = to_bf16(bias);
    ref_hidden_bf = to_bf16(ref_hidden);
    ref_weight_bf = to_bf16(ref_weight);
    ref_bias_bf = to_bf16(ref_bias);
    kl_hidden_bf = to_bf16(kl_hidden);
    kl_ref_hidden_bf = to_bf16(kl_ref_hidden);
  }
  // Precomputed reference sums: the reference head's, in double, rounded to f32 (where every
  // target is valid for the oracle; a test may break targets afterwards).
  if (!ref_hidden.empty()) {
    bool ok = true;
    for (std::int64_t y : targets64) ok = ok && (y == spec.ignore_index || (y >= 0 && y < spec.v));
    if (ok)
      ref_logps = rounded_sums(
          reference::sequence_stats(ref_head_of(ref_hidden, ref_weight, ref_bias), targets64,
                                    spec.s, spec.t, spec.h, spec.v, spec.ignore_index)
              .logps);
    if (spec.kl_batch)
      kl_ref_logps = rounded_sums(
          reference::sequence_stats(ref_head_of(kl_ref_hidden, ref_weight, ref_bias), kl_targets64,
                                    spec.kl_s, spec.kl_t, spec.h, spec.v, spec.ignore_index)
              .logps);
  }
}

namespace {

// Rows [r0, r1) of a row-major matrix of `width` columns (empty stays empty).
template <typename T>
void append_rows(std::vector<T>& dst, const std::vector<T>& src, std::int64_t r0, std::int64_t r1,
                 std::int64_t width) {
  if (src.empty()) return;
  dst.insert(dst.end(), src.begin() + r0 * width, src.begin() + r1 * width);
}

}  // namespace

PrefData data_part(const PrefData& d, std::int64_t u0, std::int64_t u1, std::int64_t k0,
                   std::int64_t k1) {
  const PrefSpec& s = d.spec;
  const bool pairs = !s.labels;
  const std::int64_t units = pairs ? s.s / 2 : s.s, t = s.t, h = s.h;
  PrefData p = d;
  p.spec.s = (pairs ? 2 : 1) * (u1 - u0);
  p.hidden.clear();
  p.ref_hidden.clear();
  p.targets64.clear();
  p.labels.clear();
  for (std::int64_t k = 0; k < (pairs ? 2 : 1); ++k) {
    const std::int64_t a = k * units + u0, b = k * units + u1;  // sequences [a, b)
    append_rows(p.hidden, d.hidden, a * t, b * t, h);
    append_rows(p.ref_hidden, d.ref_hidden, a * t, b * t, h);
    append_rows(p.targets64, d.targets64, a, b, t);
    append_rows(p.labels, d.labels, a, b, 1);
  }
  p.targets32.assign(p.targets64.begin(), p.targets64.end());
  if (s.kl_batch) {
    p.spec.kl_s = k1 - k0;
    p.kl_hidden.clear();
    p.kl_ref_hidden.clear();
    p.kl_targets64.clear();
    append_rows(p.kl_hidden, d.kl_hidden, k0 * s.kl_t, k1 * s.kl_t, h);
    append_rows(p.kl_ref_hidden, d.kl_ref_hidden, k0 * s.kl_t, k1 * s.kl_t, h);
    append_rows(p.kl_targets64, d.kl_targets64, k0, k1, s.kl_t);
    p.kl_targets32.assign(p.kl_targets64.begin(), p.kl_targets64.end());
  }
  p.sync();
  return p;
}

Head PrefData::policy_head() const {
  const std::int64_t n = rows(), h = spec.h, v = spec.v;
  Head head;
  if (spec.dtype == DType::kBF16) {
    head.hidden = TensorView::of(hidden_bf.data(), {n, h});
    head.weight = TensorView::of(weight_bf.data(), {v, h});
    if (spec.bias) head.bias = TensorView::of(bias_bf.data(), {v});
  } else {
    head.hidden = TensorView::of(hidden.data(), {n, h});
    head.weight = TensorView::of(weight.data(), {v, h});
    if (spec.bias) head.bias = TensorView::of(bias.data(), {v});
  }
  return head;
}

TensorView PrefData::targets_view() const {
  return spec.targets_i64 ? TensorView::of(targets64.data(), {spec.s, spec.t})
                          : TensorView::of(targets32.data(), {spec.s, spec.t});
}

PreferenceInputs PrefData::inputs() const {
  const std::int64_t n = rows(), h = spec.h, v = spec.v;
  const bool bf = spec.dtype == DType::kBF16;
  auto head = [&](const std::vector<float>& x, const std::vector<BFloat16>& xb, std::int64_t rows_,
                  const std::vector<float>& w, const std::vector<BFloat16>& wb,
                  const std::vector<float>& b, const std::vector<BFloat16>& bb) {
    Head hd;
    hd.hidden = bf ? TensorView::of(xb.data(), {rows_, h}) : TensorView::of(x.data(), {rows_, h});
    hd.weight = bf ? TensorView::of(wb.data(), {v, h}) : TensorView::of(w.data(), {v, h});
    if (spec.bias) hd.bias = bf ? TensorView::of(bb.data(), {v}) : TensorView::of(b.data(), {v});
    return hd;
  };
  PreferenceInputs in;
  in.policy = policy_head();
  in.targets = targets_view();
  if (spec.ref == RefMode::kHead)
    in.reference =
        head(ref_hidden, ref_hidden_bf, n, ref_weight, ref_weight_bf, ref_bias, ref_bias_bf);
  if (spec.ref == RefMode::kLogps) in.reference_logps = TensorView::of(ref_logps.data(), {spec.s});
  if (spec.labels) in.labels = TensorView::of(labels.data(), {spec.s});
  in.kl = spec.kl;
  if (spec.kl_batch) {
    const std::int64_t kn = spec.kl_s * spec.kl_t;
    in.kl_batch.policy = head(kl_hidden, kl_hidden_bf, kn, weight, weight_bf, bias, bias_bf);
    in.kl_batch.targets = spec.targets_i64
                              ? TensorView::of(kl_targets64.data(), {spec.kl_s, spec.kl_t})
                              : TensorView::of(kl_targets32.data(), {spec.kl_s, spec.kl_t});
    if (spec.kl_ref == RefMode::kHead)
      in.kl_batch.reference = head(kl_ref_hidden, kl_ref_hidden_bf, kn, ref_weight, ref_weight_bf,
                                   ref_bias, ref_bias_bf);
    if (spec.kl_ref == RefMode::kLogps)
      in.kl_batch.reference_logps = TensorView::of(kl_ref_logps.data(), {spec.kl_s});
  }
  return in;
}

reference::PrefProblem PrefData::problem() const {
  reference::PrefProblem p;
  p.s = spec.s;
  p.t = spec.t;
  p.h = spec.h;
  p.v = spec.v;
  p.policy = {widen(hidden), widen(weight), widen(bias)};
  p.targets = targets64;
  if (spec.ref == RefMode::kHead) p.reference = ref_head_of(ref_hidden, ref_weight, ref_bias);
  if (spec.ref == RefMode::kLogps) p.ref_logps = widen(ref_logps);
  p.labels.assign(labels.begin(), labels.end());
  p.kl = spec.kl;
  if (spec.kl_batch) {
    reference::PrefKlBatch k;
    k.s = spec.kl_s;
    k.t = spec.kl_t;
    k.policy = {widen(kl_hidden), widen(weight), widen(bias)};
    k.targets = kl_targets64;
    if (spec.kl_ref == RefMode::kHead)
      k.reference = ref_head_of(kl_ref_hidden, ref_weight, ref_bias);
    if (spec.kl_ref == RefMode::kLogps) k.ref_logps = widen(kl_ref_logps);
    p.kl_batch = k;
  }
  return p;
}

PrefGradBuffers::PrefGradBuffers(const PrefData& d, const PrefGradRequest& r, float fill)
    : GradStorage(r.dtype, r.hidden, r.weight, r.bias && d.spec.bias, d.rows(), d.spec.h, d.spec.v,
                  fill) {}

PrefRun run_library(const PrefData& d, const SequenceLoss& loss, const PrefGradRequest& g,
                    int threads, dist::Communicator* data_group) {
  CpuContext ctx(threads);
  // NaN-filled gradient buffers: the call overwrites them, so every row must be written.
  PrefRun run{{}, {}, PrefGradBuffers(d, g, std::numeric_limits<float>::quiet_NaN())};
  PreferenceInputs in = d.inputs();
  in.data_group = data_group;
  const PreferenceGrads grads = run.grads.views();
  run.plan = loss.plan(in, grads);
  const std::size_t bytes = loss.workspace_bytes(in, grads);
  CHECK(bytes == run.plan.workspace_bytes());
  // The block is followed by a guard region the library must not touch.
  constexpr std::size_t kGuard = 4096;
  AlignedBuffer block(bytes + kGuard);
  const Workspace ws(block.data(), bytes);
  run.result = grads.any() ? loss.forward_backward(ctx, in, grads, ws) : loss.forward(ctx, in, ws);
  const auto* guard = static_cast<const unsigned char*>(block.data()) + bytes;
  std::size_t touched = 0;
  for (std::size_t i = 0; i < kGuard; ++i) touched += guard[i] != 0xff;
  CHECK_MESSAGE(touched == 0, touched << " bytes written past the workspace's " << bytes
                                      << " bytes; plan: " << run.plan.str());
  return run;
}

PrefTol PrefTol::of(DType input, DType grad) {
  return {tolerance(input).loss, tolerance(input).rows, tolerance(grad).grad};
}

void check_against_oracle(const PrefRun& run, const reference::PrefResult& ref, const PrefTol& tol,
                          bool paired) {
  const PreferenceResult& r = run.result;
  check_scalar("loss", r.loss, ref.loss, tol.loss);
  // Metric names: exactly the oracle's (TRL's), each once.
  std::set<std::string> got_names, want_names;
  for (const auto& [name, value] : r.metrics) {
    CHECK_MESSAGE(got_names.insert(name).second, "metric " << name << " reported twice");
    (void)value;
  }
  for (const auto& [name, value] : ref.metrics) want_names.insert(name);
  if (got_names != want_names) {
    std::ostringstream os;
    os << "metric names differ: got {";
    for (const auto& n : got_names) os << " " << n;
    os << " }, want {";
    for (const auto& n : want_names) os << " " << n;
    os << " }";
    FAIL_CHECK(os.str());
  }
  for (const auto& [name, want] : ref.metrics) {
    if (!got_names.count(name)) continue;
    check_scalar("metric " + name, r.metric(name), want, tol.loss);
  }
  check_close("logps", r.logps, ref.logps, tol.vec);
  check_close("ref_logps", r.ref_logps, ref.ref_logps, tol.vec);
  CHECK(r.tokens == ref.tokens);
  // Rewards are beta (m - m0): rounding is relative to beta m, not to the (small) difference.
  check_close_scaled("rewards", r.rewards, ref.rewards,
                     std::max(norm(ref.policy_rewards), norm(ref.rewards)), tol.vec);
  check_close("unit_losses", r.unit_losses, ref.unit_losses, tol.vec);
  CHECK(r.unit_losses.size() == (paired ? ref.logps.size() / 2 : ref.logps.size()));
  check_scalar("kl", r.kl, ref.kl, tol.loss);
  if (run.grads.has_hidden())
    check_close("grad_hidden", run.grads.hidden(), ref.grad_hidden, tol.grad);
  if (run.grads.has_weight())
    check_close("grad_weight", run.grads.weight(), ref.grad_weight, tol.grad);
  if (run.grads.has_bias()) check_close("grad_bias", run.grads.bias(), ref.grad_bias, tol.grad);
}

namespace {

// Rows [v0, v1) of a [V, H] (or [V]) buffer.
template <typename T>
std::vector<T> vocab_rows(const std::vector<T>& x, std::int64_t v0, std::int64_t v1,
                          std::int64_t width) {
  if (x.empty()) return {};
  return {x.begin() + v0 * width, x.begin() + v1 * width};
}

}  // namespace

ShardRun::ShardRun(const PrefData& d, std::int64_t first, std::int64_t end,
                   const PrefGradRequest& g)
    : v0(first),
      v1(end),
      w(vocab_rows(d.weight, first, end, d.spec.h)),
      b(vocab_rows(d.bias, first, end, 1)),
      rw(vocab_rows(d.ref_weight, first, end, d.spec.h)),
      rb(vocab_rows(d.ref_bias, first, end, 1)),
      wb(to_bf16(w)),
      bb(to_bf16(b)),
      rwb(to_bf16(rw)),
      rbb(to_bf16(rb)),
      grads(g.dtype, g.hidden, g.weight, g.bias && d.spec.bias, d.rows(), d.spec.h, end - first,
            std::numeric_limits<float>::quiet_NaN()) {}

PreferenceInputs ShardRun::inputs(const PrefData& d) const {
  PreferenceInputs in = d.inputs();
  const bool bf = d.spec.dtype == DType::kBF16;
  const std::int64_t v = v1 - v0, h = d.spec.h;
  const auto weight = [&](const std::vector<float>& f, const std::vector<BFloat16>& x) {
    return bf ? TensorView::of(x.data(), {v, h}) : TensorView::of(f.data(), {v, h});
  };
  const auto bias = [&](const std::vector<float>& f, const std::vector<BFloat16>& x) {
    return f.empty() ? TensorView{}
           : bf      ? TensorView::of(x.data(), {v})
                     : TensorView::of(f.data(), {v});
  };
  for (Head* head : {&in.policy, &in.kl_batch.policy}) {
    if (!head->weight.defined()) continue;
    head->weight = weight(w, wb);
    head->bias = bias(b, bb);
  }
  for (Head* head : {&in.reference, &in.kl_batch.reference}) {
    if (!head->weight.defined()) continue;
    head->weight = weight(rw, rwb);
    head->bias = bias(rb, rbb);
  }
  return in;
}

void add_to(std::vector<double>& sum, const std::vector<double>& x) {
  sum.resize(x.size(), 0.0);
  for (std::size_t i = 0; i < x.size(); ++i) sum[i] += x[i];
}

void check_split_runs(const PrefData& d, const PrefRun& full, const std::vector<PrefRun>& runs,
                      const DataSplit& s, const SplitTol& tol, bool reduced) {
  const bool pairs = !d.spec.labels;
  const PreferenceResult& want = full.result;
  std::vector<double> dw, db;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    CAPTURE(r);
    const PreferenceResult& got = runs[r].result;
    check_scalar("loss", got.loss, want.loss, tol.values);
    check_scalar("kl", got.kl, want.kl, tol.values);
    REQUIRE(got.metrics.size() == want.metrics.size());
    for (std::size_t i = 0; i < got.metrics.size(); ++i) {
      CHECK(got.metrics[i].first == want.metrics[i].first);
      check_scalar("metric " + want.metrics[i].first, got.metrics[i].second, want.metrics[i].second,
                   tol.values);
    }
    check_close("logps", got.logps, s.rows(want.logps, r, pairs), tol.values);
    check_close("ref_logps", got.ref_logps, s.rows(want.ref_logps, r, pairs), tol.values);
    check_close("rewards", got.rewards, s.rows(want.rewards, r, pairs), tol.values);
    CHECK(got.tokens == s.rows(want.tokens, r, pairs));
    std::vector<double> units;
    append_rows(units, want.unit_losses, s.units[r], s.units[r + 1], 1);
    check_close("unit_losses", got.unit_losses, units, tol.values);
    const PrefGradBuffers& g = runs[r].grads;
    if (g.has_hidden())
      check_close("grad_hidden rows", g.hidden(),
                  s.rows(full.grads.hidden(), r, pairs, d.spec.t * d.spec.h), tol.grad);
    if (reduced) {
      if (g.has_weight())
        check_close("grad_weight (summed in the call)", g.weight(), full.grads.weight(), tol.grad);
      if (g.has_bias())
        check_close("grad_bias (summed in the call)", g.bias(), full.grads.bias(), tol.grad);
    } else {
      if (g.has_weight()) add_to(dw, g.weight());
      if (g.has_bias()) add_to(db, g.bias());
    }
  }
  if (!dw.empty())
    check_close("grad_weight summed over the ranks", dw, full.grads.weight(), tol.grad);
  if (!db.empty()) check_close("grad_bias summed over the ranks", db, full.grads.bias(), tol.grad);
}

PrefData masked_columns_data(PrefSpec s, float bias) {
  s.bias = true;
  PrefData d(s);
  for (std::int64_t j : kMaskedColumns) {
    d.bias[sz(j)] = bias;
    if (!d.ref_bias.empty()) d.ref_bias[sz(j)] = bias;
  }
  for (std::int64_t r = 0; r < d.rows(); ++r) {
    const std::int64_t y = d.targets64[sz(r)];
    if (std::find(std::begin(kMaskedColumns), std::end(kMaskedColumns), y) !=
        std::end(kMaskedColumns))
      d.set_target(r, y + 1);
  }
  d.sync();
  return d;
}

void check_masked_columns_untouched(const PrefRun& run, std::int64_t h) {
  const std::vector<double> dw = run.grads.weight(), db = run.grads.bias();
  for (std::int64_t j : kMaskedColumns) {
    CAPTURE(j);
    CHECK(db[sz(j)] == 0.0);
    for (std::int64_t i = 0; i < h; ++i) REQUIRE(dw[sz(j * h + i)] == 0.0);
  }
}

void check_runs_close(const PrefRun& a, const PrefRun& b, double tol) {
  check_scalar("loss (two plans)", a.result.loss, b.result.loss, tol);
  check_close("logps (two plans)", a.result.logps, b.result.logps, tol);
  check_close("rewards (two plans)", a.result.rewards, b.result.rewards, tol);
  check_close("unit_losses (two plans)", a.result.unit_losses, b.result.unit_losses, tol);
  CHECK(a.result.metrics.size() == b.result.metrics.size());
  for (std::size_t i = 0; i < std::min(a.result.metrics.size(), b.result.metrics.size()); ++i) {
    CHECK(a.result.metrics[i].first == b.result.metrics[i].first);
    check_scalar("metric " + a.result.metrics[i].first + " (two plans)", a.result.metrics[i].second,
                 b.result.metrics[i].second, tol);
  }
  if (a.grads.has_hidden())
    check_close("grad_hidden (two plans)", a.grads.hidden(), b.grads.hidden(), tol);
  if (a.grads.has_weight())
    check_close("grad_weight (two plans)", a.grads.weight(), b.grads.weight(), tol);
  if (a.grads.has_bias()) check_close("grad_bias (two plans)", a.grads.bias(), b.grads.bias(), tol);
}

bool runs_bitwise_equal(const PrefRun& a, const PrefRun& b) {
  const PreferenceResult &x = a.result, &y = b.result;
  bool same = std::memcmp(&x.loss, &y.loss, sizeof(double)) == 0 &&
              std::memcmp(&x.kl, &y.kl, sizeof(double)) == 0 && bitwise_equal(x.logps, y.logps) &&
              bitwise_equal(x.ref_logps, y.ref_logps) && x.tokens == y.tokens &&
              bitwise_equal(x.rewards, y.rewards) && bitwise_equal(x.unit_losses, y.unit_losses) &&
              x.metrics.size() == y.metrics.size();
  for (std::size_t i = 0; same && i < x.metrics.size(); ++i)
    same = x.metrics[i].first == y.metrics[i].first &&
           std::memcmp(&x.metrics[i].second, &y.metrics[i].second, sizeof(double)) == 0;
  return same && a.grads.bitwise_equal(b.grads);
}

std::string describe(const PrefSpec& s) {
  static const char* const kRef[] = {"none", "head", "logps"};
  std::ostringstream os;
  os << "S=" << s.s << " T=" << s.t << " H=" << s.h << " V=" << s.v
     << " dtype=" << dtype_name(s.dtype) << (s.bias ? " bias" : "")
     << " ref=" << kRef[static_cast<int>(s.ref)] << (s.labels ? " labels" : "")
     << (s.kl ? " kl=" + std::to_string(*s.kl) : "")
     << (s.kl_batch ? " kl_batch(ref=" + std::string(kRef[static_cast<int>(s.kl_ref)]) + ")" : "")
     << (s.targets_i64 ? " i64" : " i32") << " ignore_index=" << s.ignore_index
     << (s.full ? " full" : "") << " seed=" << s.seed;
  return os.str();
}

}  // namespace chunkloss::test
