// GPU suite of the preference losses: the CUDA path against the CPU path (itself checked against
// the float64 oracle) and against the oracle, on the same generated problems: every DPO loss
// type, ORPO, SimPO, CPO, KTO (KL given and computed), fp32 and bf16 (and the opt-in bf16 logits
// chunk), resident and recompute (and deferred for the pair-antisymmetric losses), several
// budgets, accumulation, forward only, SequenceLogProbs, bitwise run-to-run equality, host-side
// per-sequence vectors, data groups and vocabulary splits (SequenceLogProbs's too) of two ranks
// on one device, and bad input. Skips itself, with a message, without a device.
#include <doctest/doctest.h>

#include <chunkloss/core/error.h>
#include <chunkloss/dist/communicator.h>
#include <chunkloss/dist/nccl.h>
#include <chunkloss/gpu/context.h>
#include <chunkloss/losses/preference.h>
#include <chunkloss/losses/sequence.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "losses/preference_fixture.h"
#include "reference/preference_ref.h"
#include "skip.h"
#include "support/compare.h"
#include "support/threads.h"
#include "support/tolerance.h"
#include "support/workspace.h"

namespace chunkloss::test {
namespace {

using reference::PrefConfig;

constexpr DpoLoss kDpoLosses[] = {DpoLoss::kSigmoid, DpoLoss::kHinge,    DpoLoss::kIpo,
                                  DpoLoss::kRobust,  DpoLoss::kExoPair,  DpoLoss::kNcaPair,
                                  DpoLoss::kBcoPair, DpoLoss::kSppoHard, DpoLoss::kApoZero,
                                  DpoLoss::kApoDown, DpoLoss::kDiscoPop};
constexpr Regime kRegimes[] = {Regime::kResident, Regime::kRecompute};

Dpo make_loss(const DpoOptions& o) { return Dpo(o); }
Orpo make_loss(const OrpoOptions& o) { return Orpo(o); }
Simpo make_loss(const SimpoOptions& o) { return Simpo(o); }
Cpo make_loss(const CpoOptions& o) { return Cpo(o); }
Kto make_loss(const KtoOptions& o) { return Kto(o); }

TensorView like(void* p, const TensorView& t, Device dev) {
  switch (t.ndim()) {
    case 1:
      return TensorView(p, t.dtype(), {t.size(0)}, dev);
    case 2:
      return TensorView(p, t.dtype(), {t.size(0), t.size(1)}, dev);
    case 3:
      return TensorView(p, t.dtype(), {t.size(0), t.size(1), t.size(2)}, dev);
    default:
      return TensorView(p, t.dtype(), {t.size(0), t.size(1), t.size(2), t.size(3)}, dev);
  }
}

// Device copies of host views; the buffers live as long as this object.
struct DeviceCopies {
  std::vector<gpu::DeviceBuffer> keep;
  TensorView put(const TensorView& host) {
    if (!host.defined()) return {};
    keep.emplace_back(std::max<std::size_t>(host.nbytes(), 4));
    gpu::copy_to_device(keep.back().data(), host.data(), host.nbytes());
    return like(keep.back().data(), host, Device::kCuda);
  }
  Head put(const Head& h) { return {put(h.hidden), put(h.weight), put(h.bias)}; }
};

// A problem's inputs on the device; `host_vectors` leaves reference_logps and labels (and the
// KL batch's reference_logps) on the host, which the API allows.
struct DeviceInputs {
  DeviceInputs(const PrefData& d, bool host_vectors = false)
      : DeviceInputs(d.inputs(), host_vectors) {}
  DeviceInputs(const PreferenceInputs& h, bool host_vectors) {
    in = h;
    in.policy = mem.put(h.policy);
    in.targets = mem.put(h.targets);
    in.reference = mem.put(h.reference);
    in.kl_batch.policy = mem.put(h.kl_batch.policy);
    in.kl_batch.targets = mem.put(h.kl_batch.targets);
    in.kl_batch.reference = mem.put(h.kl_batch.reference);
    if (!host_vectors) {
      in.reference_logps = mem.put(h.reference_logps);
      in.labels = mem.put(h.labels);
      in.kl_batch.reference_logps = mem.put(h.kl_batch.reference_logps);
    }
  }
  DeviceCopies mem;
  PreferenceInputs in;
};

// Runs one call on the GPU with gradient buffers starting from `start` (its contents matter
// with accumulate) and returns the results with the gradients copied back into a PrefRun.
// With `error`, a chunkloss::Error is caught and its message stored, and the gradient buffers
// are still copied back (to check that a failed call wrote nothing).
// `group`: the call is this rank's of a data group.
PrefRun run_gpu(const PrefData& d, const SequenceLoss& loss, const PrefGradBuffers& start,
                bool accumulate = false, bool host_vectors = false, std::string* error = nullptr,
                dist::Communicator* group = nullptr) {
  DeviceInputs di(d, host_vectors);
  di.in.data_group = group;
  PrefRun run{{}, {}, start};
  PreferenceGrads host = run.grads.views(accumulate);
  DeviceCopies gmem;
  PreferenceGrads dev;
  dev.accumulate = accumulate;
  dev.hidden = gmem.put(host.hidden);
  dev.weight = gmem.put(host.weight);
  dev.bias = gmem.put(host.bias);
  run.plan = loss.plan(di.in, dev);
  const std::size_t bytes = loss.workspace_bytes(di.in, dev);
  CHECK(bytes == run.plan.workspace_bytes());
  gpu::DeviceBuffer ws(std::max<std::size_t>(bytes, 256));
  gpu::Context ctx(0);
  const Workspace w(ws.data(), bytes, Device::kCuda);
  try {
    run.result =
        dev.any() ? loss.forward_backward(ctx, di.in, dev, w) : loss.forward(ctx, di.in, w);
  } catch (const Error& e) {
    if (!error) throw;
    *error = e.what();
  }
  for (auto [h, g] : {std::pair{host.hidden, dev.hidden}, std::pair{host.weight, dev.weight},
                      std::pair{host.bias, dev.bias}})
    if (h.defined()) gpu::copy_to_host(h.data(), g.data(), h.nbytes());
  return run;
}

// NaN-filled gradient buffers: the call overwrites them, so every row must be written.
PrefRun run_gpu(const PrefData& d, const SequenceLoss& loss, const PrefGradRequest& g) {
  return run_gpu(d, loss, PrefGradBuffers(d, g, std::numeric_limits<float>::quiet_NaN()));
}

// GPU against the CPU path: fp32 GEMMs agree to fp32 rounding; bf16 GEMMs take the gradient
// coefficients rounded to bf16 (as the CPU does not), so bf16 gradients agree to ~2^-8.
PrefTol gpu_vs_cpu(DType input, DType grad) {
  return {input == DType::kF32 ? 2e-5 : 2e-4, input == DType::kF32 ? 2e-5 : 2e-4,
          grad == DType::kF32 && input == DType::kF32 ? 2e-5 : 1.5e-2};
}

// GPU against the float64 oracle: fp32 within 1e-5, bf16 inputs with fp32 gradient buffers
// within 2e-3 (the targets) once the GEMMs sum over enough rows for the independent
// bf16 roundings (the gradient tile, the scaled X rows of dW) to average out; over a handful
// of rows a single element's two roundings can reach 2^-8. bf16 gradient buffers within the
// table's bf16 bound.
PrefTol gpu_vs_oracle(DType input, DType grad, std::int64_t rows) {
  if (input == DType::kF32 && grad == DType::kF32) return {1e-5, 1e-5, 1e-5};
  const double bf16_inputs = rows >= 64 ? 2e-3 : 3.9e-3;
  return {2e-4, 2e-4, grad == DType::kF32 ? bf16_inputs : tolerance(DType::kBF16).grad};
}

// Checks runs on both paths against each other and the oracle; returns the GPU run.
template <typename Options>
PrefRun compare(const PrefSpec& s, const Options& o, DType grad_dtype) {
  const PrefData d(s);
  PrefGradRequest g;
  g.dtype = grad_dtype;
  const PrefConfig cfg = PrefConfig::from(o);
  INFO(describe(s), " grads=", dtype_name(grad_dtype), " regime=", regime_name(o.engine.regime),
       " budget=", o.engine.memory_budget_bytes);
  const PrefRun cpu = run_library(d, make_loss(o), g);
  const PrefRun gpu_run = run_gpu(d, make_loss(o), g);
  INFO("gpu plan: ", gpu_run.plan.str());
  if (o.engine.regime != Regime::kAuto) CHECK(gpu_run.plan.regime == o.engine.regime);
  {
    INFO("gpu vs the oracle");
    check_against_oracle(gpu_run, reference::preference(d.problem(), cfg),
                         gpu_vs_oracle(s.dtype, grad_dtype, s.s * s.t), cfg.paired());
  }
  {
    INFO("gpu vs cpu");
    const PrefTol t = gpu_vs_cpu(s.dtype, grad_dtype);
    check_runs_close(gpu_run, cpu, std::max(t.loss, t.grad));
    check_scalar("loss vs cpu", gpu_run.result.loss, cpu.result.loss, t.loss);
    CHECK(gpu_run.result.tokens == cpu.result.tokens);
  }
  return gpu_run;
}

template <typename Options>
void compare_matrix(const PrefSpec& base, Options o) {
  for (auto [dtype, grad_dtype] :
       {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kF32},
        std::pair{DType::kBF16, DType::kBF16}}) {
    for (Regime r : kRegimes) {
      PrefSpec s = base;
      s.dtype = dtype;
      o.engine.regime = r;
      compare(s, o, grad_dtype);
    }
  }
}

PrefSpec gpu_spec() {
  PrefSpec s;
  s.s = 6;
  s.t = 45;
  s.h = 96;
  s.v = 1031;
  s.bias = true;
  s.ref = RefMode::kHead;
  s.seed = 3;
  return s;
}

TEST_CASE("gpu: every DPO loss type matches the CPU path and the oracle") {
  if (!have_gpu()) return;
  for (DpoLoss t : kDpoLosses) {
    CAPTURE(dpo_loss_name(t));
    DpoOptions o;
    o.loss_type = t;
    if (t == DpoLoss::kExoPair) o.label_smoothing = 0.1f;
    if (t == DpoLoss::kSigmoid) {
      o.label_smoothing = 0.1f;
      o.nll = true;
    }
    compare_matrix(gpu_spec(), o);
  }
  DpoOptions avg;
  avg.average_log_prob = true;
  PrefSpec s = gpu_spec();
  s.ref = RefMode::kLogps;
  compare_matrix(s, avg);
  s.ref = RefMode::kNone;
  compare_matrix(s, DpoOptions{});
}

TEST_CASE("gpu: ORPO, SimPO, CPO and KTO match the CPU path and the oracle") {
  if (!have_gpu()) return;
  PrefSpec s = gpu_spec();
  s.ref = RefMode::kNone;
  compare_matrix(s, OrpoOptions{});
  SimpoOptions simpo;
  simpo.nll_alpha = 0.3f;
  compare_matrix(s, simpo);
  CpoOptions cpo;
  cpo.label_smoothing = 0.1f;
  compare_matrix(s, cpo);
  PrefSpec k = gpu_spec();
  k.s = 7;
  k.labels = true;
  k.kl = 0.25;
  KtoOptions ko;
  ko.desirable_weight = 1.33f;
  compare_matrix(k, ko);
  k.kl.reset();
  k.kl_batch = true;
  k.ref_noise = 0.3f;
  compare_matrix(k, KtoOptions{});
  k.kl_ref = RefMode::kLogps;
  k.ref = RefMode::kLogps;
  compare_matrix(k, KtoOptions{});
}

// The masked columns of masked_columns_data: finite losses as on the CPU (the logits metrics
// -inf on both), and exactly no gradient on the masked columns.
template <typename Options>
void compare_masked(const PrefSpec& s, Options o) {
  const PrefData d = masked_columns_data(s, -std::numeric_limits<float>::infinity());
  for (Regime r : kRegimes) {
    o.engine.regime = r;
    INFO(describe(d.spec), " regime=", regime_name(r));
    const PrefRun cpu = run_library(d, make_loss(o), {}), gpu_run = run_gpu(d, make_loss(o), {});
    CHECK(std::isfinite(gpu_run.result.loss));
    const PrefTol t = gpu_vs_cpu(s.dtype, DType::kF32);
    check_runs_close(gpu_run, cpu, std::max(t.loss, t.grad));
    check_masked_columns_untouched(gpu_run, s.h);
  }
}

TEST_CASE("gpu: a -inf bias masks columns as on the CPU: finite losses, no gradient on them") {
  if (!have_gpu()) return;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = gpu_spec();
    s.dtype = dtype;
    compare_masked(s, DpoOptions{});
    s.ref = RefMode::kNone;
    compare_masked(s, OrpoOptions{});
  }
}

