// CUDA cross-entropy benchmark case: CUDA events after warm-up, medians; the floor is the three
// bf16/fp32 cuBLAS GEMMs at full size (logits, dX, dW) timed in the same process; memory is read
// with cudaMemGetInfo around allocations; the naive path materialises the [N, V] fp32 logits.
#include <chunkloss/core/error.h>
#include <chunkloss/gpu/context.h>
#include <chunkloss/losses/cross_entropy.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "bench.h"
#include "ce_loss.h"
#include "cuda_util.cuh"

namespace chunkloss::bench {
namespace {

constexpr int kMaxSettleRounds = 64;  // warm-up rounds at most under measured GEMM selection

}  // namespace

CaseResult run_ce_cuda(const CaseConfig& c, BenchDevice& dev) {
  if (c.vocab_ranks > 1) return run_ce_cuda_vocab_parallel(c, dev);
  require_cuda_devices(1);
  CaseResult res;
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  res.device_desc = prop.name;
  const std::int64_t n = c.rows, h = c.hidden, v = c.vocab;
  const DType dt = c.dtype;
  const bool bf16 = dt == DType::kBF16;
  const std::size_t es = dtype_size(dt);
  const cudaDataType_t ct = bf16 ? CUDA_R_16BF : CUDA_R_32F;

  const std::size_t before_ctx = free_bytes();
  gpu::Context ctx(0, nullptr,
                   c.measured_gemms ? gpu::GemmSelection::kMeasured : gpu::GemmSelection::kDefault);
  const std::size_t context_bytes = taken_since(before_ctx);
  auto s = static_cast<cudaStream_t>(ctx.stream());

  // Inputs, gradients and targets (not counted as extra memory).
  gpu::DeviceBuffer x(n * h * es), w(v * h * es), dx(n * h * es), dw(v * h * es), y(n * 4);
  const RandomOperands ops = fill_operands(c, x.data(), w.data(), n * h, v * h, h, bf16, s);
  const std::vector<int> hy = int_targets(ce_targets(c, res));
  const std::int64_t valid = res.valid_rows;
  gpu::copy_to_device(y.data(), hy.data(), hy.size() * 4);
  res.inputs = ops.description;

  // The floor: the three GEMMs at full size, gradient operand of the input dtype, through the
  // context's GEMM selection as the library's. Its logits buffer lives through the timed rounds,
  // which alternate the floor and the library. gm: the naive's GEMMs, cuBLAS's own choice.
  Gemms gm{static_cast<cublasHandle_t>(ctx.cublas()), ct, ct};
  Gemms fm{gm.h, ct, ct, &ctx};
  auto z = std::make_unique<gpu::DeviceBuffer>(n * v * es);
  // The floor's three GEMMs run back to back, as the library runs its GEMMs; events between
  // them, one set per call (the warm-up and each round), give each GEMM's time.
  std::vector<std::array<cudaEvent_t, 4>> marks(static_cast<std::size_t>(c.repeats) + 1);
  for (auto& m : marks)
    for (cudaEvent_t& e : m) BENCH_CHECK(cudaEventCreate(&e));
  std::size_t floor_calls = 0;
  // With marks (the warm-up and the timed rounds) or without (settling the GEMM selection).
  auto floor_gemms = [&](const std::array<cudaEvent_t, 4>* m) {
    const auto mark = [&](int i) {
      if (m) BENCH_CHECK(cudaEventRecord((*m)[i], s));
    };
    mark(0);
    fm.logits(x.data(), w.data(), z->data(), int(n), int(h), int(v), ct, CUBLAS_COMPUTE_32F);
    mark(1);
    fm.dx(z->data(), w.data(), dx.data(), int(n), int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
    mark(2);
    fm.dw(z->data(), x.data(), dw.data(), int(n), int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
    mark(3);
  };
  auto floor = [&] { floor_gemms(&marks[floor_calls++]); };
  const char* floor_names[] = {"logits X W^T", "dX = G W", "dW = G^T X"};

  // The library.
  const CeLoss ce(c);
  CrossEntropyInputs in;
  in.hidden = TensorView(x.data(), dt, {n, h}, Device::kCuda);
  in.weight = TensorView(w.data(), dt, {v, h}, Device::kCuda);
  in.targets = TensorView(y.data(), DType::kI32, {n}, Device::kCuda);
  CrossEntropyGrads gr;
  gr.hidden = TensorView(dx.data(), dt, {n, h}, Device::kCuda);
  gr.weight = TensorView(dw.data(), dt, {v, h}, Device::kCuda);
  const Plan plan = ce.plan(in, gr);
  res.plan = plan;
  res.workspace_bytes = plan.workspace_bytes();
  res.floor_what = std::string("3 cuBLAS GEMMs at full size (logits, dX, dW), ") +
                   (bf16 ? "bf16" : "fp32") +
                   " operands and outputs, fp32 accumulation; timed in rounds alternating with "
                   "the library's calls" +
                   (c.measured_gemms ? "; the faster of the measured selection's and cuBLAS's "
                                       "own choice's"
                                     : "");
  res.device_desc +=
      ", gpu::Context (cuBLAS workspace) " + std::to_string(context_bytes >> 20) + " MiB";
  // The floor over the plan's token chunks, as the library runs its GEMMs: fp32 logits chunk,
  // the input-dtype gradient operand in place in it (rows one fp32 row apart), dW accumulated
  // on the context's side beside dX; with bf16 the dX rows in fp32 in the chunk's free halves,
  // as the library's mean does (which needs H <= V / 2 for them to fit there; else none).
  const bool do_chunked =
      c.chunked_floor && plan.order == LoopOrder::kTokenChunk && (!bf16 || 2 * h <= v);
  const std::int64_t cr = plan.chunk_rows;
  gpu::DeviceBuffer chunk(do_chunked ? cr * v * 4 : 0);
  const gpu::Context& side = ctx.side();
  Gemms sm{static_cast<cublasHandle_t>(side.cublas()), ct, ct, &side};
  auto chunked_floor = [&] {
    for (std::int64_t r0 = 0; r0 < n; r0 += cr) {
      const int rows = static_cast<int>(std::min(n, r0 + cr) - r0);
      const auto* xr = static_cast<const unsigned char*>(x.data()) + r0 * h * es;
      fm.logits(xr, w.data(), chunk.data(), rows, int(h), int(v), CUDA_R_32F, CUBLAS_COMPUTE_32F);
      const int ldg = static_cast<int>(v * 4 / es);
      ctx.fork();
      if (bf16)
        fm.dx(chunk.data(), w.data(), chunk.as<unsigned char>() + v * 2, rows, int(h), int(v), ct,
              ct, CUDA_R_32F, CUBLAS_COMPUTE_32F, ldg, int(v));
      else
        fm.dx(chunk.data(), w.data(), static_cast<unsigned char*>(dx.data()) + r0 * h * es, rows,
              int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F, ldg);
      sm.dw(chunk.data(), xr, dw.data(), rows, int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F, ldg,
            r0 > 0);
      ctx.join();
    }
  };
  // The floor's GEMMs at full size with dW on the side beside dX, as the library runs them.
  auto side_floor = [&] {
    fm.logits(x.data(), w.data(), z->data(), int(n), int(h), int(v), ct, CUBLAS_COMPUTE_32F);
    ctx.fork();
    fm.dx(z->data(), w.data(), dx.data(), int(n), int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
    sm.dw(z->data(), x.data(), dw.data(), int(n), int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
    ctx.join();
  };
  // With prompts (ce_seq_len): the floor's GEMMs over as many rows as are valid, the work left
  // when the ignored rows are skipped.
  const bool do_valid = c.ce_seq_len > 0;
  // Under measured selection, the floor's GEMMs also through cuBLAS's own choice.
  auto default_floor = [&] {
    gm.logits(x.data(), w.data(), z->data(), int(n), int(h), int(v), ct, CUBLAS_COMPUTE_32F);
    gm.dx(z->data(), w.data(), dx.data(), int(n), int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
    gm.dw(z->data(), x.data(), dw.data(), int(n), int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
  };
  auto valid_floor = [&] {
    const int nv = static_cast<int>(valid);
    fm.logits(x.data(), w.data(), z->data(), nv, int(h), int(v), ct, CUBLAS_COMPUTE_32F);
    fm.dx(z->data(), w.data(), dx.data(), nv, int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
    fm.dw(z->data(), x.data(), dw.data(), nv, int(h), int(v), ct, ct, ct, CUBLAS_COMPUTE_32F);
  };
  const std::size_t before_ws = free_bytes();
  gpu::DeviceBuffer ws(plan.workspace_bytes());
  const Workspace wsv(ws.data(), ws.bytes(), Device::kCuda);
  res.loss_value = ce.forward_backward(ctx, in, gr, wsv);
  res.extra_measured = {taken_since(before_ws),
                        "cudaMemGetInfo: free before allocating the workspace minus free after the "
                        "first call"};
  std::vector<std::function<void()>> variants = {floor};
  if (do_chunked) variants.insert(variants.end(), {chunked_floor, side_floor});
  const std::size_t valid_at = variants.size();
  if (do_valid) variants.push_back(valid_floor);
  const std::size_t default_at = variants.size();
  if (c.measured_gemms) variants.push_back(default_floor);
  // --phases: the loss with only some gradients, in the same rounds.
  CrossEntropyGrads only_dx, only_dw;
  only_dx.hidden = gr.hidden;
  only_dw.weight = gr.weight;
  std::vector<std::pair<std::string, CrossEntropyGrads>> phases;
  if (c.phases) phases = {{"loss only", {}}, {"dX only", only_dx}, {"dW only", only_dw}};
  for (const auto& [name, g] : phases)
    variants.emplace_back([&ce, &ctx, &in, &wsv, &g] { ce.forward_backward(ctx, in, g, wsv); });
  if (c.measured_gemms) {
    // Every timed call, the floor without its marks, until each GEMM shape has its algorithm.
    std::vector<std::function<void()>> settle = variants;
    settle[0] = [&] { floor_gemms(nullptr); };
    settle.emplace_back([&] { ce.forward_backward(ctx, in, gr, wsv); });
    int rounds = 0;
    do {  // the first round also introduces the floor's shapes to the context
      for (const auto& fn : settle) fn();
      ctx.synchronize();
    } while (++rounds < kMaxSettleRounds && ctx.gemm_shapes_measuring() > 0);
    res.gemm_settle_rounds = rounds;
    res.gemm_shapes_unsettled = ctx.gemm_shapes_measuring();
    res.gemm_choices = ctx.gemm_report();
    res.loss_value = ce.forward_backward(ctx, in, gr, wsv);
  }
  const double first_loss = res.loss_value;
  variants.emplace_back([&] {
    res.loss_value = ce.forward_backward(ctx, in, gr, wsv);
    res.loss_repeatable = res.loss_repeatable && res.loss_value == first_loss;
  });
  const std::vector<std::vector<double>> t = interleaved_ms(s, c.repeats, variants);
  for (std::size_t i = 0; i < phases.size(); ++i)
    res.phase_ms.emplace_back(phases[i].first, median(t[t.size() - 1 - phases.size() + i]));
  for (std::size_t g = 0; g < 3; ++g) {
    std::vector<double> ms;
    for (std::size_t r = 1; r < marks.size(); ++r) {
      float e = 0;
      BENCH_CHECK(cudaEventElapsedTime(&e, marks[r][g], marks[r][g + 1]));
      ms.push_back(e);
    }
    res.gemm_ms.emplace_back(floor_names[g], median(ms));
  }
  for (auto& m : marks)
    for (cudaEvent_t e : m) BENCH_CHECK(cudaEventDestroy(e));
  res.floor_times_ms = t[0];
  res.floor_ms = median(res.floor_times_ms);
  if (c.measured_gemms) {
    res.selected_floor_ms = res.floor_ms;
    res.default_floor_ms = median(t[default_at]);
    if (*res.default_floor_ms < res.floor_ms) {
      res.floor_times_ms = t[default_at];
      res.floor_ms = *res.default_floor_ms;
    }
  }
  if (do_chunked) {
    res.chunked_floor_ms = median(t[1]);
    res.side_floor_ms = median(t[2]);
  }
  if (do_valid) res.valid_floor_ms = median(t[valid_at]);
  res.times_ms = t.back();
  res.time_ms = median(res.times_ms);
  res.ratio = res.time_ms / res.floor_ms;
  z.reset();
  // The checks below read one more full call's gradients, written into buffers of NaN: the
  // rounds' floors and --phases' dX-only and dW-only calls also wrote there, and would otherwise
  // hide a full call that skipped a write.
  for (gpu::DeviceBuffer* g : {&dx, &dw})
    BENCH_CHECK(cudaMemsetAsync(g->data(), 0xFF, g->bytes(), s));
  if (ce.forward_backward(ctx, in, gr, wsv) != first_loss) res.loss_repeatable = false;

  const auto ni = int(n), hi = int(h), vi = int(v);
  // The naive rows' coefficients (1/valid on valid rows) and the mean loss from their stats.
  std::vector<double> hcoef(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < hcoef.size(); ++i) hcoef[i] = hy[i] < 0 ? 0.0 : 1.0 / valid;
  gpu::DeviceBuffer coef(n * 8);
  gpu::copy_to_device(coef.data(), hcoef.data(), hcoef.size() * 8);
  const auto mean_loss = [&](const gpu::DeviceBuffer& lse, const gpu::DeviceBuffer& zy) {
    BENCH_CHECK(cudaStreamSynchronize(s));
    std::vector<double> hl(static_cast<std::size_t>(n)), hz(static_cast<std::size_t>(n));
    gpu::copy_to_host(hl.data(), lse.data(), hl.size() * 8);
    gpu::copy_to_host(hz.data(), zy.data(), hz.size() * 8);
    double loss = 0;
    for (std::size_t i = 0; i < hl.size(); ++i) loss += (hl[i] - hz[i]) / valid;
    return loss;
  };
  if (c.naive) {
    // Materialised: fp32 logits [N, V] from the input-dtype GEMM, fp32 softmax gradient, the
    // gradient rounded to the input dtype [N, V], then the two gradient GEMMs into fp32 outputs.
    const std::size_t before_naive = free_bytes();
    gpu::DeviceBuffer z(n * v * 4), zg(bf16 ? n * v * 2 : 0), lse(n * 8), zy(n * 8), ndx(n * h * 4),
        ndw(v * h * 4);
    res.naive_extra = PeakMemory{taken_since(before_naive, n * h * 4 + v * h * 4),
                                 "cudaMemGetInfo around its buffers, less its fp32 gradients"};
    res.naive_logits_bytes = static_cast<std::size_t>(n * v * 4);
    res.reference = std::string("materialised fp32 logits [N, V] from the ") +
                    (bf16 ? "bf16" : "fp32") +
                    " GEMM, fp64 softmax gradient rounded to the input dtype, fp32-output GEMMs";
    const void* g = bf16 ? zg.data() : z.data();
    auto naive = [&] {
      gm.logits(x.data(), w.data(), z.data(), ni, hi, vi, CUDA_R_32F, CUBLAS_COMPUTE_32F);
      dense_rows(z.as<float>(), y.as<int>(), n, v, nullptr, coef.as<double>(), lse.as<double>(),
                 zy.as<double>(), s);
      if (bf16) narrow(z.as<float>(), zg.as<__nv_bfloat16>(), static_cast<std::size_t>(n * v), s);
      gm.dx(g, w.data(), ndx.data(), ni, hi, vi, ct, ct, CUDA_R_32F, CUBLAS_COMPUTE_32F);
      gm.dw(g, x.data(), ndw.data(), ni, hi, vi, ct, ct, CUDA_R_32F, CUBLAS_COMPUTE_32F);
    };
    res.naive_ms = time_ms(s, c.repeats, naive, &res.naive_times_ms);
    const double naive_loss = mean_loss(lse, zy);
    res.naive_loss_value = naive_loss;
    const double e_loss = scalar_rel_err(res.loss_value, naive_loss);
    const double e_dx = bf16 ? rel_err(dx.as<__nv_bfloat16>(), ndx.as<float>(), n * h)
                             : rel_err(dx.as<float>(), ndx.as<float>(), n * h);
    const double e_dw = bf16 ? rel_err(dw.as<__nv_bfloat16>(), ndw.as<float>(), v * h)
                             : rel_err(dw.as<float>(), ndw.as<float>(), v * h);
    res.err_loss = e_loss;
    res.err_grad_hidden = e_dx;
    res.err_grad_weight = e_dw;
    res.max_rel_err_vs_naive = worst_error({e_loss, e_dx, e_dw});
  }
  if (c.exact) {
    // float64 on the same input values: widened operands, fp64 GEMMs, fp64 softmax gradient.
    gpu::DeviceBuffer xd(n * h * 8), wd(v * h * 8), zd(n * v * 8), lse(n * 8), zy(n * 8),
        dxd(n * h * 8), dwd(v * h * 8);
    if (bf16) {
      widen(x.as<__nv_bfloat16>(), xd.as<double>(), static_cast<std::size_t>(n * h), s);
      widen(w.as<__nv_bfloat16>(), wd.as<double>(), static_cast<std::size_t>(v * h), s);
    } else {
      widen(x.as<float>(), xd.as<double>(), static_cast<std::size_t>(n * h), s);
      widen(w.as<float>(), wd.as<double>(), static_cast<std::size_t>(v * h), s);
    }
    Gemms g64{gm.h, CUDA_R_64F, CUDA_R_64F};
    g64.logits(xd.data(), wd.data(), zd.data(), ni, hi, vi, CUDA_R_64F, CUBLAS_COMPUTE_64F);
    dense_rows(zd.as<double>(), y.as<int>(), n, v, nullptr, coef.as<double>(), lse.as<double>(),
               zy.as<double>(), s);
    g64.dx(zd.data(), wd.data(), dxd.data(), ni, hi, vi, CUDA_R_64F, CUDA_R_64F, CUDA_R_64F,
           CUBLAS_COMPUTE_64F);
    g64.dw(zd.data(), xd.data(), dwd.data(), ni, hi, vi, CUDA_R_64F, CUDA_R_64F, CUDA_R_64F,
           CUBLAS_COMPUTE_64F);
    const double f64_loss = mean_loss(lse, zy);
    res.f64_err_loss = scalar_rel_err(res.loss_value, f64_loss);
    res.f64_err_grad_hidden = bf16 ? rel_err(dx.as<__nv_bfloat16>(), dxd.as<double>(), n * h)
                                   : rel_err(dx.as<float>(), dxd.as<double>(), n * h);
    res.f64_err_grad_weight = bf16 ? rel_err(dw.as<__nv_bfloat16>(), dwd.as<double>(), v * h)
                                   : rel_err(dw.as<float>(), dwd.as<double>(), v * h);
    res.f64_row_err_grad_hidden =
        bf16 ? row_err_quantiles(dx.as<__nv_bfloat16>(), dxd.as<double>(), n, h)
             : row_err_quantiles(dx.as<float>(), dxd.as<double>(), n, h);
  }
  return res;
}

}  // namespace chunkloss::bench
