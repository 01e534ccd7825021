// Data-parallel sequence losses on the CPU: the units of one problem split over 2 or 3 ranks of
// an in-process group (ranks as threads) against the unsplit call, for every loss, regime and
// reference mode, KTO's KL batch split too; bf16, accumulation and the dW sum inside the call;
// forward only; and the errors every rank raises when one rank's values or objective fail.
// Vocabulary splits of every loss's heads, alone and in a grid with a data group, and of
// SequenceLogProbs.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/dist/communicator.h>
#include <chunkloss/losses/preference.h>
#include <chunkloss/losses/sequence.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "preference_fixture.h"
#include "support/bf16.h"
#include "support/compare.h"
#include "support/threads.h"
#include "support/tolerance.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

std::vector<PrefRun> run_split(const PrefData& d, const SequenceLoss& loss,
                               const PrefGradRequest& g, const DataSplit& s) {
  std::vector<PrefData> parts;
  for (std::size_t r = 0; r < s.ranks(); ++r) parts.push_back(s.part(d, r));
  dist::InProcessGroup group(static_cast<int>(s.ranks()));
  return on_threads(s.ranks(), [&](std::size_t r) {
    try {
      return run_library(parts[r], loss, g, 1, &group.comm(static_cast<int>(r)));
    } catch (...) {  // a rank failing alone must not leave the others waiting
      group.abort();
      throw;
    }
  });
}

// Every rank against the unsplit call (check_split_runs).
void check_split(const PrefData& d, const SequenceLoss& loss, const PrefGradRequest& g,
                 const DataSplit& s, bool reduced, double tol) {
  check_split_runs(d, run_library(d, loss, g), run_split(d, loss, g, s), s, {1e-6, tol}, reduced);
}

// P = 5 pairs split 2 and 3 ways unevenly; for unpaired problems the same over S sequences.
std::vector<DataSplit> splits_of(std::int64_t units, std::int64_t kl_s) {
  return {{{0, 2, units}, {0, 2, kl_s}}, {{0, 1, 3, units}, {0, 1, 3, kl_s}}};
}

PrefSpec pair_spec(RefMode ref, bool bias) {
  PrefSpec s;
  s.s = 10;
  s.t = 11;
  s.h = 24;
  s.v = 67;
  s.ref = ref;
  s.bias = bias;
  s.seed = 21;
  return s;
}

PrefSpec kto_spec(RefMode ref, bool kl_batch) {
  PrefSpec s = pair_spec(ref, true);
  s.s = 7;
  s.labels = true;
  s.kl_batch = kl_batch;
  if (!kl_batch) s.kl = 0.25;
  return s;
}

template <typename Options, typename Loss>
void check_every_regime(const PrefSpec& spec, Options o, const char* what) {
  const PrefData d(spec);
  const bool pairs = !spec.labels;
  const std::int64_t units = pairs ? spec.s / 2 : spec.s;
  for (Regime regime : regimes_for(o, spec)) {
    for (std::size_t budget : {std::size_t{0}, std::size_t{24} << 10}) {
      o.engine.regime = regime;
      o.engine.memory_budget_bytes = budget;
      for (const DataSplit& s : splits_of(units, spec.kl_s)) {
        INFO(what, " regime=", regime_name(regime), " budget=", budget, " ranks=", s.ranks());
        check_split(d, Loss(o), PrefGradRequest{}, s, false, tolerance(DType::kF32).chunking);
      }
    }
  }
}

TEST_CASE("data parallel: 2 and 3 uneven parts match the unsplit call, every loss and regime") {
  check_every_regime<DpoOptions, Dpo>(pair_spec(RefMode::kHead, false), DpoOptions{}, "dpo");
  DpoOptions rpo;
  rpo.nll = true;
  rpo.average_log_prob = true;
  check_every_regime<DpoOptions, Dpo>(pair_spec(RefMode::kLogps, true), rpo, "dpo + nll");
  DpoOptions ipo;
  ipo.loss_type = DpoLoss::kIpo;
  check_every_regime<DpoOptions, Dpo>(pair_spec(RefMode::kHead, false), ipo, "ipo");
  check_every_regime<OrpoOptions, Orpo>(pair_spec(RefMode::kNone, true), OrpoOptions{}, "orpo");
  check_every_regime<SimpoOptions, Simpo>(pair_spec(RefMode::kNone, false), SimpoOptions{},
                                          "simpo");
  CpoOptions cpo;
  cpo.alpha = 0.5f;
  check_every_regime<CpoOptions, Cpo>(pair_spec(RefMode::kNone, true), cpo, "cpo + nll");
  check_every_regime<KtoOptions, Kto>(kto_spec(RefMode::kHead, false), KtoOptions{},
                                      "kto, kl given");
  check_every_regime<KtoOptions, Kto>(kto_spec(RefMode::kLogps, true), KtoOptions{},
                                      "kto, kl batch");
}

TEST_CASE("data parallel: the KL point is the mean over every rank's KL batch") {
  // Uneven KL parts (1 and 4 sequences) whose own means differ: the group's is neither.
  PrefSpec spec = kto_spec(RefMode::kHead, true);
  spec.ref_noise = 0.5f;
  const PrefData d(spec);
  const DataSplit s{{0, 3, 7}, {0, 1, 5}};
  const Kto loss(KtoOptions{});
  const std::vector<PrefRun> runs = run_split(d, loss, PrefGradRequest::none(), s);
  const PrefRun full = run_library(d, loss, PrefGradRequest::none());
  CHECK(full.result.kl > 0.0);
  for (const PrefRun& r : runs) check_scalar("kl", r.result.kl, full.result.kl, 1e-6);
  const PrefRun alone = run_library(data_part(d, 0, 3, 0, 1), loss, PrefGradRequest::none());
  CHECK(std::abs(alone.result.kl - full.result.kl) > 1e-3);
}

