// LinearCrossEntropy on the CPU: every option against the float64 oracle in fp32 and bf16 and in
// both loop orders, finite-difference gradient checks, the required edge cases (odd sizes, tiny
// V, ragged chunks, all rows ignored, one row, accumulation, chunk-size invariance, bitwise
// reruns, forward only) and the errors raised on bad input.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/losses/cross_entropy.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ce_fixture.h"
#include "reference/cross_entropy_ref.h"
#include "support/bf16.h"
#include "support/compare.h"
#include "support/tolerance.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

using reference::CeConfig;

constexpr LoopOrder kOrders[] = {LoopOrder::kTokenChunk, LoopOrder::kVocabBlock};
constexpr Reduction kReductions[] = {Reduction::kMean, Reduction::kSum, Reduction::kNone};

reference::CeResult oracle(const CeData& d, const CrossEntropyOptions& o) {
  return reference::cross_entropy(d.problem(o), CeConfig::from(o));
}

// a + b, elementwise.
std::vector<double> plus(std::vector<double> a, const std::vector<double>& b) {
  for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
  return a;
}

// The buffers after an accumulating call: their contents before (h0, w0, b0) plus the oracle's
// gradients.
void check_added(GradBuffers& grads, const std::vector<double>& h0, const std::vector<double>& w0,
                 const std::vector<double>& b0, const reference::CeResult& ref, double tol) {
  check_close("grad_hidden", grads.hidden(), plus(h0, ref.grad_hidden), tol);
  check_close("grad_weight", grads.weight(), plus(w0, ref.grad_weight), tol);
  check_close("grad_bias", grads.bias(), plus(b0, ref.grad_bias), tol);
}

// One option setting over input dtype {f32, bf16 with bf16 gradients} x shape {odd sizes in one
// chunk, N=150 in three chunks of 64} x loop order x fp32 dW accumulator {off, on}.
void check_option_matrix(const CeSpec& base, const CrossEntropyOptions& base_opts) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (bool multi : {false, true}) {
      CeSpec s = base;
      s.dtype = dtype;
      if (multi) {
        s.n = 150;
        s.h = 40;
        s.v = 300;
      }
      const CeData d(s);
      const reference::CeResult ref = oracle(d, base_opts);
      for (LoopOrder order : kOrders) {
        for (bool acc : {false, true}) {
          CrossEntropyOptions o = base_opts;
          o.loop_order = order;
          o.fp32_weight_grad_accumulator = acc;
          GradRequest g;
          g.dtype = dtype;
          if (multi) o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, 64);
          INFO(describe(s, o, g));
          const LibRun run = run_library(d, o, g);
          INFO("plan: " << run.plan.str());
          CHECK(run.plan.order == order);
          if (multi) {
            CHECK(run.plan.chunk_rows == 64);
            CHECK(run.plan.num_chunks == 3);
            if (order == LoopOrder::kVocabBlock) CHECK(run.plan.num_vocab_blocks >= 2);
          } else {
            CHECK(run.plan.num_chunks == 1);
          }
          check_against_oracle(d, o, g, run, ref);
        }
      }
    }
  }
}

// The oracle's loss under `o` differs from its loss under `plain`: the option is not a no-op
// on this data, so matching the oracle means something.
void check_option_matters(const CeSpec& s, const CrossEntropyOptions& o,
                          const CrossEntropyOptions& plain) {
  const CeData d(s);
  const double a = oracle(d, o).loss, b = oracle(d, plain).loss;
  CHECK_MESSAGE(std::abs(a - b) > 1e-3 * std::max(1.0, std::abs(b)),
                "option does not change the loss: " << a << " vs " << b);
}

TEST_CASE("oracle: mean over valid rows with ignored rows") {
  CeSpec s;
  const CeData d(s);
  const auto ref = oracle(d, {});
  CHECK(ref.valid_rows == 6);  // round(0.2 * 7) = 1 ignored row
  CHECK(ref.accuracy > 0.0);
  CHECK(ref.accuracy < 1.0);
  check_option_matrix(s, {});
}

TEST_CASE("oracle: ignore_index -1") {
  CeSpec s;
  s.ignore_index = -1;
  s.ignore_fraction = 0.4;
  CrossEntropyOptions o;
  o.ignore_index = -1;
  check_option_matrix(s, o);
}

TEST_CASE("oracle: ignore_index inside the vocabulary") {
  CeSpec s;
  s.ignore_index = 5;
  CrossEntropyOptions o;
  o.ignore_index = 5;
  check_option_matrix(s, o);
}

TEST_CASE("oracle: reduction sum") {
  CrossEntropyOptions o;
  o.reduction = Reduction::kSum;
  check_option_matrix({}, o);
}

TEST_CASE("oracle: reduction none with a per-token upstream gradient") {
  CrossEntropyOptions o;
  o.reduction = Reduction::kNone;
  check_option_matrix({}, o);
}

TEST_CASE("oracle: label smoothing") {
  for (float ls : {0.1f, 1.0f}) {
    CAPTURE(ls);
    CrossEntropyOptions o;
    o.label_smoothing = ls;
    check_option_matters({}, o, {});
    check_option_matrix({}, o);
  }
}

TEST_CASE("oracle: class weights, the mean divides by their sum over valid rows") {
  CeSpec s;
  s.class_weights = true;
  check_option_matrix(s, {});
  CrossEntropyOptions sum;
  sum.reduction = Reduction::kSum;
  check_option_matrix(s, sum);
  const CeData d(s);
  CeSpec plain_spec = s;
  plain_spec.class_weights = false;
  CHECK(std::abs(oracle(d, {}).weight_sum - 6.0) > 1e-3);
  CHECK(std::abs(oracle(d, {}).loss - oracle(CeData(plain_spec), {}).loss) > 1e-3);
}

TEST_CASE("oracle: class weights with label smoothing") {
  CeSpec s;
  s.class_weights = true;
  CrossEntropyOptions o;
  o.label_smoothing = 0.2f;
  check_option_matrix(s, o);
}

TEST_CASE("oracle: z-loss") {
  CeSpec s;
  s.logit_scale = 2.0f;
  CrossEntropyOptions o;
  o.z_loss = 0.05f;
  CHECK(oracle(CeData(s), o).z_loss > 0.1);
  check_option_matrix(s, o);
}

TEST_CASE("oracle: z-loss with class weights is weighted as the row's cross-entropy") {
  // The mean divides by the class weights' sum, so a row's z-loss carries its class weight as its
  // cross-entropy does: scaling every class weight changes nothing (an unweighted z-loss over the
  // weights' sum shrank eightfold with weights eight times larger), and a class of weight 0 adds no
  // z-loss, as it adds no cross-entropy.
  CeSpec s;
  s.class_weights = true;
  s.logit_scale = 2.0f;
  CrossEntropyOptions o;
  o.z_loss = 0.05f;
  check_option_matrix(s, o);
  const CeData d(s);
  CeData scaled = d;
  for (float& w : scaled.class_weights) w *= 8.0f;  // (a power of 2: the weights scale exactly)
  const reference::CeResult a = oracle(d, o), b = oracle(scaled, o);
  CHECK(a.z_loss > 0.1);
  check_scalar("loss", b.loss, a.loss, 1e-12);
  check_scalar("z_loss", b.z_loss, a.z_loss, 1e-12);
  check_close("grad_hidden", b.grad_hidden, a.grad_hidden, 1e-12);
  check_close("grad_weight", b.grad_weight, a.grad_weight, 1e-12);
  GradRequest g;
  check_against_oracle(scaled, o, g, run_library(scaled, o, g), b);
  // Only the class of the first valid row's target has weight (1): the z-loss is the mean over
  // its rows alone.
  CeData zero = d;
  const auto valid = std::find_if(zero.targets32.begin(), zero.targets32.end(),
                                  [&](std::int32_t y) { return y != o.ignore_index; });
  REQUIRE(valid != zero.targets32.end());
  const std::int32_t kept = *valid;
  for (float& w : zero.class_weights) w = 0.0f;
  zero.class_weights[sz(kept)] = 1.0f;
  const reference::CeResult z = oracle(zero, o);
  double only = 0, rows = 0;
  for (std::int64_t t = 0; t < s.n; ++t) {
    if (zero.targets32[sz(t)] != kept) continue;
    only += o.z_loss * z.lse[sz(t)] * z.lse[sz(t)];
    rows += 1;
  }
  CHECK(only > 0.0);
  check_scalar("z_loss", z.z_loss, only / rows, 1e-12);
  check_against_oracle(zero, o, g, run_library(zero, o, g), z);
}

TEST_CASE("oracle: softcap") {
  // Logits up to ~12 against a cap of 4: the cap bends the large logits strongly but stays out of
  // tanh's flat end, where fp32 rounds neighbouring logits to ties and the argmax is ill-posed.
  CeSpec s;
  s.logit_scale = 4.0f;
  CrossEntropyOptions o;
  o.softcap = 4.0f;
  check_option_matters(s, o, {});
  check_option_matrix(s, o);
}

TEST_CASE("oracle: bias") {
  CeSpec s;
  s.bias = true;
  check_option_matrix(s, {});
}

TEST_CASE("oracle: token weights scale rows but not the mean's divisor") {
  CeSpec s;
  s.token_weights = true;
  CeSpec plain = s;
  plain.token_weights = false;
  CHECK(std::abs(oracle(CeData(s), {}).loss - oracle(CeData(plain), {}).loss) > 1e-3);
  check_option_matrix(s, {});
}

TEST_CASE("oracle: entropy") {
  CrossEntropyOptions o;
  o.compute_entropy = true;
  CHECK(oracle(CeData({}), o).entropy > 1.0);
  check_option_matrix({}, o);
  // Reporting it changes no other result.
  const CeData d({});
  const LibRun on = run_library(d, o, {}), off = run_library(d, {}, {});
  CHECK(on.result.loss == off.result.loss);
  CHECK(on.grads.hidden() == off.grads.hidden());
  CHECK(on.grads.weight() == off.grads.weight());
  CHECK(on.out.lse == off.out.lse);
}

