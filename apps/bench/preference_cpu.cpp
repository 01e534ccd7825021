// The preference losses on the CPU: a SequenceLoss fwd+bwd (gradients for the policy's hidden and
// weight) against the bare Eigen GEMMs it cannot avoid at full size (policy logits, reference
// logits when a reference head is run, dX, dW) and against a naive computation that materialises
// the [N, V] logits, all in this process on the same threads and the same input values.
#include <omp.h>

#include <chunkloss/core/context.h>
#include <chunkloss/core/error.h>
#include <chunkloss/core/workspace.h>
#include <chunkloss/losses/sequence.h>
#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <memory>

#include "bench.h"
#include "host_util.h"
#include "preference_case.h"

namespace chunkloss::bench {
namespace {

constexpr float kReferenceNoise = 0.1f;  // reference = policy + this much relative noise

// The naive computation in precision S (float: the baseline; double: the float64 check):
// reference logits [N, V] materialised (when a reference head is given) and reduced to
// per-sequence log-probs, then the policy's, the sequence-level math, the softmax gradient
// written over the policy logits, then dX = G W and dW = G^T X.
template <typename S>
struct NaivePreference {
  const CaseConfig& c;
  const SequenceLoss& loss;
  const PreferenceBatch& b;
  const S *x, *w, *xr, *wr;                   // xr, wr: null without a reference head
  const std::vector<double>* given_ref_logp;  // --reference logps
  std::int64_t h, v;
  int threads;
  std::vector<S> lse, zy;
  std::string how;

  double run(S* z_buf, S* dx, S* dw) {
    using Map = Eigen::Map<RowMat<S>>;
    using CMap = Eigen::Map<const RowMat<S>>;
    const std::int64_t n = b.rows;
    Map z(z_buf, n, v);
    lse.resize(static_cast<std::size_t>(n));
    zy.resize(static_cast<std::size_t>(n));
    const auto stats = [&] {
      dense_row_stats(z_buf, n, v, b.targets.data(), kPreferenceIgnoreIndex, lse.data(), zy.data(),
                      threads);
      return sequence_log_probs(b, lse.data(), zy.data());
    };
    std::vector<double> ref(static_cast<std::size_t>(b.sequences), 0.0);
    if (xr) {
      z.noalias() = CMap(xr, n, h) * CMap(wr, v, h).transpose();
      ref = stats();
    } else if (given_ref_logp) {
      ref = *given_ref_logp;
    }
    const CMap xm(x, n, h), wm(w, v, h);
    z.noalias() = xm * wm.transpose();
    const std::vector<double> logp = stats();
    const NaiveSequenceResult r = naive_sequence_objective(c, loss, b, logp, ref);
    const std::vector<S> coef = row_coefficients<S>(b, r.coef);
    dense_softmax_grad(z_buf, n, v, b.targets.data(), kPreferenceIgnoreIndex, lse.data(),
                       coef.data(), threads);
    Map(dx, n, h).noalias() = z * wm;
    Map(dw, v, h).noalias() = z.transpose() * xm;
    how = r.how;
    return r.loss;
  }
};

// dst = base + N(0, (noise * stddev)^2), the reference head's operand near the policy's.
void fill_perturbed(float* dst, const float* base, std::int64_t n, float stddev, std::uint64_t seed,
                    int threads) {
  fill_normal(dst, n, kReferenceNoise * stddev, seed, threads);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) dst[i] += base[i];
}

}  // namespace

