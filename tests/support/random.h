// Seeded random test data: normal floats, positive weights and targets with an exact fraction
// of ignored rows. Every generator takes its own seed, so a test's data never depends on order.
#pragma once

#include <cstdint>
#include <vector>

namespace chunkloss::test {

/// `n` draws of N(0, stddev^2) from std::mt19937_64(seed).
std::vector<float> normal_floats(std::size_t n, float stddev, std::uint64_t seed);

/// `n` draws of U[lo, hi) from std::mt19937_64(seed).
std::vector<float> uniform_floats(std::size_t n, float lo, float hi, std::uint64_t seed);

/// `n` targets uniform in [0, vocab), of which exactly round(ignore_fraction * n) rows (chosen
/// at random) are set to `ignore_index`.
std::vector<std::int64_t> random_targets(std::int64_t n, std::int64_t vocab, double ignore_fraction,
                                         std::int64_t ignore_index, std::uint64_t seed);

}  // namespace chunkloss::test
