// Cross-entropy on the CPU: LinearCrossEntropy fwd+bwd against the three bare Eigen GEMMs at
// full size (logits, dX, dW) and against a naive computation that materialises the [N, V]
// logits, all in this process on the same threads and the same (bf16-rounded) input values.
#include <omp.h>

#include <chunkloss/core/context.h>
#include <chunkloss/core/error.h>
#include <chunkloss/core/workspace.h>
#include <chunkloss/losses/cross_entropy.h>
#include <Eigen/Core>

#include <algorithm>
#include <cmath>

#include "bench.h"
#include "ce_loss.h"
#include "host_util.h"

namespace chunkloss::bench {
namespace {

constexpr std::int64_t kIgnoreIndex = -100;

using MatMap = Eigen::Map<RowMat<float>>;
using CMatMap = Eigen::Map<const RowMat<float>>;

// The naive computation in precision S (fp32, timed; double for --exact): logits [N, V] = X W^T
// materialised, row softmax (max-shifted, Eigen's vectorised exp), the mean loss summed in
// double, the gradient written over the logits (ignored rows zero), then dX = G W and
// dW = G^T X.
template <typename S>
struct Naive {
  Naive(const S* x_, const S* w_, const std::vector<std::int64_t>& y_, std::int64_t h_,
        std::int64_t v_, std::int64_t valid_, int threads_)
      : n(static_cast<std::int64_t>(y_.size())),
        h(h_),
        v(v_),
        valid(valid_),
        threads(threads_),
        x(x_, n, h),
        w(w_, v, h),
        y(y_.data()),
        lse(y_.size()),
        zy(y_.size()),
        coef(y_.size()) {
    const auto inv = static_cast<S>(valid > 0 ? 1.0 / static_cast<double>(valid) : 0.0);
    for (std::size_t t = 0; t < y_.size(); ++t) coef[t] = y_[t] == kIgnoreIndex ? S(0) : inv;
  }

  double run(S* z_buf, S* dx, S* dw) {
    Eigen::Map<RowMat<S>> z(z_buf, n, v);
    z.noalias() = x * w.transpose();
    dense_row_stats(z_buf, n, v, y, kIgnoreIndex, lse.data(), zy.data(), threads);
    double loss = 0;
    for (std::int64_t t = 0; t < n; ++t)
      loss +=
          static_cast<double>(lse[static_cast<std::size_t>(t)] - zy[static_cast<std::size_t>(t)]);
    dense_softmax_grad(z_buf, n, v, y, kIgnoreIndex, lse.data(), coef.data(), threads);
    Eigen::Map<RowMat<S>>(dx, n, h).noalias() = z * w;
    Eigen::Map<RowMat<S>>(dw, v, h).noalias() = z.transpose() * x;
    return valid > 0 ? loss / static_cast<double>(valid) : 0.0;
  }