TEST_CASE("oracle: a -inf bias masks columns (probability 0, no gradient), entropy finite") {
  // Every 4th column from 0 is masked, including the first of every 16-byte vector and a row's
  // first column, where an online max still at -inf once met a -inf logit.
  CeSpec s;
  s.bias = true;
  s.class_weights = true;
  s.masked_every = 4;
  CrossEntropyOptions o;
  o.compute_entropy = true;
  o.z_loss = 1e-3f;
  const CeData d(s);
  const reference::CeResult ref = oracle(d, o);
  CHECK(std::isfinite(ref.loss));
  CHECK(std::isfinite(ref.entropy));
  CHECK(ref.grad_bias[0] == 0.0);
  check_option_matrix(s, o);
  // The library's masked columns get exactly no gradient either.
  const LibRun run = run_library(d, o, {});
  const std::vector<double> db = run.grads.bias(), dw = run.grads.weight();
  for (std::int64_t j = 0; j < s.v; j += s.masked_every) {
    CAPTURE(j);
    CHECK(db[sz(j)] == 0.0);
    for (std::int64_t i = 0; i < s.h; ++i) REQUIRE(dw[sz(j * s.h + i)] == 0.0);
  }
  o.softcap = 4.0f;  // softcap(-inf) = -cap: no longer masked, and still finite
  check_option_matrix(s, o);
}

TEST_CASE("oracle: valid rows whose class weights sum to 0 give a zero mean and zero gradients") {
  CeSpec s;
  s.class_weights = true;
  CeData d(s);
  for (std::int64_t t = 0; t < s.n; ++t)
    if (d.targets64[static_cast<std::size_t>(t)] != s.ignore_index) d.set_target(t, 3);
  d.class_weights[3] = 0.0f;
  CrossEntropyOptions o;
  o.label_smoothing = 0.1f;  // terms that would give a gradient without the mean's 1/D
  o.z_loss = 1e-2f;
  const reference::CeResult ref = oracle(d, o);
  CHECK(ref.weight_sum == 0.0);
  CHECK(ref.valid_rows > 0);
  const LibRun run = run_library(d, o, {});
  check_against_oracle(d, o, {}, run, ref);
  CHECK(run.result.loss == 0.0);
  for (const std::vector<double>& grad : {run.grads.hidden(), run.grads.weight()})
    CHECK(std::all_of(grad.begin(), grad.end(), [](double g) { return g == 0.0; }));
}

TEST_CASE("oracle: i64 targets give the same results as i32") {
  CeSpec s;
  s.targets_i64 = true;
  check_option_matrix(s, {});
  CeSpec s32;
  const LibRun a = run_library(CeData(s), {}, {});
  const LibRun b = run_library(CeData(s32), {}, {});
  CHECK(a.result.loss == b.result.loss);
  CHECK(a.grads.bitwise_equal(b.grads));
}

TEST_CASE("oracle: all options together") {
  for (Reduction r : kReductions) {
    CAPTURE(reduction_name(r));
    CeSpec s;
    s.bias = true;
    s.class_weights = true;
    s.token_weights = true;
    s.logit_scale = 3.0f;
    s.ignore_fraction = 0.3;
    CrossEntropyOptions o;
    o.reduction = r;
    o.label_smoothing = 0.1f;
    o.z_loss = 0.01f;
    o.softcap = 2.5f;
    o.compute_entropy = true;
    check_option_matrix(s, o);
  }
}

TEST_CASE("oracle: mixed dtypes (bf16 inputs with fp32 gradients, fp32 inputs with bf16)") {
  for (LoopOrder order : kOrders) {
    for (DType in : {DType::kF32, DType::kBF16}) {
      CeSpec s;
      s.bias = true;
      s.dtype = in;
      CrossEntropyOptions o;
      o.loop_order = order;
      GradRequest g;
      g.dtype = in == DType::kF32 ? DType::kBF16 : DType::kF32;
      check_case(s, o, g);
    }
  }
}

TEST_CASE("oracle: bf16 inputs match the oracle on the same bf16 values, not the fp32 ones") {
  // Rounding to bf16 moves the loss by far more than the bf16 tolerance on the loss, so the test
  // would fail if the library (or the fixture) used unrounded values anywhere.
  CeSpec s;
  s.dtype = DType::kBF16;
  const CeData bf(s);
  s.dtype = DType::kF32;
  const CeData f32(s);
  const double gap = std::abs(oracle(bf, {}).loss - oracle(f32, {}).loss);
  CHECK(gap > 5 * tolerance(DType::kBF16).loss * oracle(f32, {}).loss);
  s.dtype = DType::kBF16;
  check_case(s, {}, {});
}

TEST_CASE("oracle: only some gradients requested") {
  for (LoopOrder order : kOrders) {
    CeSpec s;
    s.bias = true;
    CrossEntropyOptions o;
    o.loop_order = order;
    GradRequest only_w{false, true, false, DType::kF32};
    check_case(s, o, only_w);
    GradRequest w_and_b{false, true, true, DType::kF32};
    check_case(s, o, w_and_b);
    if (order == LoopOrder::kTokenChunk) {  // vocab_block order needs dW
      GradRequest only_h{true, false, false, DType::kF32};
      check_case(s, o, only_h);
      GradRequest only_b{false, false, true, DType::kBF16};
      check_case(s, o, only_b);
    }
  }
}

// ---- finite differences ----------------------------------------------------------------------

struct FdConfig {
  Reduction reduction;
  bool all_options;
};

constexpr FdConfig kFdConfigs[] = {{Reduction::kMean, false},
                                   {Reduction::kMean, true},
                                   {Reduction::kSum, true},
                                   {Reduction::kNone, false},
                                   {Reduction::kNone, true}};

CeSpec fd_spec(bool all, std::int64_t n, std::int64_t h, std::int64_t v) {
  CeSpec s;
  s.n = n;
  s.h = h;
  s.v = v;
  s.bias = true;
  s.class_weights = all;
  s.token_weights = all;
  s.ignore_fraction = 0.25;
  s.logit_scale = 2.0f;
  s.seed = 11;
  return s;
}

CrossEntropyOptions fd_options(const FdConfig& c) {
  CrossEntropyOptions o;
  o.reduction = c.reduction;
  if (c.all_options) {
    o.label_smoothing = 0.2f;
    o.z_loss = 0.05f;
    o.softcap = 1.5f;
  }
  return o;
}

TEST_CASE("finite differences: the float64 oracle's analytic gradients") {
  for (const FdConfig& c : kFdConfigs) {
    CAPTURE(reduction_name(c.reduction));
    CAPTURE(c.all_options);
    const CeData d(fd_spec(c.all_options, 4, 5, 6));
    const CrossEntropyOptions o = fd_options(c);
    reference::CeProblem p = d.problem(o);
    const CeConfig cfg = CeConfig::from(o);
    const reference::CeResult ref = reference::cross_entropy(p, cfg);
    auto check_all = [&](std::vector<double>& x, const std::vector<double>& grad,
                         const char* what) {
      double norm = 0;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const double x0 = x[i], step = 1e-5;
        x[i] = x0 + step;
        const double up = reference::cross_entropy_objective(p, cfg);
        x[i] = x0 - step;
        const double down = reference::cross_entropy_objective(p, cfg);
        x[i] = x0;
        const double fd = (up - down) / (2 * step);
        norm += grad[i] * grad[i];
        CHECK_MESSAGE(
            std::abs(fd - grad[i]) <= 1e-8 + 1e-6 * std::abs(grad[i]),
            what << "[" << i << "]: analytic " << grad[i] << ", central difference " << fd);
      }
      CHECK(norm > 1e-6);  // not a vacuous comparison of zeros
    };
    check_all(p.hidden, ref.grad_hidden, "grad_hidden");
    check_all(p.weight, ref.grad_weight, "grad_weight");
    check_all(p.bias, ref.grad_bias, "grad_bias");
  }
}

// The library's objective: its loss, or sum_t grad_output_t * row_loss_t for reduction none.
double library_objective(const CeData& d, const CrossEntropyOptions& o) {
  const LinearCrossEntropy loss(o);
  CpuContext ctx;
  OutBuffers out(d.spec.n);
  CrossEntropyOutputs views;
  views.row_loss = out.views().row_loss;
  const CrossEntropyResult r = run_with_fresh_workspace(loss, ctx, d.inputs(o), {}, views);
  if (o.reduction != Reduction::kNone) return r.loss;
  double s = 0;
  for (std::size_t t = 0; t < out.row_loss.size(); ++t)
    s += static_cast<double>(d.grad_output[t]) * out.row_loss[t];
  return s;
}

TEST_CASE("finite differences: the library's fp32 gradients against its own fp32 loss") {
  for (const FdConfig& c : kFdConfigs) {
    for (LoopOrder order : kOrders) {
      CAPTURE(reduction_name(c.reduction));
      CAPTURE(c.all_options);
      CAPTURE(loop_order_name(order));
      const CeData d(fd_spec(c.all_options, 5, 9, 13));
      CrossEntropyOptions o = fd_options(c);
      o.loop_order = order;
      const LibRun run = run_library(d, o, {});
      const double step = 1e-2;
      auto check_entries = [&](std::vector<float> CeData::*member, const std::vector<double>& grad,
                               std::vector<std::size_t> idx, const char* what) {
        double largest = 0;
        for (std::size_t i : idx) {
          largest = std::max(largest, std::abs(grad[i]));
          CeData e = d;
          const float x0 = (d.*member)[i];
          (e.*member)[i] = x0 + static_cast<float>(step);
          const double up = library_objective(e, o);
          (e.*member)[i] = x0 - static_cast<float>(step);
          const double down = library_objective(e, o);
          const double fd = (up - down) / (2 * step);
          CHECK_MESSAGE(std::abs(fd - grad[i]) <= kFdAbs + kFdRel * std::abs(grad[i]),
                        what << "[" << i << "]: library gradient " << grad[i]
                             << ", central difference of the library's loss " << fd);
        }
        CHECK_MESSAGE(largest > 10 * kFdAbs, what << ": the checked entries are all near zero");
      };
      check_entries(&CeData::hidden, run.grads.hidden(), {0, 7, 13, 22, 30, 44}, "grad_hidden");
      check_entries(&CeData::weight, run.grads.weight(), {0, 5, 17, 40, 77, 116}, "grad_weight");
      check_entries(&CeData::bias, run.grads.bias(), {0, 3, 8, 12}, "grad_bias");
    }
  }
}

