// CUDA cross-entropy with the vocabulary split over several devices: one thread per device, an
// NCCL communicator each, the weight rows [V r / K, V (r + 1) / K) on device r. Every round all
// devices start together (a host barrier), run their shard's three floor GEMMs, start together
// again and run the loss; a round's time is the slowest device's (CUDA events on each stream).
// The unsplit call on device 0, on the same inputs, gives the time to compare with and the
// reference the split results are checked against.
#include <chunkloss/core/error.h>
#include <chunkloss/dist/nccl.h>
#include <chunkloss/gpu/context.h>
#include <chunkloss/losses/cross_entropy.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "bench.h"
#include "cuda_util.cuh"

namespace chunkloss::bench {
namespace {

// ||a - b|| / ||b|| of two host vectors of floats.
double host_rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    num += d * d;
    den += static_cast<double>(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// `count` elements of dtype `t` at device address `p` as host floats.
std::vector<float> host_floats(const void* p, std::int64_t count, DType t) {
  std::vector<float> f(static_cast<std::size_t>(count));
  if (t == DType::kF32) {
    gpu::copy_to_host(f.data(), p, f.size() * 4);
    return f;
  }
  std::vector<BFloat16> b(f.size());
  gpu::copy_to_host(b.data(), p, b.size() * 2);
  for (std::size_t i = 0; i < f.size(); ++i) f[i] = static_cast<float>(b[i]);
  return f;
}

// One device's part: its context, the full operands (the same seeded values on every device),
// its shard's gradients, the floor's logits and the loss's workspace.
struct Rank {
  std::unique_ptr<gpu::Context> ctx;
  gpu::DeviceBuffer x, w, y, dx, dw, z, ws;
  std::int64_t off = 0, rows = 0;  // the shard: weight rows [off, off + rows)
  std::size_t workspace = 0, measured = 0;
  double loss = 0;
  bool repeatable = true;
  std::vector<double> floor_ms, loss_ms;
};

}  // namespace

CaseResult run_ce_cuda_vocab_parallel(const CaseConfig& c, BenchDevice&) {
  const int k = c.vocab_ranks;
  require_cuda_devices(k);
  CaseResult res;
  cudaDeviceProp prop{};
  BENCH_CHECK(cudaGetDeviceProperties(&prop, 0));
  const std::int64_t n = c.rows, h = c.hidden, v = c.vocab;
  const DType dt = c.dtype;
  const bool bf16 = dt == DType::kBF16;
  const std::size_t es = dtype_size(dt);
  const cudaDataType_t ct = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const std::vector<int> hy = int_targets(ce_targets(c, res));

  std::vector<int> ids(static_cast<std::size_t>(k));
  for (int r = 0; r < k; ++r) ids[static_cast<std::size_t>(r)] = r;
  BENCH_CHECK(cudaSetDevice(0));
  const std::size_t before_nccl = free_bytes();
  auto comms = dist::NcclCommunicator::create_all(ids);
  BENCH_CHECK(cudaSetDevice(0));
  const std::size_t nccl_bytes = taken_since(before_nccl);

  CrossEntropyOptions o;
  o.memory_budget_bytes = c.budget_bytes;
  o.skip_ignored_rows = c.skip_ignored_rows;
  o.fp32_weight_grad_accumulator = c.fp32_weight_grad_accumulator;
  o.logits_dtype = c.logits_dtype;
  const LinearCrossEntropy ce(o);
  auto views = [&](const Rank& rk, const gpu::DeviceBuffer& dx, const gpu::DeviceBuffer& dw,
                   std::int64_t off, std::int64_t rows, dist::Communicator* group) {
    CrossEntropyInputs in;
    in.hidden = TensorView(rk.x.data(), dt, {n, h}, Device::kCuda, rk.ctx->device_index());
    in.weight = TensorView(rk.w.as<unsigned char>() + off * h * es, dt, {rows, h}, Device::kCuda,
                           rk.ctx->device_index());
    in.targets = TensorView(rk.y.data(), DType::kI32, {n}, Device::kCuda, rk.ctx->device_index());
    if (group) in.vocab_shard = {group, off, v};
    CrossEntropyGrads gr;
    gr.hidden = TensorView(dx.data(), dt, {n, h}, Device::kCuda, rk.ctx->device_index());
    gr.weight = TensorView(dw.data(), dt, {rows, h}, Device::kCuda, rk.ctx->device_index());
    return std::pair(in, gr);
  };

  std::vector<Rank> ranks(static_cast<std::size_t>(k));
  std::barrier sync(k);
  auto work = [&](int r) {
    Rank& rk = ranks[static_cast<std::size_t>(r)];
    rk.ctx = std::make_unique<gpu::Context>(r);
    const auto s = static_cast<cudaStream_t>(rk.ctx->stream());
    rk.off = v * r / k;
    rk.rows = v * (r + 1) / k - rk.off;
    rk.x = gpu::DeviceBuffer(n * h * es);
    rk.w = gpu::DeviceBuffer(v * h * es);
    rk.y = gpu::DeviceBuffer(n * 4);
    rk.dx = gpu::DeviceBuffer(n * h * es);
    rk.dw = gpu::DeviceBuffer(rk.rows * h * es);
    rk.z = gpu::DeviceBuffer(n * rk.rows * es);
    const RandomOperands ops = fill_operands(c, rk.x.data(), rk.w.data(), n * h, v * h, h, bf16, s);
    if (r == 0) res.inputs = ops.description;
    gpu::copy_to_device(rk.y.data(), hy.data(), hy.size() * 4);
    const auto [in, gr] =
        views(rk, rk.dx, rk.dw, rk.off, rk.rows, comms[static_cast<std::size_t>(r)].get());
    const Plan plan = ce.plan(in, gr);
    if (r == 0) res.plan = plan;
    rk.workspace = plan.workspace_bytes();
    const std::size_t before_ws = free_bytes();
    rk.ws = gpu::DeviceBuffer(rk.workspace);
    const Workspace wsv(rk.ws.data(), rk.ws.bytes(), Device::kCuda, r);
    // Every rank allocated before any waits in a collective (a rank waiting for one while
    // another is in cudaMalloc can deadlock in the driver).
    sync.arrive_and_wait();
    rk.loss = ce.forward_backward(*rk.ctx, in, gr, {}, wsv).loss;  // warm-up (NCCL connects)
    rk.measured = taken_since(before_ws);
    Gemms fm{static_cast<cublasHandle_t>(rk.ctx->cublas()), ct, ct, rk.ctx.get()};
    const void* ws_rows = rk.w.as<unsigned char>() + rk.off * h * es;
    const int ni = int(n), hi = int(h), vi = int(rk.rows);
    auto floor = [&] {
      fm.logits(rk.x.data(), ws_rows, rk.z.data(), ni, hi, vi, ct, CUBLAS_COMPUTE_32F);
      fm.dx(rk.z.data(), ws_rows, rk.dx.data(), ni, hi, vi, ct, ct, ct, CUBLAS_COMPUTE_32F);
      fm.dw(rk.z.data(), rk.x.data(), rk.dw.data(), ni, hi, vi, ct, ct, ct, CUBLAS_COMPUTE_32F);
    };
    floor();
    cudaEvent_t e0, e1;
    BENCH_CHECK(cudaEventCreate(&e0));
    BENCH_CHECK(cudaEventCreate(&e1));
    auto timed = [&](auto&& fn) {
      BENCH_CHECK(cudaStreamSynchronize(s));
      sync.arrive_and_wait();
      BENCH_CHECK(cudaEventRecord(e0, s));
      fn();
      BENCH_CHECK(cudaEventRecord(e1, s));
      BENCH_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      BENCH_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      return static_cast<double>(ms);
    };
    const double first = rk.loss;
    for (int i = 0; i < c.repeats; ++i) {
      rk.floor_ms.push_back(timed(floor));
      rk.loss_ms.push_back(timed([&] {
        rk.loss = ce.forward_backward(*rk.ctx, in, gr, {}, wsv).loss;
        rk.repeatable = rk.repeatable && rk.loss == first;
      }));
    }
    BENCH_CHECK(cudaEventDestroy(e0));
    BENCH_CHECK(cudaEventDestroy(e1));
    rk.z = gpu::DeviceBuffer();
  };
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < k; ++r)
      threads.emplace_back([&, r] {
        try {
          work(r);
        } catch (const std::exception& e) {
          // The others would wait at the barrier for this rank: one line, and the process ends.
          std::fprintf(stderr, "chunkloss-bench: error: device %d: %s\n", r, e.what());
          std::_Exit(1);
        }
      });
    for (auto& t : threads) t.join();
  }