TEST_CASE("gpu: P = 1, odd shapes, variable lengths") {
  if (!have_gpu()) return;
  struct Shape {
    std::int64_t s, t, h, v;
  };
  for (Shape sh :
       {Shape{2, 1, 16, 33}, Shape{2, 9, 123, 507}, Shape{4, 17, 5, 3}, Shape{6, 31, 64, 2048}}) {
    PrefSpec s = gpu_spec();
    s.s = sh.s;
    s.t = sh.t;
    s.h = sh.h;
    s.v = sh.v;
    s.max_prompt_frac = 0.6;
    compare_matrix(s, DpoOptions{});
  }
  PrefSpec s = gpu_spec();
  s.ignore_index = -1;
  DpoOptions o;
  o.engine.ignore_index = -1;
  o.nll = true;
  compare_matrix(s, o);
}

TEST_CASE("gpu: budgets and regimes agree on a larger problem, with several groups and chunks") {
  if (!have_gpu()) return;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = gpu_spec();
    s.s = 4;
    s.t = 513;
    s.h = 256;
    s.v = 8191;
    s.dtype = dtype;
    const PrefData d(s);
    PrefGradRequest g;
    g.dtype = dtype;
    DpoOptions base;
    base.nll = true;
    const PrefRun cpu = run_library(d, Dpo(base), g);
    const PrefRun ref = run_gpu(d, Dpo(base), g);
    const PrefTol t = gpu_vs_cpu(dtype, dtype);
    check_runs_close(ref, cpu, std::max(t.loss, t.grad));
    const std::size_t mib = std::size_t{1} << 20;
    struct Budget {
      Regime regime;
      std::size_t bytes;
    };
    int several = 0;
    for (Budget b : {Budget{Regime::kResident, 0}, Budget{Regime::kResident, 48 * mib},
                     Budget{Regime::kRecompute, 0}, Budget{Regime::kRecompute, 16 * mib},
                     Budget{Regime::kRecompute, 8 * mib}, Budget{Regime::kAuto, 24 * mib}}) {
      DpoOptions o = base;
      o.engine.regime = b.regime;
      o.engine.memory_budget_bytes = b.bytes;
      CAPTURE(regime_name(b.regime));
      CAPTURE(b.bytes);
      const PrefRun run = run_gpu(d, Dpo(o), g);
      INFO("gpu plan: ", run.plan.str());
      if (b.regime != Regime::kAuto) CHECK(run.plan.regime == b.regime);
      if (b.bytes) CHECK(run.plan.workspace_bytes() <= b.bytes);
      several += run.plan.num_groups > 1 || run.plan.num_chunks > 1;
      check_runs_close(run, ref, dtype == DType::kF32 ? 1e-5 : 1e-2);
    }
    CHECK(several >= 2);
  }
}

