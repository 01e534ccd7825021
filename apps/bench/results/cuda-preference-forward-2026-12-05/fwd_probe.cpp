// Probe: DPO forward only (policy + reference head) on CUDA, median of timed calls.
#include <chunkloss/gpu/context.h>
#include <chunkloss/losses/preference.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>
using namespace chunkloss;
int main(int argc, char** argv) {
  const std::int64_t pairs = atol(argv[1]), T = atol(argv[2]), H = atol(argv[3]), V = atol(argv[4]);
  const double prompt = atof(argv[5]);
  const std::int64_t S = 2 * pairs, N = S * T;
  std::mt19937 g(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto bf = [&](std::size_t n, float sc) {
    std::vector<BFloat16> v(n);
    for (auto& x : v) x = BFloat16(nd(g) * sc);
    return v;
  };
  const auto hx = bf(N * H, 1.f), hw = bf(V * H, 0.02f), rx = bf(N * H, 1.f);
  std::vector<std::int32_t> y(N);
  std::uniform_int_distribution<int> tok(0, V - 1), len(T / 2, T);
  for (std::int64_t s = 0; s < S; ++s) {
    const std::int64_t p = static_cast<std::int64_t>(prompt * T),
                       end = std::max<std::int64_t>(p + 1, len(g));
    for (std::int64_t t = 0; t < T; ++t) y[s * T + t] = t >= p && t < end ? tok(g) : -100;
  }
  gpu::DeviceBuffer dx(hx.size() * 2), dw(hw.size() * 2), drx(rx.size() * 2), dy(N * 4);
  gpu::copy_to_device(dx.data(), hx.data(), hx.size() * 2);
  gpu::copy_to_device(dw.data(), hw.data(), hw.size() * 2);
  gpu::copy_to_device(drx.data(), rx.data(), rx.size() * 2);
  gpu::copy_to_device(dy.data(), y.data(), N * 4);
  PreferenceInputs in;
  in.policy = {TensorView(dx.data(), DType::kBF16, {N, H}, Device::kCuda),
               TensorView(dw.data(), DType::kBF16, {V, H}, Device::kCuda),
               {}};
  in.reference = {TensorView(drx.data(), DType::kBF16, {N, H}, Device::kCuda),
                  TensorView(dw.data(), DType::kBF16, {V, H}, Device::kCuda),
                  {}};
  in.targets = TensorView(dy.data(), DType::kI32, {S, T}, Device::kCuda);
  Dpo loss;
  const Plan plan = loss.plan(in);
  const std::size_t bytes = loss.workspace_bytes(in);
  gpu::DeviceBuffer ws(bytes);
  gpu::Context ctx(0);
  const Workspace w(ws.data(), bytes, Device::kCuda);
  double l = 0;
  std::vector<double> ms;
  for (int r = 0; r < 12; ++r) {
    ctx.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    l = loss.forward(ctx, in, w).loss;
    ctx.synchronize();
    if (r >= 2)
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf(
      "pairs %ld T %ld H %ld V %ld prompt %.2f: forward %.3f ms (min %.3f), loss %.6f, workspace "
      "%.1f MiB, plan %s\n",
      (long)pairs, (long)T, (long)H, (long)V, prompt, ms[ms.size() / 2], ms[0], l,
      bytes / 1048576.0, plan.str().c_str());
}
