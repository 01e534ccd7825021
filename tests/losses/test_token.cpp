// TokenLoss on the CPU: token objectives (NLL, focal, a clipped ratio with per-row data) against
// the float64 oracle in fp32 and bf16, both loop orders, several chunks and skipped rows; NLL
// against LinearCrossEntropy; finite differences; the rows the objective sees; accumulation,
// forward only, all rows ignored, bitwise reruns; the errors; and the rows split over a data
// group, the vocabulary over a vocabulary group, and both (a grid), against the whole call.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/dist/communicator.h>
#include <chunkloss/losses/cross_entropy.h>
#include <chunkloss/losses/grpo.h>
#include <chunkloss/losses/token.h>

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "ce_fixture.h"
#include "data/expect_error.h"
#include "reference/token_ref.h"
#include "support/compare.h"
#include "support/random.h"
#include "support/threads.h"
#include "support/tolerance.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

constexpr LoopOrder kOrders[] = {LoopOrder::kTokenChunk, LoopOrder::kVocabBlock};

TokenInputs token_inputs(const CeData& d) {
  const CrossEntropyInputs in = d.inputs({});
  return {in.hidden, in.weight, in.bias, in.targets};
}

struct TokenRun {
  TokenResult result;
  Plan plan;
  GradBuffers grads;
};

// One call with a fresh NaN-filled workspace of exactly workspace_bytes(); `accumulate` adds to
// the buffers' contents (filled by the caller).
TokenRun run_token(const CeData& d, const TokenLoss& loss, const GradRequest& g,
                   bool accumulate = false, GradBuffers* into = nullptr) {
  const TokenInputs in = token_inputs(d);
  TokenRun run{{}, {}, into ? *into : GradBuffers(d, g, std::nanf(""))};
  const CrossEntropyGrads grads = run.grads.views(accumulate);
  run.plan = loss.plan(in, grads);
  const AlignedBuffer ws(loss.workspace_bytes(in, grads));
  CpuContext ctx(2);
  run.result = loss.forward_backward(ctx, in, grads, ws.workspace());
  return run;
}

reference::TokenOracle oracle(const CeData& d, const TokenLoss& loss) {
  const TokenOptions& o = loss.options();
  return reference::token_loss(d.problem({}), o.ignore_index, o.reduction, loss.objective());
}

void check_run(const CeData& d, const TokenLoss& loss, const GradRequest& g, const TokenRun& run,
               const reference::TokenOracle& ref) {
  const Tolerance in_tol = tolerance(d.spec.dtype), grad_tol = tolerance(g.dtype);
  INFO("plan: ", run.plan.str());
  check_scalar("loss", run.result.loss, ref.loss, in_tol.loss);
  CHECK(run.result.valid_rows == ref.valid_rows);
  CHECK(run.result.accuracy == doctest::Approx(ref.accuracy).epsilon(1e-12));
  const std::vector<std::string> names = loss.objective().extra_metrics();
  REQUIRE(run.result.metrics.size() == names.size());
  for (std::size_t m = 0; m < names.size(); ++m) {
    CHECK(run.result.metrics[m].first == names[m]);
    check_scalar(names[m], run.result.metrics[m].second, ref.metrics[m], in_tol.loss);
  }
  REQUIRE(run.result.logps.size() == ref.logps.size());
  for (std::size_t i = 0; i < ref.logps.size(); ++i)
    CHECK(std::isnan(run.result.logps[i]) == std::isnan(ref.logps[i]));
  std::vector<double> got, want;  // the valid rows' logps
  for (std::size_t i = 0; i < ref.logps.size(); ++i)
    if (!std::isnan(ref.logps[i])) got.push_back(run.result.logps[i]), want.push_back(ref.logps[i]);
  check_close("logps", got, want, in_tol.rows);
  if (g.hidden) check_close("grad_hidden", run.grads.hidden(), ref.grad_hidden, grad_tol.grad);
  if (g.weight) check_close("grad_weight", run.grads.weight(), ref.grad_weight, grad_tol.grad);
  if (g.bias && d.spec.bias)
    check_close("grad_bias", run.grads.bias(), ref.grad_bias, grad_tol.grad);
}

// The float64 oracle's log-probs of the problem's rows (NaN at ignored rows), from which the
// objectives below place their old and reference log-probs.
reference::TokenOracle oracle_logps(const CeData& d) {
  return reference::token_loss(d.problem({}), -100, Reduction::kMean, reference::NllObjective());
}

// A clipped-ratio objective whose old log-probs sit 0 or +-0.5 from the oracle's, so that about
// a third of the rows clip on each side, none near a clipping boundary.
std::shared_ptr<const TokenObjective> clipped_ratio(const CeData& d) {
  const reference::TokenOracle base = oracle_logps(d);
  const std::vector<float> a = normal_floats(base.logps.size(), 1.0f, d.spec.seed + 7);
  std::vector<double> adv(a.begin(), a.end()), old;
  for (std::size_t i = 0; i < base.logps.size(); ++i) {
    const double shift = (static_cast<int>(i % 3) - 1) * 0.5;
    old.push_back(std::isnan(base.logps[i]) ? 0.0 : base.logps[i] + shift);
  }
  return std::make_shared<reference::ClippedRatioObjective>(adv, old, 0.2);
}

// The library's GRPO objective with every term: old log-probs as clipped_ratio's (ratios 1,
// e^0.5 > delta and e^-0.5 < 1 - epsilon_low, none near a boundary), DAPO's clip-higher, the
// two-sided cap, the k3 KL to reference log-probs up to 0.3 away, and the grpo loss type's
// weights over completions of 5 rows.
std::shared_ptr<const TokenObjective> grpo(const CeData& d) {
  const reference::TokenOracle base = oracle_logps(d);
  const std::size_t n = base.logps.size();
  const std::vector<float> a = normal_floats(n, 1.0f, d.spec.seed + 7);
  const std::vector<float> r = normal_floats(n, 0.3f, d.spec.seed + 8);
  std::vector<double> adv(a.begin(), a.end()), old, ref;
  std::vector<std::int64_t> completion;
  for (std::size_t i = 0; i < n; ++i) {
    const double logp = std::isnan(base.logps[i]) ? 0.0 : base.logps[i];
    old.push_back(logp + (static_cast<int>(i % 3) - 1) * 0.5);
    ref.push_back(logp + r[i]);
    completion.push_back(static_cast<std::int64_t>(i / 5));
  }
  const GrpoNormalization norm = grpo_normalization(GrpoLossType::kGrpo, completion);
  GrpoOptions o;
  o.epsilon_high = 0.28;
  o.delta = 1.5;
  o.beta = 0.04;
  return std::make_shared<GrpoObjective>(o, GrpoRows{adv, old, ref, norm.weights});
}