TEST_CASE("gpu: the deferred regime matches the CPU path and the oracle") {
  if (!have_gpu()) return;
  // Budgets small enough for several chunks in the first pair (and, with P = 3, recomputed
  // pairs after it); the sum losses carry +-1 per sequence in the tile, the averaged ones
  // (ipo, SimPO) +-1/tokens through the row scales.
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (std::int64_t pairs : {1, 3}) {
      PrefSpec s = gpu_spec();
      s.bias = false;
      s.s = 2 * pairs;
      s.t = 257;
      s.dtype = dtype;
      const std::size_t budget = std::size_t{1} << 20;
      for (DpoLoss t : {DpoLoss::kSigmoid, DpoLoss::kIpo, DpoLoss::kHinge}) {
        CAPTURE(dpo_loss_name(t));
        DpoOptions o;
        o.loss_type = t;
        o.engine.regime = Regime::kDeferred;
        o.engine.memory_budget_bytes = budget;
        for (DType grad : {DType::kF32, dtype}) {
          const PrefRun run = compare(s, o, grad);
          CHECK(run.plan.num_chunks > 2);
          CHECK(run.plan.workspace_bytes() <= budget);
        }
      }
      PrefSpec free = s;
      free.ref = RefMode::kNone;
      SimpoOptions simpo;
      simpo.engine.regime = Regime::kDeferred;
      simpo.engine.memory_budget_bytes = budget;
      compare(free, simpo, dtype);
      CpoOptions cpo;
      cpo.alpha = 0.0f;
      cpo.engine = simpo.engine;
      compare(free, cpo, dtype);
      // Bitwise run to run on the device.
      DpoOptions o;
      o.engine.regime = Regime::kDeferred;
      o.engine.memory_budget_bytes = budget;
      const PrefData d(s);
      PrefGradRequest g;
      g.dtype = dtype;
      CHECK(runs_bitwise_equal(run_gpu(d, Dpo(o), g), run_gpu(d, Dpo(o), g)));
    }
  }
}