  // Per round, the slowest device; then medians.
  for (int i = 0; i < c.repeats; ++i) {
    double f = 0, l = 0;
    for (const Rank& rk : ranks) {
      f = std::max(f, rk.floor_ms[static_cast<std::size_t>(i)]);
      l = std::max(l, rk.loss_ms[static_cast<std::size_t>(i)]);
    }
    res.floor_times_ms.push_back(f);
    res.times_ms.push_back(l);
  }
  res.floor_ms = median(res.floor_times_ms);
  res.time_ms = median(res.times_ms);
  res.ratio = res.time_ms / res.floor_ms;
  res.loss_value = ranks[0].loss;
  std::size_t workspace = 0, measured = 0;
  for (const Rank& rk : ranks) {
    workspace = std::max(workspace, rk.workspace);
    measured = std::max(measured, rk.measured);
    res.loss_repeatable = res.loss_repeatable && rk.repeatable && rk.loss == ranks[0].loss;
  }
  res.workspace_bytes = workspace;
  res.extra_measured = {measured,
                        "cudaMemGetInfo on each device: free before allocating the workspace minus "
                        "free after the first call (NCCL's connection buffers included); the "
                        "largest over the devices"};
  res.floor_what = "each device's 3 cuBLAS GEMMs on its shard (logits, dX, dW; N rows, V/" +
                   std::to_string(k) + " columns), " + (bf16 ? "bf16" : "fp32") +
                   " operands and outputs, all devices at once; a round's time is the slowest "
                   "device's";
  res.device_desc = std::to_string(k) + " x " + prop.name + ", NCCL " +
                    std::to_string(nccl_bytes >> 20) + " MiB on device 0 at initialisation";