// GRPO at the sequence level (GSPO): old log-probs 0.25 apart within completions of 5 rows (so
// the completions' ratios s_i spread on both sides of the clip range), the current log-probs
// the float64 oracle's, DAPO's clip-higher, the cap, the KL and the grpo type's weights.
std::shared_ptr<const TokenObjective> grpo_sequence(const CeData& d) {
  const reference::TokenOracle base = oracle_logps(d);
  const std::size_t n = base.logps.size();
  const std::vector<float> a = normal_floats(n, 1.0f, d.spec.seed + 9);
  const std::vector<float> r = normal_floats(n, 0.3f, d.spec.seed + 10);
  std::vector<double> adv, old, ref;
  std::vector<std::int64_t> completion;
  for (std::size_t i = 0; i < n; ++i) {
    const bool valid = !std::isnan(base.logps[i]);
    const double logp = valid ? base.logps[i] : 0.0;
    adv.push_back(a[i / 5 * 5]);  // (the completion's)
    old.push_back(logp + (static_cast<int>(i / 5 % 3) - 1) * 0.25 + (i % 2 ? 0.1 : -0.1));
    ref.push_back(logp + r[i]);
    completion.push_back(valid ? static_cast<std::int64_t>(i / 5) : -1);
  }
  const GrpoNormalization norm = grpo_normalization(GrpoLossType::kGrpo, completion);
  GrpoOptions o;
  o.epsilon_high = 0.28;
  o.delta = 1.5;
  o.beta = 0.04;
  o.importance_sampling_level = ImportanceSamplingLevel::kSequence;
  return std::make_shared<GrpoObjective>(
      o, GrpoRows{adv, old, ref, norm.weights, completion, base.logps});
}

std::vector<std::shared_ptr<const TokenObjective>> objectives(const CeData& d) {
  return {std::make_shared<reference::NllObjective>(),
          std::make_shared<reference::FocalObjective>(2.0), clipped_ratio(d), grpo(d),
          grpo_sequence(d)};
}

// The smallest budget giving `rows` rows per chunk in `order`, as the CE fixture finds it (a
// token loss plans as cross-entropy does).
std::size_t chunk_budget(const CeData& d, const GradRequest& g, std::int64_t rows,
                         LoopOrder order = LoopOrder::kAuto) {
  CrossEntropyOptions o;
  o.loop_order = order;
  return budget_for_chunk_rows(d, o, g, rows);
}

// A problem of several 64-row chunks (at chunk_budget(..., 64)).
CeSpec chunked_spec(bool bias, DType dtype = DType::kF32) {
  CeSpec s;
  s.n = 150;
  s.h = 40;
  s.v = 300;
  s.bias = bias;
  s.dtype = dtype;
  return s;
}

// Every gradient, in `dtype`.
GradRequest grads_in(DType dtype) {
  GradRequest g;
  g.dtype = dtype;
  return g;
}

TEST_CASE("token objectives against the float64 oracle: dtypes, orders, chunks, reductions") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (LoopOrder order : kOrders) {
      for (bool multi : {false, true}) {
        CeSpec s = multi ? chunked_spec(true) : CeSpec{};
        s.dtype = dtype;
        s.bias = true;
        if (multi) s.ignored_run = {70, 100};
        const CeData d(s);
        GradRequest g;
        g.dtype = dtype;
        for (const auto& obj : objectives(d)) {
          for (Reduction red : {Reduction::kMean, Reduction::kSum}) {
            CAPTURE(obj->name());
            CAPTURE(dtype_name(dtype));
            CAPTURE(loop_order_name(order));
            CAPTURE(reduction_name(red));
            CAPTURE(multi);
            TokenOptions o;
            o.loop_order = order;
            o.reduction = red;
            if (multi) o.memory_budget_bytes = chunk_budget(d, g, 64, order);
            const TokenLoss loss(obj, o);
            const TokenRun run = run_token(d, loss, g);
            if (multi && order == LoopOrder::kTokenChunk) CHECK(run.plan.num_chunks == 3);
            check_run(d, loss, g, run, oracle(d, loss));
          }
        }
      }
    }
  }
}

TEST_CASE("token objectives: skipped rows, the fp32 dW accumulator, bf16 logits are refused") {
  CeSpec s;
  s.n = 300;
  s.h = 24;
  s.v = 200;
  s.dtype = DType::kBF16;
  s.ignored_prefix = 90;
  s.ignored_run = {150, 230};
  const CeData d(s);
  GradRequest g;
  g.dtype = DType::kBF16;
  for (const auto& obj : objectives(d)) {
    CAPTURE(obj->name());
    TokenOptions o;
    o.skip_ignored_rows = true;
    o.fp32_weight_grad_accumulator = true;
    o.memory_budget_bytes = chunk_budget(d, g, 64);
    const TokenLoss loss(obj, o);
    const TokenRun run = run_token(d, loss, g);
    check_run(d, loss, g, run, oracle(d, loss));
  }
}

TEST_CASE("token objectives: NLL is LinearCrossEntropy's mean, to rounding") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const CeData d(chunked_spec(true, dtype));
    const GradRequest g = grads_in(dtype);
    const LibRun ce = run_library(d, {}, g, false);
    const TokenRun tok = run_token(d, TokenLoss(std::make_shared<reference::NllObjective>()), g);
    const Tolerance t = tolerance(dtype);
    check_scalar("loss", tok.result.loss, ce.result.loss, 1e-6);
    CHECK(tok.result.accuracy == ce.result.accuracy);
    CHECK(tok.result.valid_rows == ce.result.valid_rows);
    check_close("grad_hidden", tok.grads.hidden(), ce.grads.hidden(), t.chunking);
    check_close("grad_weight", tok.grads.weight(), ce.grads.weight(), t.chunking);
    check_close("grad_bias", tok.grads.bias(), ce.grads.bias(), t.chunking);
  }
}

TEST_CASE("token objectives: finite differences of the float64 loss at the library's gradients") {
  CeSpec s;
  s.n = 6;
  s.h = 9;
  s.v = 13;
  s.bias = true;
  s.ignore_fraction = 0.2;
  s.logit_scale = 2.0f;
  const CeData d(s);
  for (const auto& obj :
       {std::shared_ptr<const TokenObjective>(std::make_shared<reference::FocalObjective>(1.5)),
        clipped_ratio(d), grpo(d), grpo_sequence(d)}) {
    for (LoopOrder order : kOrders) {
      CAPTURE(obj->name());
      CAPTURE(loop_order_name(order));
      TokenOptions o;
      o.loop_order = order;
      if (obj->name() == "Grpo") o.reduction = Reduction::kSum;  // its weights' reduction
      const TokenLoss loss(obj, o);
      const TokenRun run = run_token(d, loss, {});
      const double step = 1e-5;
      auto check_entries = [&](std::vector<double> reference::CeProblem::*member,
                               const std::vector<double>& grad, const char* what) {
        double largest = 0;
        for (std::size_t i = 0; i < grad.size(); ++i) {
          reference::CeProblem p = d.problem({});
          const double x0 = (p.*member)[i];
          (p.*member)[i] = x0 + step;
          const double up = reference::token_loss_value(p, -100, o.reduction, *obj);
          (p.*member)[i] = x0 - step;
          const double down = reference::token_loss_value(p, -100, o.reduction, *obj);
          const double fd = (up - down) / (2 * step);
          largest = std::max(largest, std::abs(fd));
          CHECK_MESSAGE(std::abs(fd - grad[i]) <= 1e-5 + 1e-4 * std::abs(fd),
                        what << "[" << i << "]: library gradient " << grad[i]
                             << ", central difference of the float64 loss " << fd);
        }
        CHECK_MESSAGE(largest > 1e-2, what << ": every entry is near zero");
      };
      check_entries(&reference::CeProblem::hidden, run.grads.hidden(), "grad_hidden");
      check_entries(&reference::CeProblem::weight, run.grads.weight(), "grad_weight");
      check_entries(&reference::CeProblem::bias, run.grads.bias(), "grad_bias");
    }
  }
}

// Records the rows it is asked about (test instrumentation; a real objective is pure).
class RecordingObjective final : public TokenObjective {
 public:
  std::string_view name() const override { return "Recording"; }
  TokenValue evaluate(const TokenStats& row, std::span<double>) const override {
    const std::lock_guard<std::mutex> lock(mutex_);
    rows.push_back(row);
    return {-row.logp, -1.0};
  }
  mutable std::vector<TokenStats> rows;