// ---- required edge cases ---------------------------------------------------------------------

TEST_CASE("odd sizes N=7 H=123 V=507 with every output, both orders, both dtypes") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (LoopOrder order : kOrders) {
      CeSpec s;
      s.dtype = dtype;
      s.bias = true;
      s.class_weights = true;
      CrossEntropyOptions o;
      o.loop_order = order;
      o.compute_entropy = true;
      GradRequest g;
      g.dtype = dtype;
      const LibRun run = check_case(s, o, g);
      CHECK(run.plan.chunk_rows == 7);
      CHECK(run.plan.num_chunks == 1);
    }
  }
}

TEST_CASE("V smaller than one chunk and than the 64-column granule") {
  for (std::int64_t v : {1, 2, 3, 63}) {
    for (LoopOrder order : kOrders) {
      CAPTURE(v);
      CeSpec s;
      s.n = 100;
      s.h = 16;
      s.v = v;
      s.bias = true;
      CrossEntropyOptions o;
      o.loop_order = order;
      o.label_smoothing = 0.1f;
      // With one class the z-loss gradient is all that survives alpha p - beta - gamma, an fp32
      // cancellation of O(1) terms; the z-loss is covered at V=1 by the loss value only.
      o.z_loss = v == 1 ? 0.0f : 0.02f;
      const CeData d(s);
      const GradRequest g;
      o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, 64);
      INFO(describe(s, o, g));
      const LibRun run = run_library(d, o, g);
      INFO(run.plan.str());
      if (order == LoopOrder::kTokenChunk) {
        CHECK(run.plan.chunk_rows == 64);
        CHECK(run.plan.num_chunks == 2);
      } else {
        // Vocab blocks are multiples of 64 columns or all of V: with V < 64 pass 2 holds all
        // [N, V] logits, which forces one chunk of all rows.
        CHECK(run.plan.chunk_rows == 100);
      }
      CHECK(run.plan.vocab_block == v);
      CHECK(run.plan.num_vocab_blocks == 1);
      check_against_oracle(d, o, g, run, oracle(d, o));
      if (v == 1) {
        // One class: the cross-entropy part is 0 and lse is the logit itself.
        CrossEntropyOptions plain = o;
        plain.label_smoothing = 0.0f;
        plain.z_loss = 0.0f;
        const LibRun zero = run_library(d, plain, g);
        CHECK(std::abs(zero.result.loss) <= 1e-6);
        CHECK(zero.result.accuracy == 1.0);
      }
    }
  }
}

TEST_CASE("N not a multiple of the chunk: ragged last chunk") {
  for (LoopOrder order : kOrders) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      for (std::int64_t rows : {64, 128}) {
        CeSpec s;
        s.n = 201;
        s.h = 24;
        s.v = 190;
        s.bias = true;
        s.dtype = dtype;
        CrossEntropyOptions o;
        o.loop_order = order;
        o.label_smoothing = 0.05f;
        GradRequest g;
        g.dtype = dtype;
        const CeData d(s);
        o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, rows);
        INFO(describe(s, o, g));
        const LibRun run = run_library(d, o, g);
        INFO(run.plan.str());
        CHECK(run.plan.chunk_rows == rows);
        CHECK(run.plan.num_chunks == (201 + rows - 1) / rows);
        CHECK(201 % run.plan.chunk_rows != 0);
        check_against_oracle(d, o, g, run, oracle(d, o));
      }
    }
  }
}

TEST_CASE("all rows ignored: zero loss, zero gradients, no NaN") {
  for (Reduction r : kReductions) {
    for (LoopOrder order : kOrders) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        for (bool accumulate : {false, true}) {
          for (bool skip : {false, true}) {
            CeSpec s;
            s.n = 70;
            s.h = 12;
            s.v = 90;
            s.dtype = dtype;
            s.bias = true;
            s.class_weights = true;
            s.token_weights = true;
            s.ignore_fraction = 1.0;
            CrossEntropyOptions o;
            o.reduction = r;
            o.loop_order = order;
            o.label_smoothing = 0.1f;
            o.z_loss = 0.01f;
            o.softcap = 3.0f;
            o.compute_entropy = true;
            o.skip_ignored_rows = skip;  // with no valid row, every row is skipped
            o.fp32_weight_grad_accumulator = r == Reduction::kSum;  // zeroed, not flushed stale
            GradRequest g;
            g.dtype = dtype;
            const CeData d(s);
            o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, 64);  // two chunks
            INFO(describe(s, o, g) << " accumulate=" << accumulate << " skip=" << skip);
            const LinearCrossEntropy loss(o);
            CpuContext ctx;
            const float sentinel = 0.75f;
            GradBuffers grads(d, g, sentinel);
            OutBuffers out(s.n);
            const CrossEntropyResult res = run_with_fresh_workspace(
                loss, ctx, d.inputs(o), grads.views(accumulate), out.views());
            CHECK(res.loss == 0.0);
            CHECK(res.z_loss == 0.0);
            CHECK(res.valid_rows == 0);
            CHECK(res.weight_sum == 0.0);
            CHECK(res.accuracy == 0.0);
            CHECK(res.entropy == 0.0);
            const double expect = accumulate ? sentinel : 0.0;
            check_all_equal("grad_hidden", grads.hidden(), expect);
            check_all_equal("grad_weight", grads.weight(), expect);
            check_all_equal("grad_bias", grads.bias(), expect);
            check_all_equal("row_loss", to_double(out.row_loss), 0.0);
            check_all_equal("predictions", to_double(out.predictions), -1.0);
            if (skip && order != LoopOrder::kVocabBlock) {  // (vocab-block order skips nothing)
              bool all_nan = true;
              for (float x : out.lse) all_nan = all_nan && std::isnan(x);
              CHECK(all_nan);
              continue;
            }
            bool lse_finite = true;
            for (float x : out.lse) lse_finite = lse_finite && std::isfinite(x);
            CHECK(lse_finite);
            check_close("lse", out.lse, oracle(d, o).lse, tolerance(dtype).rows);
          }
        }
      }
    }
  }
}

TEST_CASE("large logits (|z| up to ~200) stay finite and match the oracle") {
  for (LoopOrder order : kOrders) {
    for (Reduction r : kReductions) {
      CeSpec s;
      s.n = 70;
      s.h = 32;
      s.v = 300;
      s.bias = true;
      s.logit_scale = 60.0f;
      CrossEntropyOptions o;
      o.loop_order = order;
      o.reduction = r;
      o.label_smoothing = 0.1f;
      o.compute_entropy = true;
      const LibRun run = check_case(s, o, {});
      CHECK(std::isfinite(run.result.loss));
      CHECK(run.result.loss > 10.0);
    }
  }
}

TEST_CASE("ties: predictions and accuracy use the first argmax") {
  // Small integers make every logit exact in any summation order, so ties are exact ties:
  // weight rows 3 and 7 are equal and hold the maximum of every row with non-zero hidden; the
  // last row has zero hidden, so all its logits tie and its first argmax is class 0.
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (LoopOrder order : kOrders) {
      CeSpec s;
      s.n = 7;
      s.h = 4;
      s.v = 9;
      s.dtype = dtype;
      s.ignore_fraction = 0.0;
      s.hits = false;
      CeData d(s);
      for (std::int64_t t = 0; t < s.n; ++t)
        for (std::int64_t i = 0; i < s.h; ++i)
          d.hidden[static_cast<std::size_t>(t * s.h + i)] =
              t == s.n - 1 ? 0.0f : static_cast<float>((t + i) % 3);
      std::fill(d.weight.begin(), d.weight.end(), 0.0f);
      for (std::int64_t i = 0; i < s.h; ++i) {
        d.weight[static_cast<std::size_t>(3 * s.h + i)] = 1.0f;
        d.weight[static_cast<std::size_t>(7 * s.h + i)] = 1.0f;
      }
      d.sync();
      const std::int64_t targets[] = {3, 7, 3, 7, 7, 3, 0};
      for (std::int64_t t = 0; t < s.n; ++t) d.set_target(t, targets[t]);
      CrossEntropyOptions o;
      o.loop_order = order;
      INFO(describe(s, o, {}));
      const LibRun run = run_library(d, o, {});
      const std::vector<std::int32_t> want = {3, 3, 3, 3, 3, 3, 0};
      CHECK(run.out.predictions == want);
      CHECK(run.result.accuracy == doctest::Approx(4.0 / 7.0).epsilon(1e-12));
      check_against_oracle(d, o, {}, run, oracle(d, o));
    }
  }
}

TEST_CASE("NaN logits: predictions leave NaNs out, a row of NaNs predicts column 0") {
  // NaN weight rows make a few columns NaN in every row (the first, one inside a 16-byte vector,
  // the last); row 2's hidden is NaN, so all its logits are. Every other row must predict what
  // it predicts with those columns masked by a -inf bias instead (the other logits are the same
  // GEMM sums), and the loss is NaN.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::int64_t nan_cols[] = {0, 3, 17, 506};
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (LoopOrder order : kOrders) {
      CeSpec s;
      s.n = 9;
      s.h = 16;
      s.dtype = dtype;
      s.bias = true;
      s.ignore_fraction = 0.0;
      CeData with_nan(s), masked(s);
      for (std::int64_t j : nan_cols) {
        for (std::int64_t i = 0; i < s.h; ++i) {
          with_nan.weight[sz(j * s.h + i)] = nan;
          masked.weight[sz(j * s.h + i)] = 0.0f;
        }
        masked.bias[sz(j)] = -std::numeric_limits<float>::infinity();
      }
      for (std::int64_t i = 0; i < s.h; ++i) with_nan.hidden[sz(2 * s.h + i)] = nan;
      with_nan.sync();
      masked.sync();
      CrossEntropyOptions o;
      o.loop_order = order;
      INFO(describe(s, o, {}));
      const LibRun a = run_library(with_nan, o, {}), b = run_library(masked, o, {});
      CHECK(std::isnan(a.result.loss));
      for (std::int64_t t = 0; t < s.n; ++t) {
        CAPTURE(t);
        CHECK(a.out.predictions[sz(t)] == (t == 2 ? 0 : b.out.predictions[sz(t)]));
      }
    }
  }
}