TEST_CASE("data parallel: bf16, accumulation of a rank's share, and dW and db summed in the call") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec spec = pair_spec(RefMode::kHead, true);
    spec.dtype = dtype;
    const PrefData d(spec);
    PrefGradRequest g;
    g.dtype = dtype;
    for (Regime regime : {Regime::kResident, Regime::kRecompute}) {
      DpoOptions o;
      o.engine.regime = regime;
      o.engine.reduce_weight_grad_over_data_group = true;
      // The sum goes through the fp32 accumulator: the unsplit call too, so both round once.
      o.engine.fp32_weight_grad_accumulator = true;
      INFO("dtype=", dtype_name(dtype), " regime=", regime_name(regime));
      for (const DataSplit& s : splits_of(5, 0))
        check_split(d, Dpo(o), g, s, true, tolerance(dtype).chunking);
      // Without the sum, bf16 gradients keep only the rank's share (checked in fp32 above).
      if (dtype == DType::kBF16) {
        o.engine.reduce_weight_grad_over_data_group = false;
        check_split(d, Dpo(o), PrefGradRequest{true, false, false, dtype}, splits_of(5, 0)[0],
                    false, tolerance(dtype).chunking);
      }
    }
  }
  // The deferred regime with the sum (its dW goes through the fp32 accumulator then).
  PrefSpec spec = pair_spec(RefMode::kHead, false);
  spec.s = 4;
  spec.t = 101;
  const PrefData d(spec);
  DpoOptions o;
  o.engine.regime = Regime::kDeferred;
  o.engine.memory_budget_bytes = std::size_t{24} << 10;
  o.engine.reduce_weight_grad_over_data_group = true;
  CHECK(run_library(d, Dpo(o), {}).plan.regime == Regime::kDeferred);
  check_split(d, Dpo(o), PrefGradRequest{}, DataSplit{{0, 1, 2}, {}}, true,
              tolerance(DType::kF32).chunking);
}

TEST_CASE("data parallel: forward only gives the group's loss and metrics") {
  const PrefData d(pair_spec(RefMode::kNone, true));
  for (const DataSplit& s : splits_of(5, 0))
    check_split(d, Orpo(OrpoOptions{}), PrefGradRequest::none(), s, false,
                tolerance(DType::kF32).chunking);
}

// Runs every rank of `parts` (rank 1 with `loss1` when given) and returns each rank's error
// message ("" when it returned).
std::vector<std::string> errors_of(const std::vector<PrefData>& parts, const SequenceLoss& loss0,
                                   const std::function<void(std::size_t, PrefRun&)>& check,
                                   const SequenceLoss* loss1 = nullptr) {
  dist::InProcessGroup group(static_cast<int>(parts.size()));
  return on_threads(parts.size(), [&](std::size_t r) {
    const SequenceLoss& loss = r == 1 && loss1 ? *loss1 : loss0;
    CpuContext ctx(1);
    PrefRun run{{}, {}, PrefGradBuffers(parts[r], PrefGradRequest{}, 7.0f)};
    PreferenceInputs in = parts[r].inputs();
    in.data_group = &group.comm(static_cast<int>(r));
    const PreferenceGrads grads = run.grads.views();
    // A call whose plan fails still calls, with some workspace: the ranks must agree on it.
    std::size_t bytes = std::size_t{1} << 20;
    try {
      bytes = loss.workspace_bytes(in, grads);
    } catch (const Error&) {
    }
    const AlignedBuffer block(bytes);
    std::string error;
    try {
      run.result = loss.forward_backward(ctx, in, grads, block.workspace());
    } catch (const Error& e) {
      error = e.what();
    }
    check(r, run);
    return error;
  });
}

bool untouched(const PrefRun& run) {
  bool ok = true;
  for (const auto& x : {run.grads.hidden(), run.grads.weight()})
    for (double v : x) ok = ok && v == 7.0;
  return ok;
}

TEST_CASE("data parallel: bad values on one rank make every rank throw before writing") {
  const PrefData d(pair_spec(RefMode::kLogps, false));
  const auto expect = [&](std::vector<PrefData> parts, const std::string& own) {
    const std::vector<std::string> e = errors_of(
        parts, Dpo(DpoOptions{}), [](std::size_t, PrefRun& run) { CHECK(untouched(run)); });
    CHECK(e[0].find("1 rank(s) of data_group rejected") != std::string::npos);
    CHECK(e[1].find(own) != std::string::npos);
    INFO(e[0], " | ", e[1]);
  };
  {
    std::vector<PrefData> parts = {data_part(d, 0, 2, 0, 0), data_part(d, 2, 5, 0, 0)};
    parts[1].set_target(3, d.spec.v + 4);
    expect(parts, "is outside [0, V=67)");
  }
  {
    std::vector<PrefData> parts = {data_part(d, 0, 2, 0, 0), data_part(d, 2, 5, 0, 0)};
    for (std::int64_t t = 0; t < d.spec.t; ++t) parts[1].set_target(2 * d.spec.t + t, -100);
    expect(parts, "has no valid token");
  }
  {
    std::vector<PrefData> parts = {data_part(d, 0, 2, 0, 0), data_part(d, 2, 5, 0, 0)};
    parts[1].ref_logps[1] = std::numeric_limits<float>::infinity();
    expect(parts, "reference_logps[1] is not finite");
  }
  {
    std::vector<PrefData> parts = {data_part(d, 0, 2, 0, 0), data_part(d, 2, 5, 0, 0)};
    parts[1].hidden[5] = std::numeric_limits<float>::quiet_NaN();
    DpoOptions o;
    o.engine.check_finite = true;
    const std::vector<std::string> e =
        errors_of(parts, Dpo(o), [](std::size_t, PrefRun& run) { CHECK(untouched(run)); });
    CHECK(e[0].find("1 rank(s) of data_group rejected") != std::string::npos);
    CHECK(e[1].find("policy.hidden") != std::string::npos);
  }
}

