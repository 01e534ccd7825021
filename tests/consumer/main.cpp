// Consumer of the installed chunkloss package: with zero weights every logit is 0, so the mean
// cross-entropy is exactly log(V) and the hidden gradient is exactly 0; a wrong link or ABI
// shows up as a different loss, an exception, or a crash. A bad target must throw
// chunkloss::Error, caught with only the loss header included.
#include <chunkloss/losses/cross_entropy.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

int main() {
  using namespace chunkloss;
  const std::int64_t n = 5, h = 3, v = 11;
  std::vector<float> x(n * h, 1.0f), w(v * h, 0.0f), dx(n * h, 7.0f), dw(v * h, 7.0f);
  std::vector<std::int32_t> y = {0, 3, -100, 10, 4};
  CrossEntropyInputs in;
  in.hidden = TensorView::of(x.data(), {n, h});
  in.weight = TensorView::of(w.data(), {v, h});
  in.targets = TensorView::of(y.data(), {n});
  CrossEntropyGrads g;
  g.hidden = TensorView::of(dx.data(), {n, h});
  g.weight = TensorView::of(dw.data(), {v, h});
  const LinearCrossEntropy ce;
  const std::size_t bytes = ce.workspace_bytes(in, g);
  void* block = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  CpuContext ctx(1);
  const CrossEntropyResult r = ce.forward_backward(ctx, in, g, {}, Workspace(block, bytes));
  // Bad input throws chunkloss::Error, which the loss header brings along.
  y[1] = 11;
  bool refused = false;
  try {
    ce.forward_backward(ctx, in, g, {}, Workspace(block, bytes));
  } catch (const chunkloss::Error& e) {
    refused = std::string(e.what()).find("targets") != std::string::npos;
  }
  std::free(block);
  const double want = std::log(static_cast<double>(v));
  double max_dx = 0;
  for (float d : dx) max_dx = std::fmax(max_dx, std::fabs(d));
  std::printf("consumer: loss %.7f (log V = %.7f), valid rows %lld, max |dx| %g\n", r.loss, want,
              static_cast<long long>(r.valid_rows), max_dx);
  std::printf("consumer: a target of 11 was %s\n", refused ? "refused" : "NOT refused");
  const bool ok = std::fabs(r.loss - want) < 1e-6 && r.valid_rows == 4 && max_dx == 0.0 && refused;
  return ok ? 0 : 1;
}