 private:
  mutable std::mutex mutex_;
};

TEST_CASE("token objectives: each valid row is evaluated once, in row order, with its target") {
  CeSpec s;
  s.n = 300;
  s.h = 16;
  s.v = 100;
  s.ignored_prefix = 40;
  s.ignored_run = {120, 200};
  const CeData d(s);
  for (bool skip : {false, true}) {
    for (LoopOrder order : kOrders) {
      for (bool grads : {false, true}) {
        CAPTURE(skip);
        CAPTURE(loop_order_name(order));
        CAPTURE(grads);
        auto rec = std::make_shared<RecordingObjective>();
        TokenOptions o;
        o.skip_ignored_rows = skip;
        o.loop_order = order;
        o.memory_budget_bytes = chunk_budget(d, {}, 64, order);
        GradRequest g;
        g.hidden = g.weight = g.bias = grads;
        const TokenRun run = run_token(d, TokenLoss(rec, o), g);
        std::vector<std::int64_t> want;
        for (std::int64_t t = 0; t < s.n; ++t)
          if (d.targets64[sz(t)] != s.ignore_index) want.push_back(t);
        REQUIRE(rec->rows.size() == want.size());
        for (std::size_t i = 0; i < want.size(); ++i) {
          CHECK(rec->rows[i].row == want[i]);
          CHECK(rec->rows[i].target == d.targets64[sz(want[i])]);
          CHECK(rec->rows[i].logp == run.result.logps[sz(want[i])]);
        }
        CHECK(run.result.valid_rows == static_cast<std::int64_t>(want.size()));
      }
    }
  }
}

TEST_CASE("token objectives: accumulate, forward only, all rows ignored, bitwise reruns") {
  const CeSpec s = chunked_spec(true);
  const CeData d(s);
  GradRequest g;
  const auto focal = std::make_shared<reference::FocalObjective>(2.0);
  TokenOptions o;
  o.memory_budget_bytes = chunk_budget(d, g, 64);
  const TokenLoss loss(focal, o);
  const reference::TokenOracle ref = oracle(d, loss);

  SUBCASE("accumulate") {
    GradBuffers start(d, g);
    start.fill_random(5, 0.01, 0.01, 0.01);
    const std::vector<double> h0 = start.hidden(), w0 = start.weight(), b0 = start.bias();
    const TokenRun run = run_token(d, loss, g, true, &start);
    const auto plus = [](std::vector<double> a, const std::vector<double>& b) {
      for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
      return a;
    };
    check_close("grad_hidden", run.grads.hidden(), plus(h0, ref.grad_hidden), 1e-5);
    check_close("grad_weight", run.grads.weight(), plus(w0, ref.grad_weight), 1e-5);
    check_close("grad_bias", run.grads.bias(), plus(b0, ref.grad_bias), 1e-5);
  }
  SUBCASE("forward only: the same loss and metrics, no gradient work") {
    GradRequest none;
    none.hidden = none.weight = none.bias = false;
    const TokenRun fwd = run_token(d, loss, none);
    const TokenRun full = run_token(d, loss, g);
    CHECK(fwd.result.loss == full.result.loss);
    CHECK(fwd.result.metrics == full.result.metrics);
    CHECK(fwd.plan.workspace_bytes() <= full.plan.workspace_bytes());
  }
  SUBCASE("all rows ignored: loss 0, metrics 0, zero gradients (every row skipped, or not)") {
    CeSpec all = s;
    all.ignore_fraction = 1.0;
    const CeData e(all);
    for (bool skip : {false, true}) {
      CAPTURE(skip);
      TokenOptions so = o;
      so.skip_ignored_rows = skip;
      const TokenRun run = run_token(e, TokenLoss(focal, so), g);
      CHECK(run.result.loss == 0.0);
      CHECK(run.result.valid_rows == 0);
      CHECK(run.result.metrics.at(0).second == 0.0);
      check_all_equal("grad_hidden", run.grads.hidden(), 0.0);
      check_all_equal("grad_weight", run.grads.weight(), 0.0);
      check_all_equal("grad_bias", run.grads.bias(), 0.0);
    }
  }
  SUBCASE("bitwise reruns") {
    const TokenRun a = run_token(d, loss, g), b = run_token(d, loss, g);
    CHECK(a.result.loss == b.result.loss);
    CHECK(a.grads.bitwise_equal(b.grads));
  }
}

// Throws, or returns NaN, at one row.
class FailingObjective final : public TokenObjective {
 public:
  FailingObjective(std::int64_t row, bool nan) : row_(row), nan_(nan) {}
  std::string_view name() const override { return "Failing"; }
  TokenValue evaluate(const TokenStats& row, std::span<double>) const override {
    if (row.row != row_) return {-row.logp, -1.0};
    if (nan_) return {std::nan(""), -1.0};
    throw std::runtime_error("advantages missing");
  }

 private:
  std::int64_t row_;
  bool nan_;
};

TEST_CASE("token objectives: bad input and failing objectives raise chunkloss::Error") {
  CeSpec s = chunked_spec(false);
  s.ignore_fraction = 0.0;
  const CeData d(s);
  const auto nll = std::make_shared<reference::NllObjective>();

  TokenOptions none;
  none.reduction = Reduction::kNone;
  CHECK(contains(error_message([&] { TokenLoss bad(nll, none); }),
                 "Nll: reduction must be mean or sum"));
  CHECK(contains(error_message([&] { TokenLoss bad(nullptr); }), "the objective is null"));

  CeData bad_target = d;
  bad_target.set_target(5, 300);
  CHECK(contains(error_message([&] { run_token(bad_target, TokenLoss(nll), {}); }),
                 "Nll: targets[5] = 300 is outside [0, V=300)"));

  TokenInputs in = token_inputs(d);
  in.weight = TensorView::of(d.weight.data(), {300, 39});
  CHECK(contains(error_message([&] { (void)TokenLoss(nll).plan(in); }), "Nll: weight"));

  TokenOptions finite;
  finite.check_finite = true;
  CeData nan_hidden = d;
  nan_hidden.hidden[17] = std::nanf("");
  CHECK(contains(error_message([&] { run_token(nan_hidden, TokenLoss(nll, finite), {}); }),
                 "hidden"));

  TokenOptions chunks;
  chunks.memory_budget_bytes = chunk_budget(d, {}, 64);
  SUBCASE("an objective that throws in the first chunk: nothing written yet") {
    const std::string m = error_message(
        [&] { run_token(d, TokenLoss(std::make_shared<FailingObjective>(3, false), chunks), {}); });
    CHECK(contains(m, "Failing: the objective threw for row 3: advantages missing"));
    CHECK(!contains(m, "unspecified"));
    try {
      run_token(d, TokenLoss(std::make_shared<FailingObjective>(3, false), chunks), {});
    } catch (const Error& e) {
      try {
        std::rethrow_if_nested(e);
        FAIL("the objective's exception is not nested");
      } catch (const std::runtime_error& inner) {
        CHECK(std::string(inner.what()) == "advantages missing");
      }
    }
  }
  SUBCASE("a non-finite value in a later chunk: the message says gradients were written") {
    const std::string m = error_message([&] {
      run_token(d, TokenLoss(std::make_shared<FailingObjective>(100, true), chunks), {});
    });
    CHECK(contains(m, "Failing: row 100"));
    CHECK(contains(m, "the objective must return finite values"));
    CHECK(contains(m, "unspecified"));
  }
}

// ---- data and vocabulary parallel ------------------------------------------------------------

