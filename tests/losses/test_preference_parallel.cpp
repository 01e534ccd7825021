// Data-parallel sequence losses on the CPU: the units of one problem split over 2 or 3 ranks of
// an in-process group (ranks as threads) against the unsplit call, for every loss, regime and
// reference mode, KTO's KL batch split too; bf16, accumulation and the dW sum inside the call;
// forward only; and the errors every rank raises when one rank's values or objective fail.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/dist/communicator.h>
#include <chunkloss/losses/preference.h>
#include <chunkloss/losses/sequence.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "preference_fixture.h"
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

// Runs every rank of `parts` and returns each rank's error message ("" when it returned).
std::vector<std::string> errors_of(const std::vector<PrefData>& parts, const SequenceLoss& loss,
                                   const std::function<void(std::size_t, PrefRun&)>& check) {
  dist::InProcessGroup group(static_cast<int>(parts.size()));
  return on_threads(parts.size(), [&](std::size_t r) {
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
    } catch (const std::exception& x) {
      return std::string(x.what());
    }
    return std::string();
  });
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("failed (threw or returned a non-finite value) on 1 other rank(s)") !=
        std::string::npos);
  CHECK(e[1] == "ThrowOnMarker: the marker");
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
  // KTO with a KL batch on one rank and the KL point given on the other.
  const PrefData kto(kto_spec(RefMode::kLogps, true));
  std::vector<PrefData> parts = {data_part(kto, 0, 3, 0, 2), data_part(kto, 3, 7, 2, 5)};
  parts[1].spec.kl_batch = false;
  parts[1].spec.kl = 0.1;
  const std::vector<std::string> k =
      errors_of(parts, Kto(KtoOptions{}), [](std::size_t, PrefRun& run) { CHECK(untouched(run)); });
  for (const std::string& m : k)
    CHECK(m.find("make different kinds of calls") != std::string::npos);
}

}  // namespace
}  // namespace chunkloss::test
