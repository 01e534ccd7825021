// Seeded random test data.
#include "support/random.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

namespace chunkloss::test {

std::vector<float> normal_floats(std::size_t n, float stddev, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

std::vector<float> uniform_floats(std::size_t n, float lo, float hi, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

std::vector<std::int64_t> random_targets(std::int64_t n, std::int64_t vocab, double ignore_fraction,
                                         std::int64_t ignore_index, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> dist(0, vocab - 1);
  std::vector<std::int64_t> out(static_cast<std::size_t>(n));
  for (auto& y : out) y = dist(rng);
  std::vector<std::size_t> order(out.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::shuffle(order.begin(), order.end(), rng);
  const auto ignored =
      static_cast<std::size_t>(std::llround(ignore_fraction * static_cast<double>(n)));
  for (std::size_t i = 0; i < std::min(ignored, order.size()); ++i) out[order[i]] = ignore_index;
  return out;
}

}  // namespace chunkloss::test