// A pair objective on the reference margin that returns NaN for a pair whose chosen reference
// sum is the marker (given as reference_logps).
constexpr float kMarker = 1234.0f;
class NanOnMarker final : public SequenceObjective {
 public:
  std::string_view name() const override { return "NanOnMarker"; }
  Unit unit() const override { return Unit::kPair; }
  bool uses_reference() const override { return true; }
  UnitResult evaluate(std::span<const SequenceStats> s, const BatchConstants&,
                      std::span<double>) const override {
    const double m = (s[0].logp - s[0].ref_logp) - (s[1].logp - s[1].ref_logp);
    UnitResult r;
    r.loss = s[0].ref_logp == kMarker ? std::numeric_limits<double>::quiet_NaN() : 0.5 * m * m;
    r.dlogp = {m, -m};
    r.reward = {s[0].logp, s[1].logp};
    return r;
  }
};

TEST_CASE("data parallel: a non-finite objective value on one rank makes every rank throw") {
  const PrefData d(pair_spec(RefMode::kLogps, false));
  std::vector<PrefData> parts = {data_part(d, 0, 2, 0, 0), data_part(d, 2, 5, 0, 0)};
  const SequenceLoss loss(std::make_shared<NanOnMarker>());
  // Every rank ends its call: without the marker both return.
  const std::vector<std::string> ok = errors_of(parts, loss, [](std::size_t, PrefRun&) {});
  CHECK(ok[0].empty());
  CHECK(ok[1].empty());
  parts[0].ref_logps[1] = kMarker;
  const std::vector<std::string> e = errors_of(parts, loss, [](std::size_t, PrefRun&) {});
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("non-finite loss or derivative for unit 1") != std::string::npos);
  CHECK(e[0].find("gradient buffers hold unspecified values") != std::string::npos);
  CHECK(e[1].find("failed (threw or returned a non-finite value) on 1 other rank(s)") !=
        std::string::npos);
}

// Throws std::runtime_error (not chunkloss::Error) where NanOnMarker returns NaN.
class ThrowOnMarker final : public SequenceObjective {
 public:
  std::string_view name() const override { return "ThrowOnMarker"; }
  Unit unit() const override { return Unit::kPair; }
  bool uses_reference() const override { return true; }
  UnitResult evaluate(std::span<const SequenceStats> s, const BatchConstants& b,
                      std::span<double> e) const override {
    if (s[0].ref_logp == kMarker) throw std::runtime_error("ThrowOnMarker: the marker");
    return NanOnMarker().evaluate(s, b, e);
  }
};

TEST_CASE("data parallel: an objective that throws on one rank makes every rank throw") {
  const PrefData d(pair_spec(RefMode::kLogps, false));
  std::vector<PrefData> parts = {data_part(d, 0, 2, 0, 0), data_part(d, 2, 5, 0, 0)};
  parts[1].ref_logps[0] = kMarker;
  const SequenceLoss loss(std::make_shared<ThrowOnMarker>());
  dist::InProcessGroup group(2);
  const std::vector<std::string> e = on_threads(2, [&](std::size_t r) {
    CpuContext ctx(1);
    PrefGradBuffers grads(parts[r], PrefGradRequest{});
    PreferenceInputs in = parts[r].inputs();
    in.data_group = &group.comm(static_cast<int>(r));
    const AlignedBuffer ws(loss.workspace_bytes(in, grads.views()));
    try {
      loss.forward_backward(ctx, in, grads.views(), ws.workspace());
    } catch (const Error& x) {
      // The objective's own exception is nested in the rank's Error.
      std::string nested;
      try {
        std::rethrow_if_nested(x);
      } catch (const std::runtime_error& inner) {
        nested = inner.what();
      }
      return std::string(x.what()) + " | nested: " + nested;
    }
    return std::string();
  });
  INFO(e[0], " || ", e[1]);
  CHECK(e[0].find("failed (threw or returned a non-finite value) on 1 other rank(s)") !=
        std::string::npos);
  CHECK(e[0].find("| nested: ") == e[0].size() - 10);  // the other rank's: nothing nested
  CHECK(e[1].find("the objective threw for unit 0: ThrowOnMarker: the marker; gradients were "
                  "already written") != std::string::npos);
  CHECK(e[1].find("| nested: ThrowOnMarker: the marker") != std::string::npos);
}

