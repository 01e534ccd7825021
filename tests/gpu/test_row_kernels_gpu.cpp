// The token engine's row kernels on a tile of random logits, without GEMMs: the fused kernel
// (one thread-block cluster per row) against the statistics kernel followed by the gradient
// kernel, for clusters of 1 to 16 blocks, both gradient dtypes, the plain rule and every row
// option; run to run bit for bit. The sanitizers run this case (no cuBLAS in it).
#include <doctest/doctest.h>

#include <chunkloss/core/dtype.h>
#include <chunkloss/gpu/context.h>
#include <chunkloss/kernels/token_epilogue.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

namespace {

using namespace chunkloss;
using kern::Elem;

constexpr int kRowArrays = 10;  // lse, a, b, g, loss, zloss, entropy, zsum, scale, argmax

struct Rows {
  gpu::DeviceBuffer mem;
  kern::RowPtrs ptrs{};
  explicit Rows(std::int64_t n) : mem(static_cast<std::size_t>(n * kRowArrays) * 4) {
    const std::vector<float> zeros(static_cast<std::size_t>(n * kRowArrays), 0.0f);
    gpu::copy_to_device(mem.data(), zeros.data(), zeros.size() * 4);
    auto* f = static_cast<float*>(mem.data());
    float** slots[] = {&ptrs.lse,   &ptrs.a,       &ptrs.b,    &ptrs.g,    &ptrs.loss,
                       &ptrs.zloss, &ptrs.entropy, &ptrs.zsum, &ptrs.scale};
    std::int64_t i = 0;
    for (float** s : slots) *s = f + n * i++;
    ptrs.argmax = reinterpret_cast<std::int32_t*>(f + n * i);
  }
  std::vector<float> host(std::int64_t n) const {
    std::vector<float> h(static_cast<std::size_t>(n * kRowArrays));
    gpu::copy_to_host(h.data(), mem.data(), h.size() * 4);
    return h;
  }
};

// What one path left: the row arrays and the gradient rows (as floats).
struct Result {
  std::vector<float> rows, grad;
};

void check_ok(int e) { REQUIRE(e == 0); }

struct Case {
  std::int64_t n, v;
  Elem grad;
  bool options;  // label smoothing, z-loss, softcap, class weights, token weights, entropy, sums
};

class Fixture {
 public:
  explicit Fixture(const Case& c) : c_(c), ctx_(0) {
    std::mt19937_64 g(static_cast<std::uint64_t>(c.v * 7 + c.n));
    std::normal_distribution<float> z(0.0f, 3.0f);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    logits_.resize(static_cast<std::size_t>(c.n * c.v));
    for (float& x : logits_) x = z(g);
    std::vector<std::int64_t> y(static_cast<std::size_t>(c.n));
    for (auto& t : y) t = u(g) < 1.0f / 7 ? -100 : static_cast<std::int64_t>(g() % c.v);
    std::vector<float> cw(static_cast<std::size_t>(c.v)), tw(static_cast<std::size_t>(c.n));
    for (float& w : cw) w = 0.5f + u(g);
    for (float& w : tw) w = 2.0f * u(g);
    targets_ = upload(y.data(), y.size() * 8);
    cw_ = upload(cw.data(), cw.size() * 4);
    tw_ = upload(tw.data(), tw.size() * 4);
    scalars_ = gpu::DeviceBuffer(64 * sizeof(double));

    p_.rows = c.n;
    p_.vocab = c.v;
    p_.targets = targets_.data();
    p_.targets_i64 = true;
    p_.scale = kern::Scale::kMean;
    p_.scalars = static_cast<double*>(scalars_.data());
    if (c.options) {
      p_.rule.one_minus_ls = 0.9f;
      p_.rule.eps = 0.1f / static_cast<float>(c.v);
      p_.rule.z_loss = 1e-3f;
      p_.softcap = 8.0f;
      p_.class_weights = static_cast<const float*>(cw_.data());
      p_.token_weights = static_cast<const float*>(tw_.data());
      p_.entropy = p_.logit_sums = true;
    }
  }

