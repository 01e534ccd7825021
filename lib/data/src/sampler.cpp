// Fisher-Yates over std::mt19937_64 with rejection-sampled bounded draws, and epoch batching.
#include "chunkloss/data/sampler.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "chunkloss/core/error.h"

namespace chunkloss::data {
namespace {

// Uniform in [0, bound] without modulo bias: reject draws above the largest multiple of
// (bound + 1) that fits in 2^64.
std::uint64_t draw_at_most(std::mt19937_64& rng, std::uint64_t bound) {
  if (bound == 0) return 0;
  if (bound == UINT64_MAX) return rng();
  const std::uint64_t range = bound + 1;
  const std::uint64_t limit = UINT64_MAX - (UINT64_MAX % range + 1) % range;
  std::uint64_t x;
  do {
    x = rng();
  } while (x > limit);
  return x % range;
}

}  // namespace

std::vector<std::size_t> shuffled_indices(std::size_t n, std::uint64_t seed) {
  std::vector<std::size_t> idx(n);
  std::iota(idx.begin(), idx.end(), std::size_t{0});
  std::mt19937_64 rng(seed);
  for (std::size_t i = n; i > 1; --i) {
    const std::size_t j = static_cast<std::size_t>(draw_at_most(rng, i - 1));
    std::swap(idx[i - 1], idx[j]);
  }
  return idx;
}

BatchSampler::BatchSampler(std::size_t n, std::size_t batch_size, std::uint64_t seed, bool shuffle,
                           bool drop_last)
    : n_(n), batch_size_(batch_size), seed_(seed), shuffle_(shuffle), drop_last_(drop_last) {
  CHUNKLOSS_CHECK(n > 0, "BatchSampler: no examples");
  CHUNKLOSS_CHECK(batch_size > 0, "BatchSampler: batch_size must be >= 1");
  CHUNKLOSS_CHECK(!drop_last || n >= batch_size, "BatchSampler: drop_last with ", n,
                  " examples and batch_size ", batch_size, " leaves no batch");
}

std::size_t BatchSampler::batches_per_epoch() const {
  // (not (n + b - 1) / b, which wraps for a batch size near the largest size_t)
  return n_ / batch_size_ + (!drop_last_ && n_ % batch_size_ != 0 ? 1 : 0);
}

std::uint64_t BatchSampler::epoch_seed(std::uint64_t seed, std::uint64_t epoch) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ull * (epoch + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

std::vector<std::vector<std::size_t>> BatchSampler::epoch(std::uint64_t epoch) const {
  std::vector<std::size_t> order;
  if (shuffle_) {
    order = shuffled_indices(n_, epoch_seed(seed_, epoch));
  } else {
    order.resize(n_);
    std::iota(order.begin(), order.end(), std::size_t{0});
  }
  std::vector<std::vector<std::size_t>> out;
  const std::size_t count = batches_per_epoch();
  out.reserve(count);
  for (std::size_t b = 0; b < count; ++b) {
    const std::size_t begin = b * batch_size_;
    const std::size_t end = std::min(n_, begin + batch_size_);
    out.emplace_back(order.begin() + static_cast<std::ptrdiff_t>(begin),
                     order.begin() + static_cast<std::ptrdiff_t>(end));
  }
  return out;
}

}  // namespace chunkloss::data