// NanOnMarker whose extra_metrics() throws (the library asks it while comparing the ranks'
// calls, before the first collective).
class ThrowingMetrics final : public SequenceObjective {
 public:
  std::string_view name() const override { return "NanOnMarker"; }
  Unit unit() const override { return Unit::kPair; }
  bool uses_reference() const override { return true; }
  std::vector<std::string> extra_metrics() const override {
    // (long: the other ranks quote its first 1000 bytes)
    throw std::runtime_error("ThrowingMetrics: no metrics today" + std::string(3000, '!'));
  }
  UnitResult evaluate(std::span<const SequenceStats> s, const BatchConstants& b,
                      std::span<double> e) const override {
    return NanOnMarker().evaluate(s, b, e);
  }
};

TEST_CASE("data parallel: an objective that throws while the ranks compare calls fails them all") {
  // (rank 1 threw alone and rank 0 waited in the exchange for ever)
  const PrefData d(pair_spec(RefMode::kLogps, false));
  const std::vector<PrefData> parts = {data_part(d, 0, 2, 0, 0), data_part(d, 2, 5, 0, 0)};
  const SequenceLoss good(std::make_shared<NanOnMarker>()),
      bad(std::make_shared<ThrowingMetrics>());
  const std::vector<std::string> e = errors_of(
      parts, good, [](std::size_t, PrefRun& run) { CHECK(untouched(run)); }, &bad);
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("1 rank(s) of data_group rejected") != std::string::npos);
  CHECK(e[1].find("ThrowingMetrics: no metrics today") != std::string::npos);
  // Rank 0 quotes rank 1's message, cut.
  CHECK(e[0].find("(rank 1: ") != std::string::npos);
  CHECK(e[0].find("ThrowingMetrics: no metrics today!!!") != std::string::npos);
  CHECK(e[0].find("!!!...)") != std::string::npos);
  CHECK(e[0].size() < 1500);
}

TEST_CASE(
    "data parallel: a call one rank rejects, or calls of different kinds, fail on every rank") {
  // Ranks may differ in S and T: a forced resident regime fits one rank's budget only.
  PrefSpec long_spec = pair_spec(RefMode::kHead, false);
  long_spec.s = 4;
  long_spec.t = 101;
  const PrefData long_pairs(long_spec), short_pairs(pair_spec(RefMode::kHead, false));
  DpoOptions o;
  o.engine.regime = Regime::kResident;
  o.engine.memory_budget_bytes = std::size_t{24} << 10;
  const std::vector<std::string> e = errors_of(
      {short_pairs, long_pairs}, Dpo(o), [](std::size_t, PrefRun& run) { CHECK(untouched(run)); });
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("1 rank(s) of data_group rejected their calls") != std::string::npos);
  CHECK(e[1].find("regime resident") != std::string::npos);
  CHECK(e[0].find("(rank 1: ") != std::string::npos);
  CHECK(e[0].find("regime resident") != std::string::npos);
  // KTO with a KL batch on one rank and the KL point given on the other.
  const PrefData kto(kto_spec(RefMode::kLogps, true));
  std::vector<PrefData> parts = {data_part(kto, 0, 3, 0, 2), data_part(kto, 3, 7, 2, 5)};
  parts[1].spec.kl_batch = false;
  parts[1].spec.kl = 0.1;
  const std::vector<std::string> k =
      errors_of(parts, Kto(KtoOptions{}), [](std::size_t, PrefRun& run) { CHECK(untouched(run)); });
  for (const std::string& m : k)
    CHECK(m.find("make different kinds of calls") != std::string::npos);
  // Heads of another H on one rank (its dW sum would have another size).
  PrefSpec wide = pair_spec(RefMode::kHead, false);
  wide.h += 1;
  DpoOptions sum;
  sum.engine.reduce_weight_grad_over_data_group = true;
  const std::vector<std::string> h =
      errors_of({short_pairs, PrefData(wide)}, Dpo(sum),
                [](std::size_t, PrefRun& run) { CHECK(untouched(run)); });
  for (const std::string& m : h)
    CHECK(m.find("data_group make different kinds of calls") != std::string::npos);
  // Another objective on one rank, and the same objective with another NLL weight.
  const PrefData free_pairs(pair_spec(RefMode::kNone, false));
  const Simpo simpo{SimpoOptions{}};
  CpoOptions half;
  half.alpha = 0.5f;
  const Cpo other_alpha(half);
  for (const SequenceLoss* other :
       {static_cast<const SequenceLoss*>(&simpo), static_cast<const SequenceLoss*>(&other_alpha)})
    for (const std::string& m : errors_of(
             {free_pairs, free_pairs}, Cpo(CpoOptions{}),
             [](std::size_t, PrefRun& run) { CHECK(untouched(run)); }, other)) {
      INFO(m);
      CHECK(m.find("data_group make different kinds of calls") != std::string::npos);
    }
}

// ---- vocabulary split ----------------------------------------------------------------------