  // Statistics and gradient of every row: fused (one kernel) or the two kernels.
  Result run(bool fused) {
    Rows rows(c_.n);
    gpu::DeviceBuffer tile = upload(logits_.data(), logits_.size() * 4);
    kern::TokenParams p = p_;
    p.row = rows.ptrs;
    void* s = ctx_.stream();
    check_ok(kern::launch_token_begin(p, s));
    if (fused) {
      check_ok(kern::launch_row_fused(p, tile.data(), Elem::kF32, c_.grad, c_.v, 0, c_.n, s));
    } else {
      check_ok(kern::launch_row_stats(p, tile.data(), Elem::kF32, c_.v, 0, c_.n, s));
      check_ok(kern::launch_grad_epilogue(p, tile.data(), Elem::kF32, c_.grad, c_.v, 0, c_.n, 0,
                                          c_.v, s));
    }
    ctx_.synchronize();
    Result r;
    r.rows = rows.host(c_.n);
    std::vector<float> raw(logits_.size());
    gpu::copy_to_host(raw.data(), tile.data(), raw.size() * 4);
    r.grad.resize(raw.size());
    if (c_.grad == Elem::kF32) {
      r.grad = raw;
    } else {  // row i's bf16 gradient lies over the first half of its fp32 row
      const auto* base = reinterpret_cast<const unsigned char*>(raw.data());
      for (std::int64_t i = 0; i < c_.n; ++i)
        for (std::int64_t j = 0; j < c_.v; ++j) {
          BFloat16 b;
          std::memcpy(&b, base + (i * c_.v) * 4 + j * 2, 2);
          r.grad[static_cast<std::size_t>(i * c_.v + j)] = static_cast<float>(b);
        }
    }
    return r;
  }

 private:
  static gpu::DeviceBuffer upload(const void* src, std::size_t bytes) {
    gpu::DeviceBuffer b(bytes);
    gpu::copy_to_device(b.data(), src, bytes);
    return b;
  }

  Case c_;
  gpu::Context ctx_;
  std::vector<float> logits_;
  gpu::DeviceBuffer targets_, cw_, tw_, scalars_;
  kern::TokenParams p_;
};

}  // namespace

TEST_CASE("gpu: fused row kernel matches the statistics and gradient kernels") {
  if (gpu::device_count() == 0) {
    MESSAGE("no CUDA device: GPU test skipped");
    return;
  }
  // 8192 logits of a row per block, else 16384: V = 16000 takes two blocks, 40000 eight,
  // 100003 sixteen (odd: unaligned rows, element loads), 250001 sixteen of 16384.
  for (std::int64_t v : {16000, 40000, 100003, 250001}) {
    for (Elem grad : {Elem::kF32, Elem::kBF16}) {
      for (bool options : {false, true}) {
        CAPTURE(v);
        CAPTURE(grad == Elem::kF32);
        CAPTURE(options);
        REQUIRE(kern::row_fused_fits(v));
        const Case c{v > 50000 ? 9 : 33, v, grad, options};
        Fixture f(c);
        const Result two = f.run(false), fused = f.run(true), again = f.run(true);
        CHECK(std::memcmp(fused.grad.data(), again.grad.data(), fused.grad.size() * 4) == 0);
        CHECK(std::memcmp(fused.rows.data(), again.rows.data(), fused.rows.size() * 4) == 0);
        // Row arrays: equal up to the order of the statistics' reduction, to 2e-5 of each
        // array's largest value (logit sums cancel); argmax exactly.
        const std::size_t n = static_cast<std::size_t>(c.n);
        int worse = 0;
        for (std::size_t a = 0; a + 1 < kRowArrays; ++a) {
          float largest = 0;
          for (std::size_t k = a * n; k < (a + 1) * n; ++k)
            largest = std::max(largest, std::abs(two.rows[k]));
          for (std::size_t k = a * n; k < (a + 1) * n; ++k)
            worse += std::abs(fused.rows[k] - two.rows[k]) > 2e-5f * largest;
        }
        CHECK(worse == 0);
        CHECK(std::memcmp(fused.rows.data() + n * (kRowArrays - 1),
                          two.rows.data() + n * (kRowArrays - 1), n * 4) == 0);
        // Gradients: fp32 to a few ulps of the row's largest; bf16 to one bf16 rounding.
        // (plus a millionth of the largest, for the cancellation at p_y near 1).
        const float tol = grad == Elem::kF32 ? 1e-5f : 1.0f / 128;
        float largest = 0;
        for (float b : two.grad) largest = std::max(largest, std::abs(b));
        double num = 0, den = 0;
        worse = 0;
        for (std::size_t k = 0; k < fused.grad.size(); ++k) {
          const float a = fused.grad[k], b = two.grad[k];
          worse += std::abs(a - b) > tol * std::abs(b) + 1e-6f * largest;
          num += (static_cast<double>(a) - b) * (static_cast<double>(a) - b);
          den += static_cast<double>(b) * b;
        }
        CHECK(worse == 0);
        CHECK(den > 0);
        CHECK(std::sqrt(num / den) <= (grad == Elem::kF32 ? 1e-6 : 1e-3));
      }
    }
  }
}