TEST_CASE("gpu: sequences of 512+ rows with different coefficients, resident and recompute") {
  if (!have_gpu()) return;
  // ORPO's chosen rows carry the NLL term and its rejected rows do not, so a resident pair's
  // two sequences have different coefficient mantissas: at 512 rows or more each gets its own
  // dW GEMM with its mantissa as alpha (below, the X rows are scaled instead).
  PrefSpec s = gpu_spec();
  s.bias = false;
  s.ref = RefMode::kNone;
  s.s = 4;
  s.t = 1100;
  s.h = 64;
  s.v = 515;
  s.max_prompt_frac = 0.05;
  s.dtype = DType::kBF16;
  OrpoOptions o;
  o.engine.regime = Regime::kResident;
  o.engine.memory_budget_bytes = std::size_t{7} << 20;  // one pair per group
  for (DType grad : {DType::kF32, DType::kBF16}) {
    const PrefRun run = compare(s, o, grad);
    CHECK(run.plan.num_groups == 2);
  }
  DpoOptions dpo;  // sums: chosen and rejected share a mantissa, one GEMM per group
  dpo.engine = o.engine;
  s.ref = RefMode::kHead;
  compare(s, dpo, DType::kBF16);
  // Recompute with one chunk for both pairs: a run of two sequences per pair, a dW GEMM each
  // (DPO); ORPO's four sequences each their own run. KTO's resident groups of sequences with
  // their own coefficients likewise.
  const std::size_t whole = std::size_t{24} << 20;
  dpo.engine.regime = Regime::kRecompute;
  dpo.engine.memory_budget_bytes = whole;
  CHECK(compare(s, dpo, DType::kF32).plan.num_chunks == 1);
  s.ref = RefMode::kNone;
  o.engine = dpo.engine;
  compare(s, o, DType::kBF16);
  PrefSpec ks = s;
  ks.labels = true;
  ks.ref = RefMode::kHead;
  KtoOptions kto;
  kto.engine.regime = Regime::kResident;
  kto.engine.memory_budget_bytes = whole;
  compare(ks, kto, DType::kF32);
}

// Sequences of 200 rows with prompts of up to 140 and no bias: short spans for packed chunks.
PrefSpec long_prompt_spec() {
  PrefSpec s = gpu_spec();
  s.bias = false;
  s.t = 200;
  s.max_prompt_frac = 0.7;
  s.seed = 11;
  return s;
}

TEST_CASE("gpu: skipped rows of long prompts and padding, every regime, packed chunks") {
  if (!have_gpu()) return;
  // Prompts of up to 140 of 200 rows: each sequence's leading and trailing ignored rows are
  // skipped (their dH written as zero over the NaN-filled buffers), and at 2 MiB the recompute
  // regime packs several short spans into one chunk with one logits, dH and dW GEMM (X rows
  // gathered in staging; with bf16 inputs the dH rows and scaled X rows in the tile).
  PrefSpec s = long_prompt_spec();
  PrefSpec free = s;
  free.ref = RefMode::kNone;
  PrefSpec ks = s;
  ks.s = 7;
  ks.labels = true;
  const std::size_t budget = std::size_t{2} << 20;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    s.dtype = free.dtype = ks.dtype = dtype;
    for (std::size_t b : {std::size_t{0}, budget}) {
      for (Regime r : {Regime::kResident, Regime::kRecompute, Regime::kDeferred}) {
        DpoOptions o;
        o.engine.regime = r;
        o.engine.memory_budget_bytes = b;
        compare(s, o, dtype);
        if (r == Regime::kDeferred) continue;
        OrpoOptions orpo;
        orpo.engine = o.engine;
        compare(free, orpo, dtype);
        KtoOptions kto;
        kto.engine = o.engine;
        compare(ks, kto, DType::kF32);
      }
    }
  }
}

TEST_CASE("gpu: the opt-in bf16 logits chunk stays close to the fp32 one, packed chunks too") {
  if (!have_gpu()) return;
  // bf16 inputs, the layout of the skipped-rows case: at 2 MiB the recompute regime packs short
  // spans into chunks, one logits and one dH GEMM each (X rows gathered in staging; with bf16
  // logits the tile has no free halves, so the fp32 dH rows and scaled X rows stage beside it).
  // bf16 logits round each logit to 2^-8 of itself, so the runs agree to about 1e-2 (as the
  // cross-entropy's bf16 chunk does), not to the fp32 chunk's bits.
  PrefSpec s = long_prompt_spec();
  s.dtype = DType::kBF16;
  const PrefData d(s);
  PrefGradRequest g;
  g.dtype = DType::kBF16;
  for (std::size_t budget : {std::size_t{0}, std::size_t{2} << 20}) {
    for (Regime r : {Regime::kResident, Regime::kRecompute, Regime::kDeferred}) {
      CAPTURE(budget);
      CAPTURE(regime_name(r));
      DpoOptions o;
      o.engine.regime = r;
      o.engine.memory_budget_bytes = budget;
      const PrefRun f32 = run_gpu(d, Dpo(o), g);
      o.engine.logits_dtype = DType::kBF16;
      const PrefRun b16 = run_gpu(d, Dpo(o), g);
      INFO("bf16-logits plan: ", b16.plan.str());
      CHECK(b16.plan.logits_dtype == DType::kBF16);
      CHECK(b16.plan.regime == r);
      if (budget) CHECK(b16.plan.workspace_bytes() <= budget);
      if (budget && r == Regime::kRecompute) {  // several chunks, each of several spans
        CHECK(b16.plan.num_chunks > 1);
        CHECK(b16.plan.chunk_rows >= 2 * s.t);
      }
      check_scalar("loss (bf16 logits)", b16.result.loss, f32.result.loss, 1e-2);
      check_close("logps (bf16 logits)", b16.result.logps, f32.result.logps, 1e-3);
      check_close("grad_hidden (bf16 logits)", b16.grads.hidden(), f32.grads.hidden(), 3e-2);
      check_close("grad_weight (bf16 logits)", b16.grads.weight(), f32.grads.weight(), 3e-2);
    }
  }
}