// How a call is split: the problem's rows at `rows` offsets over a data group, the weight's rows
// at `vocab` offsets over a vocabulary group (one offset: not split that way).
struct TokenSplit {
  std::vector<std::int64_t> rows = {0};
  std::vector<std::int64_t> vocab = {0};
};

// One rank's call: its result and gradients.
struct TokenRank {
  TokenResult result;
  GradStorage grads;
};
using MakeObjective =
    std::function<std::shared_ptr<const TokenObjective>(std::int64_t r0, std::int64_t rows)>;

// The rank holding row part `ri` and vocabulary part `vi` of `s` calls with its rows and weight
// rows over the grid's groups, its objective from make_obj(first row, rows).
TokenRank call_token_rank(const CeData& d, const TokenOptions& o, const GradRequest& g,
                          const TokenSplit& s, const Grid& grid, std::size_t ri, std::size_t vi,
                          const MakeObjective& make_obj) {
  const auto [r0, r1] = part(s.rows, ri, d.spec.n);
  const auto [v0, v1] = part(s.vocab, vi, d.spec.v);
  const std::int64_t n = r1 - r0, h = d.spec.h;
  TokenInputs in = token_inputs(d);
  in.hidden = rows_of(d, d.hidden, d.hidden_bf, r0, n, h);
  in.targets = TensorView::of(d.targets32.data() + r0, {n});
  in.weight = rows_of(d, d.weight, d.weight_bf, v0, v1 - v0, h);
  if (d.spec.bias) in.bias = rows_of(d, d.bias, d.bias_bf, v0, v1 - v0, 0);
  if (dist::Communicator* vocab = grid.vocab(ri, vi)) in.vocab_shard = {vocab, v0, d.spec.v};
  in.data_group = grid.data(ri, vi);
  TokenRank rank{{},
                 GradStorage(g.dtype, g.hidden, g.weight, g.bias && d.spec.bias, n, h, v1 - v0,
                             std::nanf(""))};
  const TokenLoss loss(make_obj(r0, n), o);
  const CrossEntropyGrads grads = rank.grads.views_as<CrossEntropyGrads>(false);
  const AlignedBuffer ws(loss.workspace_bytes(in, grads));
  CpuContext ctx(1);
  rank.result = loss.forward_backward(ctx, in, grads, ws.workspace());
  return rank;
}

// Every rank of `s` on its own thread, rank (ri, vi) at [ri * vocabulary parts + vi].
template <typename Call>
auto on_grid(const TokenSplit& s, const Call& call) {
  const std::size_t nv = s.vocab.size(), nr = s.rows.size();
  const Grid grid(nr, nv);
  return on_threads(nr * nv, [&](std::size_t k) { return call(grid, k / nv, k % nv); });
}

// A clipped ratio over rows [r0, r0 + rows) of `all`'s per-row data (advantages, old logps).
MakeObjective clipped_rows(const CeData& d) {
  const auto all =
      std::static_pointer_cast<const reference::ClippedRatioObjective>(clipped_ratio(d));
  return [all](std::int64_t r0, std::int64_t rows) -> std::shared_ptr<const TokenObjective> {
    return all->rows(r0, rows);
  };
}

// GRPO over rows [r0, r0 + rows) of per-row data made for all rows (the grpo type's weights, old
// log-probs 0.25 apart between completions and 0.1 within, the KL), at `level`. Completions have
// up to 5 rows and end at every row offset of the split test's splits, so that a completion's
// rows stay on one rank (GSPO's ratio is the mean over them).
MakeObjective grpo_rows(const CeData& d, ImportanceSamplingLevel level) {
  struct Rows {
    std::vector<double> adv, old, ref, weights, current;
    std::vector<std::int64_t> completion;
  };
  const auto all = std::make_shared<Rows>();
  const reference::TokenOracle base = oracle_logps(d);
  const std::size_t n = base.logps.size();
  const std::vector<float> a = normal_floats(n, 1.0f, d.spec.seed + 11);
  const std::vector<float> r = normal_floats(n, 0.3f, d.spec.seed + 12);
  for (std::size_t i = 0; i < n; ++i) {
    std::size_t start = 0, segment = 0;  // (the split test's offsets)
    for (const std::size_t cut : {20, 61, 97})
      if (i >= cut) start = cut, ++segment;
    const std::size_t first = start + (i - start) / 5 * 5;  // the completion's first row
    const auto c = static_cast<std::int64_t>(segment * 1000 + first);
    const bool valid = !std::isnan(base.logps[i]);
    const double logp = valid ? base.logps[i] : 0.0;
    all->completion.push_back(valid ? c : -1);
    all->adv.push_back(a[first]);
    all->old.push_back(logp + 0.25 * static_cast<double>(c % 3 - 1) + (i % 2 ? 0.1 : -0.1));
    all->ref.push_back(logp + r[i]);
    all->current.push_back(base.logps[i]);
  }
  all->weights = grpo_normalization(GrpoLossType::kGrpo, all->completion).weights;
  GrpoOptions o;
  o.epsilon_high = 0.28;
  o.delta = 1.5;
  o.beta = 0.04;
  o.importance_sampling_level = level;
  return [all, o](std::int64_t r0, std::int64_t rows) -> std::shared_ptr<const TokenObjective> {
    const auto slice = [&](const auto& v) {
      return std::span(v).subspan(static_cast<std::size_t>(r0), static_cast<std::size_t>(rows));
    };
    return std::make_shared<GrpoObjective>(
        o, GrpoRows{slice(all->adv), slice(all->old), slice(all->ref), slice(all->weights),
                    slice(all->completion), slice(all->current)});
  };
}

// The ranks' results against the call on all rows and columns: every rank's loss, accuracy,
// valid rows and metric; each vocabulary part's dH and logps over its row parts (the ranks of a
// vocabulary group bitwise equal); dW and db over the vocabulary parts, summed over the row
// parts (or, summed in the call, each rank's).
void check_split(const CeData& d, const TokenSplit& s, bool reduced, const GradRequest& g,
                 const std::vector<TokenRank>& ranks, const reference::TokenOracle& ref) {
  const std::size_t nv = s.vocab.size(), nr = s.rows.size();
  const Tolerance in_tol = tolerance(d.spec.dtype), grad_tol = tolerance(g.dtype);
  const std::int64_t h = d.spec.h;
  std::vector<double> dw(ref.grad_weight.size(), 0.0), db(ref.grad_bias.size(), 0.0);
  for (std::size_t vi = 0; vi < nv; ++vi) {
    const auto [v0, v1] = part(s.vocab, vi, d.spec.v);
    std::vector<double> dh, logps;
    for (std::size_t ri = 0; ri < nr; ++ri) {
      const TokenRank& rk = ranks[ri * nv + vi];
      check_scalar("loss", rk.result.loss, ref.loss, in_tol.loss);
      CHECK(rk.result.valid_rows == ref.valid_rows);
      CHECK(rk.result.accuracy == doctest::Approx(ref.accuracy).epsilon(1e-12));
      check_scalar("metric", rk.result.metrics.at(0).second, ref.metrics.at(0), in_tol.loss);
      const TokenRank& first = ranks[ri * nv];  // its vocabulary group's rank 0
      CHECK(rk.result.loss == first.result.loss);
      CHECK(rk.grads.hidden() == first.grads.hidden());
      for (std::size_t j = 0; j < rk.result.logps.size(); ++j)
        CHECK((rk.result.logps[j] == first.result.logps[j] ||
               (std::isnan(rk.result.logps[j]) && std::isnan(first.result.logps[j]))));
      const std::vector<double> rh = rk.grads.hidden(), rw = rk.grads.weight();
      dh.insert(dh.end(), rh.begin(), rh.end());
      logps.insert(logps.end(), rk.result.logps.begin(), rk.result.logps.end());
      const auto w0 = static_cast<std::size_t>(v0 * h);
      if (reduced) {
        const std::vector<double> want(
            ref.grad_weight.begin() + static_cast<std::ptrdiff_t>(w0),
            ref.grad_weight.begin() + static_cast<std::ptrdiff_t>(v1 * h));
        check_close("each rank's dW summed in the call", rw, want, grad_tol.grad);
      } else {
        for (std::size_t j = 0; j < rw.size(); ++j) dw[w0 + j] += rw[j];
      }
      if (rk.grads.has_bias()) {
        const std::vector<double> rb = rk.grads.bias();
        if (reduced)
          check_close("each rank's db summed in the call", rb,
                      std::vector<double>(ref.grad_bias.begin() + v0, ref.grad_bias.begin() + v1),
                      grad_tol.grad);
        else
          for (std::size_t j = 0; j < rb.size(); ++j) db[static_cast<std::size_t>(v0) + j] += rb[j];
      }
    }
    check_close("grad_hidden", dh, ref.grad_hidden, grad_tol.grad);
    REQUIRE(logps.size() == ref.logps.size());
    std::vector<double> got, want;  // the valid rows'
    for (std::size_t j = 0; j < logps.size(); ++j) {
      CHECK(std::isnan(logps[j]) == std::isnan(ref.logps[j]));
      if (!std::isnan(ref.logps[j])) got.push_back(logps[j]), want.push_back(ref.logps[j]);
    }
    check_close("logps", got, want, in_tol.rows);
  }
  if (!reduced) check_close("grad_weight", dw, ref.grad_weight, grad_tol.grad);
  if (d.spec.bias && g.bias && !reduced) check_close("grad_bias", db, ref.grad_bias, grad_tol.grad);
}