// The problem over a grid: `vocab` ranks per vocabulary group (rank r holding the heads' rows
// [V r / K, V (r + 1) / K)) times the split's parts (one part: no data group); rank (p, r) gets
// part p and shard r. The runs part-major.
// With `errors`, each rank's chunkloss::Error is stored there instead ("" when it returned), and
// `drop_bias` drops the bias gradient of the ranks it returns true for.
std::vector<ShardRun> run_grid(const PrefData& d, const SequenceLoss& loss,
                               const PrefGradRequest& g, int vocab, const DataSplit& split,
                               std::vector<std::string>* errors = nullptr,
                               const std::function<bool(std::size_t)>& drop_bias = {}) {
  const auto parts = static_cast<int>(split.ranks());
  std::vector<PrefData> data;
  for (int p = 0; p < parts; ++p)
    data.push_back(parts == 1 ? d : split.part(d, static_cast<std::size_t>(p)));
  std::vector<ShardRun> runs;
  for (int p = 0; p < parts; ++p)
    for (int r = 0; r < vocab; ++r)
      runs.emplace_back(data[static_cast<std::size_t>(p)], d.spec.v * r / vocab,
                        d.spec.v * (r + 1) / vocab, g);
  std::vector<std::unique_ptr<dist::InProcessGroup>> vocab_groups, data_groups;
  for (int p = 0; p < parts; ++p)
    vocab_groups.push_back(std::make_unique<dist::InProcessGroup>(vocab));
  for (int r = 0; r < vocab; ++r)
    data_groups.push_back(std::make_unique<dist::InProcessGroup>(parts));
  if (errors) errors->assign(runs.size(), "");
  on_threads(runs.size(), [&](std::size_t i) {
    const auto p = i / static_cast<std::size_t>(vocab), r = i % static_cast<std::size_t>(vocab);
    ShardRun& run = runs[i];
    try {
      CpuContext ctx(1);
      PreferenceInputs in = run.inputs(data[p]);
      in.vocab_shard = {&vocab_groups[p]->comm(static_cast<int>(r)), run.v0, d.spec.v};
      if (parts > 1) in.data_group = &data_groups[r]->comm(static_cast<int>(p));
      PreferenceGrads grads = run.grads.views_as<PreferenceGrads>(false);
      if (drop_bias && drop_bias(i)) grads.bias = {};
      const AlignedBuffer ws(loss.workspace_bytes(in, grads));
      run.result = grads.any() ? loss.forward_backward(ctx, in, grads, ws.workspace())
                               : loss.forward(ctx, in, ws.workspace());
    } catch (const Error& e) {
      if (!errors) {
        for (auto& x : vocab_groups) x->abort();
        for (auto& x : data_groups) x->abort();
        throw;
      }
      (*errors)[i] = e.what();
    } catch (...) {  // a rank failing alone must not leave the others waiting
      for (auto& x : vocab_groups) x->abort();
      for (auto& x : data_groups) x->abort();
      throw;
    }
    return 0;
  });
  return runs;
}

// Every rank of a grid against the unsplit call: the group's loss, metrics and KL point, the
// part's per-sequence vectors and dH rows on every shard, and the shard's dW and db rows (summed
// over the parts, unless the call summed them: `reduced`).
void check_grid(const PrefData& d, const SequenceLoss& loss, const PrefGradRequest& g, int vocab,
                const DataSplit& split, bool reduced, double tol) {
  const bool pairs = !d.spec.labels;
  const PrefRun full = run_library(d, loss, g);
  const std::vector<ShardRun> runs = run_grid(d, loss, g, vocab, split);
  const std::int64_t h = d.spec.h;
  const std::vector<double> full_w = full.grads.weight(), full_b = full.grads.bias();
  std::vector<std::vector<double>> dw(static_cast<std::size_t>(vocab)),
      db(static_cast<std::size_t>(vocab));
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const ShardRun& s = runs[i];
    const std::size_t p = i / static_cast<std::size_t>(vocab),
                      r = i % static_cast<std::size_t>(vocab);
    CAPTURE(p);
    CAPTURE(r);
    const PreferenceResult& got = s.result;
    const PreferenceResult& want = full.result;
    check_scalar("loss", got.loss, want.loss, 1e-6);
    check_scalar("kl", got.kl, want.kl, 1e-6);
    REQUIRE(got.metrics.size() == want.metrics.size());
    for (std::size_t m = 0; m < got.metrics.size(); ++m)
      check_scalar("metric " + want.metrics[m].first, got.metrics[m].second, want.metrics[m].second,
                   1e-6);
    check_close("logps", got.logps, split.rows(want.logps, p, pairs), 1e-6);
    check_close("rewards", got.rewards, split.rows(want.rewards, p, pairs), 1e-6);
    check_close("unit_losses", got.unit_losses,
                std::vector<double>(want.unit_losses.begin() + split.units[p],
                                    want.unit_losses.begin() + split.units[p + 1]),
                1e-6);
    if (s.grads.has_hidden())
      check_close("grad_hidden rows", s.grads.hidden(),
                  split.rows(full.grads.hidden(), p, pairs, d.spec.t * h), tol);
    if (s.grads.has_weight() && reduced)
      check_close("grad_weight rows (summed in the call)", s.grads.weight(),
                  {full_w.begin() + s.v0 * h, full_w.begin() + s.v1 * h}, tol);
    if (s.grads.has_bias() && reduced)
      check_close("grad_bias rows (summed in the call)", s.grads.bias(),
                  {full_b.begin() + s.v0, full_b.begin() + s.v1}, tol);
    if (s.grads.has_weight() && !reduced) add_to(dw[r], s.grads.weight());
    if (s.grads.has_bias() && !reduced) add_to(db[r], s.grads.bias());
  }
  for (int r = 0; r < vocab; ++r) {
    const ShardRun& s = runs[static_cast<std::size_t>(r)];
    const auto ri = static_cast<std::size_t>(r);
    if (!dw[ri].empty())
      check_close("grad_weight rows summed over the parts", dw[ri],
                  {full_w.begin() + s.v0 * h, full_w.begin() + s.v1 * h}, tol);
    if (!db[ri].empty())
      check_close("grad_bias rows summed over the parts", db[ri],
                  {full_b.begin() + s.v0, full_b.begin() + s.v1}, tol);
  }
}

const DataSplit kWhole{{0, 5}, {}};  // pair_spec's 5 pairs, one part