TEST_CASE("one row, valid and ignored") {
  for (double ignored : {0.0, 1.0}) {
    for (LoopOrder order : kOrders) {
      for (Reduction r : kReductions) {
        CeSpec s;
        s.n = 1;
        s.h = 33;
        s.v = 257;
        s.bias = true;
        s.ignore_fraction = ignored;
        s.hits = false;
        CrossEntropyOptions o;
        o.loop_order = order;
        o.reduction = r;
        o.z_loss = 0.01f;
        const LibRun run = check_case(s, o, {});
        CHECK(run.plan.chunk_rows == 1);
        CHECK(run.result.valid_rows == (ignored > 0 ? 0 : 1));
      }
    }
  }
}

TEST_CASE("accumulate adds the gradients to pre-filled buffers") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (LoopOrder order : kOrders) {
      for (bool acc : {false, true}) {
        CeSpec s;
        s.n = 150;
        s.h = 40;
        s.v = 300;
        s.bias = true;
        s.dtype = dtype;
        CrossEntropyOptions o;
        o.loop_order = order;
        o.fp32_weight_grad_accumulator = acc;
        o.reduction = Reduction::kSum;
        GradRequest g;
        g.dtype = dtype;
        const CeData d(s);
        o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, 64);
        INFO(describe(s, o, g));
        const reference::CeResult ref = oracle(d, o);
        auto rms = [](const std::vector<double>& x) {
          double q = 0;
          for (double e : x) q += e * e;
          return std::sqrt(q / static_cast<double>(x.size()));
        };
        // Pre-fill at the gradients' own scale: a dropped or doubled contribution then moves the
        // result by about its own norm.
        GradBuffers grads(d, g);
        grads.fill_random(99, rms(ref.grad_hidden), rms(ref.grad_weight), rms(ref.grad_bias));
        const std::vector<double> h0 = grads.hidden(), w0 = grads.weight(), b0 = grads.bias();
        const LinearCrossEntropy loss(o);
        CpuContext ctx;
        const CrossEntropyResult res =
            run_with_fresh_workspace(loss, ctx, d.inputs(o), grads.views(true), {});
        check_scalar("loss", res.loss, ref.loss, tolerance(dtype).loss);
        const double tol = tolerance(dtype).grad;
        check_added(grads, h0, w0, b0, ref, tol);
        if (dtype == DType::kF32) {
          // A second accumulating call adds the same gradients again.
          run_with_fresh_workspace(loss, ctx, d.inputs(o), grads.views(true), {});
          auto twice = [&](const std::vector<double>& x0, const std::vector<double>& gr) {
            return plus(plus(x0, gr), gr);
          };
          check_close("grad_hidden x2", grads.hidden(), twice(h0, ref.grad_hidden), tol);
          check_close("grad_weight x2", grads.weight(), twice(w0, ref.grad_weight), tol);
          check_close("grad_bias x2", grads.bias(), twice(b0, ref.grad_bias), tol);
        }
      }
    }
  }
}

TEST_CASE("overwrite (accumulate = false) ignores the buffers' previous contents") {
  for (LoopOrder order : kOrders) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      CeSpec s;
      s.n = 150;
      s.h = 40;
      s.v = 300;
      s.bias = true;
      s.dtype = dtype;
      CrossEntropyOptions o;
      o.loop_order = order;
      GradRequest g;
      g.dtype = dtype;
      const CeData d(s);
      o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, 64);
      GradBuffers clean(d, g, 0.0f), dirty(d, g, std::numeric_limits<float>::quiet_NaN());
      const LinearCrossEntropy loss(o);
      CpuContext ctx;
      run_with_fresh_workspace(loss, ctx, d.inputs(o), clean.views(), {});
      run_with_fresh_workspace(loss, ctx, d.inputs(o), dirty.views(), {});
      CHECK(clean.bitwise_equal(dirty));
    }
  }
}

// Runs `d` under `o` with the budget for `rows` rows per chunk (0: the default budget).
LibRun run_with_chunk_rows(const CeData& d, CrossEntropyOptions o, const GradRequest& g,
                           std::int64_t rows) {
  if (rows) o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, rows);
  LibRun run = run_library(d, o, g);
  if (rows) CHECK(run.plan.chunk_rows == rows);
  return run;
}

TEST_CASE("chunk-size invariance: every budget gives the same results to rounding") {
  struct Setting {
    DType dtype;
    bool acc;
  };
  for (const Setting st : {Setting{DType::kF32, false}, Setting{DType::kBF16, true}}) {
    for (LoopOrder order : kOrders) {
      CeSpec s;
      s.n = 250;  // below the CPU's chunk cap: one chunk with an unbounded budget
      s.h = 48;
      s.v = 700;
      s.bias = true;
      s.class_weights = true;
      s.dtype = st.dtype;
      CrossEntropyOptions o;
      o.loop_order = order;
      o.fp32_weight_grad_accumulator = st.acc;
      o.label_smoothing = 0.1f;
      o.z_loss = 0.01f;
      o.compute_entropy = true;
      GradRequest g;
      g.dtype = st.dtype;
      const CeData d(s);
      const LibRun whole = run_with_chunk_rows(d, o, g, 0);
      CHECK(whole.plan.num_chunks == 1);
      CHECK(whole.plan.num_vocab_blocks == 1);
      const Tolerance tg = tolerance(st.dtype);
      std::int64_t blocks_seen = 1;
      for (std::int64_t rows : {64, 128, 192}) {
        CAPTURE(rows);
        INFO(describe(s, o, g));
        const LibRun part = run_with_chunk_rows(d, o, g, rows);
        INFO(part.plan.str());
        blocks_seen = std::max(blocks_seen, part.plan.num_vocab_blocks);
        check_scalar("loss", part.result.loss, whole.result.loss, tolerance(DType::kF32).chunking);
        check_scalar("z_loss", part.result.z_loss, whole.result.z_loss, 1e-6);
        check_scalar("entropy", part.result.entropy, whole.result.entropy, 1e-6);
        CHECK(part.result.accuracy == whole.result.accuracy);
        CHECK(part.out.predictions == whole.out.predictions);
        check_close("lse", part.out.lse, whole.out.lse, tolerance(DType::kF32).chunking);
        check_close("row_loss", part.out.row_loss, whole.out.row_loss,
                    tolerance(DType::kF32).chunking);
        check_close("grad_hidden", part.grads.hidden(), whole.grads.hidden(), tg.chunking);
        check_close("grad_weight", part.grads.weight(), whole.grads.weight(), tg.chunking);
        check_close("grad_bias", part.grads.bias(), whole.grads.bias(), tg.chunking);
      }
      if (order == LoopOrder::kVocabBlock) CHECK(blocks_seen > 1);
    }
  }
}

// skip_ignored_rows: a problem of 1400 rows whose ignored runs are 300 leading rows, 40 rows
// (too short to skip: below 64), 350 rows and 100 trailing rows, besides single ignored rows in
// the valid spans (ignore_fraction).
CeData skip_layout(CeSpec s) {
  s.n = 1400;
  s.h = 32;
  s.v = 300;
  CeData d(s);
  for (std::int64_t t = 0; t < s.n; ++t) {
    const bool run = t < 300 || (t >= 500 && t < 540) || (t >= 900 && t < 1250) || t >= 1300;
    const bool edge = t == 300 || t == 499 || t == 540 || t == 899 || t == 1250 || t == 1299;
    if (run) d.set_target(t, s.ignore_index);
    if (edge) d.set_target(t, (t * 7) % s.v);
  }
  return d;
}

// The rows skip_ignored_rows skips, found independently of the library: the maximal runs of
// ignored rows that lead, trail, or hold at least `min_gap` rows (the plan's skip_gap_rows,
// which must lie between skip_layout's two inner runs for it to test both sides).
std::vector<bool> skipped_rows(const CeData& d, std::int64_t min_gap) {
  REQUIRE(min_gap > 40);
  REQUIRE(min_gap <= 350);
  const std::int64_t n = d.spec.n;
  std::vector<bool> skip(sz(n), false);
  for (std::int64_t a = 0; a < n;) {
    if (d.targets64[sz(a)] != d.spec.ignore_index) {
      ++a;
      continue;
    }
    std::int64_t b = a;
    while (b < n && d.targets64[sz(b)] == d.spec.ignore_index) ++b;
    if (a == 0 || b == n || b - a >= min_gap)
      for (std::int64_t t = a; t < b; ++t) skip[sz(t)] = true;
    a = b;
  }
  return skip;
}

// lse: NaN on the skipped rows, the oracle's elsewhere.
void check_skipped_lse(const std::vector<float>& lse, const std::vector<bool>& skip,
                       const std::vector<double>& want, double tol) {
  std::vector<double> got, ref;
  std::int64_t wrong = -1;
  for (std::size_t t = 0; t < lse.size(); ++t) {
    if (skip[t] != std::isnan(lse[t]) && wrong < 0) wrong = static_cast<std::int64_t>(t);
    if (skip[t]) continue;
    got.push_back(lse[t]);
    ref.push_back(want[t]);
  }
  if (wrong >= 0)
    FAIL_CHECK("lse[" << wrong << "] = " << lse[sz(wrong)] << " for a row "
                      << std::string(skip[sz(wrong)] ? "skipped" : "computed"));
  check_close("lse (computed rows)", got, ref, tol);
}