TEST_CASE("token objectives, split over ranks: data, vocabulary and a grid match the whole call") {
  const std::vector<TokenSplit> splits = {
      {{0, 61}, {0}},        // two uneven row parts
      {{0, 20, 97}, {0}},    // three
      {{0}, {0, 150}},       // two vocabulary shards (VocabShard::of's)
      {{0}, {0, 100, 200}},  // three
      {{0, 61}, {0, 150}}};  // a 2 x 2 grid
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const CeData d(chunked_spec(true, dtype));
    const GradRequest g = grads_in(dtype);
    const MakeObjective focal = [](std::int64_t, std::int64_t) {
      return std::make_shared<reference::FocalObjective>(2.0);
    };
    for (const MakeObjective& make :
         {focal, clipped_rows(d), grpo_rows(d, ImportanceSamplingLevel::kToken),
          grpo_rows(d, ImportanceSamplingLevel::kSequence)}) {
      for (bool reduce : {false, true}) {
        for (const TokenSplit& s : splits) {
          const std::shared_ptr<const TokenObjective> whole = make(0, d.spec.n);
          CAPTURE(whole->name());
          CAPTURE(dtype_name(dtype));
          CAPTURE(reduce);
          CAPTURE(s.rows.size());
          CAPTURE(s.vocab.size());
          TokenOptions o;
          o.memory_budget_bytes = chunk_budget(d, g, 64);
          o.reduce_weight_grad_over_data_group = reduce;
          const reference::TokenOracle ref = oracle(d, TokenLoss(whole, o));
          const std::vector<TokenRank> ranks =
              on_grid(s, [&](const Grid& grid, std::size_t ri, std::size_t vi) {
                return call_token_rank(d, o, g, s, grid, ri, vi, make);
              });
          check_split(d, s, reduce && s.rows.size() > 1, g, ranks, ref);
        }
      }
    }
  }
}

TEST_CASE(
    "token objectives, split over ranks: one rank's bad call or failing objective fails all") {
  CeSpec s = chunked_spec(false);
  s.ignore_fraction = 0.0;
  // Rank (ri, vi) of `split` calls with options and an objective from `pick(ri, vi)`; each
  // rank's error, or "returned".
  using Pick = std::function<std::pair<TokenOptions, MakeObjective>(std::size_t, std::size_t)>;
  const auto run = [&](const CeData& d, const TokenSplit& split, const Pick& pick) {
    return on_grid(split, [&](const Grid& grid, std::size_t ri, std::size_t vi) -> std::string {
      try {
        const auto [o, make] = pick(ri, vi);
        call_token_rank(d, o, {}, split, grid, ri, vi, make);
      } catch (const Error& e) {
        return e.what();
      }
      return "returned";
    });
  };
  const MakeObjective nll = [](std::int64_t, std::int64_t) {
    return std::make_shared<reference::NllObjective>();
  };
  const MakeObjective focal = [](std::int64_t, std::int64_t) {
    return std::make_shared<reference::FocalObjective>(2.0);
  };
  const MakeObjective fails_at_30 = [](std::int64_t, std::int64_t) {
    return std::make_shared<FailingObjective>(30, false);
  };
  const MakeObjective never_fails = [](std::int64_t, std::int64_t) {
    return std::make_shared<FailingObjective>(-1, false);
  };
  // Rank (ri0, vi0) calls with `there`, the others with `elsewhere`, all with default options.
  const auto one_rank = [](std::size_t ri0, std::size_t vi0, const MakeObjective& there,
                           const MakeObjective& elsewhere) -> Pick {
    return [=](std::size_t ri, std::size_t vi) {
      return std::pair{TokenOptions{}, ri == ri0 && vi == vi0 ? there : elsewhere};
    };
  };
  const TokenSplit rows = {{0, 75}, {0}}, vocab = {{0}, {0, 150}}, grid = {{0, 75}, {0, 150}};
  const CeData d(s);
  SUBCASE("an out-of-range target on data rank 1: both throw before computing") {
    CeData bad(s);
    bad.set_target(100, s.v);
    const std::vector<std::string> e = run(bad, rows, one_rank(0, 0, nll, nll));
    CHECK(contains(e[0], "1 rank(s) of data_group rejected their calls (rank 1: Nll: targets[25]"));
    CHECK(contains(e[1], "Nll: targets[25] = 300 is outside [0, V=300)"));
  }
  SUBCASE(
      "a NaN in one vocabulary shard's weight, with check_finite: both throw, nothing written") {
    CeData bad(s);
    bad.weight[static_cast<std::size_t>(200 * s.h)] = std::nanf("");  // rank 1's row 50
    const std::vector<std::string> e = run(bad, vocab, [&](std::size_t, std::size_t) {
      TokenOptions o;
      o.check_finite = true;
      return std::pair{o, nll};
    });
    CHECK(contains(e[0],
                   "Nll: 1 rank(s) of vocab_shard.group rejected their calls (rank 1: Nll: "
                   "weight [150, 40] f32 cpu has a non-finite value nan at flat index 2000"));
    CHECK(contains(e[0], "nothing was written"));
    CHECK(contains(e[1], "Nll: weight [150, 40] f32 cpu has a non-finite value"));
  }
  SUBCASE("different objectives over a data group or a vocabulary split: every rank throws") {
    for (const TokenSplit& split : {rows, vocab}) {
      const std::vector<std::string> e = run(d, split, one_rank(0, 0, nll, focal));
      for (const std::string& m : e) CHECK(contains(m, "the objective's name and metrics"));
    }
  }
  SUBCASE("an objective whose values differ over a vocabulary split: both throw at the end") {
    const MakeObjective focal3 = [](std::int64_t, std::int64_t) {
      return std::make_shared<reference::FocalObjective>(3.0);  // the same name and metrics
    };
    const std::vector<std::string> e = run(d, vocab, one_rank(0, 1, focal3, focal));
    for (const std::string& m : e)
      CHECK(contains(m,
                     "Focal: the objective gave different values on the ranks of a "
                     "vocab_shard.group"));
    // In a grid the ranks of the other row part learn of it over their data groups.
    for (const std::string& m : run(d, grid, one_rank(1, 1, focal3, focal)))
      CHECK(contains(m, "Focal: the objective gave different values"));
  }
  SUBCASE("different reductions over a vocabulary split: both throw before computing") {
    const std::vector<std::string> e = run(d, vocab, [&](std::size_t, std::size_t vi) {
      TokenOptions o;
      if (vi == 1) o.reduction = Reduction::kSum;
      return std::pair{o, nll};
    });
    for (const std::string& m : e)
      CHECK(contains(m, "Nll: the ranks of vocab_shard.group make different kinds of calls"));
  }
  SUBCASE("an objective that throws on one rank's row 30: every rank throws at the end") {
    const std::vector<std::string> e = run(d, rows, one_rank(1, 0, fails_at_30, never_fails));
    CHECK(contains(e[0],
                   "Failing: the objective failed (threw or returned a non-finite value) on "
                   "1 other rank(s) of data_group"));
    CHECK(contains(e[1], "Failing: the objective threw for row 30: advantages missing"));
    CHECK(contains(e[1], "unspecified"));
    // The ranks of a vocabulary split see the same rows: one whose objective alone fails.
    const std::vector<std::string> v = run(d, vocab, one_rank(0, 1, fails_at_30, never_fails));
    CHECK(contains(v[0], "on 1 other rank(s) of vocab_shard.group"));
    CHECK(contains(v[1], "Failing: the objective threw for row 30"));
    // In a 2 x 2 grid, rank (1, 1)'s objective fails: the other three count it once.
    const std::vector<std::string> g = run(d, grid, one_rank(1, 1, fails_at_30, never_fails));
    for (std::size_t k = 0; k < 3; ++k)
      CHECK(contains(g[k], "on 1 other rank(s) of the data_group x vocab_shard.group grid"));
    CHECK(contains(g[3], "Failing: the objective threw for row 30"));
    // Both ranks of row part 1 fail: the ranks of row part 0 count two.
    const std::vector<std::string> two = run(d, grid, [&](std::size_t ri, std::size_t) {
      return std::pair{TokenOptions{}, ri == 1 ? fails_at_30 : never_fails};
    });
    for (std::size_t k = 0; k < 2; ++k)
      CHECK(contains(two[k], "on 2 other rank(s) of the data_group x vocab_shard.group grid"));
    for (std::size_t k = 2; k < 4; ++k)
      CHECK(contains(two[k], "Failing: the objective threw for row 30"));
  }
}

