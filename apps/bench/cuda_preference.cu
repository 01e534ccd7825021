// The preference losses on CUDA: a SequenceLoss fwd+bwd (gradients for the policy's hidden and
// weight) timed with CUDA events against the bare cuBLAS GEMMs it cannot avoid at full size
// (policy logits, reference logits with a reference head, dX, dW) in the same process; memory from
// cudaMemGetInfo around the workspace and the first call; checked against a materialised
// fp32-logits computation and, with --exact, a float64 one on the same input values.
#include <chunkloss/core/error.h>
#include <chunkloss/gpu/context.h>
#include <chunkloss/losses/sequence.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <memory>
#include <type_traits>
#include <vector>

#include "bench.h"
#include "cuda_util.cuh"
#include "preference_case.h"

namespace chunkloss::bench {
namespace {

constexpr float kReferenceNoise = 0.1f;  // reference = policy + this much relative noise

// The materialised computation in the logits precision Z (float: the naive baseline; double:
// the float64 check): reference logits [N, V] (with a reference head) reduced to per-sequence
// log-probs on the host, then the policy's, the sequence-level math on the host, the softmax
// gradient written over the policy logits (rounded to bf16 into zg when given), then the two
// gradient GEMMs.
template <typename Z>
struct NaiveCuda {
  const CaseConfig& c;
  const SequenceLoss& loss;
  const PreferenceBatch& b;
  Gemms gm;  // gm.in: the operands' dtype
  cudaStream_t s;
  cublasComputeType_t compute;
  const void *x, *w, *xr, *wr;                // xr, wr: null without a reference head
  const std::vector<double>* given_ref_logp;  // --reference logps
  const int* y;
  Z* z;
  double *lse, *zy, *coef;  // device [N]
  __nv_bfloat16* zg;        // the gradient rounded to bf16 for the GEMMs (bf16 inputs), or null
  void *dx, *dw;
  cudaDataType_t out;  // dtype of dx and dw
  std::int64_t h, v;
  std::vector<double> host_lse, host_zy, host_coef;
  std::string how;

  static constexpr cudaDataType_t kZType = std::is_same_v<Z, double> ? CUDA_R_64F : CUDA_R_32F;

  std::vector<double> sequence_sums() {
    const std::int64_t n = b.rows;
    dense_rows(z, y, n, v, nullptr, nullptr, lse, zy, s);
    BENCH_CHECK(cudaStreamSynchronize(s));
    host_lse.resize(static_cast<std::size_t>(n));
    host_zy.resize(static_cast<std::size_t>(n));
    gpu::copy_to_host(host_lse.data(), lse, host_lse.size() * 8);
    gpu::copy_to_host(host_zy.data(), zy, host_zy.size() * 8);
    return sequence_log_probs(b, host_lse.data(), host_zy.data());
  }