TEST_CASE("skip_ignored_rows: long runs of ignored rows are skipped, the rest is the oracle's") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (Reduction r : kReductions) {
      for (std::int64_t chunk : {0, 128}) {
        CeSpec s;
        s.dtype = dtype;
        s.bias = true;
        s.class_weights = true;
        s.token_weights = true;
        s.targets_i64 = r == Reduction::kSum;
        CrossEntropyOptions o;
        o.reduction = r;
        o.loop_order = chunk ? LoopOrder::kTokenChunk : LoopOrder::kAuto;  // auto takes it
        o.fp32_weight_grad_accumulator = dtype == DType::kBF16 && r == Reduction::kNone;
        o.label_smoothing = 0.1f;
        o.z_loss = 0.01f;
        o.compute_entropy = true;
        GradRequest g;
        g.dtype = dtype;
        const CeData d = skip_layout(s);
        o.skip_ignored_rows = true;  // (its plan may stage X rows: the budget for its chunks)
        if (chunk) o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, chunk);
        INFO(describe(d.spec, o, g) << " chunk rows " << chunk);
        const LibRun run = run_library(d, o, g);
        o.skip_ignored_rows = false;
        const reference::CeResult ref = oracle(d, o);
        const LibRun plain = run_library(d, o, g);
        INFO("plan: " << run.plan.str());
        const std::vector<bool> skip = skipped_rows(d, run.plan.skip_gap_rows);
        REQUIRE(std::count(skip.begin(), skip.end(), true) == 750);
        CHECK(run.plan.order == LoopOrder::kTokenChunk);
        if (chunk) CHECK(run.plan.chunk_rows == chunk);
        // Everything but lse against the oracle (row_loss is 0 on every ignored row, and so
        // are the skipped rows' dH), and lse on the computed rows.
        OutBuffers out = run.out;
        const Tolerance tv = tolerance(dtype);
        check_skipped_lse(out.lse, skip, ref.lse, tv.rows);
        std::vector<double> ref_lse = ref.lse;
        for (std::size_t t = 0; t < skip.size(); ++t)
          if (skip[t]) ref_lse[t] = 0.0, out.lse[t] = 0.0f;
        LibRun masked{run.result, run.plan, run.grads, out};
        reference::CeResult ref_masked = ref;
        ref_masked.lse = ref_lse;
        check_against_oracle(d, o, g, masked, ref_masked);
        // ... and the call that computes every row, to rounding (a bf16 dW is rounded once per
        // chunk, and the two calls cut their chunks elsewhere: to the oracle's tolerance).
        check_scalar("loss vs all rows", run.result.loss, plain.result.loss,
                     tolerance(DType::kF32).chunking);
        const double tg = dtype == DType::kBF16 ? tolerance(dtype).grad : tolerance(dtype).chunking;
        check_close("grad_hidden vs all rows", run.grads.hidden(), plain.grads.hidden(), tg);
        check_close("grad_weight vs all rows", run.grads.weight(), plain.grads.weight(), tg);
        check_close("grad_bias vs all rows", run.grads.bias(), plain.grads.bias(), tg);
      }
    }
  }
}

// SFT batches: 20 sequences of 100 rows, each a prompt of 64-83 ignored rows and a completion
// of the rest (one of its rows ignored too). The completions are shorter than a chunk, so a
// chunk holds pieces of several of them, cut where the chunk fills.
TEST_CASE("skip_ignored_rows: short completions share chunks, cut anywhere") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (std::int64_t chunk : {0, 64, 128}) {
      CeSpec s;
      s.n = 2000;
      s.h = 24;
      s.v = 200;
      s.dtype = dtype;
      s.bias = true;
      s.ignore_fraction = 0.0;
      CeData d(s);
      std::int64_t prompts = 0;
      for (std::int64_t q = 0; q < 20; ++q) {
        const std::int64_t prompt = 64 + (q * 7) % 20;
        for (std::int64_t t = 0; t < prompt; ++t) d.set_target(q * 100 + t, s.ignore_index);
        d.set_target(q * 100 + prompt + 5, s.ignore_index);
        prompts += prompt;
      }
      CrossEntropyOptions o;
      o.skip_ignored_rows = true;
      o.label_smoothing = 0.05f;
      GradRequest g;
      g.dtype = dtype;
      if (chunk) o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, chunk);
      INFO(describe(d.spec, o, g) << " chunk rows " << chunk);
      const LibRun run = run_library(d, o, g);
      INFO("plan: " << run.plan.str());
      if (chunk) CHECK(run.plan.chunk_rows == chunk);
      CHECK(run.plan.skip_gap_rows == 64);
      const std::vector<bool> skip = skipped_rows(d, run.plan.skip_gap_rows);
      REQUIRE(std::count(skip.begin(), skip.end(), true) == prompts);
      o.skip_ignored_rows = false;
      const reference::CeResult ref = oracle(d, o);
      OutBuffers out = run.out;
      check_skipped_lse(out.lse, skip, ref.lse, tolerance(dtype).rows);
      reference::CeResult ref_masked = ref;
      for (std::size_t t = 0; t < skip.size(); ++t)
        if (skip[t]) ref_masked.lse[t] = 0.0, out.lse[t] = 0.0f;
      check_against_oracle(d, o, g, LibRun{run.result, run.plan, run.grads, out}, ref_masked);
    }
  }
}

TEST_CASE("skip_ignored_rows: skipped dH rows zero, or kept with accumulate, forward only") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CeSpec s;
    s.dtype = dtype;
    s.bias = true;
    CrossEntropyOptions o;
    o.loop_order = LoopOrder::kTokenChunk;
    o.reduction = dtype == DType::kF32 ? Reduction::kSum : Reduction::kMean;
    o.skip_ignored_rows = true;
    GradRequest g;
    g.dtype = dtype;
    const CeData d = skip_layout(s);
    INFO(describe(d.spec, o, g));
    const reference::CeResult ref = oracle(d, o);
    GradBuffers grads(d, g);
    grads.fill_random(5, 1e-3, 1e-3, 1e-3);
    const std::vector<double> h0 = grads.hidden(), w0 = grads.weight(), b0 = grads.bias();
    const LinearCrossEntropy loss(o);
    CpuContext ctx;
    const CrossEntropyResult res =
        run_with_fresh_workspace(loss, ctx, d.inputs(o), grads.views(true), {});
    check_scalar("loss", res.loss, ref.loss, tolerance(dtype).loss);
    const double tol = tolerance(dtype).grad;
    check_added(grads, h0, w0, b0, ref, tol);
    const std::vector<bool> skip =
        skipped_rows(d, loss.plan(d.inputs(o), grads.views()).skip_gap_rows);
    std::int64_t changed = 0;  // skipped rows whose dH moved (they must keep their bits)
    const std::vector<double> h1 = grads.hidden();
    for (std::int64_t t = 0; t < d.spec.n; ++t)
      for (std::int64_t j = 0; j < d.spec.h; ++j)
        if (skip[sz(t)] && h1[sz(t * d.spec.h + j)] != h0[sz(t * d.spec.h + j)]) ++changed;
    CHECK(changed == 0);

    GradBuffers over(d, g, 0.75f);  // without accumulate the skipped rows' dH becomes zero
    run_with_fresh_workspace(loss, ctx, d.inputs(o), over.views(false), {});
    check_close("grad_hidden (overwritten)", over.hidden(), ref.grad_hidden, tol);
    check_close("grad_weight (overwritten)", over.weight(), ref.grad_weight, tol);

    // Forward only, with a workspace of zeros (not NaN): the skipped rows' lse is written.
    OutBuffers out(d.spec.n);
    const AlignedBuffer zeros(loss.workspace_bytes(d.inputs(o)), 0x00);
    const CrossEntropyResult fwd = loss.forward(ctx, d.inputs(o), out.views(), zeros.workspace());
    check_scalar("forward loss", fwd.loss, ref.loss, tolerance(dtype).loss);
    check_skipped_lse(out.lse, skip, ref.lse, tolerance(dtype).rows);
    check_close("forward row_loss", out.row_loss, ref.row_loss, tolerance(dtype).rows);
  }
}

TEST_CASE("skip_ignored_rows: vocab-block order skips nothing") {
  CeSpec s;
  CrossEntropyOptions o;
  o.loop_order = LoopOrder::kVocabBlock;
  o.skip_ignored_rows = true;
  const CeData d = skip_layout(s);
  const LibRun run = run_library(d, o, {});
  REQUIRE(run.plan.order == LoopOrder::kVocabBlock);
  check_against_oracle(d, o, {}, run, oracle(d, o));  // lse of every row, none NaN
}

TEST_CASE("thread counts agree to rounding, and with the oracle") {
  // Large enough that the bf16 conversions and stores (64 Ki values and more) and the bias
  // gradient's column sums (two blocks of columns) are shared out over the threads.
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (LoopOrder order : kOrders) {
      for (bool acc : {false, true}) {
        CeSpec s;
        s.n = 300;
        s.h = 300;
        s.v = 1100;
        s.bias = true;
        s.dtype = dtype;
        CrossEntropyOptions o;
        o.loop_order = order;
        o.fp32_weight_grad_accumulator = acc;
        GradRequest g;
        g.dtype = dtype;
        const CeData d(s);
        INFO(describe(s, o, g));
        const LibRun one = run_library(d, o, g, true, 1);
        const LibRun three = run_library(d, o, g, true, 3);
        check_against_oracle(d, o, g, three, oracle(d, o));
        const double tol = tolerance(dtype).chunking;
        check_scalar("loss", three.result.loss, one.result.loss, tol);
        check_close("grad_hidden", three.grads.hidden(), one.grads.hidden(), tol);
        check_close("grad_weight", three.grads.weight(), one.grads.weight(), tol);
        check_close("grad_bias", three.grads.bias(), one.grads.bias(), tol);
      }
    }
  }
}