TEST_CASE("gpu: bitwise run-to-run equality in both regimes") {
  if (!have_gpu()) return;
  PrefSpec s = gpu_spec();
  s.s = 8;
  s.t = 129;
  s.h = 256;
  s.v = 4099;
  s.dtype = DType::kBF16;
  const PrefData d(s);
  PrefGradRequest g;
  g.dtype = DType::kBF16;
  for (Regime r : kRegimes) {
    CAPTURE(regime_name(r));
    DpoOptions o;
    o.engine.regime = r;
    o.engine.memory_budget_bytes = std::size_t{24} << 20;
    const PrefRun a = run_gpu(d, Dpo(o), g), b = run_gpu(d, Dpo(o), g);
    CHECK(runs_bitwise_equal(a, b));
    KtoOptions k;
    k.engine = o.engine;
    PrefSpec ks = s;
    ks.labels = true;
    ks.kl_batch = true;
    const PrefData kd(ks);
    CHECK(runs_bitwise_equal(run_gpu(kd, Kto(k), g), run_gpu(kd, Kto(k), g)));
  }
}

TEST_CASE("gpu: accumulate, forward only, and per-sequence vectors on the host") {
  if (!have_gpu()) return;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (Regime r : kRegimes) {
      PrefSpec s = gpu_spec();
      s.dtype = dtype;
      const PrefData d(s);
      PrefGradRequest g;
      g.dtype = dtype;
      DpoOptions o;
      o.engine.regime = r;
      CAPTURE(dtype_name(dtype));
      CAPTURE(regime_name(r));
      const auto ref = reference::preference(d.problem(), PrefConfig::from(o));
      PrefGradBuffers start(d, g);
      start.fill_random(5, 1e-3);
      const PrefRun acc = run_gpu(d, Dpo(o), start, true);
      auto plus = [](std::vector<double> a, const std::vector<double>& b) {
        for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
        return a;
      };
      const double tol = gpu_vs_oracle(dtype, dtype, s.s * s.t).grad;
      check_close("accumulated grad_hidden", acc.grads.hidden(),
                  plus(start.hidden(), ref.grad_hidden), tol);
      check_close("accumulated grad_weight", acc.grads.weight(),
                  plus(start.weight(), ref.grad_weight), tol);
      check_close("accumulated grad_bias", acc.grads.bias(), plus(start.bias(), ref.grad_bias),
                  tol);
      const PrefRun fwd = run_gpu(d, Dpo(o), PrefGradRequest::none());
      const PrefRun fb = run_gpu(d, Dpo(o), g);
      check_runs_close(fwd, fb, dtype == DType::kF32 ? 1e-6 : 1e-4);
      CHECK(fwd.plan.packed_pieces);  // the pieces of its chunks gathered for one GEMM each
      CHECK(fwd.plan.workspace_bytes() <= fb.plan.workspace_bytes());
      PrefSpec ks = s;
      ks.labels = true;
      ks.ref = RefMode::kLogps;
      const PrefData kd(ks);
      KtoOptions k;
      k.engine.regime = r;
      const PrefRun dev_vectors = run_gpu(kd, Kto(k), PrefGradBuffers(kd, g), false, false);
      const PrefRun host_vectors = run_gpu(kd, Kto(k), PrefGradBuffers(kd, g), false, true);
      CHECK(runs_bitwise_equal(dev_vectors, host_vectors));
    }
  }
}

// SequenceLogProbs of `d`'s policy head on the device, unsplit.
SequenceLogProbResult gpu_log_probs(const PrefData& d, const SequenceOptions& o) {
  const SequenceLogProbs lp(o);
  DeviceCopies mem;
  const Head head = mem.put(d.policy_head());
  const TensorView y = mem.put(d.targets_view());
  const std::size_t bytes = lp.workspace_bytes(head, y);
  gpu::DeviceBuffer ws(bytes);
  gpu::Context ctx(0);
  return lp.compute(ctx, head, y, Workspace(ws.data(), bytes, Device::kCuda));
}

TEST_CASE("gpu: SequenceLogProbs matches the CPU path and the oracle") {
  if (!have_gpu()) return;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = gpu_spec();
    s.dtype = dtype;
    PrefData d(s);
    for (std::int64_t j = 0; j < s.t; ++j) d.set_target(2 * s.t + j, s.ignore_index);
    const auto want = reference::sequence_stats(d.problem().policy, d.targets64, s.s, s.t, s.h, s.v,
                                                s.ignore_index);
    for (std::size_t budget : {std::size_t{0}, std::size_t{1} << 20}) {
      SequenceOptions o;
      o.memory_budget_bytes = budget;
      const SequenceLogProbs lp(o);
      const auto r = gpu_log_probs(d, o);
      AlignedBuffer hws(lp.workspace_bytes(d.policy_head(), d.targets_view()));
      CpuContext cctx;
      const auto c = lp.compute(cctx, d.policy_head(), d.targets_view(), hws.workspace());
      CAPTURE(dtype_name(dtype));
      CAPTURE(budget);
      check_close("logps vs oracle", r.logps, want.logps, dtype == DType::kF32 ? 1e-6 : 1e-5);
      check_close("logps vs cpu", r.logps, c.logps, dtype == DType::kF32 ? 1e-6 : 1e-5);
      CHECK(r.tokens == want.tokens);
      CHECK(r.logps[2] == 0.0);
    }
  }
}

TEST_CASE("gpu: bad targets and empty sequences raise chunkloss::Error and write nothing") {
  if (!have_gpu()) return;
  PrefSpec s = gpu_spec();
  for (int kind : {0, 1}) {
    CAPTURE(kind);
    PrefData d(s);
    if (kind == 0) d.set_target(d.rows() - 1, s.v);
    if (kind == 1)
      for (std::int64_t j = 0; j < s.t; ++j) d.set_target(4 * s.t + j, s.ignore_index);
    for (Regime r : kRegimes) {
      DpoOptions o;
      o.engine.regime = r;
      const PrefGradBuffers pristine(d, {}, 3.25f);
      for (bool accumulate : {false, true}) {
        std::string what;
        const PrefRun run = run_gpu(d, Dpo(o), pristine, accumulate, false, &what);
        CHECK_MESSAGE(what.find("targets") != std::string::npos,
                      "expected chunkloss::Error naming targets, got: " << what);
        CHECK_MESSAGE(run.grads.bitwise_equal(pristine), "a failed call wrote into the gradients");
      }
    }
  }
}