  double run() {
    const auto n = static_cast<int>(b.rows), hi = static_cast<int>(h), vi = static_cast<int>(v);
    std::vector<double> ref(static_cast<std::size_t>(b.sequences), 0.0);
    if (xr) {
      gm.logits(xr, wr, z, n, hi, vi, kZType, compute);
      ref = sequence_sums();
    } else if (given_ref_logp) {
      ref = *given_ref_logp;
    }
    gm.logits(x, w, z, n, hi, vi, kZType, compute);
    const std::vector<double> logp = sequence_sums();
    const NaiveSequenceResult r = naive_sequence_objective(c, loss, b, logp, ref);
    host_coef = row_coefficients<double>(b, r.coef);
    BENCH_CHECK(
        cudaMemcpyAsync(coef, host_coef.data(), host_coef.size() * 8, cudaMemcpyHostToDevice, s));
    dense_rows(z, y, b.rows, v, lse, coef, nullptr, nullptr, s);
    const void* g = z;
    cudaDataType_t gt = kZType;
    if constexpr (std::is_same_v<Z, float>) {
      if (zg) {
        narrow(z, zg, static_cast<std::size_t>(b.rows * v), s);
        g = zg;
        gt = CUDA_R_16BF;
      }
    }
    gm.dx(g, w, dx, n, hi, vi, gt, gm.in, out, compute);
    gm.dw(g, x, dw, n, hi, vi, gt, gm.in, out, compute);
    BENCH_CHECK(cudaStreamSynchronize(s));  // host_coef stays alive until the copy is done
    how = r.how;
    return r.loss;
  }
};

}  // namespace

CaseResult run_preference_cuda(const CaseConfig& c, BenchDevice&) {
  require_cuda_devices(1);
  CaseResult res;
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  res.device_desc = prop.name;
  const std::int64_t h = c.hidden, v = c.vocab;
  const PreferenceBatch b = make_preference_batch(c, v);
  const std::int64_t n = b.rows, sq = b.sequences, t = b.seq_len;
  const DType dt = c.dtype;
  const bool bf16 = dt == DType::kBF16;
  CHUNKLOSS_CHECK(dt == DType::kF32 || bf16, "bench: --dtype must be f32 or bf16");
  const std::size_t es = dtype_size(dt);
  const cudaDataType_t ct = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const bool ref_head = c.reference == "head", ref_logps = c.reference == "logps";
  const bool ref_operands = ref_head || ref_logps;

  const std::size_t before_ctx = free_bytes();
  gpu::Context ctx(0);
  const std::size_t context_bytes = taken_since(before_ctx);
  auto s = static_cast<cudaStream_t>(ctx.stream());

  // Inputs, gradients, targets and labels (not counted as extra memory). The reference head is
  // the policy's operands plus 10% noise.
  const auto nh = static_cast<std::size_t>(n * h), vh = static_cast<std::size_t>(v * h);
  gpu::DeviceBuffer x(nh * es), w(vh * es), xr(ref_operands ? nh * es : 0),
      wr(ref_operands ? vh * es : 0), dx(nh * es), dw(vh * es), y(n * 4),
      labels(b.paired ? 0 : sq * 4), ref_lp_dev(ref_logps ? sq * 4 : 0);
  const RandomOperands ops = fill_operands(c, x.data(), w.data(), nh, vh, h, bf16, s);
  const float ref_wscale = kReferenceNoise * ops.weight_scale;
  if (ref_operands && bf16) {
    fill_random(xr.as<__nv_bfloat16>(), nh, kReferenceNoise, ops.seed + 2, s,
                x.as<__nv_bfloat16>());
    fill_random(wr.as<__nv_bfloat16>(), vh, ref_wscale, ops.seed + 3, s, w.as<__nv_bfloat16>());
  } else if (ref_operands) {
    fill_random(xr.as<float>(), nh, kReferenceNoise, ops.seed + 2, s, x.as<float>());
    fill_random(wr.as<float>(), vh, ref_wscale, ops.seed + 3, s, w.as<float>());
  }
  BENCH_CHECK(cudaStreamSynchronize(s));
  gpu::copy_to_device(y.data(), b.targets.data(), b.targets.size() * 4);
  if (!b.paired) gpu::copy_to_device(labels.data(), b.labels.data(), b.labels.size() * 4);
  res.inputs = ops.description +
               "; reference head (when used) = the policy's hidden and weight plus 10% noise";

  // The floor: the GEMMs at full size, gradient operand of the input dtype.
  Gemms gm{static_cast<cublasHandle_t>(ctx.cublas()), ct, ct};
  const auto ni = int(n), hi = int(h), vi = int(v);
  // (freed before the naive computation; allocated before the workspace, so not counted)
  auto z = std::make_unique<gpu::DeviceBuffer>(static_cast<std::size_t>(n * v) * es);
  auto logits = [&] {
    gm.logits(x.data(), w.data(), z->data(), ni, hi, vi, ct, CUBLAS_COMPUTE_32F);
  };
  auto ref_logits = [&] {
    gm.logits(xr.data(), wr.data(), z->data(), ni, hi, vi, ct, CUBLAS_COMPUTE_32F);
  };
  auto grad_x = [&] {
    gm.dx(z->data(), w.data(), dx.data(), ni, hi, vi, ct, ct, ct, CUBLAS_COMPUTE_32F);
  };
  auto grad_w = [&] {
    gm.dw(z->data(), x.data(), dw.data(), ni, hi, vi, ct, ct, ct, CUBLAS_COMPUTE_32F);
  };
  res.gemm_ms.emplace_back("logits", time_ms(s, c.repeats, logits));
  if (ref_head) res.gemm_ms.emplace_back("ref_logits", time_ms(s, c.repeats, ref_logits));
  res.gemm_ms.emplace_back("grad_hidden", time_ms(s, c.repeats, grad_x));
  res.gemm_ms.emplace_back("grad_weight", time_ms(s, c.repeats, grad_w));
  // The floor, its GEMMs over the valid rows only (the work left when prompt and padding rows
  // are skipped) and, with --phases, the forward-only call's floor (its logits GEMMs over the
  // valid rows): timed below in the library's rounds.
  const int nv = static_cast<int>(b.valid_rows);
  const auto valid_logits = [&] {
    gm.logits(x.data(), w.data(), z->data(), nv, hi, vi, ct, CUBLAS_COMPUTE_32F);
    if (ref_head) gm.logits(xr.data(), wr.data(), z->data(), nv, hi, vi, ct, CUBLAS_COMPUTE_32F);
  };
  std::vector<std::function<void()>> floors = {
      [&] {
        logits();
        if (ref_head) ref_logits();
        grad_x();
        grad_w();
      },
      [&] {
        valid_logits();
        gm.dx(z->data(), w.data(), dx.data(), nv, hi, vi, ct, ct, ct, CUBLAS_COMPUTE_32F);
        gm.dw(z->data(), x.data(), dw.data(), nv, hi, vi, ct, ct, ct, CUBLAS_COMPUTE_32F);
      }};
  if (c.phases) floors.emplace_back(valid_logits);
  res.floor_what = std::to_string(preference_floor_gemms(c)) +
                   " cuBLAS GEMMs at full size (logits" + (ref_head ? ", reference logits" : "") +
                   ", dX, dW), " + (bf16 ? "bf16" : "fp32") +
                   " operands and outputs, fp32 accumulation";

  // The library.
  const SequenceLoss loss = make_preference_loss(c);
  const auto dev_rows = [&](const gpu::DeviceBuffer& p, std::int64_t rows) {
    return TensorView(p.data(), dt, {rows, h}, Device::kCuda);
  };
  PreferenceInputs in;
  in.policy = {dev_rows(x, n), dev_rows(w, v), {}};
  in.targets = TensorView(y.data(), DType::kI32, {sq, t}, Device::kCuda);
  if (!b.paired) in.labels = TensorView(labels.data(), DType::kI32, {sq}, Device::kCuda);
  if (ref_head) in.reference = {dev_rows(xr, n), dev_rows(wr, v), {}};
  std::vector<double> ref_lp;
  if (ref_logps) {
    // Precomputed reference log-probs (as a trainer would cache them), from the reference head.
    SequenceOptions o;
    o.memory_budget_bytes = c.budget_bytes;
    const SequenceLogProbs lp(o);
    const Head rh{dev_rows(xr, n), dev_rows(wr, v), {}};
    gpu::DeviceBuffer lp_ws(lp.workspace_bytes(rh, in.targets));
    const SequenceLogProbResult r =
        lp.compute(ctx, rh, in.targets, Workspace(lp_ws.data(), lp_ws.bytes(), Device::kCuda));
    const std::vector<float> lp32(r.logps.begin(), r.logps.end());
    ref_lp.assign(lp32.begin(), lp32.end());
    gpu::copy_to_device(ref_lp_dev.data(), lp32.data(), lp32.size() * 4);
    in.reference_logps = TensorView(ref_lp_dev.data(), DType::kF32, {sq}, Device::kCuda);
  }
  PreferenceGrads gr;
  gr.hidden = dev_rows(dx, n);
  gr.weight = dev_rows(dw, v);
  res.plan = loss.plan(in, gr);
  res.workspace_bytes = loss.workspace_bytes(in, gr);
  res.device_desc +=
      ", gpu::Context (cuBLAS workspace) " + std::to_string(context_bytes >> 20) + " MiB";
  const std::size_t before_ws = free_bytes();
  gpu::DeviceBuffer ws(res.workspace_bytes);
  const Workspace wsv(ws.data(), ws.bytes(), Device::kCuda);
  const PreferenceResult first = loss.forward_backward(ctx, in, gr, wsv);
  res.extra_measured = {taken_since(before_ws),
                        "cudaMemGetInfo: free before allocating the workspace minus free after the "
                        "first call"};
  res.loss_value = first.loss;
  describe_preference_case(c, b, first, res);
  // The floors and the library alternate in each round, the library last (its gradients are
  // the ones checked below).
  std::vector<std::function<void()>> variants = floors;
  variants.emplace_back([&] {
    const double l = loss.forward_backward(ctx, in, gr, wsv).loss;
    res.loss_repeatable = res.loss_repeatable && l == first.loss;
  });
  const std::vector<std::vector<double>> ms = interleaved_ms(s, c.repeats, variants);
  res.floor_times_ms = ms[0];
  res.floor_ms = median(ms[0]);
  res.valid_floor_ms = median(ms[1]);
  if (c.phases) res.phase_floor_ms.emplace_back("forward only", median(ms[2]));
  res.times_ms = ms.back();
  res.time_ms = median(res.times_ms);
  res.ratio = res.time_ms / res.floor_ms;
  z.reset();
  if (c.phases) {
    // Forward only, in the workspace of the call with gradients where its plan fits there (a
    // resident plan may leave part of the budget unused), else in one of its own.
    const std::size_t forward_bytes = loss.workspace_bytes(in);
    gpu::DeviceBuffer own(forward_bytes > res.workspace_bytes ? forward_bytes : 0);
    const Workspace fws = own.bytes() ? Workspace(own.data(), own.bytes(), Device::kCuda) : wsv;
    const double forward_first = loss.forward(ctx, in, fws).loss;
    res.phase_ms.emplace_back("forward only", time_ms(s, c.repeats, [&] {
                                const double l = loss.forward(ctx, in, fws).loss;
                                res.loss_repeatable = res.loss_repeatable && l == forward_first;
                              }));
  }

  const auto grad_err = [&](const auto* ref_dx, const auto* ref_dw, double& e_dx, double& e_dw) {
    e_dx = bf16 ? rel_err(dx.as<__nv_bfloat16>(), ref_dx, nh) : rel_err(dx.as<float>(), ref_dx, nh);
    e_dw = bf16 ? rel_err(dw.as<__nv_bfloat16>(), ref_dw, vh) : rel_err(dw.as<float>(), ref_dw, vh);
  };
  if (c.naive) {
    // Materialised: fp32 logits [N, V] from the input-dtype GEMM, fp64 row math, the gradient
    // rounded to the input dtype [N, V], then the two gradient GEMMs into fp32 outputs.
    const std::size_t before_naive = free_bytes();
    gpu::DeviceBuffer z(static_cast<std::size_t>(n * v) * 4),
        zg(bf16 ? static_cast<std::size_t>(n * v) * 2 : 0), lse(n * 8), zy(n * 8), coef(n * 8),
        ndx(nh * 4), ndw(vh * 4);
    res.naive_extra = PeakMemory{taken_since(before_naive, nh * 4 + vh * 4),
                                 "cudaMemGetInfo around its buffers, less its fp32 gradients"};
    res.naive_logits_bytes = static_cast<std::size_t>(n * v) * 4;
    NaiveCuda<float> naive{c,
                           loss,
                           b,
                           gm,
                           s,
                           CUBLAS_COMPUTE_32F,
                           x.data(),
                           w.data(),
                           ref_head ? xr.data() : nullptr,
                           ref_head ? wr.data() : nullptr,
                           ref_logps ? &ref_lp : nullptr,
                           y.as<int>(),
                           z.as<float>(),
                           lse.as<double>(),
                           zy.as<double>(),
                           coef.as<double>(),
                           bf16 ? zg.as<__nv_bfloat16>() : nullptr,
                           ndx.data(),
                           ndw.data(),
                           CUDA_R_32F,
                           h,
                           v,
                           {},
                           {},
                           {},
                           {}};
    double naive_loss = 0;
    res.naive_ms = time_ms(
        s, c.repeats, [&] { naive_loss = naive.run(); }, &res.naive_times_ms);
    res.naive_loss_value = naive_loss;
    res.err_loss = scalar_rel_err(res.loss_value, naive_loss);
    double e_dx = 0, e_dw = 0;
    grad_err(ndx.as<float>(), ndw.as<float>(), e_dx, e_dw);
    res.err_grad_hidden = e_dx;
    res.err_grad_weight = e_dw;
    res.max_rel_err_vs_naive = worst_error({*res.err_loss, e_dx, e_dw});
    res.reference = std::string("materialised fp32 logits [N, V] from the ") +
                    (bf16 ? "bf16" : "fp32") + " GEMM" +
                    (ref_head ? " (reference, then policy)" : "") +
                    ", fp64 row math, per-sequence sums on the host, " + naive.how +
                    ", the gradient rounded to the input dtype, fp32-output GEMMs";
  }
  if (c.exact) {
    // float64 on the same input values: widened operands, fp64 GEMMs and row math.
    gpu::DeviceBuffer xd(nh * 8), wd(vh * 8), xrd(ref_head ? nh * 8 : 0),
        wrd(ref_head ? vh * 8 : 0), zd(static_cast<std::size_t>(n * v) * 8), lse(n * 8), zy(n * 8),
        coef(n * 8), dxd(nh * 8), dwd(vh * 8);
    const auto widen_in = [&](const gpu::DeviceBuffer& src, gpu::DeviceBuffer& dst,
                              std::size_t count) {
      if (bf16)
        widen(src.as<__nv_bfloat16>(), dst.as<double>(), count, s);
      else
        widen(src.as<float>(), dst.as<double>(), count, s);
    };
    widen_in(x, xd, nh);
    widen_in(w, wd, vh);
    if (ref_head) {
      widen_in(xr, xrd, nh);
      widen_in(wr, wrd, vh);
    }
    NaiveCuda<double> exact{c,
                            loss,
                            b,
                            Gemms{gm.h, CUDA_R_64F, CUDA_R_64F},
                            s,
                            CUBLAS_COMPUTE_64F,
                            xd.data(),
                            wd.data(),
                            ref_head ? xrd.data() : nullptr,
                            ref_head ? wrd.data() : nullptr,
                            ref_logps ? &ref_lp : nullptr,
                            y.as<int>(),
                            zd.as<double>(),
                            lse.as<double>(),
                            zy.as<double>(),
                            coef.as<double>(),
                            nullptr,
                            dxd.data(),
                            dwd.data(),
                            CUDA_R_64F,
                            h,
                            v,
                            {},
                            {},
                            {},
                            {}};
    const double l64 = exact.run();
    res.f64_err_loss = scalar_rel_err(res.loss_value, l64);
    double e_dx = 0, e_dw = 0;
    grad_err(dxd.as<double>(), dwd.as<double>(), e_dx, e_dw);
    res.f64_err_grad_hidden = e_dx;
    res.f64_err_grad_weight = e_dw;
  }
  return res;
}

}  // namespace chunkloss::bench