TEST_CASE("bitwise run-to-run equality, whatever the workspace held before, at each thread count") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (LoopOrder order : kOrders) {
      for (const auto& [acc, threads] :
           {std::pair{false, 1}, {true, 1}, {false, 2}, {true, 2}, {false, 5}, {true, 5}}) {
        CeSpec s;
        s.n = 150;
        s.h = 40;
        s.v = 300;
        s.bias = true;
        s.class_weights = true;
        s.token_weights = true;
        s.dtype = dtype;
        CrossEntropyOptions o;
        o.loop_order = order;
        o.fp32_weight_grad_accumulator = acc;
        o.label_smoothing = 0.1f;
        o.z_loss = 0.01f;
        o.softcap = 5.0f;
        o.compute_entropy = true;
        GradRequest g;
        g.dtype = dtype;
        const CeData d(s);
        o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, 64);
        INFO(describe(s, o, g));
        CAPTURE(threads);
        const LinearCrossEntropy loss(o);
        CpuContext ctx(threads);
        const CrossEntropyInputs in = d.inputs(o);
        GradBuffers g1(d, g), g2(d, g);
        OutBuffers o1(s.n), o2(s.n);
        const std::size_t bytes = loss.workspace_bytes(in, g1.views());
        AlignedBuffer ws1(bytes, 0x00), ws2(bytes, 0xff);
        const CrossEntropyResult r1 =
            loss.forward_backward(ctx, in, g1.views(), o1.views(), ws1.workspace());
        const CrossEntropyResult r2 =
            loss.forward_backward(ctx, in, g2.views(), o2.views(), ws2.workspace());
        CHECK(std::memcmp(&r1.loss, &r2.loss, sizeof(double)) == 0);
        CHECK(std::memcmp(&r1.z_loss, &r2.z_loss, sizeof(double)) == 0);
        CHECK(std::memcmp(&r1.entropy, &r2.entropy, sizeof(double)) == 0);
        CHECK(g1.bitwise_equal(g2));
        CHECK(bitwise_equal(o1.row_loss, o2.row_loss));
        CHECK(bitwise_equal(o1.lse, o2.lse));
        CHECK(bitwise_equal(o1.predictions, o2.predictions));
      }
    }
  }
}

TEST_CASE("forward only: same loss and outputs, inputs untouched, token-chunk plan") {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (Reduction r : kReductions) {
      CeSpec s;
      s.n = 150;
      s.h = 40;
      s.v = 300;
      s.bias = true;
      s.class_weights = true;
      s.token_weights = true;
      s.dtype = dtype;
      CrossEntropyOptions o;
      o.reduction = r;
      o.label_smoothing = 0.1f;
      o.z_loss = 0.01f;
      o.compute_entropy = true;
      o.loop_order = LoopOrder::kVocabBlock;  // a forward has no gradient pass: ignored
      GradRequest g;
      g.dtype = dtype;
      const CeData d(s);
      const CeData before = d;
      INFO(describe(s, o, g));
      const LinearCrossEntropy loss(o);
      CpuContext ctx;
      OutBuffers out(s.n);
      const CrossEntropyInputs in = d.inputs(o);
      const Plan p = loss.plan(in);
      CHECK(p.order == LoopOrder::kTokenChunk);
      CHECK(p.reason.find("forward") != std::string::npos);
      CHECK(p.dw_accum.bytes == 0);
      CHECK(p.db_accum.bytes == 0);
      AlignedBuffer ws(loss.workspace_bytes(in));
      const CrossEntropyResult fwd = loss.forward(ctx, in, out.views(), ws.workspace());
      const LibRun full = run_library(d, o, g);
      check_scalar("loss", fwd.loss, full.result.loss, tolerance(DType::kF32).chunking);
      check_scalar("z_loss", fwd.z_loss, full.result.z_loss, tolerance(DType::kF32).chunking);
      check_scalar("entropy", fwd.entropy, full.result.entropy, tolerance(DType::kF32).chunking);
      CHECK(fwd.accuracy == full.result.accuracy);
      CHECK(fwd.valid_rows == full.result.valid_rows);
      check_close("row_loss", out.row_loss, full.out.row_loss, tolerance(DType::kF32).chunking);
      check_close("lse", out.lse, full.out.lse, tolerance(DType::kF32).chunking);
      CHECK(out.predictions == full.out.predictions);
      const reference::CeResult ref = oracle(d, o);
      check_scalar("loss vs oracle", fwd.loss, ref.loss, tolerance(dtype).loss);
      CHECK(bitwise_equal(d.hidden, before.hidden));
      CHECK(bitwise_equal(d.weight, before.weight));
      CHECK(bitwise_equal(d.bias, before.bias));
      CHECK(bitwise_equal(d.hidden_bf, before.hidden_bf));
      CHECK(bitwise_equal(d.weight_bf, before.weight_bf));
      CHECK(bitwise_equal(d.bias_bf, before.bias_bf));
      CHECK(bitwise_equal(d.targets32, before.targets32));
      CHECK(bitwise_equal(d.class_weights, before.class_weights));
      CHECK(bitwise_equal(d.token_weights, before.token_weights));
      CHECK(bitwise_equal(d.grad_output, before.grad_output));
    }
  }
}

// Validation allows reduction none without grad_output when no gradient is requested.
TEST_CASE("forward only with reduction none needs no grad_output") {
  CeSpec s;
  CrossEntropyOptions o;
  o.reduction = Reduction::kNone;
  const CeData d(s);
  CrossEntropyInputs in = d.inputs(o);
  in.grad_output = {};
  const LinearCrossEntropy loss(o);
  CpuContext ctx;
  OutBuffers out(s.n);
  const CrossEntropyResult r = run_with_fresh_workspace(loss, ctx, in, {}, out.views());
  const reference::CeResult ref = oracle(d, o);
  check_scalar("loss", r.loss, ref.loss, tolerance(DType::kF32).loss);
  check_close("row_loss", out.row_loss, ref.row_loss, tolerance(DType::kF32).rows);
}

TEST_CASE("bf16 gradient buffers, with and without the fp32 dW accumulator") {
  for (LoopOrder order : kOrders) {
    for (bool acc : {false, true}) {
      CeSpec s;
      s.n = 260;
      s.h = 32;
      s.v = 333;
      s.bias = true;
      s.dtype = DType::kBF16;
      CrossEntropyOptions o;
      o.loop_order = order;
      o.fp32_weight_grad_accumulator = acc;
      GradRequest g;
      g.dtype = DType::kBF16;
      const CeData d(s);
      o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, 64);
      INFO(describe(s, o, g));
      const LibRun run = run_library(d, o, g);
      INFO(run.plan.str());
      CHECK(run.plan.num_chunks == 5);
      CHECK((run.plan.dw_accum.bytes > 0) == acc);
      check_against_oracle(d, o, g, run, oracle(d, o));
    }
  }
}

// ---- bad input ---------------------------------------------------------------------------------

template <typename F>
std::string error_message(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<not a chunkloss::Error: ") + e.what() + ">";
  }
  return "<no exception>";
}

// CHECKs that f() throws chunkloss::Error whose message contains every needle.
template <typename F>
void check_error(F&& f, std::initializer_list<std::string_view> needles) {
  CHECK_THROWS_AS(f(), Error);
  const std::string what = error_message(f);
  for (std::string_view n : needles)
    CHECK_MESSAGE(what.find(n) != std::string::npos,
                  "expected \"" << n << "\" in the message: " << what);
}

// A small valid call that each bad-input test breaks in one place.
struct BadCall {
  BadCall() : BadCall(spec()) {}
  explicit BadCall(const CeSpec& s)
      : d(s), grads(d, GradRequest{}), out(d.spec.n), ws(std::size_t{1} << 20) {}
  static CeSpec spec(bool weights = false) {
    CeSpec s;
    s.n = 5;
    s.h = 8;
    s.v = 11;
    s.bias = true;
    s.class_weights = s.token_weights = weights;
    s.ignore_fraction = 0.2;
    return s;
  }
  CrossEntropyResult call(const CrossEntropyOptions& opts, const CrossEntropyInputs& in,
                          const CrossEntropyGrads& g, const CrossEntropyOutputs& outs) {
    CpuContext ctx;
    return LinearCrossEntropy(opts).forward_backward(ctx, in, g, outs, ws.workspace());
  }
  CrossEntropyResult call(const CrossEntropyInputs& in) {
    return call(o, in, grads.views(), out.views());
  }
  CrossEntropyInputs in() const { return d.inputs(o); }

  CeData d;
  CrossEntropyOptions o;
  GradBuffers grads;
  OutBuffers out;
  AlignedBuffer ws;
};

TEST_CASE("bad input: the valid baseline call succeeds") {
  BadCall b;
  CHECK_NOTHROW(b.call(b.in()));
}

TEST_CASE("bad input: targets out of range or negative") {
  for (std::int64_t y : {11, 12, 1000, -1, -99, -101}) {
    CAPTURE(y);
    BadCall b;
    b.d.set_target(3, y);
    check_error([&] { b.call(b.in()); }, {"targets", "targets[3]", std::to_string(y)});
    b.d.spec.targets_i64 = true;
    check_error([&] { b.call(b.in()); }, {"targets[3]"});
  }
  {
    BadCall wide;  // i64 targets beyond the i32 range are range-checked, not truncated
    wide.d.spec.targets_i64 = true;
    wide.d.targets64[2] = (std::int64_t{1} << 32) + 3;
    check_error([&] { wide.call(wide.in()); }, {"targets[2]", "4294967299"});
  }
  BadCall b;
  b.d.set_target(3, -100);  // ignore_index itself is fine
  CHECK_NOTHROW(b.call(b.in()));
  b.o.ignore_index = -1;
  check_error([&] { b.call(b.in()); }, {"targets"});  // -100 is not ignore_index any more
}

TEST_CASE("bad input: shapes of hidden and weight") {
  BadCall b;
  CrossEntropyInputs in = b.in();
  std::vector<float> w(12 * 8);
  in.weight = TensorView::of(w.data(), {11, 7});
  check_error([&] { b.call(in); }, {"weight", "hidden", "[11, 7]", "[5, 8]"});
  in.weight = TensorView::of(w.data(), {11 * 8});
  check_error([&] { b.call(in); }, {"weight"});
  in.weight = {};
  check_error([&] { b.call(in); }, {"weight"});
  in = b.in();
  in.hidden = TensorView::of(b.d.hidden.data(), {40});
  check_error([&] { b.call(in); }, {"hidden"});
  in.hidden = {};
  check_error([&] { b.call(in); }, {"hidden"});
}