TEST_CASE("gpu: check_finite names the head's tensor and writes nothing") {
  if (!have_gpu()) return;
  PrefSpec s = gpu_spec();
  s.ref = RefMode::kHead;
  for (int where : {0, 1, 2}) {
    CAPTURE(where);
    PrefData d(s);
    std::vector<float>& x = where == 0 ? d.hidden : where == 1 ? d.weight : d.ref_hidden;
    x[x.size() / 2] = where == 1 ? std::numeric_limits<float>::infinity()
                                 : std::numeric_limits<float>::quiet_NaN();
    d.sync();
    const char* name = where == 0   ? "policy.hidden"
                       : where == 1 ? "policy.weight"
                                    : "reference.hidden";
    for (Regime r : kRegimes) {
      DpoOptions o;
      o.engine.regime = r;
      o.engine.check_finite = true;
      const PrefGradBuffers pristine(d, {}, 3.25f);
      std::string what;
      const PrefRun run = run_gpu(d, Dpo(o), pristine, false, false, &what);
      const bool named = what.find(std::string(name) + " ") != std::string::npos &&
                         what.find("has 1 non-finite values") != std::string::npos;
      CHECK_MESSAGE(named, "expected chunkloss::Error naming " << name << ", got: " << what);
      CHECK_MESSAGE(run.grads.bitwise_equal(pristine), "a failed call wrote into the gradients");
    }
  }
}

// Two ranks of an in-process group on one device, each with its part of the units (and of the
// KL batch), against the unsplit call on the device.
void check_gpu_split(const PrefData& d, const SequenceLoss& loss, const PrefGradRequest& g,
                     const DataSplit& split, bool reduced) {
  const PrefRun full = run_gpu(d, loss, g);
  std::vector<PrefData> parts;
  for (std::size_t r = 0; r < split.ranks(); ++r) parts.push_back(split.part(d, r));
  dist::InProcessGroup group(static_cast<int>(split.ranks()));
  const std::vector<PrefRun> runs = on_threads(split.ranks(), [&](std::size_t r) {
    try {
      return run_gpu(parts[r], loss,
                     PrefGradBuffers(parts[r], g, std::numeric_limits<float>::quiet_NaN()), false,
                     false, nullptr, &group.comm(static_cast<int>(r)));
    } catch (...) {  // a rank failing alone must not leave the others waiting
      group.abort();
      throw;
    }
  });
  // Other GEMM shapes may take other cuBLAS algorithms: fp32 rounding, and one bf16 rounding
  // of the gradients.
  const double grad_tol = g.dtype == DType::kF32 && d.spec.dtype == DType::kF32 ? 2e-5 : 4e-3;
  check_split_runs(d, full, runs, split, {2e-5, grad_tol}, reduced);
}

TEST_CASE("gpu: data parallel: two ranks on one device match the unsplit call") {
  if (!have_gpu()) return;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = gpu_spec();
    s.dtype = dtype;
    s.ref = RefMode::kHead;
    const PrefData d(s);
    const std::int64_t units = s.s / 2;
    const DataSplit split{{0, units / 3, units}, {}};
    PrefGradRequest g;
    g.dtype = dtype;
    for (Regime r : {Regime::kResident, Regime::kRecompute, Regime::kDeferred}) {
      INFO("dtype=", dtype_name(dtype), " regime=", regime_name(r));
      DpoOptions o;
      o.engine.regime = r;
      PrefGradRequest gr = g;
      gr.bias = r != Regime::kDeferred;  // the deferred regime takes no bias gradient
      check_gpu_split(d, Dpo(o), gr, split, false);
      // Summed in the call, through the fp32 accumulator (the unsplit call too).
      o.engine.fp32_weight_grad_accumulator = true;
      o.engine.reduce_weight_grad_over_data_group = true;
      check_gpu_split(d, Dpo(o), gr, split, true);
    }
    CpoOptions cpo;
    cpo.alpha = 0.5f;
    PrefSpec cs = s;
    cs.ref = RefMode::kNone;
    check_gpu_split(PrefData(cs), Cpo(cpo), g, split, false);
    PrefSpec ks = s;
    ks.s = 9;
    ks.labels = true;
    ks.kl_batch = true;
    ks.kl_ref = RefMode::kLogps;
    check_gpu_split(PrefData(ks), Kto(KtoOptions{}), g, DataSplit{{0, 4, 9}, {0, 1, ks.kl_s}},
                    false);
  }
}

TEST_CASE("gpu: data parallel: a bad target on one rank makes both ranks throw") {
  if (!have_gpu()) return;
  const PrefData d(gpu_spec());
  const DataSplit split{{0, 1, 3}, {}};
  std::vector<PrefData> parts = {split.part(d, 0), split.part(d, 1)};
  parts[1].set_target(parts[1].rows() - 1, d.spec.v);
  dist::InProcessGroup group(2);
  const std::vector<std::string> e = on_threads(2, [&](std::size_t r) {
    const PrefGradBuffers pristine(parts[r], {}, 3.25f);
    std::string what;
    const PrefRun run = run_gpu(parts[r], Dpo(DpoOptions{}), pristine, false, false, &what,
                                &group.comm(static_cast<int>(r)));
    CHECK_MESSAGE(run.grads.bitwise_equal(pristine), "a failed call wrote into the gradients");
    return what;
  });
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("1 rank(s) of data_group rejected their calls") != std::string::npos);
  CHECK(e[1].find("targets") != std::string::npos);
}