TEST_CASE("vocab parallel: 2 and 3 uneven shards match the unsplit call, every loss") {
  for (int vocab : {2, 3}) {
    for (Regime regime : {Regime::kResident, Regime::kRecompute}) {
      INFO("vocab ranks ", vocab, " regime ", regime_name(regime));
      DpoOptions dpo;
      dpo.engine.regime = regime;
      check_grid(PrefData(pair_spec(RefMode::kHead, true)), Dpo(dpo), {}, vocab, kWhole, false,
                 tolerance(DType::kF32).chunking);
      OrpoOptions orpo;
      orpo.engine.regime = regime;
      orpo.engine.memory_budget_bytes = std::size_t{24} << 10;  // several groups or chunks
      check_grid(PrefData(pair_spec(RefMode::kNone, true)), Orpo(orpo), {}, vocab, kWhole, false,
                 tolerance(DType::kF32).chunking);
      KtoOptions kto;
      kto.engine.regime = regime;
      const PrefData k(kto_spec(RefMode::kHead, true));
      check_grid(k, Kto(kto), {}, vocab, DataSplit{{0, k.spec.s}, {}}, false,
                 tolerance(DType::kF32).chunking);
    }
  }
}

TEST_CASE("vocab parallel: bf16, forward only, and a 2 x 2 grid with a data group") {
  PrefSpec bf = pair_spec(RefMode::kHead, false);
  bf.dtype = DType::kBF16;
  PrefGradRequest g;
  g.dtype = DType::kBF16;
  DpoOptions o;
  o.engine.fp32_weight_grad_accumulator = true;
  check_grid(PrefData(bf), Dpo(o), g, 2, kWhole, false, tolerance(DType::kBF16).chunking);
  check_grid(PrefData(pair_spec(RefMode::kNone, true)), Simpo(SimpoOptions{}),
             PrefGradRequest::none(), 3, kWhole, false, 0.0);
  const PrefData d(pair_spec(RefMode::kHead, true));
  check_grid(d, Dpo(DpoOptions{}), {}, 2, DataSplit{{0, 2, 5}, {}}, false,
             tolerance(DType::kF32).chunking);
  DpoOptions sum;
  sum.engine.reduce_weight_grad_over_data_group = true;
  check_grid(d, Dpo(sum), {}, 2, DataSplit{{0, 2, 5}, {}}, true, tolerance(DType::kF32).chunking);
}

// Both ranks of a vocabulary split of `d`, rank 1 with `shard1`'s rows (rank 0 with the right
// ones), `nan1` put into its weight and options `o1` when given, each rank's inputs then passed
// to `edit` when given; each rank's error message ("" when it returned), after checking that a
// failed call wrote nothing.
std::vector<std::string> vocab_errors(
    const PrefData& d, const DpoOptions& o, std::pair<std::int64_t, std::int64_t> shard1,
    bool nan1 = false, const DpoOptions* o1 = nullptr,
    const std::function<void(std::size_t, PreferenceInputs&)>& edit = nullptr) {
  std::vector<ShardRun> runs;
  runs.emplace_back(d, 0, d.spec.v / 2, PrefGradRequest{});
  runs.emplace_back(d, shard1.first, shard1.second, PrefGradRequest{});
  if (nan1) runs[1].w[3] = std::numeric_limits<float>::quiet_NaN();
  dist::InProcessGroup group(2);
  return on_threads(2, [&](std::size_t r) {
    ShardRun& run = runs[r];
    PreferenceInputs in = run.inputs(d);
    in.vocab_shard = {&group.comm(static_cast<int>(r)), run.v0, d.spec.v};
    if (edit) edit(r, in);
    CpuContext ctx(1);
    const PreferenceGrads grads = run.grads.views_as<PreferenceGrads>(false);
    const AlignedBuffer ws(std::size_t{1} << 20);
    std::string what;
    try {
      Dpo(r == 1 && o1 ? *o1 : o).forward_backward(ctx, in, grads, ws.workspace());
    } catch (const Error& x) {
      what = x.what();
    }
    if (!what.empty())
      for (double v : run.grads.hidden()) CHECK(std::isnan(v));
    return what;
  });
}

TEST_CASE("vocab parallel: bad shards, the deferred regime, and a rank's bad values") {
  const PrefData d(pair_spec(RefMode::kHead, false));  // V = 67: rank 1 of 2 holds [33, 67)
  const std::pair<std::int64_t, std::int64_t> right{33, 67};
  std::vector<std::string> e = vocab_errors(d, DpoOptions{}, {30, 67});
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("1 rank(s) of vocab_shard.group rejected their calls") != std::string::npos);
  CHECK(e[1].find("must hold rows [33, 67)") != std::string::npos);
  DpoOptions def;
  def.engine.regime = Regime::kDeferred;
  e = vocab_errors(d, def, right);
  for (const std::string& m : e)
    CHECK(m.find("regime deferred is not available with vocab_shard") != std::string::npos);
  DpoOptions checked;
  checked.engine.check_finite = true;
  e = vocab_errors(d, checked, right, true);
  CHECK(e[0].find("1 rank(s) of vocab_shard.group rejected their calls") != std::string::npos);
  CHECK(e[1].find("policy.weight") != std::string::npos);
  DpoOptions rpo;  // another objective on rank 1: DPO with an NLL term
  rpo.nll = true;
  e = vocab_errors(d, DpoOptions{}, right, false, &rpo);
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  e = vocab_errors(d, DpoOptions{}, right);
  CHECK(e[0].empty());
  CHECK(e[1].empty());
}