TEST_CASE("bad input: dtype mismatch between hidden and weight, and non-float inputs") {
  BadCall b;
  CrossEntropyInputs in = b.in();
  const std::vector<BFloat16> wb = to_bf16(b.d.weight);
  in.weight = TensorView::of(wb.data(), {11, 8});
  check_error([&] { b.call(in); }, {"weight", "bf16", "f32"});
  in = b.in();
  std::vector<std::int32_t> hi(5 * 8);
  in.hidden = TensorView::of(hi.data(), {5, 8});
  check_error([&] { b.call(in); }, {"hidden", "i32"});
  in = b.in();
  const std::vector<BFloat16> bb = to_bf16(b.d.bias);
  in.bias = TensorView::of(bb.data(), {11});
  check_error([&] { b.call(in); }, {"bias"});
  in.bias = TensorView::of(b.d.bias.data(), {10});
  check_error([&] { b.call(in); }, {"bias", "[10]"});
}

TEST_CASE("bad input: targets dtype and length") {
  BadCall b;
  CrossEntropyInputs in = b.in();
  std::vector<float> tf(5);
  in.targets = TensorView::of(tf.data(), {5});
  check_error([&] { b.call(in); }, {"targets", "f32"});
  in.targets = TensorView::of(b.d.targets32.data(), {4});
  check_error([&] { b.call(in); }, {"targets", "[4]"});
  in.targets = TensorView::of(b.d.targets32.data(), {5, 1});
  check_error([&] { b.call(in); }, {"targets"});
  in.targets = {};
  check_error([&] { b.call(in); }, {"targets"});
}

TEST_CASE("bad input: optional inputs, gradients and outputs with the wrong shape or dtype") {
  BadCall b;
  std::vector<float> f(200);
  std::vector<std::int32_t> i(200);
  auto with_in = [&](auto edit, std::initializer_list<std::string_view> needles) {
    CrossEntropyInputs in = b.in();
    edit(in);
    check_error([&] { b.call(b.o, in, b.grads.views(), b.out.views()); }, needles);
  };
  with_in([&](CrossEntropyInputs& in) { in.class_weights = TensorView::of(f.data(), {10}); },
          {"class_weights"});
  with_in([&](CrossEntropyInputs& in) { in.class_weights = TensorView::of(i.data(), {11}); },
          {"class_weights"});
  with_in([&](CrossEntropyInputs& in) { in.token_weights = TensorView::of(f.data(), {6}); },
          {"token_weights"});
  auto with_grads = [&](auto edit, std::initializer_list<std::string_view> needles) {
    CrossEntropyGrads g = b.grads.views();
    edit(g);
    check_error([&] { b.call(b.o, b.in(), g, b.out.views()); }, needles);
  };
  with_grads(
      [&](CrossEntropyGrads& g) {
        g.hidden = TensorView::of(f.data(), {5, 7});
      },
      {"grad_hidden"});
  with_grads(
      [&](CrossEntropyGrads& g) {
        g.weight = TensorView::of(f.data(), {8, 11});
      },
      {"grad_weight"});
  with_grads(
      [&](CrossEntropyGrads& g) {
        g.weight = TensorView::of(i.data(), {11, 8});
      },
      {"grad_weight", "i32"});
  with_grads([&](CrossEntropyGrads& g) { g.bias = TensorView::of(f.data(), {12}); }, {"grad_bias"});
  auto with_out = [&](auto edit, std::initializer_list<std::string_view> needles) {
    CrossEntropyOutputs o = b.out.views();
    edit(o);
    check_error([&] { b.call(b.o, b.in(), b.grads.views(), o); }, needles);
  };
  with_out([&](CrossEntropyOutputs& o) { o.lse = TensorView::of(f.data(), {4}); }, {"lse"});
  with_out([&](CrossEntropyOutputs& o) { o.row_loss = TensorView::of(i.data(), {5}); },
           {"row_loss"});
  with_out([&](CrossEntropyOutputs& o) { o.predictions = TensorView::of(f.data(), {5}); },
           {"predictions"});
}

TEST_CASE("bad input: views or workspace on another device") {
  BadCall b;
  CrossEntropyInputs in = b.in();
  in.hidden = TensorView(b.d.hidden.data(), DType::kF32, {5, 8}, Device::kCuda);
  check_error([&] { b.call(in); }, {"hidden", "device"});
  in = b.in();
  in.targets = TensorView(b.d.targets32.data(), DType::kI32, {5}, Device::kCuda);
  check_error([&] { b.call(in); }, {"targets", "device"});
  CpuContext ctx;
  const Workspace cuda_ws(b.ws.data(), b.ws.bytes(), Device::kCuda);
  check_error(
      [&] {
        LinearCrossEntropy(b.o).forward_backward(ctx, b.in(), b.grads.views(), b.out.views(),
                                                 cuda_ws);
      },
      {"workspace"});
}

TEST_CASE("bad input: on CUDA, f32 hidden with a bf16 gradient buffer (plan checks the shapes)") {
  // cuBLAS has no GEMM from f32 operands to a bf16 result; the CPU rounds its f32 gradients.
  BadCall b;
  const auto on_cuda = [](const TensorView& t, DType dtype) {
    return TensorView(t.data(), dtype, {t.size(0), t.ndim() > 1 ? t.size(1) : 1}, Device::kCuda);
  };
  CrossEntropyInputs in = b.in();
  in.hidden = on_cuda(in.hidden, DType::kF32);
  in.weight = on_cuda(in.weight, DType::kF32);
  in.bias = TensorView(in.bias.data(), DType::kF32, {11}, Device::kCuda);
  in.targets = TensorView(in.targets.data(), in.targets.dtype(), {5}, Device::kCuda);
  CrossEntropyGrads g;
  g.hidden = on_cuda(b.grads.views().hidden, DType::kF32);
  g.weight = on_cuda(b.grads.views().weight, DType::kF32);
  const LinearCrossEntropy loss(b.o);
  CHECK_NOTHROW(loss.plan(in, g));
  g.weight = on_cuda(b.grads.views().weight, DType::kBF16);
  check_error([&] { loss.plan(in, g); },
              {"grad_weight [11, 8] bf16 cuda must be f32 with f32 hidden [5, 8] f32 cuda"});
  // The CPU takes it.
  CrossEntropyGrads cpu = b.grads.views();
  cpu.weight = TensorView(cpu.weight.data(), DType::kBF16, {11, 8});
  CHECK_NOTHROW(loss.plan(b.in(), cpu));
}

TEST_CASE("bad input: an output sharing memory with an input, another output or the workspace") {
  BadCall b;
  const CrossEntropyInputs in = b.in();
  CrossEntropyGrads g = b.grads.views();
  g.hidden = TensorView::of(b.d.hidden.data(), {5, 8});  // an in-place dX is not supported
  check_error([&] { b.call(b.o, in, g, b.out.views()); },
              {"grad_hidden [5, 8] f32 cpu shares memory with hidden [5, 8] f32 cpu"});
  g = b.grads.views();
  g.bias = TensorView::of(g.weight.data_as<float>() + 3, {11});
  check_error([&] { b.call(b.o, in, g, b.out.views()); },
              {"grad_weight [11, 8] f32 cpu shares memory with grad_bias"});
  CrossEntropyOutputs o = b.out.views();
  o.row_loss = TensorView::of(reinterpret_cast<float*>(b.d.targets32.data()), {5});
  check_error([&] { b.call(b.o, in, b.grads.views(), o); },
              {"outputs.row_loss", "shares memory with targets"});
  g = b.grads.views();
  g.hidden = TensorView::of(reinterpret_cast<float*>(b.ws.data()) + 8, {5, 8});
  check_error([&] { b.call(b.o, in, g, b.out.views()); },
              {"grad_hidden", "shares memory with the workspace"});
  // An input inside the workspace would be overwritten while the call reads it.
  float* in_ws = reinterpret_cast<float*>(b.ws.data()) + 64;
  std::copy(b.d.hidden.begin(), b.d.hidden.end(), in_ws);
  CrossEntropyInputs moved = in;
  moved.hidden = TensorView::of(in_ws, {5, 8});
  check_error([&] { b.call(moved); }, {"hidden [5, 8] f32 cpu shares memory with the workspace"});
  auto* targets_ws = reinterpret_cast<std::int32_t*>(in_ws);
  std::copy(b.d.targets32.begin(), b.d.targets32.end(), targets_ws);
  moved = in;
  moved.targets = TensorView::of(targets_ws, {5});
  check_error([&] { b.call(moved); }, {"targets [5] i32 cpu shares memory with the workspace"});
}

TEST_CASE("bad input: too-small workspace") {
  BadCall b;
  const LinearCrossEntropy loss(b.o);
  const std::size_t need = loss.workspace_bytes(b.in(), b.grads.views());
  CHECK(need > 0);
  CpuContext ctx;
  for (std::size_t have : {need - 1, need / 2, std::size_t{0}}) {
    CAPTURE(have);
    const Workspace ws(have ? b.ws.data() : nullptr, have);
    check_error([&] { loss.forward_backward(ctx, b.in(), b.grads.views(), b.out.views(), ws); },
                {"workspace", std::to_string(need)});
  }
  const Workspace exact(b.ws.data(), need);
  CHECK_NOTHROW(loss.forward_backward(ctx, b.in(), b.grads.views(), b.out.views(), exact));
}

TEST_CASE("bad input: grad_bias without bias") {
  BadCall b;
  CrossEntropyInputs in = b.in();
  in.bias = {};
  check_error([&] { b.call(in); }, {"grad_bias", "bias"});
  check_error([&] { LinearCrossEntropy(b.o).workspace_bytes(in, b.grads.views()); }, {"grad_bias"});
}