// NCCL reduces device memory only: the sums go through the workspace. With one rank the results
// are the call's alone, bit for bit. (Not under memcheck with API errors reported: NCCL's
// initialisation probes kernel images it does not have.)
TEST_CASE("gpu: NCCL data group of one rank: the sums go through the device") {
  if (!have_gpu()) return;
  auto comms = dist::NcclCommunicator::create_all({0});
  PrefSpec ks = gpu_spec();
  ks.s = 9;
  ks.labels = true;
  ks.kl_batch = true;
  const PrefData kd(ks);
  KtoOptions o;
  o.engine.fp32_weight_grad_accumulator = true;
  o.engine.reduce_weight_grad_over_data_group = true;
  const PrefGradBuffers start(kd, {}, std::numeric_limits<float>::quiet_NaN());
  const PrefRun alone = run_gpu(kd, Kto(o), start);
  const PrefRun nccl = run_gpu(kd, Kto(o), start, false, false, nullptr, comms[0].get());
  CHECK(runs_bitwise_equal(alone, nccl));
}

// The heads split over `vocab` ranks of an in-process group on one device (rank r holding rows
// [V r / K, V (r + 1) / K)), against the unsplit call on the device: every rank's loss, metrics,
// per-sequence vectors and dH, and its shard's dW and db rows.
void check_gpu_vocab_split(const PrefData& d, const SequenceLoss& loss, const PrefGradRequest& g,
                           int vocab) {
  const PrefRun full = run_gpu(d, loss, g);
  std::vector<ShardRun> runs;
  for (int r = 0; r < vocab; ++r)
    runs.emplace_back(d, d.spec.v * r / vocab, d.spec.v * (r + 1) / vocab, g);
  dist::InProcessGroup group(vocab);
  on_threads(runs.size(), [&](std::size_t r) {
    ShardRun& run = runs[r];
    try {
      DeviceInputs di(run.inputs(d), false);
      di.in.vocab_shard = {&group.comm(static_cast<int>(r)), run.v0, d.spec.v};
      PreferenceGrads host = run.grads.views_as<PreferenceGrads>(false);
      DeviceCopies gmem;
      PreferenceGrads dev;
      dev.hidden = gmem.put(host.hidden);
      dev.weight = gmem.put(host.weight);
      dev.bias = gmem.put(host.bias);
      const std::size_t bytes = loss.workspace_bytes(di.in, dev);
      gpu::DeviceBuffer ws(std::max<std::size_t>(bytes, 256));
      gpu::Context ctx(0);
      const Workspace w(ws.data(), bytes, Device::kCuda);
      run.result =
          dev.any() ? loss.forward_backward(ctx, di.in, dev, w) : loss.forward(ctx, di.in, w);
      for (auto [hv, dv] : {std::pair{host.hidden, dev.hidden}, std::pair{host.weight, dev.weight},
                            std::pair{host.bias, dev.bias}})
        if (hv.defined()) gpu::copy_to_host(hv.data(), dv.data(), hv.nbytes());
    } catch (...) {  // a rank failing alone must not leave the others waiting
      group.abort();
      throw;
    }
    return 0;
  });
  const double tol = g.dtype == DType::kF32 && d.spec.dtype == DType::kF32 ? 2e-5 : 4e-3;
  const std::int64_t h = d.spec.h;
  const std::vector<double> full_w = full.grads.weight(), full_b = full.grads.bias();
  for (const ShardRun& run : runs) {
    CAPTURE(run.v0);
    check_scalar("loss", run.result.loss, full.result.loss, 2e-5);
    check_scalar("kl", run.result.kl, full.result.kl, 2e-5);
    REQUIRE(run.result.metrics.size() == full.result.metrics.size());
    for (std::size_t m = 0; m < run.result.metrics.size(); ++m)
      check_scalar("metric " + run.result.metrics[m].first, run.result.metrics[m].second,
                   full.result.metrics[m].second, 2e-5);
    check_close("logps", run.result.logps, full.result.logps, 2e-5);
    check_close("rewards", run.result.rewards, full.result.rewards, 2e-5);
    if (run.grads.has_hidden())
      check_close("grad_hidden", run.grads.hidden(), full.grads.hidden(), tol);
    if (run.grads.has_weight())
      check_close("grad_weight rows", run.grads.weight(),
                  {full_w.begin() + run.v0 * h, full_w.begin() + run.v1 * h}, tol);
    if (run.grads.has_bias())
      check_close("grad_bias rows", run.grads.bias(),
                  {full_b.begin() + run.v0, full_b.begin() + run.v1}, tol);
  }
}

TEST_CASE("gpu: vocab parallel: two ranks on one device match the unsplit call") {
  if (!have_gpu()) return;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = gpu_spec();  // V = 1031: shards of 515 and 516 rows
    s.dtype = dtype;
    const PrefData d(s);
    PrefGradRequest g;
    g.dtype = dtype;
    for (Regime r : kRegimes) {
      INFO("dtype=", dtype_name(dtype), " regime=", regime_name(r));
      DpoOptions o;
      o.engine.regime = r;
      check_gpu_vocab_split(d, Dpo(o), g, 2);
      OrpoOptions orpo;
      orpo.engine.regime = r;
      PrefSpec os = s;
      os.ref = RefMode::kNone;
      check_gpu_vocab_split(PrefData(os), Orpo(orpo), g, 2);
    }
    PrefSpec ks = s;
    ks.s = 9;
    ks.labels = true;
    ks.kl_batch = true;
    check_gpu_vocab_split(PrefData(ks), Kto(KtoOptions{}), g, 2);
    // Shards of 291 and 292 rows, where the bf16 row-scale staging fits one rank's logits tile
    // and not the other's (so neither stages in the tile); KTO's dW GEMMs mix mantissas.
    ks.v = 583;
    check_gpu_vocab_split(PrefData(ks), Kto(KtoOptions{}), g, 2);
  }
}