  std::int64_t n, h, v, valid;
  int threads;
  Eigen::Map<const RowMat<S>> x, w;
  const std::int64_t* y;
  std::vector<S> lse, zy, coef;
};

}  // namespace

CaseResult run_ce_cpu(const CaseConfig& c, BenchDevice& dev) {
  CaseResult res;
  res.device_desc = dev.describe();
  res.load_before = loadavg();
  const std::int64_t n = c.rows, h = c.hidden, v = c.vocab;
  const int threads = c.threads;
  const bool bf16 = c.dtype == DType::kBF16;
  CHUNKLOSS_CHECK(c.dtype == DType::kF32 || bf16, "bench: --dtype must be f32 or bf16");
  omp_set_num_threads(threads);  // the library and the floor GEMMs alike

  // Inputs: hidden ~ N(0, 1), weight ~ N(0, 1/H) so the logits are O(1); targets as ce_targets.
  // For bf16 the library gets the bf16 values; the floor and the naive use them widened to fp32.
  HostBuffer x32(static_cast<std::size_t>(n * h) * 4), w32(static_cast<std::size_t>(v * h) * 4);
  fill_normal(x32.as<float>(), n * h, 1.0f, c.seed * 2, threads);
  fill_normal(w32.as<float>(), v * h, 1.0f / std::sqrt(static_cast<float>(h)), c.seed * 2 + 1,
              threads);
  const std::size_t es = dtype_size(c.dtype);
  HostBuffer xb(bf16 ? static_cast<std::size_t>(n * h) * 2 : 0),
      wb(bf16 ? static_cast<std::size_t>(v * h) * 2 : 0);
  if (bf16) {
    round_to_bf16(x32.as<float>(), xb.as<BFloat16>(), n * h, threads);
    round_to_bf16(w32.as<float>(), wb.as<BFloat16>(), v * h, threads);
  }
  const std::vector<std::int64_t> y = ce_targets(c, res);
  const std::int64_t valid = res.valid_rows;
  const CMatMap xm(x32.as<float>(), n, h), wm(w32.as<float>(), v, h);
  res.inputs = "hidden ~ N(0, 1), weight ~ N(0, 1/H), targets uniform in [0, V)";

  // The library's operands and gradient buffers (zeroed, so their pages are resident).
  HostBuffer dx(static_cast<std::size_t>(n * h) * es), dw(static_cast<std::size_t>(v * h) * es);
  dx.zero();
  dw.zero();
  const CeLoss ce(c);
  CrossEntropyInputs in;
  in.hidden = TensorView(bf16 ? xb.as<void>() : x32.as<void>(), c.dtype, {n, h});
  in.weight = TensorView(bf16 ? wb.as<void>() : w32.as<void>(), c.dtype, {v, h});
  in.targets = TensorView::of(y.data(), {n});
  CrossEntropyGrads gr;
  gr.hidden = TensorView(dx.as<void>(), c.dtype, {n, h});
  gr.weight = TensorView(dw.as<void>(), c.dtype, {v, h});
  res.plan = ce.plan(in, gr);
  res.workspace_bytes = res.plan.workspace_bytes();
  CpuContext ctx(threads);

  // The floor's buffers: the [N, V] logits (also the gradient operand), dX [N, H], dW [V, H].
  HostBuffer fz(static_cast<std::size_t>(n * v) * 4), fdx(static_cast<std::size_t>(n * h) * 4),
      fdw(static_cast<std::size_t>(v * h) * 4);
  MatMap fzm(fz.as<float>(), n, v), fdxm(fdx.as<float>(), n, h), fdwm(fdw.as<float>(), v, h);
  auto gemm_logits = [&] { fzm.noalias() = xm * wm.transpose(); };
  auto gemm_dx = [&] { fdxm.noalias() = fzm * wm; };
  auto gemm_dw = [&] { fdwm.noalias() = fzm.transpose() * xm; };
  // With prompts (ce_seq_len): the three GEMMs over as many rows as are valid, the work left when
  // the ignored rows are skipped.
  auto valid_floor = [&] {
    MatMap zv(fz.as<float>(), valid, v);
    zv.noalias() = xm.topRows(valid) * wm.transpose();
    fdxm.topRows(valid).noalias() = zv * wm;
    fdwm.noalias() = zv.transpose() * xm.topRows(valid);
  };
  const bool do_valid = c.ce_seq_len > 0;
  // The same three GEMMs over the plan's token chunks (dW accumulated chunk by chunk).
  const std::int64_t chunk = res.plan.chunk_rows;
  auto chunked_floor = [&] {
    for (std::int64_t r0 = 0; r0 < n; r0 += chunk) {
      const std::int64_t rows = std::min(n, r0 + chunk) - r0;
      MatMap zc(fz.as<float>(), rows, v);
      zc.noalias() = xm.middleRows(r0, rows) * wm.transpose();
      fdxm.middleRows(r0, rows).noalias() = zc * wm;
      if (r0 == 0)
        fdwm.noalias() = zc.transpose() * xm.middleRows(r0, rows);
      else
        fdwm.noalias() += zc.transpose() * xm.middleRows(r0, rows);
    }
  };
  const bool do_chunked = c.chunked_floor && res.plan.order == LoopOrder::kTokenChunk;
  res.floor_what =
      "3 Eigen fp32 GEMMs at full size: logits [N, V] = X W^T, dX [N, H] = G W, "
      "dW [V, H] = G^T X (G: the logits buffer)";

  // The naive computation's gradients (fp32, resident before its memory window).
  HostBuffer ndx(c.naive ? static_cast<std::size_t>(n * h) * 4 : 0),
      ndw(c.naive ? static_cast<std::size_t>(v * h) * 4 : 0);
  ndx.zero();
  ndw.zero();
  Naive<float> naive(x32.as<float>(), w32.as<float>(), y, h, v, valid, threads);
  std::unique_ptr<HostBuffer> nz;

  // Warm-up runs; the floor's, the first library call's and the first naive run's are the memory
  // windows (the GEMM library's own temporaries show in every one of them).
  fz.zero();
  fdx.zero();
  fdw.zero();
  dev.begin_peak();
  gemm_logits();
  gemm_dx();
  gemm_dw();
  res.floor_measured = dev.end_peak();
  if (do_chunked) chunked_floor();
  dev.begin_peak();
  HostBuffer ws_buf(res.workspace_bytes);
  const Workspace ws(ws_buf.as<void>(), ws_buf.bytes());
  res.loss_value = ce.forward_backward(ctx, in, gr, ws);
  res.extra_measured = dev.end_peak();
  if (c.naive) {
    dev.begin_peak();
    nz = std::make_unique<HostBuffer>(static_cast<std::size_t>(n * v) * 4);
    naive.run(nz->as<float>(), ndx.as<float>(), ndw.as<float>());
    res.naive_extra = dev.end_peak();
    res.naive_logits_bytes = nz->bytes();
  }

  // Timed rounds, interleaved so drift in the machine's load hits every variant alike.
  std::vector<double> t_logits, t_dx, t_dw, t_chunked, t_valid;
  double naive_loss = 0;
  for (int r = 0; r < c.repeats; ++r) {
    t_logits.push_back(dev.time_ms(gemm_logits));
    t_dx.push_back(dev.time_ms(gemm_dx));
    t_dw.push_back(dev.time_ms(gemm_dw));
    res.floor_times_ms.push_back(t_logits.back() + t_dx.back() + t_dw.back());
    if (do_chunked) t_chunked.push_back(dev.time_ms(chunked_floor));
    if (do_valid) t_valid.push_back(dev.time_ms(valid_floor));
    double loss = 0;
    res.times_ms.push_back(dev.time_ms([&] { loss = ce.forward_backward(ctx, in, gr, ws); }));
    res.loss_repeatable = res.loss_repeatable && loss == res.loss_value;
    if (c.naive)
      res.naive_times_ms.push_back(dev.time_ms(
          [&] { naive_loss = naive.run(nz->as<float>(), ndx.as<float>(), ndw.as<float>()); }));
  }
  res.time_ms = median(res.times_ms);
  res.floor_ms = median(res.floor_times_ms);
  res.ratio = res.time_ms / res.floor_ms;
  res.gemm_ms = {
      {"logits", median(t_logits)}, {"grad_hidden", median(t_dx)}, {"grad_weight", median(t_dw)}};
  if (do_chunked) res.chunked_floor_ms = median(t_chunked);
  if (do_valid) res.valid_floor_ms = median(t_valid);

  if (c.naive) {
    res.naive_ms = median(res.naive_times_ms);
    res.naive_loss_value = naive_loss;
    res.err_loss = scalar_rel_err(res.loss_value, naive_loss);
    const float* rx = ndx.as<float>();
    const float* rw = ndw.as<float>();
    res.err_grad_hidden = bf16 ? rel_norm_err(dx.as<BFloat16>(), rx, n * h, threads)
                               : rel_norm_err(dx.as<float>(), rx, n * h, threads);
    res.err_grad_weight = bf16 ? rel_norm_err(dw.as<BFloat16>(), rw, v * h, threads)
                               : rel_norm_err(dw.as<float>(), rw, v * h, threads);
    res.max_rel_err_vs_naive =
        worst_error({*res.err_loss, *res.err_grad_hidden, *res.err_grad_weight});
    if (bf16)
      res.bf16_storage_err =
          std::max(bf16_storage_err(rx, n * h, threads), bf16_storage_err(rw, v * h, threads));
    res.reference =
        "naive fp32: Eigen GEMM logits [N, V] materialised, fp32 softmax and gradient, loss "
        "summed in double, two Eigen fp32 gradient GEMMs";
    if (bf16) res.reference += ", on the bf16 input values widened to fp32";
  }
  if (c.exact) {
    // The same computation in float64 on the same input values (untimed).
    std::vector<double> xd(static_cast<std::size_t>(n * h)), wd(static_cast<std::size_t>(v * h)),
        zd(static_cast<std::size_t>(n * v)), dxd(xd.size()), dwd(wd.size());
    widen_to_double(x32.as<float>(), xd.data(), n * h, threads);
    widen_to_double(w32.as<float>(), wd.data(), v * h, threads);
    const double l64 = Naive<double>(xd.data(), wd.data(), y, h, v, valid, threads)
                           .run(zd.data(), dxd.data(), dwd.data());
    res.f64_err_loss = scalar_rel_err(res.loss_value, l64);
    res.f64_err_grad_hidden = bf16 ? rel_norm_err(dx.as<BFloat16>(), dxd.data(), n * h, threads)
                                   : rel_norm_err(dx.as<float>(), dxd.data(), n * h, threads);
    res.f64_err_grad_weight = bf16 ? rel_norm_err(dw.as<BFloat16>(), dwd.data(), v * h, threads)
                                   : rel_norm_err(dw.as<float>(), dwd.data(), v * h, threads);
  }
  res.load_after = loadavg();
  return res;
}

}  // namespace chunkloss::bench