// ---- GRPO ------------------------------------------------------------------------------------

// TRL's per-token GRPO loss, written from its formula: the ratio's two terms, the cap, the k3 KL.
double trl_grpo_token_loss(const GrpoOptions& o, double a, double logp, double old, double ref,
                           double weight) {
  const double ratio = std::exp(logp - old);
  const double coef2 = std::clamp(ratio, 1 - o.epsilon_low, 1 + o.epsilon_high);
  const double coef1 = o.delta > 0 ? std::min(ratio, o.delta) : ratio;
  double loss = -std::min(coef1 * a, coef2 * a);
  if (o.beta > 0) loss += o.beta * (std::exp(ref - logp) - (ref - logp) - 1);
  return weight * loss;
}

TEST_CASE("GRPO objective: TRL's per-token loss, its derivative, the clip metrics and the k3 KL") {
  // logp - old from -0.6 to 0.6: ratios below 1 - epsilon_low, inside, and above delta; none
  // within 0.05 of a boundary, so central differences see no kink.
  const double logp = -1.3, ref = -1.1;
  for (bool on_policy : {false, true}) {
    for (double shift : {-0.6, -0.1, 0.0, 0.1, 0.6}) {
      for (double a : {-1.3, 0.7}) {
        for (double delta : {0.0, 1.6}) {
          for (double beta : {0.0, 0.1}) {
            for (double weight : {1.0, 0.25}) {
              if (on_policy && shift != 0.0) continue;
              const double old = logp - shift;
              GrpoOptions o;
              o.epsilon_high = 0.28;
              o.delta = delta;
              o.beta = beta;
              const std::vector<double> adv = {0.0, a}, olds = {0.0, old}, refs = {0.0, ref},
                                        w = {1.0, weight};
              const GrpoObjective obj(o, {adv, on_policy ? std::span<const double>{} : olds,
                                          beta > 0 ? refs : std::span<const double>{}, w});
              CAPTURE(on_policy);
              CAPTURE(shift);
              CAPTURE(a);
              CAPTURE(delta);
              CAPTURE(beta);
              CAPTURE(weight);
              std::vector<double> extras(obj.extra_metrics().size(), 0.0);
              const TokenValue v = obj.evaluate({1, 4, logp}, extras);
              // On-policy, the old log-prob is the current one, held constant.
              const auto f = [&](double lp) {
                return trl_grpo_token_loss(o, a, lp, on_policy ? logp : old, ref, weight);
              };
              CHECK(v.loss == doctest::Approx(f(logp)).epsilon(1e-14));
              const double h = 1e-6, fd = (f(logp + h) - f(logp - h)) / (2 * h);
              CHECK(v.dlogp == doctest::Approx(fd).epsilon(1e-7).scale(1.0));
              const double ratio = std::exp(shift);
              const bool low = ratio < 0.8 && a<0, high = ratio> 1.28 && a > 0;
              REQUIRE(extras.size() == (beta > 0 ? 4u : 3u));
              CHECK(extras[0] == (low ? 1.0 : 0.0));
              CHECK(extras[1] == (high ? 1.0 : 0.0));
              CHECK(extras[2] == (low || high ? 1.0 : 0.0));
              if (beta > 0)
                CHECK(extras[3] == doctest::Approx(std::exp(ref - logp) - (ref - logp) - 1));
            }
          }
        }
      }
    }
  }
  GrpoOptions kl;
  kl.beta = 0.1;
  const std::vector<double> one = {1.0};
  CHECK(GrpoObjective(kl, {one, {}, one, {}}).extra_metrics() ==
        std::vector<std::string>{"clip_ratio/low_mean", "clip_ratio/high_mean",
                                 "clip_ratio/region_mean", "kl"});
  CHECK(GrpoObjective({}, {one}).extra_metrics().size() == 3);
}