CaseResult run_preference_cpu(const CaseConfig& c, BenchDevice& dev) {
  CaseResult res;
  res.device_desc = dev.describe();
  res.load_before = loadavg();
  const std::int64_t h = c.hidden, v = c.vocab;
  const int threads = c.threads;
  const bool bf16 = c.dtype == DType::kBF16;
  CHUNKLOSS_CHECK(c.dtype == DType::kF32 || bf16, "bench: --dtype must be f32 or bf16");
  omp_set_num_threads(threads);  // the library and the floor GEMMs alike
  const PreferenceBatch b = make_preference_batch(c, v);
  const std::int64_t n = b.rows, s = b.sequences, t = b.seq_len;
  const bool ref_head = c.reference == "head", ref_logps = c.reference == "logps";
  const bool ref_operands = ref_head || ref_logps;

  // Inputs: hidden ~ N(0, 1), weight ~ N(0, 1/H); the reference head is the policy's operands
  // perturbed by 10% noise. For bf16 the library gets the bf16 values; the floor and the naive
  // use them widened to fp32.
  const auto nh = static_cast<std::size_t>(n * h), vh = static_cast<std::size_t>(v * h);
  const float wstd = 1.0f / std::sqrt(static_cast<float>(h));
  HostBuffer x32(nh * 4), w32(vh * 4), xr32(ref_operands ? nh * 4 : 0),
      wr32(ref_operands ? vh * 4 : 0);
  fill_normal(x32.as<float>(), n * h, 1.0f, c.seed * 2, threads);
  fill_normal(w32.as<float>(), v * h, wstd, c.seed * 2 + 1, threads);
  if (ref_operands) {
    fill_perturbed(xr32.as<float>(), x32.as<float>(), n * h, 1.0f, c.seed * 2 + 2, threads);
    fill_perturbed(wr32.as<float>(), w32.as<float>(), v * h, wstd, c.seed * 2 + 3, threads);
  }
  HostBuffer xb(bf16 ? nh * 2 : 0), wb(bf16 ? vh * 2 : 0), xrb(bf16 && ref_operands ? nh * 2 : 0),
      wrb(bf16 && ref_operands ? vh * 2 : 0);
  if (bf16) {
    round_to_bf16(x32.as<float>(), xb.as<BFloat16>(), n * h, threads);
    round_to_bf16(w32.as<float>(), wb.as<BFloat16>(), v * h, threads);
    if (ref_operands) {
      round_to_bf16(xr32.as<float>(), xrb.as<BFloat16>(), n * h, threads);
      round_to_bf16(wr32.as<float>(), wrb.as<BFloat16>(), v * h, threads);
    }
  }
  const auto lib_view = [&](const HostBuffer& f32, const HostBuffer& b16, std::int64_t rows) {
    return TensorView(bf16 ? b16.as<void>() : f32.as<void>(), c.dtype, {rows, h});
  };
  res.inputs =
      "hidden ~ N(0, 1), weight ~ N(0, 1/H), targets uniform in [0, V); reference head (when "
      "used) = the policy's hidden and weight plus 10% Gaussian noise";

  // The library's operands and gradient buffers (zeroed, so their pages are resident).
  const std::size_t es = dtype_size(c.dtype);
  HostBuffer dx(nh * es), dw(vh * es);
  dx.zero();
  dw.zero();
  const SequenceLoss loss = make_preference_loss(c);
  PreferenceInputs in;
  in.policy = {lib_view(x32, xb, n), lib_view(w32, wb, v), {}};
  in.targets = TensorView::of(b.targets.data(), {s, t});
  if (!b.paired) in.labels = TensorView::of(b.labels.data(), {s});
  if (ref_head) in.reference = {lib_view(xr32, xrb, n), lib_view(wr32, wrb, v), {}};
  CpuContext ctx(threads);
  std::vector<float> ref_lp32;
  std::vector<double> ref_lp;
  if (ref_logps) {
    // Precomputed reference log-probs (as a trainer would cache them), from the reference head.
    SequenceOptions o;
    o.memory_budget_bytes = c.budget_bytes;
    const SequenceLogProbs lp(o);
    const Head rh{lib_view(xr32, xrb, n), lib_view(wr32, wrb, v), {}};
    HostBuffer lp_ws(lp.workspace_bytes(rh, in.targets));
    const SequenceLogProbResult r =
        lp.compute(ctx, rh, in.targets, Workspace(lp_ws.as<void>(), lp_ws.bytes()));
    ref_lp32.assign(r.logps.begin(), r.logps.end());
    ref_lp.assign(ref_lp32.begin(), ref_lp32.end());
    in.reference_logps = TensorView::of(ref_lp32.data(), {s});
  }
  PreferenceGrads gr;
  gr.hidden = TensorView(dx.as<void>(), c.dtype, {n, h});
  gr.weight = TensorView(dw.as<void>(), c.dtype, {v, h});
  res.plan = loss.plan(in, gr);
  res.workspace_bytes = loss.workspace_bytes(in, gr);

  // The floor's buffers: the [N, V] logits (also the gradient operand), dX [N, H], dW [V, H].
  using Map = Eigen::Map<RowMat<float>>;
  using CMap = Eigen::Map<const RowMat<float>>;
  HostBuffer fz(static_cast<std::size_t>(n * v) * 4), fdx(nh * 4), fdw(vh * 4);
  const CMap xm(x32.as<float>(), n, h), wm(w32.as<float>(), v, h);
  Map fzm(fz.as<float>(), n, v), fdxm(fdx.as<float>(), n, h), fdwm(fdw.as<float>(), v, h);
  auto gemm_logits = [&] { fzm.noalias() = xm * wm.transpose(); };
  auto gemm_ref_logits = [&] {
    fzm.noalias() = CMap(xr32.as<float>(), n, h) * CMap(wr32.as<float>(), v, h).transpose();
  };
  auto gemm_dx = [&] { fdxm.noalias() = fzm * wm; };
  auto gemm_dw = [&] { fdwm.noalias() = fzm.transpose() * xm; };
  // The same GEMMs over the first valid-rows rows: the work left when prompt and padding rows
  // are skipped.
  const std::int64_t nv = b.valid_rows;
  auto valid_floor = [&] {
    fzm.topRows(nv).noalias() = xm.topRows(nv) * wm.transpose();
    if (ref_head)
      fzm.topRows(nv).noalias() =
          CMap(xr32.as<float>(), nv, h) * CMap(wr32.as<float>(), v, h).transpose();
    fdxm.topRows(nv).noalias() = fzm.topRows(nv) * wm;
    fdwm.noalias() = fzm.topRows(nv).transpose() * xm.topRows(nv);
  };
  res.floor_what = std::to_string(preference_floor_gemms(c)) +
                   " Eigen fp32 GEMMs at full size: logits [N, V] = X W^T" +
                   (ref_head ? ", reference logits [N, V] = X_ref W_ref^T" : "") +
                   ", dX [N, H] = G W, dW [V, H] = G^T X (G: the logits buffer)";

  // The naive computations' buffers (resident before their memory windows).
  HostBuffer ndx(c.naive ? nh * 4 : 0), ndw(c.naive ? vh * 4 : 0);
  ndx.zero();
  ndw.zero();
  NaivePreference<float> naive{c,
                               loss,
                               b,
                               x32.as<float>(),
                               w32.as<float>(),
                               ref_head ? xr32.as<float>() : nullptr,
                               ref_head ? wr32.as<float>() : nullptr,
                               ref_logps ? &ref_lp : nullptr,
                               h,
                               v,
                               threads,
                               {},
                               {},
                               {}};
  std::unique_ptr<HostBuffer> nz;

  // Warm-up runs; the floor's, the first library call's and the first naive run's are the memory
  // windows (the GEMM library's own temporaries show in every one of them).
  fz.zero();
  fdx.zero();
  fdw.zero();
  dev.begin_peak();
  gemm_logits();
  if (ref_head) gemm_ref_logits();
  gemm_dx();
  gemm_dw();
  res.floor_measured = dev.end_peak();
  dev.begin_peak();
  HostBuffer ws_buf(res.workspace_bytes);
  const Workspace ws(ws_buf.as<void>(), ws_buf.bytes());
  const PreferenceResult first = loss.forward_backward(ctx, in, gr, ws);
  res.extra_measured = dev.end_peak();
  res.loss_value = first.loss;
  describe_preference_case(c, b, first, res);
  if (c.naive) {
    dev.begin_peak();
    nz = std::make_unique<HostBuffer>(static_cast<std::size_t>(n * v) * 4);
    naive.run(nz->as<float>(), ndx.as<float>(), ndw.as<float>());
    res.naive_extra = dev.end_peak();
    res.naive_logits_bytes = nz->bytes();
  }

  // Timed rounds, interleaved so drift in the machine's load hits every variant alike.
  std::vector<double> t_logits, t_ref, t_dx, t_dw, t_valid;
  double naive_loss = 0;
  for (int r = 0; r < c.repeats; ++r) {
    t_logits.push_back(dev.time_ms(gemm_logits));
    if (ref_head) t_ref.push_back(dev.time_ms(gemm_ref_logits));
    t_dx.push_back(dev.time_ms(gemm_dx));
    t_dw.push_back(dev.time_ms(gemm_dw));
    res.floor_times_ms.push_back(t_logits.back() + (ref_head ? t_ref.back() : 0.0) + t_dx.back() +
                                 t_dw.back());
    t_valid.push_back(dev.time_ms(valid_floor));
    double l = 0;
    res.times_ms.push_back(dev.time_ms([&] { l = loss.forward_backward(ctx, in, gr, ws).loss; }));
    res.loss_repeatable = res.loss_repeatable && l == res.loss_value;
    if (c.naive)
      res.naive_times_ms.push_back(dev.time_ms(
          [&] { naive_loss = naive.run(nz->as<float>(), ndx.as<float>(), ndw.as<float>()); }));
  }
  res.time_ms = median(res.times_ms);
  res.floor_ms = median(res.floor_times_ms);
  res.ratio = res.time_ms / res.floor_ms;
  res.valid_floor_ms = median(t_valid);
  res.gemm_ms.emplace_back("logits", median(t_logits));
  if (ref_head) res.gemm_ms.emplace_back("ref_logits", median(t_ref));
  res.gemm_ms.emplace_back("grad_hidden", median(t_dx));
  res.gemm_ms.emplace_back("grad_weight", median(t_dw));

  const auto grad_err = [&](const auto* ref_dx, const auto* ref_dw, double& e_dx, double& e_dw) {
    e_dx = bf16 ? rel_norm_err(dx.as<BFloat16>(), ref_dx, n * h, threads)
                : rel_norm_err(dx.as<float>(), ref_dx, n * h, threads);
    e_dw = bf16 ? rel_norm_err(dw.as<BFloat16>(), ref_dw, v * h, threads)
                : rel_norm_err(dw.as<float>(), ref_dw, v * h, threads);
  };
  if (c.naive) {
    res.naive_ms = median(res.naive_times_ms);
    res.naive_loss_value = naive_loss;
    res.err_loss = scalar_rel_err(res.loss_value, naive_loss);
    double e_dx = 0, e_dw = 0;
    grad_err(ndx.as<float>(), ndw.as<float>(), e_dx, e_dw);
    res.err_grad_hidden = e_dx;
    res.err_grad_weight = e_dw;
    res.max_rel_err_vs_naive = worst_error({*res.err_loss, e_dx, e_dw});
    if (bf16)
      res.bf16_storage_err = std::max(bf16_storage_err(ndx.as<float>(), n * h, threads),
                                      bf16_storage_err(ndw.as<float>(), v * h, threads));
    res.reference = "naive fp32: Eigen GEMM logits [N, V] materialised" +
                    std::string(ref_head ? " (reference, then policy)" : "") +
                    ", fp32 row softmax, per-sequence sums in double, " + naive.how +
                    ", fp32 gradient over the logits, two Eigen fp32 gradient GEMMs";
    if (bf16) res.reference += ", on the bf16 input values widened to fp32";
  }
  if (c.exact) {
    // float64 on the same input values (untimed).
    std::vector<double> xd(nh), wd(vh), xrd(ref_head ? nh : 0), wrd(ref_head ? vh : 0), dxd(nh),
        dwd(vh), zd(static_cast<std::size_t>(n * v));
    widen_to_double(x32.as<float>(), xd.data(), n * h, threads);
    widen_to_double(w32.as<float>(), wd.data(), v * h, threads);
    if (ref_head) {
      widen_to_double(xr32.as<float>(), xrd.data(), n * h, threads);
      widen_to_double(wr32.as<float>(), wrd.data(), v * h, threads);
    }
    NaivePreference<double> exact{c,
                                  loss,
                                  b,
                                  xd.data(),
                                  wd.data(),
                                  ref_head ? xrd.data() : nullptr,
                                  ref_head ? wrd.data() : nullptr,
                                  ref_logps ? &ref_lp : nullptr,
                                  h,
                                  v,
                                  threads,
                                  {},
                                  {},
                                  {}};
    const double l64 = exact.run(zd.data(), dxd.data(), dwd.data());
    res.f64_err_loss = scalar_rel_err(res.loss_value, l64);
    double e_dx = 0, e_dw = 0;
    grad_err(dxd.data(), dwd.data(), e_dx, e_dw);
    res.f64_err_grad_hidden = e_dx;
    res.f64_err_grad_weight = e_dw;
  }
  res.load_after = loadavg();
  return res;
}

}  // namespace chunkloss::bench