TEST_CASE("bad input: reduction none needs row_loss, and grad_output with gradients") {
  BadCall b;
  b.o.reduction = Reduction::kNone;
  CrossEntropyOutputs no_rows = b.out.views();
  no_rows.row_loss = {};
  check_error([&] { b.call(b.o, b.in(), b.grads.views(), no_rows); }, {"row_loss"});
  check_error([&] { b.call(b.o, b.in(), {}, no_rows); }, {"row_loss"});
  CrossEntropyInputs in = b.in();
  in.grad_output = {};
  check_error([&] { b.call(b.o, in, b.grads.views(), b.out.views()); }, {"grad_output"});
  std::vector<float> go(4);
  in.grad_output = TensorView::of(go.data(), {4});
  check_error([&] { b.call(b.o, in, b.grads.views(), b.out.views()); }, {"grad_output"});
  CHECK_NOTHROW(b.call(b.o, b.in(), b.grads.views(), b.out.views()));
}

TEST_CASE("bad input: grad_output with reduction mean or sum") {
  for (Reduction r : {Reduction::kMean, Reduction::kSum}) {
    BadCall b;
    b.o.reduction = r;
    CrossEntropyInputs in = b.in();
    in.grad_output = TensorView::of(b.d.grad_output.data(), {5});
    check_error([&] { b.call(b.o, in, b.grads.views(), b.out.views()); },
                {"grad_output", std::string(reduction_name(r))});
  }
}

TEST_CASE("bad input: invalid option values") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (float ls : {-0.1f, 1.5f, nan, inf}) {
    CAPTURE(ls);
    CrossEntropyOptions o;
    o.label_smoothing = ls;
    check_error([&] { LinearCrossEntropy{o}; }, {"label_smoothing"});
  }
  for (float z : {-1e-3f, nan, inf}) {
    CAPTURE(z);
    CrossEntropyOptions o;
    o.z_loss = z;
    check_error([&] { LinearCrossEntropy{o}; }, {"z_loss"});
  }
  for (float c : {0.0f, -1.0f, nan, inf}) {
    CAPTURE(c);
    CrossEntropyOptions o;
    o.softcap = c;
    check_error([&] { LinearCrossEntropy{o}; }, {"softcap"});
  }
  CrossEntropyOptions o;
  o.logits_dtype = DType::kI32;
  check_error([&] { LinearCrossEntropy{o}; }, {"logits_dtype"});
  // Enumerators out of range (a cast from a bad integer) are refused, not read as another one.
  CrossEntropyOptions red;
  red.reduction = static_cast<Reduction>(7);
  check_error([&] { LinearCrossEntropy{red}; }, {"reduction", "value 7"});
  CrossEntropyOptions order;
  order.loop_order = static_cast<LoopOrder>(9);
  check_error([&] { LinearCrossEntropy{order}; }, {"loop_order", "value 9"});
  for (float ok : {0.0f, 1.0f}) {
    CrossEntropyOptions fine;
    fine.label_smoothing = ok;
    CHECK_NOTHROW(LinearCrossEntropy{fine});
  }
}

TEST_CASE("bad input: options the CPU plan cannot honour") {
  BadCall b;
  b.o.logits_dtype = DType::kBF16;  // a CUDA-only speed mode
  check_error([&] { b.call(b.in()); }, {"logits_dtype"});
  BadCall v;
  v.o.loop_order = LoopOrder::kVocabBlock;
  v.o.memory_budget_bytes = 64;
  check_error([&] { v.call(v.in()); }, {"vocab_block"});
  check_error([&] { LinearCrossEntropy(v.o).plan(v.in(), v.grads.views()); }, {"vocab_block"});
}

TEST_CASE("bad input: check_finite finds NaN and Inf in every float input") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    CAPTURE(dtype_name(dtype));
    struct Poison {
      std::vector<float> CeData::*member;
      std::size_t index;
      float value;
      const char* name;
    };
    for (const Poison& p :
         {Poison{&CeData::hidden, 17, nan, "hidden"}, Poison{&CeData::weight, 80, inf, "weight"},
          Poison{&CeData::bias, 10, -inf, "bias"},
          Poison{&CeData::token_weights, 2, nan, "token_weights"},
          Poison{&CeData::grad_output, 4, inf, "grad_output"}}) {
      CAPTURE(p.name);
      BadCall b(BadCall::spec(true));
      b.d.spec.dtype = dtype;
      if (std::string_view(p.name) == "grad_output") b.o.reduction = Reduction::kNone;
      (b.d.*p.member)[p.index] = p.value;
      b.d.sync();
      b.o.check_finite = true;
      check_error([&] { b.call(b.in()); }, {p.name, std::to_string(p.index)});
      b.o.check_finite = false;  // without the check the call goes ahead
      CHECK_NOTHROW(b.call(b.in()));
    }
  }
}

TEST_CASE("bad input: class weights negative or not finite, checked always") {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float w : {-1.0f, -1e-30f, nan, std::numeric_limits<float>::infinity()}) {
    CAPTURE(w);
    for (bool check : {false, true}) {
      BadCall b(BadCall::spec(true));
      b.o.check_finite = check;
      b.d.class_weights[6] = w;
      GradBuffers pristine(b.d, GradRequest{});
      check_error([&] { b.call(b.in()); }, {"class_weights", "index 6", "finite and >= 0"});
      CHECK(b.grads.bitwise_equal(pristine));
    }
  }
  BadCall zero(BadCall::spec(true));  // zero weights are valid (a class left out of the loss)
  zero.d.class_weights[6] = 0.0f;
  CHECK_NOTHROW(zero.call(zero.in()));
}

TEST_CASE("bad input: empty problems") {
  BadCall b;
  CrossEntropyInputs in = b.in();
  in.hidden = TensorView(nullptr, DType::kF32, {0, 8});
  in.targets = TensorView(nullptr, DType::kI32, {0});
  check_error([&] { b.call(b.o, in, {}, {}); }, {"hidden"});
  check_error([&] { LinearCrossEntropy(b.o).workspace_bytes(in); }, {"hidden"});
  in = b.in();
  in.weight = TensorView(nullptr, DType::kF32, {0, 8});
  check_error([&] { b.call(b.o, in, {}, {}); }, {"weight"});
  in = b.in();
  in.hidden = TensorView(nullptr, DType::kF32, {5, 0});
  in.weight = TensorView(nullptr, DType::kF32, {11, 0});
  check_error([&] { b.call(b.o, in, {}, {}); }, {"hidden"});
}

TEST_CASE("a failed call leaves gradients and outputs untouched") {
  for (LoopOrder order : kOrders) {
    for (bool accumulate : {false, true}) {
      CAPTURE(loop_order_name(order));
      CAPTURE(accumulate);
      struct Failure {
        const char* name;
        int kind;
      };
      for (const Failure f : {Failure{"bad last target", 0}, Failure{"NaN in weight", 1},
                              Failure{"small workspace", 2}, Failure{"bad lse length", 3}}) {
        CAPTURE(f.name);
        CeSpec s;
        s.n = 150;
        s.h = 16;
        s.v = 100;
        s.bias = true;
        CeData d(s);
        CrossEntropyOptions o;
        o.loop_order = order;
        o.check_finite = f.kind == 1;
        GradRequest g;
        o.memory_budget_bytes = budget_for_chunk_rows(d, o, g, 64);
        GradBuffers grads(d, g, 3.25f), pristine(d, g, 3.25f);
        OutBuffers out(s.n), out0(s.n);
        const LinearCrossEntropy loss(o);
        const std::size_t need = loss.workspace_bytes(d.inputs(o), grads.views());
        if (f.kind == 0) d.set_target(s.n - 1, s.v);
        if (f.kind == 1) d.weight[s.v * s.h - 1] = std::numeric_limits<float>::quiet_NaN();
        CrossEntropyOutputs views = out.views();
        std::vector<float> short_lse(s.n - 1, 1.0f);
        if (f.kind == 3) views.lse = TensorView::of(short_lse.data(), {s.n - 1});
        AlignedBuffer ws(f.kind == 2 ? need - 256 : need);
        CpuContext ctx;
        CHECK_THROWS_AS(
            loss.forward_backward(ctx, d.inputs(o), grads.views(accumulate), views, ws.workspace()),
            Error);
        CHECK(grads.bitwise_equal(pristine));
        CHECK(bitwise_equal(out.row_loss, out0.row_loss));
        CHECK(bitwise_equal(out.lse, out0.lse));
        CHECK(out.predictions == out0.predictions);
      }
    }
  }
}

TEST_CASE("outputs.scalars holds the results, copy_results_to_host = false returns NaN") {
  const CeData d(CeSpec{});
  const GradRequest g;
  CrossEntropyOptions o;
  o.label_smoothing = 0.1f;
  o.z_loss = 1e-3f;
  const LibRun host = run_library(d, o, g, false);
  o.copy_results_to_host = false;
  const LinearCrossEntropy ce(o);
  const CrossEntropyInputs in = d.inputs(o);
  GradBuffers gb(d, g);
  const CrossEntropyGrads gv = gb.views();
  AlignedBuffer ws(ce.workspace_bytes(in, gv));
  CpuContext ctx(2);
  CrossEntropyOutputs out;
  CHECK_THROWS_WITH_AS(ce.forward_backward(ctx, in, gv, out, ws.workspace()),
                       doctest::Contains("outputs.scalars"), Error);
  std::vector<float> s(7, -1.0f);
  out.scalars = TensorView::of(s.data(), {7});
  const CrossEntropyResult r = ce.forward_backward(ctx, in, gv, out, ws.workspace());
  CHECK(std::isnan(r.loss));
  CHECK(s[0] == doctest::Approx(host.result.loss).epsilon(1e-6));
  CHECK(s[1] == doctest::Approx(host.result.z_loss).epsilon(1e-6));
  CHECK(s[2] == doctest::Approx(host.result.accuracy));
  CHECK(s[4] == static_cast<float>(host.result.valid_rows));
  CHECK(s[5] == doctest::Approx(host.result.weight_sum));
  CHECK(s[6] == 0.0f);
  CHECK(gb.bitwise_equal(host.grads));
}

}  // namespace
}  // namespace chunkloss::test