TEST_CASE("GSPO: the sequence ratio, TRL's sequence-level loss and its gradient, the metrics") {
  // Completions 0 (rows 1-3) and 1 (rows 4-5); rows 0 and 6 have none (ignored, NaN current
  // log-probs, as TokenResult::logps holds them).
  const double nan = std::nan("");
  const std::vector<std::int64_t> completion = {-1, 0, 0, 0, 1, 1, -1};
  const std::vector<double> cur = {nan, -0.5, -1.2, -0.3, -2.0, -0.7, nan};
  const std::vector<double> ref = {0.0, -0.4, -1.5, -0.2, -1.6, -0.9, 0.0};
  const GrpoNormalization norm = grpo_normalization(GrpoLossType::kGrpo, completion);
  // TRL's sequence-level total: every token of completion i has the loss of s_i = exp(mean of
  // logp - old over i), weighted, plus its own k3 (the gradient flows through s_i).
  const auto trl_total = [&](const GrpoOptions& o, const std::vector<double>& adv,
                             const std::vector<double>& old, const std::vector<double>& logp) {
    double total = 0;
    for (std::int64_t c = 0; c < 2; ++c) {
      double sum = 0, count = 0;
      for (std::size_t t = 0; t < logp.size(); ++t)
        if (completion[t] == c) sum += logp[t] - old[t], count += 1;
      const double s = std::exp(sum / count);
      for (std::size_t t = 0; t < logp.size(); ++t)
        if (completion[t] == c)
          total += norm.weights[t] *
                   (-std::min((o.delta > 0 ? std::min(s, o.delta) : s) * adv[t],
                              std::clamp(s, 1 - o.epsilon_low, 1 + o.epsilon_high) * adv[t]) +
                    o.beta * (std::exp(ref[t] - logp[t]) - (ref[t] - logp[t]) - 1));
    }
    return total;
  };
  // Mean log-ratios (completion 0, completion 1): inside the range, below 1 - epsilon_low,
  // above delta; none within 0.05 of a boundary.
  for (const auto& [m0, m1] : {std::pair{0.05, -0.4}, std::pair{0.6, -0.05}}) {
    for (const auto& [a0, a1] : {std::pair{1.2, -0.8}, std::pair{-0.9, 0.6}}) {
      for (double beta : {0.0, 0.1}) {
        for (double delta : {0.0, 1.6}) {
          std::vector<double> old(cur.size(), nan), adv(cur.size(), 0.0);
          const double offsets[] = {0, 0.2, -0.3, 0.1, 0.25, -0.25, 0};
          for (std::size_t t = 0; t < cur.size(); ++t) {
            if (completion[t] < 0) continue;
            old[t] = cur[t] - (completion[t] == 0 ? m0 : m1) + offsets[t];
            adv[t] = completion[t] == 0 ? a0 : a1;
          }
          GrpoOptions o;
          o.epsilon_high = 0.28;
          o.delta = delta;
          o.beta = beta;
          o.importance_sampling_level = ImportanceSamplingLevel::kSequence;
          const GrpoObjective obj(
              o, {adv, old, beta > 0 ? ref : std::vector<double>{}, norm.weights, completion, cur});
          CAPTURE(m0);
          CAPTURE(m1);
          CAPTURE(a0);
          CAPTURE(beta);
          CAPTURE(delta);
          std::vector<double> logp = cur;
          for (std::size_t t = 0; t < logp.size(); ++t)
            if (completion[t] < 0) logp[t] = 0;
          double loss = 0;
          for (std::size_t t = 0; t < cur.size(); ++t) {
            if (completion[t] < 0) continue;
            CAPTURE(t);
            std::vector<double> extras(obj.extra_metrics().size(), 0.0);
            const TokenValue v = obj.evaluate({static_cast<std::int64_t>(t), 3, cur[t]}, extras);
            loss += v.loss;
            const double s = std::exp(completion[t] == 0 ? m0 : m1);
            const bool low = s < 0.8 && adv[t]<0, high = s> 1.28 && adv[t] > 0;
            CHECK(extras[0] == (low ? 1.0 : 0.0));
            CHECK(extras[1] == (high ? 1.0 : 0.0));
            CHECK(extras[2] == (low || high ? 1.0 : 0.0));
            // d total / d logp_t through s_i, by central differences.
            const double h = 1e-6;
            std::vector<double> up = logp, down = logp;
            up[t] += h;
            down[t] -= h;
            const double fd = (trl_total(o, adv, old, up) - trl_total(o, adv, old, down)) / (2 * h);
            CHECK(v.dlogp == doctest::Approx(fd).epsilon(1e-6).scale(1e-3));
          }
          CHECK(loss == doctest::Approx(trl_total(o, adv, old, logp)).epsilon(1e-13));
        }
      }
    }
  }
  // On-policy, the sequence ratio is 1 as the token one: the same values.
  const std::vector<double> adv = {0, 1.5, 1.5, 1.5, -0.5, -0.5, 0};
  GrpoOptions seq;
  seq.importance_sampling_level = ImportanceSamplingLevel::kSequence;
  const GrpoObjective on_seq(seq, {adv, {}, {}, norm.weights});
  const GrpoObjective on_tok({}, {adv, {}, {}, norm.weights});
  for (std::int64_t t = 1; t < 6; ++t) {
    std::vector<double> e1(3), e2(3);
    const TokenValue a = on_seq.evaluate({t, 2, cur[static_cast<std::size_t>(t)]}, e1);
    const TokenValue b = on_tok.evaluate({t, 2, cur[static_cast<std::size_t>(t)]}, e2);
    CHECK(a.loss == b.loss);
    CHECK(a.dlogp == b.dlogp);
  }
  // Names, and refused rows, named.
  for (ImportanceSamplingLevel l :
       {ImportanceSamplingLevel::kToken, ImportanceSamplingLevel::kSequence})
    CHECK(parse_importance_sampling_level(importance_sampling_level_name(l)) == l);
  CHECK(contains(error_message([] { (void)parse_importance_sampling_level("sequence_token"); }),
                 "unknown importance_sampling_level 'sequence_token'; expected one of token, "
                 "sequence"));
  const std::vector<double> old = {nan, -0.4, -1.0, -0.3, -1.9, -0.8, nan};
  const auto message = [&](const GrpoRows& r) {
    return error_message([&] { GrpoObjective obj(seq, r); });
  };
  CHECK(contains(message({adv, old}),
                 "the sequence level with old_logps needs rows.completion "
                 "and rows.current_logps, one per row (7), got 0 and 0"));
  std::vector<std::int64_t> orphan = completion;
  orphan[2] = -1;
  CHECK(contains(message({adv, old, {}, {}, orphan, cur}),
                 "Grpo: row 2 has a current log-prob (-1.2) but completion -1"));
  std::vector<double> bad_old = old;
  bad_old[4] = nan;
  CHECK(contains(message({adv, bad_old, {}, {}, completion, cur}),
                 "Grpo: row 4 of completion 1: current_logps -2 and old_logps nan must be finite"));
  // A row the call finds valid where current_logps has NaN.
  const GrpoObjective obj(seq, {adv, old, {}, {}, completion, cur});
  std::vector<double> extras(3);
  CHECK(contains(error_message([&] {
                   (void)obj.evaluate({6, 1, -0.5}, extras);
                 }),
                 "Grpo: row 6 is valid, but rows.current_logps has NaN there"));
}