// SequenceLogProbs of `d`'s policy head split over two ranks of an in-process group on one
// device (with `nan1`, a NaN in rank 1's weight): each rank's result, or its chunkloss::Error
// in `errors`.
std::vector<SequenceLogProbResult> gpu_log_probs_split(const PrefData& d, const SequenceOptions& o,
                                                       std::vector<std::string>& errors,
                                                       bool nan1 = false) {
  std::vector<ShardRun> runs;
  for (int r = 0; r < 2; ++r)
    runs.emplace_back(d, d.spec.v * r / 2, d.spec.v * (r + 1) / 2, PrefGradRequest::none());
  if (nan1) {
    runs[1].w[5] = std::numeric_limits<float>::quiet_NaN();
    runs[1].wb[5] = BFloat16(std::numeric_limits<float>::quiet_NaN());
  }
  dist::InProcessGroup group(2);
  errors.assign(2, "");
  return on_threads(runs.size(), [&](std::size_t r) {
    const SequenceLogProbs lp(o);
    DeviceCopies mem;
    const PreferenceInputs host = runs[r].inputs(d);
    const Head head = mem.put(host.policy);
    const TensorView y = mem.put(host.targets);
    const VocabShard shard{&group.comm(static_cast<int>(r)), runs[r].v0, d.spec.v};
    try {
      const std::size_t bytes = lp.workspace_bytes(head, y, shard);
      gpu::DeviceBuffer ws(bytes);
      gpu::Context ctx(0);
      return lp.compute(ctx, head, y, Workspace(ws.data(), bytes, Device::kCuda), shard);
    } catch (const Error& e) {
      errors[r] = e.what();
    } catch (...) {  // a rank failing alone must not leave the other waiting
      group.abort();
      throw;
    }
    return SequenceLogProbResult{};
  });
}

TEST_CASE("gpu: vocab parallel: SequenceLogProbs over two ranks matches the unsplit call") {
  if (!have_gpu()) return;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    PrefSpec s = gpu_spec();  // V = 1031: shards of 515 and 516 rows
    s.dtype = dtype;
    PrefData d(s);
    for (std::int64_t j = 0; j < s.t; ++j) d.set_target(2 * s.t + j, s.ignore_index);
    for (std::size_t budget : {std::size_t{0}, std::size_t{1} << 20}) {
      CAPTURE(dtype_name(dtype));
      CAPTURE(budget);
      SequenceOptions o;
      o.memory_budget_bytes = budget;
      const auto want = gpu_log_probs(d, o);
      std::vector<std::string> errors;
      const auto got = gpu_log_probs_split(d, o, errors);
      for (std::size_t r = 0; r < got.size(); ++r) {
        CHECK(errors[r].empty());
        check_close("logps", got[r].logps, want.logps, dtype == DType::kF32 ? 1e-6 : 1e-5);
        CHECK(got[r].tokens == want.tokens);
        CHECK(got[r].logps[2] == 0.0);
        CHECK(got[r].logps == got[0].logps);
      }
    }
  }
  // check_finite: a NaN in one rank's shard makes both ranks throw.
  SequenceOptions checked;
  checked.check_finite = true;
  std::vector<std::string> e;
  gpu_log_probs_split(PrefData(gpu_spec()), checked, e, true);
  INFO(e[0], " | ", e[1]);
  CHECK(e[0].find("1 rank(s) of vocab_shard.group rejected their calls") != std::string::npos);
  CHECK(e[1].find("head.weight") != std::string::npos);
}

TEST_CASE("gpu: vocab parallel: a rank's too-small or host workspace makes every rank throw") {
  if (!have_gpu()) return;
  // The ranks exchange through each context's scratch memory, not the workspace, so a rank
  // whose workspace is wrong still takes part in the first exchange: it throws its own error and
  // the other rank says that one rank rejected its call, instead of waiting for it.
  const PrefData d(gpu_spec());
  std::vector<ShardRun> runs;
  for (int r = 0; r < 2; ++r)
    runs.emplace_back(d, d.spec.v * r / 2, d.spec.v * (r + 1) / 2, PrefGradRequest::none());
  dist::InProcessGroup group(2);
  const auto errors = on_threads(2, [&](std::size_t r) {
    DeviceInputs di(runs[r].inputs(d), false);
    di.in.vocab_shard = {&group.comm(static_cast<int>(r)), runs[r].v0, d.spec.v};
    const Dpo dpo;
    const SequenceLogProbs lp;
    const std::size_t need =
        std::max(dpo.workspace_bytes(di.in),
                 lp.workspace_bytes(di.in.policy, di.in.targets, di.in.vocab_shard));
    gpu::DeviceBuffer ws(need);
    const std::size_t small = r == 0 ? 160 : need;  // rank 0's workspace is too small
    gpu::Context ctx(0);
    std::array<std::string, 3> e;
    try {
      dpo.forward(ctx, di.in, Workspace(ws.data(), small, Device::kCuda));
    } catch (const Error& x) {
      e[0] = x.what();
    }
    try {
      lp.compute(ctx, di.in.policy, di.in.targets, Workspace(ws.data(), small, Device::kCuda),
                 di.in.vocab_shard);
    } catch (const Error& x) {
      e[1] = x.what();
    }
    const AlignedBuffer hws(need);  // rank 0's workspace is in host memory
    try {
      dpo.forward(ctx, di.in, r == 0 ? hws.workspace() : Workspace(ws.data(), need, Device::kCuda));
    } catch (const Error& x) {
      e[2] = x.what();
    }
    return e;
  });
  INFO(errors[0][0], " | ", errors[0][1], " | ", errors[0][2]);
  INFO(errors[1][0], " | ", errors[1][1], " | ", errors[1][2]);
  CHECK(errors[0][0].find("workspace of 160 bytes is too small") != std::string::npos);
  CHECK(errors[0][1].find("workspace of 160 bytes is too small") != std::string::npos);
  CHECK(errors[0][2].find("workspace is on cpu, the context on cuda") != std::string::npos);
  for (const std::string& e : errors[1])
    CHECK(e.find("1 rank(s) of vocab_shard.group rejected their calls") != std::string::npos);
}

}  // namespace
}  // namespace chunkloss::test