TEST_CASE(
    "vocab parallel: ranks that differ in V or in the objective's inputs fail on every rank") {
  // Rank 0's shard [0, 33) is its own for V = 66 as for V = 67, but the ranks' vocabularies
  // differ (its targets 66 made 0, so that it accepts them).
  const PrefData d(pair_spec(RefMode::kHead, false));
  std::vector<std::int32_t> targets = d.targets32;
  std::replace(targets.begin(), targets.end(), 66, 0);
  std::vector<std::string> e = vocab_errors(
      d, DpoOptions{}, {33, 67}, false, nullptr, [&](std::size_t r, PreferenceInputs& in) {
        if (r != 0) return;
        in.vocab_shard.size = 66;
        in.targets = TensorView::of(targets.data(), {d.spec.s, d.spec.t});
      });
  for (const std::string& m : e)
    CHECK_MESSAGE(m.find("vocab_shard.group make different kinds of calls") != std::string::npos,
                  m);
  // Precomputed reference sums that differ on one rank (the ranks' coefficients would differ).
  const PrefData logps(pair_spec(RefMode::kLogps, false));
  std::vector<float> other = logps.ref_logps;
  other[1] += 0.5f;
  e = vocab_errors(logps, DpoOptions{}, {33, 67}, false, nullptr,
                   [&](std::size_t r, PreferenceInputs& in) {
                     if (r == 1) in.reference_logps = TensorView::of(other.data(), {logps.spec.s});
                   });
  for (const std::string& m : e)
    CHECK_MESSAGE(m.find("vocab_shard.group make different kinds of calls") != std::string::npos,
                  m);
  e = vocab_errors(logps, DpoOptions{}, {33, 67});
  CHECK(e[0].empty());
  CHECK(e[1].empty());
}

// Throws where `throws` is set: an objective whose ranks differ in what the library cannot see.
class ThrowsOnRank final : public SequenceObjective {
 public:
  explicit ThrowsOnRank(bool throws) : throws_(throws) {}
  std::string_view name() const override { return "ThrowsOnRank"; }
  Unit unit() const override { return Unit::kPair; }
  bool uses_reference() const override { return true; }
  UnitResult evaluate(std::span<const SequenceStats> s, const BatchConstants& b,
                      std::span<double> e) const override {
    if (throws_) throw std::runtime_error("ThrowsOnRank: thrown");
    return NanOnMarker().evaluate(s, b, e);
  }

 private:
  bool throws_;
};

TEST_CASE("vocab parallel: an objective that throws on one rank only makes every rank throw") {
  // The ranks' passes go on with the failed units' coefficients 0 (their collectives match), and
  // the failure is exchanged at the end.
  const PrefData d(pair_spec(RefMode::kHead, false));
  std::vector<ShardRun> runs;
  runs.emplace_back(d, 0, 33, PrefGradRequest{});
  runs.emplace_back(d, 33, 67, PrefGradRequest{});
  dist::InProcessGroup group(2);
  const std::vector<std::string> e = on_threads(2, [&](std::size_t r) {
    PreferenceInputs in = runs[r].inputs(d);
    in.vocab_shard = {&group.comm(static_cast<int>(r)), runs[r].v0, d.spec.v};
    CpuContext ctx(1);
    const AlignedBuffer ws(std::size_t{1} << 20);
    try {
      SequenceLoss(std::make_shared<ThrowsOnRank>(r == 1))
          .forward_backward(ctx, in, runs[r].grads.views_as<PreferenceGrads>(false),
                            ws.workspace());
    } catch (const Error& x) {
      return std::string(x.what());
    }
    return std::string();
  });
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("failed (threw or returned a non-finite value) on 1 other rank(s) of "
                  "data_group or vocab_shard.group") != std::string::npos);
  CHECK(e[1].find("the objective threw for unit 0: ThrowsOnRank: thrown; gradients were already "
                  "written") != std::string::npos);
}

TEST_CASE("vocab parallel: the auto regime at a small budget plans token chunks on every rank") {
  PrefSpec s = pair_spec(RefMode::kHead, true);
  s.bias = false;
  s.h = 64;  // the cost model would pick vocab-block order for a shard's plan here
  DpoOptions o;
  o.engine.memory_budget_bytes = std::size_t{24} << 10;
  check_grid(PrefData(s), Dpo(o), {}, 2, kWhole, false, tolerance(DType::kF32).chunking);
}

TEST_CASE("vocab parallel: in a grid, one data group's mismatch fails every rank") {
  // Rank (0, 0) sums no bias gradient over its data group, rank (1, 0) does: data group 0 fails;
  // data group 1 agrees, and hears of it through the vocabulary groups.
  const PrefData d(pair_spec(RefMode::kHead, true));
  DpoOptions o;
  o.engine.reduce_weight_grad_over_data_group = true;
  std::vector<std::string> e;
  run_grid(d, Dpo(o), {}, 2, DataSplit{{0, 2, 5}, {}}, &e, [](std::size_t i) { return i == 0; });
  INFO(e[0], " | ", e[1], " | ", e[2], " | ", e[3]);
  CHECK(e[0].find("data_group make different kinds of calls") != std::string::npos);
  CHECK(e[2].find("data_group make different kinds of calls") != std::string::npos);
  // Ranks 1 and 3 quote what their vocabulary group's rank 0 (ranks 0 and 2, data group 0) found.
  for (const std::size_t i : {std::size_t{1}, std::size_t{3}})
    CHECK(e[i].find("the data group of another rank of vocab_shard.group failed (rank 0: the "
                    "ranks of its data_group make different kinds of calls)") != std::string::npos);
}