TEST_CASE("GRPO: the loss types' weights and reductions") {
  const std::vector<std::int64_t> completion = {0, 0, 0, 1, 1, -1, 2};
  const GrpoNormalization grpo = grpo_normalization(GrpoLossType::kGrpo, completion);
  CHECK(grpo.reduction == Reduction::kSum);
  const std::vector<double> third = {1.0 / 9, 1.0 / 9, 1.0 / 9, 1.0 / 6, 1.0 / 6, 0.0, 1.0 / 3};
  REQUIRE(grpo.weights.size() == third.size());
  for (std::size_t t = 0; t < third.size(); ++t)
    CHECK(grpo.weights[t] == doctest::Approx(third[t]).epsilon(1e-15));
  // Five completions over the data group, three of them here.
  const GrpoNormalization group = grpo_normalization(GrpoLossType::kGrpo, completion, 5);
  CHECK(group.weights[0] == doctest::Approx(1.0 / 15).epsilon(1e-15));
  CHECK(group.weights[6] == doctest::Approx(1.0 / 5).epsilon(1e-15));
  const GrpoNormalization dr = grpo_normalization(GrpoLossType::kDrGrpo, completion, 0, 4);
  CHECK(dr.reduction == Reduction::kSum);
  for (std::size_t t = 0; t < completion.size(); ++t)
    CHECK(dr.weights[t] == (completion[t] < 0 ? 0.0 : doctest::Approx(1.0 / 12).epsilon(1e-15)));
  const GrpoNormalization bnpo = grpo_normalization(GrpoLossType::kBnpo, completion);
  CHECK(bnpo.reduction == Reduction::kMean);
  CHECK(bnpo.weights.empty());
  for (GrpoLossType t : {GrpoLossType::kGrpo, GrpoLossType::kBnpo, GrpoLossType::kDrGrpo})
    CHECK(parse_grpo_loss(grpo_loss_name(t)) == t);
  CHECK(contains(error_message([] { (void)parse_grpo_loss("dapo2"); }),
                 "unknown loss_type 'dapo2'; expected one of grpo, bnpo, dr_grpo"));
  const std::vector<std::int64_t> bad = {0, -2};
  CHECK(contains(error_message([&] { (void)grpo_normalization(GrpoLossType::kGrpo, bad); }),
                 "completion[1] = -2 must be -1 (no completion)"));
  CHECK(
      contains(error_message([&] { (void)grpo_normalization(GrpoLossType::kGrpo, completion, 2); }),
               "completion[6] = 2 must be -1 (no completion) or in [0, 2)"));
  CHECK(
      contains(error_message([&] { (void)grpo_normalization(GrpoLossType::kDrGrpo, completion); }),
               "dr_grpo needs max_completion_length > 0, got 0"));

  // A whole call with the grpo type's weights is the mean over completions of their token
  // means, taken here from the unweighted objective's values at the call's own log-probs.
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CeSpec s = chunked_spec(true, dtype);
    s.ignored_run = {70, 100};
    const CeData d(s);
    const std::size_t n = static_cast<std::size_t>(s.n);
    const std::vector<float> a = normal_floats(n, 1.0f, 11);
    const std::vector<double> adv(a.begin(), a.end());
    std::vector<std::int64_t> comp(n);
    for (std::size_t t = 0; t < n; ++t)
      comp[t] = d.targets32[t] == -100 ? -1 : static_cast<std::int64_t>(t / 12);
    const GrpoNormalization norm = grpo_normalization(GrpoLossType::kGrpo, comp);
    TokenOptions o;
    o.reduction = norm.reduction;
    o.memory_budget_bytes = chunk_budget(d, grads_in(dtype), 64);
    const TokenRun run = run_token(
        d,
        TokenLoss(
            std::make_shared<GrpoObjective>(GrpoOptions{}, GrpoRows{adv, {}, {}, norm.weights}), o),
        grads_in(dtype));
    CHECK(run.plan.num_chunks == 3);
    const GrpoObjective plain({}, {adv});
    std::vector<double> sum, count;
    std::vector<double> extras(3);
    for (std::size_t t = 0; t < n; ++t) {
      if (comp[t] < 0) continue;
      const auto c = static_cast<std::size_t>(comp[t]);
      if (c >= sum.size()) sum.resize(c + 1, 0.0), count.resize(c + 1, 0.0);
      sum[c] +=
          plain
              .evaluate({static_cast<std::int64_t>(t), d.targets32[t], run.result.logps[t]}, extras)
              .loss;
      count[c] += 1;
    }
    // Completions whose rows are all ignored (the run 70-100) are not counted.
    double want = 0, completions = 0;
    for (std::size_t c = 0; c < sum.size(); ++c)
      if (count[c] > 0) want += sum[c] / count[c], completions += 1;
    want /= completions;
    CHECK(completions < static_cast<double>(sum.size()));
    CHECK(run.result.loss == doctest::Approx(want).epsilon(1e-12));
  }
}

TEST_CASE(
    "GRPO: bad options and rows raise chunkloss::Error naming them, before anything is written") {
  const std::vector<double> two = {0.5, -0.5}, neg = {1.0, -1.0}, three = {1.0, 2.0, 3.0};
  const auto message = [](const GrpoOptions& o, const GrpoRows& r) {
    return error_message([&] { GrpoObjective obj(o, r); });
  };
  GrpoOptions o;
  o.epsilon_low = 1.0;
  CHECK(contains(message(o, {two}), "Grpo: epsilon_low must be in [0, 1), got 1"));
  o = {};
  o.epsilon_high = -0.1;
  CHECK(contains(message(o, {two}), "Grpo: epsilon_high must be finite and >= 0, got -0.1"));
  o = {};
  o.delta = 1.1;
  CHECK(contains(message(o, {two}),
                 "Grpo: delta must be 0 (off) or finite and > 1 + epsilon_high = 1.2, got 1.1"));
  o = {};
  o.beta = 0.1;
  CHECK(contains(message(o, {two}), "Grpo: beta = 0.1 needs rows.ref_logps"));
  CHECK(contains(message({}, {}), "Grpo: rows.advantages is empty"));
  CHECK(contains(message({}, {two, three}), "Grpo: rows.old_logps has 3 values, expected 0 or 2"));
  CHECK(contains(message({}, {two, {}, {}, neg}), "Grpo: rows.weights[1] = -1 must be >= 0"));
  o = {};
  o.beta = -0.5;
  CHECK(contains(message(o, {two, {}, two}), "Grpo: beta must be finite and >= 0, got -0.5"));
  CHECK(contains(message({}, {two, {}, three}),
                 "Grpo: rows.ref_logps has 3 values, expected 0 or 2"));

  // Rows for 2 rows, a call on 150: refused before anything is written.
  const CeData d(chunked_spec(true));
  const TokenLoss loss(std::make_shared<GrpoObjective>(GrpoOptions{}, GrpoRows{two}));
  GradBuffers buffers(d, {}, 7.0f);
  CHECK(contains(error_message([&] { run_token(d, loss, {}, true, &buffers); }),
                 "Grpo: the objective holds per-row data for 2 rows, but hidden [N, H] has N=150"));
  CHECK(contains(error_message([&] { (void)loss.plan(token_inputs(d)); }),
                 "per-row data for 2 rows"));
  for (double x : buffers.hidden()) REQUIRE(x == 7.0);
  for (double x : buffers.weight()) REQUIRE(x == 7.0);

  // NaN old or reference log-probs at ignored rows (as TokenResult::logps holds them) are not
  // read; at a valid row the call throws naming the row.
  const auto n = static_cast<std::size_t>(d.spec.n);
  std::vector<double> adv(n, 1.0), old(n, -1.0);
  const auto first = [&](bool ignored_row) {
    return static_cast<std::size_t>(
        std::find_if(d.targets32.begin(), d.targets32.end(),
                     [&](std::int32_t y) { return (y == -100) == ignored_row; }) -
        d.targets32.begin());
  };
  const std::size_t ignored = first(true), valid = first(false);
  REQUIRE(valid < n);
  REQUIRE(ignored < n);
  old[ignored] = std::nan("");
  GrpoOptions kl;
  kl.beta = 0.1;
  CHECK_NOTHROW(
      run_token(d, TokenLoss(std::make_shared<GrpoObjective>(kl, GrpoRows{adv, old, old})), {}));
  old[valid] = std::nan("");
  CHECK(contains(
      error_message([&] {
        run_token(d, TokenLoss(std::make_shared<GrpoObjective>(kl, GrpoRows{adv, old, old})), {});
      }),
      "Grpo: row " + std::to_string(valid) + " (target"));
}

}  // namespace
}  // namespace chunkloss::test