  // The unsplit call on device 0: its time, and the reference for the split results.
  Rank& r0 = ranks[0];
  r0.ctx->activate();
  const auto s0 = static_cast<cudaStream_t>(r0.ctx->stream());
  gpu::DeviceBuffer dx_full(n * h * es), dw_full(v * h * es);
  const auto [in, gr] = views(r0, dx_full, dw_full, 0, v, nullptr);
  gpu::DeviceBuffer ws(ce.workspace_bytes(in, gr));
  const Workspace wsv(ws.data(), ws.bytes(), Device::kCuda, 0);
  double unsplit_loss = 0;
  res.unsplit_ms = time_ms(
      s0, c.repeats, [&] { unsplit_loss = ce.forward_backward(*r0.ctx, in, gr, {}, wsv).loss; });
  r0.ctx->synchronize();
  res.unsplit_err_loss = scalar_rel_err(res.loss_value, unsplit_loss);
  res.unsplit_err_grad_hidden =
      host_rel_err(host_floats(r0.dx.data(), n * h, dt), host_floats(dx_full.data(), n * h, dt));
  std::vector<float> dw_split;
  for (Rank& rk : ranks) {
    rk.ctx->synchronize();
    const std::vector<float> part = host_floats(rk.dw.data(), rk.rows * h, dt);
    dw_split.insert(dw_split.end(), part.begin(), part.end());
  }
  res.unsplit_err_grad_weight = host_rel_err(dw_split, host_floats(dw_full.data(), v * h, dt));
  return res;
}

}  // namespace chunkloss::bench