// ---- SequenceLogProbs over a vocabulary split ----------------------------------------------

// SequenceLogProbs of `d`'s policy head split into `vocab` shards (rank r: rows [V r / K,
// V (r + 1) / K), or `shard1` for rank 1 when given), each rank with options `opts(r)`; `nan1`
// puts a NaN into rank 1's weight. Each rank's result, or with `errors` its chunkloss::Error
// there ("" when it returned; the workspace is then 1 MiB, not workspace_bytes()).
std::vector<SequenceLogProbResult> log_probs_split(
    const PrefData& d, int vocab, const std::function<SequenceOptions(std::size_t)>& opts,
    std::vector<std::string>* errors = nullptr,
    std::optional<std::pair<std::int64_t, std::int64_t>> shard1 = {}, bool nan1 = false) {
  std::vector<ShardRun> runs;
  for (int r = 0; r < vocab; ++r) {
    const bool moved = r == 1 && shard1;
    runs.emplace_back(d, moved ? shard1->first : d.spec.v * r / vocab,
                      moved ? shard1->second : d.spec.v * (r + 1) / vocab, PrefGradRequest::none());
  }
  if (nan1) {
    runs[1].w[3] = std::numeric_limits<float>::quiet_NaN();
    runs[1].wb[3] = BFloat16(std::numeric_limits<float>::quiet_NaN());
  }
  dist::InProcessGroup group(vocab);
  if (errors) errors->assign(runs.size(), "");
  return on_threads(runs.size(), [&](std::size_t r) {
    const SequenceLogProbs lp(opts(r));
    const PreferenceInputs in = runs[r].inputs(d);
    const VocabShard shard{&group.comm(static_cast<int>(r)), runs[r].v0, d.spec.v};
    CpuContext ctx(1);
    try {  // a rank that gets workspace_bytes() wrong must still make the call
      const AlignedBuffer ws(errors ? std::size_t{1} << 20
                                    : lp.workspace_bytes(in.policy, in.targets, shard));
      return lp.compute(ctx, in.policy, in.targets, ws.workspace(), shard);
    } catch (const Error& e) {
      if (!errors) {
        group.abort();
        throw;
      }
      (*errors)[r] = e.what();
    } catch (...) {  // a rank failing alone must not leave the others waiting
      group.abort();
      throw;
    }
    return SequenceLogProbResult{};
  });
}

TEST_CASE("vocab parallel: SequenceLogProbs over 2 and 3 uneven shards matches the unsplit call") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec spec = pair_spec(RefMode::kNone, true);
    spec.dtype = dtype;
    PrefData d(spec);
    for (std::int64_t j = 0; j < spec.t; ++j) d.set_target(2 * spec.t + j, spec.ignore_index);
    for (std::size_t budget : {std::size_t{0}, std::size_t{16} << 10}) {
      SequenceOptions o;
      o.memory_budget_bytes = budget;
      const SequenceLogProbs lp(o);
      const Head head = d.policy_head();
      const AlignedBuffer ws(lp.workspace_bytes(head, d.targets_view()));
      CpuContext ctx(1);
      const SequenceLogProbResult want = lp.compute(ctx, head, d.targets_view(), ws.workspace());
      CHECK(want.tokens[2] == 0);
      for (int vocab : {2, 3}) {
        INFO(dtype_name(dtype), " budget ", budget, " vocab ranks ", vocab);
        const auto got = log_probs_split(d, vocab, [&](std::size_t) { return o; });
        for (const SequenceLogProbResult& r : got) {
          check_close("logps", r.logps, want.logps, 1e-6);
          CHECK(r.tokens == want.tokens);
          CHECK(r.logps[2] == 0.0);
          CHECK(r.logps == got[0].logps);  // every rank the same values
        }
      }
    }
  }
}

TEST_CASE("vocab parallel: SequenceLogProbs fails on every rank when one rank's call is bad") {
  const PrefData d(pair_spec(RefMode::kNone, false));  // V = 67: rank 1 of 2 holds [33, 67)
  const auto plain = [](std::size_t) { return SequenceOptions{}; };
  std::vector<std::string> e;
  log_probs_split(d, 2, plain, &e, std::pair<std::int64_t, std::int64_t>{30, 67});
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("1 rank(s) of vocab_shard.group rejected their calls") != std::string::npos);
  CHECK(e[1].find("must hold rows [33, 67)") != std::string::npos);
  SequenceOptions checked;
  checked.check_finite = true;
  log_probs_split(
      d, 2, [&](std::size_t) { return checked; }, &e, {}, true);
  CHECK(e[0].find("1 rank(s) of vocab_shard.group rejected their calls") != std::string::npos);
  CHECK(e[1].find("head.weight") != std::string::npos);
  // Budgets that give the ranks different chunks.
  log_probs_split(
      d, 2,
      [](std::size_t r) {
        SequenceOptions o;
        o.memory_budget_bytes = r == 0 ? 0 : std::size_t{16} << 10;
        return o;
      },
      &e);
  for (const std::string& m : e)
    CHECK(m.find("vocab_shard.group make different kinds of calls") != std::string::npos);
  log_probs_split(d, 2, plain, &e);
  CHECK(e[0].empty());
  CHECK(e[1].empty());
}

}  // namespace
}  // namespace chunkloss::test
