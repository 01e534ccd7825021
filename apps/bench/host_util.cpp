// Host-side helpers of the CPU cases (see host_util.h), and the cross-entropy cases' targets.
#include "host_util.h"

#include <chunkloss/core/error.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <sys/mman.h>

#include "bench.h"

namespace chunkloss::bench {

std::vector<std::int64_t> ce_targets(const CaseConfig& c, CaseResult& res) {
  constexpr std::int64_t kIgnoreEvery = 7;  // rows 3, 10, 17, ... (as torch_ce.py)
  const std::int64_t t = c.ce_seq_len,
                     prompt = static_cast<std::int64_t>(std::floor(c.prompt_frac * t));
  std::vector<std::int64_t> y(static_cast<std::size_t>(c.rows));
  std::uint64_t state = c.seed;
  res.valid_rows = 0;
  for (std::int64_t i = 0; i < c.rows; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const bool ignored = t ? i % t < prompt : i % kIgnoreEvery == 3;
    y[static_cast<std::size_t>(i)] =
        ignored ? -100
                : static_cast<std::int64_t>((state >> 33) % static_cast<std::uint64_t>(c.vocab));
    res.valid_rows += !ignored;
  }
  CHUNKLOSS_CHECK(res.valid_rows > 0, "bench: --rows ", c.rows, " --ce-seq-len ", t,
                  " --prompt-frac ", c.prompt_frac, " leaves no valid row (the prompt is ", prompt,
                  " rows)");
  res.ignored_rows = t ? "the first " + std::to_string(prompt) + " of each " + std::to_string(t) +
                             " rows (prompts)"
                       : "1 in 7 (rows t with t % 7 == 3)";
  res.reduction = "mean";
  return y;
}

HostBuffer::HostBuffer(std::size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  p_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  CHUNKLOSS_CHECK(p_ != MAP_FAILED, "bench: cannot map ", bytes,
                  " bytes of host memory for a buffer of the case (smaller --rows, --pairs, "
                  "--seq-len, --hidden or --vocab need less)");
}

HostBuffer::~HostBuffer() {
  if (p_ && p_ != MAP_FAILED) munmap(p_, bytes_);
}

void HostBuffer::zero() {
  if (bytes_) std::fill_n(as<unsigned char>(), bytes_, 0);
}

void fill_normal(float* p, std::int64_t n, float stddev, std::uint64_t seed, int threads) {
  constexpr std::int64_t kBlock = 1 << 16;
  const std::int64_t blocks = (n + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t b = 0; b < blocks; ++b) {
    std::seed_seq seq{static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                      static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(b >> 32)};
    std::mt19937_64 gen(seq);
    std::normal_distribution<float> dist(0.0f, stddev);
    const std::int64_t end = std::min(n, (b + 1) * kBlock);
    for (std::int64_t i = b * kBlock; i < end; ++i) p[i] = dist(gen);
  }
}

void round_to_bf16(float* src, BFloat16* dst, std::int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) {
    dst[i] = BFloat16(src[i]);
    src[i] = static_cast<float>(dst[i]);
  }
}

namespace {

double widen(float x) { return static_cast<double>(x); }
double widen(double x) { return x; }
double widen(BFloat16 x) { return static_cast<double>(static_cast<float>(x)); }

template <typename A, typename B>
double rel_norm_err_of(const A* a, const B* b, std::int64_t n, int threads) {
  double e = 0, r = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : e, r)
  for (std::int64_t i = 0; i < n; ++i) {
    const double d = widen(a[i]) - widen(b[i]);
    e += d * d;
    r += widen(b[i]) * widen(b[i]);
  }
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

}  // namespace

void widen_to_double(const float* src, double* dst, std::int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (std::int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(src[i]);
}

double rel_norm_err(const float* a, const float* b, std::int64_t n, int threads) {
  return rel_norm_err_of(a, b, n, threads);
}
double rel_norm_err(const BFloat16* a, const float* b, std::int64_t n, int threads) {
  return rel_norm_err_of(a, b, n, threads);
}
double rel_norm_err(const float* a, const double* b, std::int64_t n, int threads) {
  return rel_norm_err_of(a, b, n, threads);
}
double rel_norm_err(const BFloat16* a, const double* b, std::int64_t n, int threads) {
  return rel_norm_err_of(a, b, n, threads);
}

double bf16_storage_err(const float* b, std::int64_t n, int threads) {
  double e = 0, r = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : e, r)
  for (std::int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(chunkloss::round_to_bf16(b[i])) - b[i];
    e += d * d;
    r += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string s;
  std::getline(f, s);
  return s;
}

}  // namespace chunkloss::bench
